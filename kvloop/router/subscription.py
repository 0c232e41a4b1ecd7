"""Connects a worker's `EventFeed` to `kvloop.events.subscriber.KVEventSubscriber`.

The subscriber delivers one worker's batches in publisher order (resyncing across gaps,
epochs and restarts by replay or snapshot) on its own thread; this adapter hands them to the
feed, reports heartbeats as liveness signals and recency notices as index touches, and
exposes the subscriber's counters under the router's metric names.

A worker whose events require CURVE (`EventSource.curve`, from its /kvloop/worker) is
subscribed to with the fleet secret's KV-event client keys (`subscription_factory(secret)`);
a router without the secret cannot subscribe to it: it says so in an error log line, and
the worker is routed by load until its `silent` alarm clears.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

from kvloop.router.feed import EventFeed
from kvloop.router.registry import EventSource
from kvloop.trust import PURPOSE_KV_EVENTS, CurveKeys, FleetSecret

log = logging.getLogger("kvloop.router")

# router metric name -> subscriber stat name
_STAT_NAMES = {
    "events_received": "events_received", "batches_received": "batches_received",
    "heartbeats": "heartbeats", "gaps": "gaps", "unrecovered_gaps": "unrecovered_gaps",
    "replays": "replays", "replay_failures": "replay_failures", "snapshots": "snapshots",
    "resets": "resets", "restarts": "restarts", "epochs": "epochs_seen",
    "duplicates": "duplicates", "malformed": "malformed", "callback_errors": "callback_errors",
    "touches": "touches", "last_seq": "last_seq", "current_epoch": "current_epoch",
    "kvloop_publisher": "kvloop_publisher",
}


CACHE_GONE_REASONS = ("epoch", "restart")   # resets after which the worker's cache is new


def deliver(feed: EventFeed, wb: Any) -> None:
    """Hand one subscriber delivery (a `WorkerBatch`) to `feed`."""
    if wb.is_reset:
        feed.on_clear(f"subscriber reset: {wb.reason}", wb.reason in CACHE_GONE_REASONS)
        return
    feed.on_batch(wb.batch)


class KVEventSubscription:
    """A started subscriber feeding one `EventFeed`; `stop()` ends it."""

    def __init__(self, source: EventSource, feed: EventFeed, probe_interval_s: float = 1.0,
                 curve_keys: CurveKeys | None = None):
        from kvloop.events.subscriber import KVEventSubscriber

        self.feed = feed
        self.source = source
        self._sub = KVEventSubscriber(
            source.endpoint, source.replay_endpoint, source.topic, on_batch=self._on_batch,
            worker_id=feed.worker,
            on_heartbeat=self._on_heartbeat, on_touch=self._on_touch,
            probe_interval_s=probe_interval_s,
            curve_keys=curve_keys if source.curve else None)
        self._sub.start()

    def _on_batch(self, wb: Any) -> None:
        deliver(self.feed, wb)

    def _on_heartbeat(self, worker_id: str, info: Any) -> None:
        self.feed.on_heartbeat()

    def _on_touch(self, worker_id: str, hashes: list[int | bytes]) -> None:
        self.feed.on_touch(hashes)

    def stop(self) -> None:
        self._sub.stop(timeout=2.0)

    def stats(self) -> dict[str, Any]:
        return router_stats(self._sub.stats)


def router_stats(stats: Any) -> dict[str, Any]:
    """A subscriber's `SubscriberStats` (ZMQ or NATS) under the router's metric names."""
    raw = dataclasses.asdict(stats)
    return {ours: raw.get(theirs) for ours, theirs in _STAT_NAMES.items()}


class NoSubscription:
    """What stands for the subscription of a worker whose events this router cannot read."""

    def stop(self) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {}


def kv_event_subscription(source: EventSource, feed: EventFeed,
                          curve_keys: CurveKeys | None = None
                          ) -> KVEventSubscription | NoSubscription:
    """The router's default `SubscriberFactory` (without a fleet secret's keys)."""
    if source.curve and curve_keys is None:
        log.error("worker %s: its KV events require CURVE keys and this router has no fleet "
                  "secret (--fleet-secret-file or $KVLOOP_FLEET_SECRET): not subscribed; it "
                  "is routed by load only", feed.worker)
        return NoSubscription()
    return KVEventSubscription(source, feed, curve_keys=curve_keys)


def subscription_factory(secret: FleetSecret | None
                         ) -> Callable[[EventSource, EventFeed], Any]:
    """The router's `SubscriberFactory`: CURVE clients with `secret`'s KV-event keys for
    workers that require them."""
    keys = secret.curve_keys(PURPOSE_KV_EVENTS) if secret is not None else None
    return functools.partial(kv_event_subscription, curve_keys=keys)
