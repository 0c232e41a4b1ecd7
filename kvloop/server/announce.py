"""Discovery: a worker on the NATS event plane announces itself, and withdraws when it stops.

Every `NatsPlaneConfig.announce_interval_s` the API server publishes one `WorkerAnnouncement`
(kvloop.wire: its URL, its `GET /kvloop/worker` answer as a caller without private facts sees
it, and the id its KV-event messages carry) on `namespace.{ns}.kvloop.workers`; on a clean stop
it publishes the same with `withdrawn` set, and so does a worker that starts draining (SIGTERM
with `--shutdown-timeout`): it withdraws at the start of the drain, not at its end, so routers
stop sending it work at once and it finishes what it holds. A router started with `--discover`
registers what it hears and ages out a worker whose announcements stop
(kvloop.router.discovery).

With the fleet secret (`ServeConfig.fleet_secret`) each announcement and the withdrawal carry
its signature (`kvloop.events.nats_plane.signed_headers`): a router holding the secret admits
no other, so nobody without it can add a worker or withdraw one.

Owner: the API server's event loop runs the announcer; the NATS client is its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import msgspec

from kvloop.events.config import NatsPlaneConfig
from kvloop.events.nats_plane import (
    connect_options,
    discovery_subject,
    first_connect,
    signed_headers,
)
from kvloop.trust import FleetSecret
from kvloop.wire import WorkerAnnouncement, WorkerInfo

logger = logging.getLogger("kvloop.server")


class WorkerAnnouncer:
    """Announces one worker on the event plane until `stop()`."""

    def __init__(self, plane: NatsPlaneConfig, url: str, worker_id: int,
                 describe: Callable[[], WorkerInfo], secret: FleetSecret | None = None):
        self.plane = plane
        self.secret = secret
        self.url = url
        self.worker_id = worker_id
        self.describe = describe
        self.subject = discovery_subject(plane.namespace)
        self.sent = 0
        self._nc: Any = None
        self._task: asyncio.Task[None] | None = None
        self._withdrawal: asyncio.Future[None] | None = None   # once set, never announced again

    def announcement(self, withdrawn: bool = False) -> bytes:
        return msgspec.json.encode(WorkerAnnouncement(
            url=self.url, info=self.describe(), worker_id=self.worker_id,
            interval_s=self.plane.announce_interval_s, withdrawn=withdrawn))

    async def start(self) -> None:
        """Connect and announce now, then every interval (a server that cannot be reached
        is logged: the worker serves on, undiscoverable)."""
        try:
            self._nc = await first_connect(
                connect_options(self.plane, f"kvloop-announcer-{self.worker_id}"),
                self.plane.connect_timeout_s)
        except Exception as e:   # no server, bad credentials: the engine already said so
            logger.error("discovery: cannot reach %s (%s); this worker is not announced",
                         self.plane.safe_url, e)
            return
        if self._withdrawal is not None:   # the drain began while we connected
            await self._withdraw()
            return
        self._task = asyncio.create_task(self._loop(), name="kvloop-announcer")
        logger.info("discovery: announcing %s on %s every %gs%s", self.url, self.subject,
                    self.plane.announce_interval_s,
                    "" if self.secret else " UNSIGNED (no fleet secret: routers that hold "
                    "one ignore this worker)")

    async def _publish(self, withdrawn: bool) -> None:
        payload = self.announcement(withdrawn)
        await self._nc.publish(self.subject, payload,
                               headers=signed_headers(self.secret, self.subject, payload))

    async def _loop(self) -> None:
        while True:
            try:
                await self._publish(withdrawn=False)
                self.sent += 1
            except Exception as e:  # reconnecting: the next announcement will do
                logger.debug("discovery: announcement failed: %s", e)
            await asyncio.sleep(self.plane.announce_interval_s)

    def begin_withdraw(self) -> None:
        """Stop announcing and withdraw (best effort, within a second), in the background;
        idempotent. The connection stays open until `stop()`."""
        if self._withdrawal is None:
            self._withdrawal = asyncio.ensure_future(self._end_announcing())

    async def _end_announcing(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._withdraw()

    async def _withdraw(self) -> None:
        if self._nc is None:
            return
        try:
            await self._publish(withdrawn=True)
            await self._nc.flush(timeout=1)
            logger.info("discovery: %s withdrawn", self.url)
        except Exception as e:
            logger.warning("discovery: the withdrawal of %s was not sent: %s", self.url, e)

    async def stop(self) -> None:
        """Withdraw (unless already done) and disconnect."""
        self.begin_withdraw()
        assert self._withdrawal is not None
        await self._withdrawal
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()
