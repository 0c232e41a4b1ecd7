"""The router's fleet membership, without routing: who the workers are, their event feeds,
the fleet's hashing, and the alarms that make a worker load-only.

Owner: `Membership` (the base of `kvloop.router.router.Router`) owns the prefix index, the
registry, the metrics, the fleet's hashing and each worker's feed and subscription; routing
and tickets (`Router`) read them.

    register(spec, desc)   a worker answered /kvloop/worker: its feed (re)starts on a new
                           epoch; a hashing or role mismatch is a `config_mismatch` alarm
    worker_down(name)      it stopped answering: its entries go; its feed restarts on return
    deregister(name)       it left for good
    check_liveness()       time- and verification-based alarms, after every poll round
    resync_index()         a shared index lost writes: every feed starts again
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from kvloop.config import KV_HOLDS, KV_LOADS
from kvloop.core.hashing import BlockHasher
from kvloop.front.advertise import unreachable_from_afar
from kvloop.router.config import HashSpec, IndexConfig, RouterConfig
from kvloop.router.feed import EventFeed
from kvloop.router.index import BlockIndex, PrefixIndex
from kvloop.router.metrics import RouterMetrics
from kvloop.router.registry import (
    CONFIG_MISMATCH,
    NO_EVENT_SOURCE,
    NO_KV_CONNECTOR,
    UNREACHABLE_EVENT_SOURCE,
    WRONG_EVENT_SOURCE,
    Alarm,
    EventSource,
    Registry,
    WorkerDescription,
    WorkerSpec,
    WorkerState,
    event_source,
)

log = logging.getLogger("kvloop.router")

def make_index(config: IndexConfig, clock: Callable[[], float] = time.monotonic) -> BlockIndex:
    """The index `config` asks for: shared in Redis with `config.url`, else in memory."""
    if config.url is None:
        return PrefixIndex(config, clock)
    from kvloop.router.redis_index import RedisIndex

    return RedisIndex(config, clock)



class Subscription(Protocol):
    """A running KV-event subscription to one worker."""

    def stop(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...


SubscriberFactory = Callable[[EventSource, EventFeed], Subscription]


class Membership:
    """Index + registry + feeds + alarms; thread-safe for one event loop plus feeds."""

    def __init__(self, config: RouterConfig | None = None,
                 subscriber_factory: SubscriberFactory | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config or RouterConfig()
        self.clock = clock
        self.index: BlockIndex = make_index(self.config.index, clock)
        self.registry = Registry(self.config.liveness, clock,
                                 self.config.pd.failures_to_skip)
        self.metrics = RouterMetrics(self.registry, self.index, clock)
        self.hash_spec: HashSpec | None = self.config.hash_spec
        self.hasher = self._make_hasher(self.hash_spec)
        self._subscriber_factory = subscriber_factory
        self._feeds: dict[str, EventFeed] = {}
        self._subs: dict[str, Subscription] = {}
        self._epochs: dict[str, tuple[str | None, EventSource | None]] = {}
        self._lock = threading.RLock()
        self.watchers: list[Callable[[Any], None]] = []   # run by check_liveness (the Router)
        self.index.on_lost(self.resync_index)

    @property
    def block_size(self) -> int:
        """The fleet's block size (16 while no worker has said)."""
        return self.hash_spec.block_size if self.hash_spec else 16

    def forget_cache(self, name: str) -> None:
        """Worker `name` lost its cache (a new epoch): what routing remembers of it goes
        (`Router` forgets its sessions)."""

    @staticmethod
    def _make_hasher(spec: HashSpec | None) -> BlockHasher | None:
        return None if spec is None else BlockHasher(spec.block_size, spec.algo, spec.seed)

    # --- membership -----------------------------------------------------------------------
    def register(self, spec: WorkerSpec, desc: WorkerDescription | None) -> list[str]:
        """Add (or refresh) a worker that answered with `desc` (None: it is no kvloop worker,
        so its hashing is not known); returns warnings.

        The first worker that discloses its hashing fixes the fleet's, unless the config
        did. A worker that disagrees (block size, algorithm, seed, role) is kept for
        load-only routing, its events are refused, and a `config_mismatch` alarm says why.
        """
        with self._lock:
            w = self.registry.get(spec.name) or self.registry.add(spec)
            offered = desc.hash_spec() if desc is not None else None
            if self.hash_spec is None and offered is not None:
                self.hash_spec = offered
                self.hasher = self._make_hasher(offered)
                log.info("fleet hashing: %s (from %s)", offered.describe(), spec.name)
                self._rehash_feeds()
            self.index.add_worker(spec.name, capacity(desc))
            self.index.set_shared_store(spec.name, desc.kv_shared_store if desc else None)
            identity = (desc.epoch if desc is not None else None, event_source(spec, desc))
            before = self._epochs.get(spec.name)
            self._epochs[spec.name] = identity
            if before != identity:   # a new epoch: the worker's old cache is gone
                cache_gone = before is not None and before[0] != identity[0]
                if cache_gone:
                    self.forget_cache(spec.name)
                self._restart_feed(w, spec, desc, cache_gone)
            self.registry.mark_up(spec.name, desc)
            return self._check_worker(w, spec, desc)

    def _rehash_feeds(self) -> None:
        """Workers registered before the fleet's hashing was known get a working feed."""
        for w in self.registry.all():
            feed = self._feeds.get(w.name)
            if w.up and feed is not None and feed.hasher is None:
                self._restart_feed(w, w.spec, w.description, cache_gone=False)

    def deregister(self, name: str) -> bool:
        with self._lock:
            self._stop_feed(name)
            self._epochs.pop(name, None)
            dropped = self.index.remove_worker(name)
            removed = self.registry.remove(name) is not None
        if removed:
            log.info("worker %s deregistered (%d index entries dropped)", name, dropped)
        return removed

    def worker_down(self, name: str, reason: str) -> None:
        """`name` stopped answering: drop its entries; its subscription restarts on return."""
        with self._lock:
            if not self.registry.mark_down(name, reason):
                return
            self._stop_feed(name)
            self._epochs.pop(name, None)
            dropped = self.index.forget_worker(name)   # what other replicas see stays
        log.warning("worker %s is down (%s): %d index entries dropped; new requests go "
                    "to other workers", name, reason, dropped)

    def _restart_feed(self, w: WorkerState, spec: WorkerSpec,
                      desc: WorkerDescription | None, cache_gone: bool) -> None:
        """A new subscription; the index forgets what this router knew of the worker (and,
        when `cache_gone`, what any replica sharing the index knew)."""
        self._stop_feed(w.name)
        if cache_gone:
            self.index.clear_worker(w.name)
        else:
            self.index.forget_worker(w.name)
        self.registry.restart_liveness(w.name)
        feed = EventFeed(w.name, self.index, self.hasher, w.events, self._on_mismatch,
                         self.registry.note_signal)
        self._feeds[w.name] = feed
        source = event_source(spec, desc)
        if source is None or self._subscriber_factory is None:
            w.subscriber_stats = None
            return
        sub = self._subscriber_factory(source, feed)
        self._subs[w.name] = sub
        w.subscriber_stats = sub.stats

    def _stop_feed(self, name: str, wait: bool = False) -> None:
        """End `name`'s subscription. Its feed refuses everything from now on, so the
        subscriber thread may finish in the background (never blocking the event loop)."""
        sub = self._subs.pop(name, None)
        feed = self._feeds.pop(name, None)
        if feed is not None:
            feed.refusing = "stopped"
        if sub is None:
            return
        if wait:
            _stop_quietly(name, sub)
        else:
            threading.Thread(target=_stop_quietly, args=(name, sub), daemon=True,
                             name=f"kvloop-router-unsub-{name}").start()

    def feed(self, name: str) -> EventFeed | None:
        return self._feeds.get(name)

    def _check_worker(self, w: WorkerState, spec: WorkerSpec,
                      desc: WorkerDescription | None) -> list[str]:
        problems = self._mismatches(spec, desc)
        warnings: list[str] = []
        if problems:
            detail = "; ".join(problems)
            feed = self._feeds.get(w.name)
            if feed is not None:
                feed.refuse(detail)
            self._raise(w.name, CONFIG_MISMATCH, detail + " (its KV events are refused)")
            warnings.append(f"{w.name}: {detail}")
        else:
            self._clear(w.name, CONFIG_MISMATCH)
        source = event_source(spec, desc)
        if source is None and (desc is None or desc.enable_prefix_caching):
            detail = _no_source_detail(desc)
            self._raise(w.name, NO_EVENT_SOURCE, detail)
            warnings.append(f"{w.name}: {detail}")
        else:
            self._clear(w.name, NO_EVENT_SOURCE)
        far = unreachable_from_afar(spec.url, source.endpoint if source else None)
        if far is not None:
            self._raise(w.name, UNREACHABLE_EVENT_SOURCE, far)
            warnings.append(f"{w.name}: {far}")
        else:
            self._clear(w.name, UNREACHABLE_EVENT_SOURCE)
        missing = _missing_connector(w)
        if missing is not None:
            warnings.append(f"{w.name}: {missing}")
        if missing is not None and w.role == "prefill":
            self._raise(w.name, NO_KV_CONNECTOR, missing)
        else:
            self._clear(w.name, NO_KV_CONNECTOR)
            if missing is not None:   # it serves, prefilling locally: a warning, no alarm
                log.warning("worker %s: %s", w.name, missing)
        return warnings

    def hashing_mismatches(self, desc: WorkerDescription) -> list[str]:
        """How `desc`'s block size, hash algorithm and seed differ from the fleet's (none
        while the fleet's hashing is not known yet)."""
        fleet = self.hash_spec
        out: list[str] = []
        if fleet is not None:
            for field, theirs, ours in (("block size", desc.block_size, fleet.block_size),
                                        ("hash algorithm", desc.hash_algo, fleet.algo),
                                        ("hash seed", desc.hash_seed, fleet.seed)):
                if theirs != ours:
                    out.append(f"{field} {theirs!r} differs from the fleet's {ours!r}")
        return out

    def _mismatches(self, spec: WorkerSpec, desc: WorkerDescription | None) -> list[str]:
        if desc is None:
            return []
        out = self.hashing_mismatches(desc)
        if desc.role != spec.role:
            out.append(f"it serves role {desc.role!r} but was registered as {spec.role!r}")
        return out

    def _on_mismatch(self, name: str, detail: str) -> None:
        self._raise(name, CONFIG_MISMATCH, detail + " (seen in its KV events; refused)")

    # --- alarms ---------------------------------------------------------------------------
    def raise_alarm(self, name: str, kind: str, detail: str) -> None:
        """Raise alarm `kind` on worker `name` (a watcher's finding); logged once."""
        self._raise(name, kind, detail)

    def clear_alarm(self, name: str, kind: str) -> None:
        self._clear(name, kind)

    def _raise(self, name: str, kind: str, detail: str) -> None:
        alarm = self.registry.raise_alarm(name, kind, detail)
        if alarm is not None:
            self._announce(alarm)

    def _clear(self, name: str, kind: str) -> None:
        alarm = self.registry.clear_alarm(name, kind)
        if alarm is not None:
            log.warning("worker %s: %s cleared", name, kind)

    def _announce(self, alarm: Alarm) -> None:
        self.metrics.alarms_raised.labels(alarm.worker, alarm.kind).inc()
        log.warning("%s; routing to %s is load-only (no cache credit) until this clears",
                    alarm.message, alarm.worker)

    def check_liveness(self) -> list[Alarm]:
        """Re-evaluate time- and verification-based alarms; returns the new ones."""
        raised, cleared = self.registry.evaluate()
        for watch in self.watchers:
            watch(self)
        for a in raised:
            feed = self._feeds.get(a.worker)
            if a.kind == WRONG_EVENT_SOURCE and feed is not None:
                feed.refuse(a.detail)
            self._announce(a)
        for a in cleared:
            log.warning("worker %s: %s cleared; cache-aware routing to it resumes",
                        a.worker, a.kind)
        self.index.expire_provisional()
        return raised


    def resync_index(self) -> None:
        """The index lost what the workers told it (a shared Redis that restarted or missed
        writes): every live worker's subscription starts again, and its snapshot or replay
        re-stores its blocks (what Redis still holds of it is cleared first: it may be
        stale)."""
        with self._lock:
            workers = [w for w in self.registry.all() if w.up and w.name in self._feeds]
            for w in workers:
                self._restart_feed(w, w.spec, w.description, cache_gone=True)
        log.warning("index resync: %d workers asked for their blocks again", len(workers))

    def shutdown(self) -> None:
        with self._lock:
            for name in list(self._subs):
                self._stop_feed(name, wait=True)
        self.index.close()


