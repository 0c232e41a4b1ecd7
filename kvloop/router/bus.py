"""The router on a NATS event plane: its workers' events, its discovery, and the bus watch.

- Events: one `kvloop.events.nats_subscriber.NatsEventPlane` (one connection, wildcard
  subscriptions on the router's component, or on every component) feeds every worker whose
  event source is on NATS; the worker of each message comes from the message itself (its
  `Kvloop-Worker` header, or a Dynamo payload's `worker_id`). Workers on ZMQ keep their ZMQ
  subscriptions (`fallback`).
- Discovery (`--discover`): `kvloop.router.discovery.Discovery` on the same connection.
- Identity: with the fleet secret (`RouterConfig.fleet_secret`) the plane admits only
  messages signed by fleet members (`kvloop.events.nats_plane.MessageGate`); what it refused
  is in /health's `bus` details (`describe`).
- The bus watch: a worker that serves traffic but whose events do not reach the index for
  half the liveness window makes the router listen to what is actually published in its
  namespace (and on every namespace's data and heartbeat subjects) for `probe_s`; when that
  worker's messages travel on a subject the router does not listen on, a `wrong_subject`
  alarm names both subjects and the flag to change. It clears once the worker's events
  arrive.

Owner: `RouterBus` owns the plane and its probes; alarms go through the router.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvloop.events.nats_plane import component_of, subject_matches
from kvloop.events.nats_subscriber import NatsEventPlane, WorkerStream
from kvloop.router.config import BusConfig
from kvloop.router.feed import EventFeed
from kvloop.router.registry import WRONG_SUBJECT, EventSource, WorkerState, event_source
from kvloop.router.subscription import deliver, router_stats
from kvloop.trust import FleetSecret

if TYPE_CHECKING:
    from kvloop.router.router import Router, SubscriberFactory, Subscription

log = logging.getLogger("kvloop.router")


def is_nats(source: EventSource) -> bool:
    return source.worker_id is not None and source.endpoint.startswith(("nats://", "tls://"))


class NatsSubscription:
    """One worker's stream on the plane, feeding its `EventFeed` (a router `Subscription`)."""

    def __init__(self, plane: NatsEventPlane, source: EventSource, feed: EventFeed):
        assert source.worker_id is not None
        self.plane = plane
        self.worker_id = source.worker_id
        component = component_of(source.subject or "") or plane.config.component
        block_size = feed.hasher.block_size if feed.hasher is not None else 0
        self.stream: WorkerStream = plane.attach(
            source.worker_id, feed.worker, component, on_batch=lambda wb: deliver(feed, wb),
            on_heartbeat=lambda name, info: feed.on_heartbeat(),
            on_touch=lambda name, hashes: feed.on_touch(hashes), block_size=block_size,
            payload_format=source.payload_format)

    def stop(self) -> None:
        self.plane.detach(self.worker_id, self.stream)

    def stats(self) -> dict[str, Any]:
        return router_stats(self.stream.stats)


