"""Discovery: workers that announce themselves on the NATS event plane join the router, and
leave it when they withdraw or fall silent.

Workers announce (kvloop.server.announce) a `WorkerAnnouncement` every `interval_s` on
`namespace.{ns}.kvloop.workers`. For each URL heard:
- new: register it as a worker of the announced role (`RouterApp.register`: the router asks
  its `/kvloop/worker` itself, with its own key, as for a `--worker`);
- known, with another epoch: registered again at once (its feed restarts), and with another
  role: removed and registered anew with the new one;
- withdrawn: removed (its index entries dropped);
- no announcement for `discovery_ttl_s`: asked `GET /health` (with the worker key only,
  within `health_timeout_s`); kept while it answers 200 (the bus is a signal, not the data
  path: a NATS outage takes no healthy worker offline), aged out (removed likewise) once it
  does not. While the router's own NATS connection is down nobody ages out for silence: the
  clock of every worker restarts when it comes back. Workers named with `--worker` are
  never aged out.

Only what the plane admits reaches `Discovery`: with the fleet secret, announcements and
withdrawals signed by a fleet member, fresh and never seen (kvloop.events.nats_plane), so a
stranger on the bus can neither add a worker (nor learn any key from the router's probe of
one) nor withdraw one.

Owner: `Discovery` runs on the router's event loop; the plane's thread only hands it
announcements.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

import httpx
import msgspec

from kvloop.events.nats_plane import discovery_subject
from kvloop.router.registry import WorkerSpec
from kvloop.wire import WorkerAnnouncement

if TYPE_CHECKING:
    from kvloop.router.bus import RouterBus
    from kvloop.router.proxy import RouterApp

log = logging.getLogger("kvloop.router")

_DECODE = msgspec.json.Decoder(WorkerAnnouncement)


class Discovery:
    """Registers announced workers with `app`, removes withdrawn and silent ones."""

    def __init__(self, app: RouterApp, bus: RouterBus):
        self.app = app
        self.bus = bus
        self.ttl_s = bus.config.discovery_ttl_s
        self.subject = discovery_subject(bus.config.plane.namespace)
        self.last_heard: dict[str, float] = {}       # discovered worker -> monotonic time
        self.joined = self.left = self.aged_out = self.malformed = 0
        self.kept_silent = 0     # silent past the TTL but answering /health: kept
        self._busy: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Listen (call from the router's event loop)."""
        self._loop = asyncio.get_running_loop()
        self.bus.plane.subscribe(self.subject, self._on_message)
        self._task = self._loop.create_task(self._age_out_loop(), name="kvloop-discovery")
        log.info("discovery: listening on %s (workers age out after %gs)", self.subject,
                 self.ttl_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _on_message(self, subject: str, payload: bytes, headers: dict[str, str]) -> None:
        """On the plane's thread: decode, then hand over to the router's loop."""
        try:
            ann = _DECODE.decode(payload)
            spec = WorkerSpec(ann.url.rstrip("/"), ann.info.role)
        except (msgspec.DecodeError, ValueError) as e:
            self.malformed += 1
            log.warning("discovery: ignoring an announcement: %s", e)
            return
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._heard(spec, ann), self._loop)

    async def _heard(self, spec: WorkerSpec, ann: WorkerAnnouncement) -> None:
        name = spec.name
        router = self.app.router
        if ann.withdrawn:
            if self.last_heard.pop(name, None) is not None and router.deregister(name):
                self.left += 1
                log.info("discovery: worker %s withdrew", name)
            return
        self.last_heard[name] = router.clock()
        if name in self._busy:
            return
        w = router.registry.get(name)
        if w is not None and w.spec.role != spec.role:
            log.warning("discovery: worker %s now serves %s (was %s): registering it anew",
                        name, spec.role, w.spec.role)
            router.deregister(name)
            w = None
        known = w.description.epoch if w is not None and w.description is not None else None
        if w is not None and w.up and known == ann.info.epoch:
            return
        self._busy.add(name)
        try:
            await self.app.register(spec)
            if w is None:
                self.joined += 1
                log.info("discovery: worker %s joined (role %s, model %s)", name,
                            spec.role, ann.info.model)
        finally:
            self._busy.discard(name)

    async def _age_out_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.ttl_s / 4))
            await self.age_out()

    async def age_out(self) -> list[str]:
        """Remove the discovered workers silent for `ttl_s` whose /health does not answer
        200; returns their names. Silent ones that answer are kept (their clock restarts);
        while the bus is down, every clock restarts and nobody is asked."""
        router = self.app.router
        now = router.clock()
        if not self.bus.connected:
            self.last_heard = dict.fromkeys(self.last_heard, now)
            return []
        silent = [n for n, t in self.last_heard.items() if now - t > self.ttl_s]
        answers = await asyncio.gather(*(self._healthy(n) for n in silent))
        gone = []
        for name, healthy in zip(silent, answers, strict=True):
            if name not in self.last_heard or self.last_heard[name] > now:
                continue   # announced, or withdrew, while we asked
            if healthy:
                self.last_heard[name] = router.clock()
                self.kept_silent += 1
                continue
            del self.last_heard[name]
            gone.append(name)
            if router.deregister(name):
                self.aged_out += 1
                log.warning("discovery: worker %s aged out (no announcement for %.1fs and "
                            "no answer on /health)", name, self.ttl_s)
        return gone

    async def _healthy(self, name: str) -> bool:
        """Does the worker answer `GET /health` 200 within `health_timeout_s`? (The router's
        client presents only the worker key.)"""
        w = self.app.router.registry.get(name)
        client = self.app.client
        if w is None or client is None:
            return False
        try:
            r = await client.get(w.spec.url + "/health",
                                 timeout=self.bus.config.health_timeout_s)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    def describe(self) -> dict[str, Any]:
        """The `discovery` part of /health."""
        return {"workers": sorted(self.last_heard), "joined": self.joined, "left": self.left,
                "aged_out": self.aged_out, "kept_silent": self.kept_silent,
                "malformed": self.malformed, "ttl_s": self.ttl_s}