def _stop_quietly(name: str, sub: Subscription) -> None:
    try:
        sub.stop()
    except Exception:  # a dead socket must not break deregistration
        log.exception("stopping the KV-event subscription of %s failed", name)


def _missing_connector(w: WorkerState) -> str | None:
    """The `no_kv_connector` detail of a P/D worker whose connector cannot serve its role."""
    need = {"prefill": (KV_HOLDS, "holds blocks for a decode worker: no prefill leg goes to it"),
            "decode": (KV_LOADS, "loads blocks from a prefill worker: it prefills every request "
                              "itself")}.get(w.role)
    if need is None or w.kv_role in need[0]:
        return None
    has = "no KV connector" if w.kv_role is None else f"a {w.kv_role} KV connector"
    return f"{w.role} worker with {has}; it needs one that {need[1]}"


def _no_source_detail(desc: WorkerDescription | None) -> str:
    """The `no_event_source` detail: no endpoint at all, or one hidden from this router."""
    if desc is not None and desc.api_key_required and not desc.api_key_accepted:
        return ("it hides its KV-event endpoint from this router: it requires an API key "
                "and did not accept the router's (--worker-api-key)")
    return "it advertises no KV-event endpoint"


def capacity(desc: WorkerDescription | None) -> int | None:
    """The worker's usable KV blocks (None: not known)."""
    return desc.kv_capacity_blocks if desc is not None else None