class RouterBus:
    """The router's NATS connection and what runs on it (see the module docstring)."""

    def __init__(self, config: BusConfig, secret: FleetSecret | None = None):
        self.config = config
        self.plane = NatsEventPlane(config.plane, name="kvloop-router", secret=secret)
        self.signed = secret is not None
        self._probing: dict[str, concurrent.futures.Future[dict[str, int]]] = {}
        self._last_probe: dict[str, float] = {}
        self.probes = 0

    def start(self) -> RouterBus:
        """Connect (OSError when the server cannot be reached)."""
        self.plane.start()
        log.info("event plane: %s, listening on %s", self.config.plane.safe_url,
                 self.plane.listening)
        return self

    def stop(self) -> None:
        self.plane.stop()

    @property
    def connected(self) -> bool:
        return self.plane.stats.connected

    def problems(self) -> list[str]:
        """The /health reason while the connection is down: events, discovery and replica
        tickets stop arriving, so the index and the fleet may be stale."""
        if self.connected:
            return []
        st = self.plane.stats
        return [f"event plane {self.config.plane.safe_url} is disconnected (disconnects so "
                f"far: {st.disconnects}); reconnecting: KV events, discovery and replica "
                "tickets are not arriving, so the index may be stale"]

    def describe(self) -> dict[str, Any]:
        """The `bus` part of /health: the connection and what it refused."""
        st = self.plane.stats
        return {"url": self.config.plane.safe_url, "connected": st.connected,
                "signed_only": self.signed, "disconnects": st.disconnects,
                "reconnects": st.reconnects, **st.refusals.describe()}

    def factory(self, fallback: SubscriberFactory) -> Callable[[EventSource, EventFeed],
                                                                 Subscription]:
        """The router's subscriber factory: NATS sources on the plane, others `fallback`."""
        def make(source: EventSource, feed: EventFeed) -> Subscription:
            if is_nats(source):
                return NatsSubscription(self.plane, source, feed)
            return fallback(source, feed)
        return make

    # --- the bus watch --------------------------------------------------------------------
    def watch(self, router: Router) -> None:
        """Run by `Router.check_liveness`: probe the bus for quiet NATS workers, clear the
        alarm of workers whose events arrive again (nothing while the bus is down)."""
        if not self.connected:
            return   # with the bus down, a probe would only hear silence
        now = router.clock()
        window = router.config.liveness.window_s
        for w in router.registry.all():
            source = event_source(w.spec, w.description)
            if not w.up or source is None or not is_nats(source):
                continue
            alarm = w.alarms.get(WRONG_SUBJECT)
            if alarm is not None:
                last = w.events.last_event_at or w.events.last_heartbeat_at
                if w.first_unsignalled_send is None and last is not None and last > alarm.since:
                    router.clear_alarm(w.name, WRONG_SUBJECT)
                continue
            if self._quiet(w, now, window / 2) and w.name not in self._probing \
                    and now - self._last_probe.get(w.name, float("-inf")) >= window:
                self._start_probe(router, w, source)

    @staticmethod
    def _quiet(w: WorkerState, now: float, after_s: float) -> bool:
        """Served traffic that expects events, and none arrived for `after_s`."""
        sent = w.first_unsignalled_send
        return sent is not None and now - max(sent, w.subscribed_at) >= after_s

    def _start_probe(self, router: Router, w: WorkerState, source: EventSource) -> None:
        assert source.worker_id is not None
        self._last_probe[w.name] = router.clock()
        self.probes += 1
        fut = self.plane.probe(source.worker_id, self.config.probe_s)
        self._probing[w.name] = fut
        fut.add_done_callback(lambda f: self._probed(router, w.name, source, f))

    def _probed(self, router: Router, name: str, source: EventSource,
                fut: concurrent.futures.Future[dict[str, int]]) -> None:
        self._probing.pop(name, None)
        try:
            seen = fut.result()
        except Exception as e:  # disconnected meanwhile: the next window probes again
            log.warning("bus watch: probing for %s failed: %s", name, e)
            return
        detail = self.finding(seen, source)
        if detail is None:
            log.warning("bus watch: worker %s sends no KV events this router receives; on "
                        "the bus: %s", name, ", ".join(sorted(seen)) or "nothing of it "
                        f"within {self.config.probe_s:g}s (its publisher is not on "
                        f"{self.config.plane.safe_url}?)")
            return
        w = router.registry.get(name)
        if w is not None and w.first_unsignalled_send is not None:
            router.raise_alarm(name, WRONG_SUBJECT, detail)

    def finding(self, seen: dict[str, int], source: EventSource) -> str | None:
        """The alarm's detail when the worker's messages travel on subjects this router does
        not listen on (None: nothing of it seen, or only where the router listens)."""
        listening = self.plane.listening
        heard = [s for s in sorted(seen) if s.endswith(".kv-events")] or \
            [s.rsplit(".kvloop.", 1)[0] + ".kv-events" for s in sorted(seen)
             if s.endswith(".kvloop.heartbeat")]
        elsewhere = [s for s in dict.fromkeys(heard) if not subject_matches(listening, s)]
        if not elsewhere:
            return None
        where = elsewhere[0]
        return (f"its KV events arrive on `{where}`; this router listens on `{listening}`, "
                f"so none reach its index. Fix: {self._fix(where)}")

    def _fix(self, where: str) -> str:
        plane = self.config.plane
        ns, comp = where.split(".")[1], component_of(where)
        if ns != plane.namespace:
            return (f"start the router with --dyn-namespace {ns}, or the worker with "
                    f"--dyn-namespace {plane.namespace}")
        return (f"start the router with --dyn-component {comp} (or without --dyn-component, "
                f"to hear every component), or the worker with --dyn-component "
                f"{plane.component}")
