"""RedisIndex: the prefix index with block -> workers shared in Redis (or Valkey), so N router
replicas route from one view.

Layout (llm-d's `RedisIndex`):

    <hash>               HASH   field = a JSON PodEntry {"DeviceTier": "gpu",
                                "PodIdentifier": "host:port"}, value ""   (who holds the block)
    engine:<hash>        ZSET   the request keys of an engine key (kvloop's router computes the
                                engine's own hashes, so its one member is <hash>, score 0)
    kvloop:pod:<name>    SET    kvloop's addition: the hashes one worker holds, so clearing a
                                worker touches its keys only (llm-d SCANs the keyspace)

Keys are decimal 64-bit hashes (the events' `event_int`). Nothing expires; a key whose last
holder leaves is deleted with its engine key (one Lua script per removal).

What stays in each replica (this class is a `PrefixIndex` that mirrors every holder change,
`_set` / `_unset`, into Redis): its own per-worker LRU and copy counts, which bound each
worker and decide when a block really leaves; provisional entries (its routing guesses); its
counters. `match` reads Redis (one pipelined round trip of HKEYS), plus the local provisional
entries. Every replica applies the events it receives: Redis writes are idempotent (HSET /
HDEL of one field), so replicas fed the same stream write the same thing.

Tiers below the device (host, disk, shared store) stay in each replica's own view: every
replica receives every worker's events, and only the device tier has an llm-d layout that
other consumers read (`DeviceTier` "gpu").

`forget_worker` (this replica subscribes anew, meets a gap, loses sight of the worker) drops
only the local view: Redis keeps what the others see, so a replica that restarts routes from
the shared view at once. `clear_worker` (the worker's cache is gone) clears it in Redis too. A
`BlockRemoved` of a block this replica never saw stored still removes it from Redis.

A Redis error never fails a decision, and a frozen Redis never stalls one for long: a
decision reads with a short timeout (`IndexConfig.read_timeout_s`); after a failure the
index is marked down and decisions use the local view, writes are dropped (counted in
`errors`, logged once a minute), until the watcher thread (one `PING` every
`WATCH_INTERVAL_S`) sees Redis answer again. Redis then no longer holds what the workers
told this replica, so the index asks the router to resync (`on_lost`: every worker's
subscription restarts, its entries are cleared in Redis and re-stored from its snapshot).
The same happens when Redis lost its data without the watcher noticing an outage (a restart
between two pings, a flush): the marker key `kvloop:index:epoch` is gone or changed, or
Redis holds none of a worker's blocks while this replica's view holds some. `alarms()`
names each state for /health (down, resynced, empty).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kvloop.events.config import redact_url
from kvloop.events.types import TIER_DEVICE
from kvloop.router.config import IndexConfig
from kvloop.router.index import ApplyResult, PrefixIndex, to_u64

log = logging.getLogger("kvloop.router")

DEVICE_TIER = "gpu"
POD_SET_PREFIX = "kvloop:pod:"
ENGINE_PREFIX = "engine:"
EPOCH_KEY = "kvloop:index:epoch"   # set once per Redis dataset: gone or changed = data lost
WATCH_INTERVAL_S = 0.5             # the watcher's PING period
RESYNC_NOTICE_S = 10.0             # /health names a resync this long
WRITE_TIMEOUT_S = 2.0              # writes, off the event loop (feed and watcher threads)
_UNSET = """
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('SREM', KEYS[3], ARGV[2])
if redis.call('HLEN', KEYS[1]) == 0 then redis.call('DEL', KEYS[2]) end
return 0
"""


def pod_entry(name: str) -> bytes:
    """The hash field naming worker `name` (llm-d's PodEntry, as JSON)."""
    return json.dumps({"DeviceTier": DEVICE_TIER, "PodIdentifier": name},
                      sort_keys=True, separators=(",", ":")).encode()


def redis_url(url: str) -> str:
    """valkey:// as redis:// (the same protocol), as llm-d does."""
    parts = urlsplit(url)
    scheme = {"valkey": "redis", "valkeys": "rediss"}.get(parts.scheme, parts.scheme)
    return urlunsplit(parts._replace(scheme=scheme))


class RedisIndex(PrefixIndex):
    """A `PrefixIndex` whose block -> workers map lives in Redis; see the module docstring.
    Raises OSError when Redis cannot be reached at construction."""

    remote = True

    def __init__(self, config: IndexConfig, clock: Callable[[], float] = time.monotonic):
        super().__init__(config, clock)
        import redis

        assert config.url is not None
        self.url = redact_url(config.url)
        self._redis_errors: tuple[type[Exception], ...] = (redis.RedisError, OSError)
        url = redis_url(config.url)
        self.client = redis.Redis.from_url(url, password=config.password,
                                           socket_timeout=WRITE_TIMEOUT_S,
                                           socket_connect_timeout=WRITE_TIMEOUT_S)
        self.reader = redis.Redis.from_url(url, password=config.password,
                                           socket_timeout=config.read_timeout_s,
                                           socket_connect_timeout=config.read_timeout_s)
        try:
            self.client.ping()
            self._epoch = self._dataset_epoch()
        except self._redis_errors as e:
            raise OSError(f"cannot reach the shared index {self.url}: {e}") from e
        self._unset_script = self.client.register_script(_UNSET)
        self._local = threading.local()
        self._fields: dict[bytes, str] = {}
        self.errors = 0
        self.resyncs = 0
        self._last_error_log = float("-inf")
        self._down: str | None = None          # why Redis is not used now (None: it is)
        self._down_since = 0.0
        self._last_resync: tuple[float, str] | None = None
        self._resync: Callable[[], None] | None = None
        self._empty_seen: set[str] = set()
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True,
                                         name="kvloop-router-redis-watch")
        self._watcher.start()

    # --- mirroring the holder changes -----------------------------------------------------
    def _ops(self) -> list[tuple[bool, str, int]]:
        ops = getattr(self._local, "ops", None)
        if ops is None:
            ops = self._local.ops = []
        return ops   # type: ignore[no-any-return]

    def _mirroring(self) -> bool:
        return not getattr(self._local, "quiet", False)

    def _name_of_bit(self, bit: int) -> str | None:
        return self._slot_names.get(bit.bit_length() - 1)

    def _set(self, h: int, bit: int) -> None:
        super()._set(h, bit)
        name = self._name_of_bit(bit)
        if name is not None and self._mirroring():
            self._ops().append((True, name, h))

    def _unset(self, h: int, bit: int) -> None:
        super()._unset(h, bit)
        name = self._name_of_bit(bit)
        if name is not None and self._mirroring():
            self._ops().append((False, name, h))

    def _flush(self) -> None:
        ops, self._local.ops = self._ops(), []
        if not ops:
            return
        pipe = self.client.pipeline(transaction=False)
        for stored, name, h in ops:
            key, field, pods = str(h), pod_entry(name), POD_SET_PREFIX + name
            if stored:
                pipe.hset(key, field, "")
                pipe.zadd(ENGINE_PREFIX + key, {key: 0})
                pipe.sadd(pods, key)
            else:
                self._unset_script(keys=[key, ENGINE_PREFIX + key, pods], args=[field, key],
                                   client=pipe)
        self._run(pipe)

    def _run(self, pipe: Any) -> list[Any] | None:
        """Execute `pipe`; None when Redis is down or fails (then it is marked down)."""
        if self._down is not None:
            self.errors += 1
            return None
        try:
            return pipe.execute()   # type: ignore[no-any-return]
        except self._redis_errors as e:
            self._note_error(e)
            self._mark_down(f"{type(e).__name__}: {e}")
            return None

    def _note_error(self, e: Exception) -> None:
        self.errors += 1
        now = time.monotonic()
        if now - self._last_error_log >= 60.0:
            self._last_error_log = now
            log.warning("shared index %s: %s (%d errors so far; deciding from this "
                        "router's own view meanwhile)", self.url, e, self.errors)

    # --- health: the watcher thread -----------------------------------------------------
    def on_lost(self, resync: Callable[[], None]) -> None:
        self._resync = resync

    def close(self) -> None:
        self._stop.set()
        self._watcher.join(timeout=5)

    def alarms(self) -> list[str]:
        """Why decisions do not (fully) come from Redis now, for /health."""
        now = time.monotonic()
        out = []
        if self._down is not None:
            out.append(f"shared index {self.url}: unreachable for {now - self._down_since:.1f}s"
                       f" ({self._down}); decisions use this router's own view, writes are "
                       "dropped, and every worker is re-read once it answers")
        if self._last_resync is not None and now - self._last_resync[0] < RESYNC_NOTICE_S:
            at, why = self._last_resync
            out.append(f"shared index {self.url}: {why}; resynced from the workers "
                       f"{now - at:.1f}s ago")
        return out

    def _mark_down(self, why: str) -> None:
        if self._down is None:
            self._down_since = time.monotonic()
            log.warning("shared index %s is down (%s): deciding from this router's own "
                        "view until it answers", self.url, why)
        self._down = why

    def _dataset_epoch(self) -> object:
        """The marker of Redis's current dataset (set here if it has none)."""
        self.client.set(EPOCH_KEY, uuid.uuid4().hex, nx=True)
        return self.client.get(EPOCH_KEY)

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL_S):
            try:
                self._check()
            except Exception:  # the watcher must outlive any single failure
                log.exception("shared index %s: the watcher failed once", self.url)

    def _check(self) -> None:
        """One look at Redis: up or down, its data lost or not (then resync)."""
        try:
            self.reader.ping()
            epoch = self._dataset_epoch()
            empty = self._emptied_workers()
        except self._redis_errors as e:
            self._mark_down(f"{type(e).__name__}: {e}")
            return
        lost = None
        if self._down is not None:
            lost = f"it was unreachable for {time.monotonic() - self._down_since:.1f}s"
        elif epoch != self._epoch:
            lost = "it lost its data (restarted or flushed)"
        elif empty:
            lost = (f"it holds none of the blocks this router's view has for "
                    f"{', '.join(empty)}")
        self._epoch = epoch
        if lost is None:
            return
        log.warning("shared index %s: %s; resyncing from the workers", self.url, lost)
        self._last_resync = (time.monotonic(), lost)
        self._down = None
        self.resyncs += 1
        if self._resync is not None:
            self._resync()

    def _emptied_workers(self) -> list[str]:
        """Workers of which this replica holds blocks while Redis holds none, at this look and
        the one before (Redis lost them)."""
        names = [n for n in list(self._workers) if self.worker_blocks(n) > 0]
        if not names:
            return []
        pipe = self.reader.pipeline(transaction=False)
        for n in names:
            pipe.scard(POD_SET_PREFIX + n)
        counts = pipe.execute()
        empty = {n for n, c in zip(names, counts, strict=True) if not c}
        twice, self._empty_seen = empty & self._empty_seen, empty   # not a write in flight
        return sorted(twice)

    # --- writes ---------------------------------------------------------------------------
    def store(self, name: str, hashes: Iterable[int | bytes],
              tier: str = TIER_DEVICE) -> ApplyResult:
        result = super().store(name, hashes, tier)
        self._flush()
        return result

    def remove(self, name: str, hashes: Iterable[int | bytes],
               tier: str = TIER_DEVICE) -> ApplyResult:
        if tier != TIER_DEVICE:
            return super().remove(name, hashes, tier)   # lower tiers: this replica's view
        stored = [to_u64(h) for h in hashes]
        w = self._workers.get(name)
        unseen = [h for h in stored if w is None or h not in w.lru]
        result = super().remove(name, stored)
        if self._mirroring():
            self._ops().extend((False, name, h) for h in unseen)
        self._flush()
        return result

    def forget_worker(self, name: str) -> int:
        """Drop this replica's view of `name`; Redis keeps the shared one."""
        self._local.quiet = True
        try:
            return super().clear_worker(name)
        finally:
            self._local.quiet = False
            self._local.ops = []

    def clear_worker(self, name: str) -> int:
        """`name`'s cache is gone: forget it here and remove it from Redis."""
        dropped = self.forget_worker(name)
        pods = POD_SET_PREFIX + name
        if self._down is not None:   # the resync after the outage clears it
            return dropped
        try:
            members = self.client.smembers(pods)
        except self._redis_errors as e:
            self._note_error(e)
            self._mark_down(f"{type(e).__name__}: {e}")
            return dropped
        pipe = self.client.pipeline(transaction=False)
        field = pod_entry(name)
        for raw in members:
            key = raw.decode() if isinstance(raw, bytes) else str(raw)
            self._unset_script(keys=[key, ENGINE_PREFIX + key, pods], args=[field, key],
                               client=pipe)
        pipe.delete(pods)
        self._run(pipe)
        return max(dropped, len(members))

    # --- lookups --------------------------------------------------------------------------
    def match(self, hashes: Sequence[int], workers: Iterable[str] | None = None,
              include_provisional: bool = True) -> dict[str, int]:
        """Longest consecutive run of `hashes` each candidate holds, per Redis (and this
        replica's provisional entries); the local view if Redis fails."""
        if not hashes:
            return {}
        candidates = set(self._workers if workers is None else workers)
        pipe = self.reader.pipeline(transaction=False)
        for h in hashes:
            pipe.hkeys(str(h))
        holders = self._run(pipe)
        if holders is None:
            return super().match(hashes, workers, include_provisional)
        now = self._clock()
        use_prov = include_provisional and bool(self._prov)
        depth: dict[str, int] = {}
        active = candidates
        for i, (h, fields) in enumerate(zip(hashes, holders, strict=True)):
            held = {self._holder(f) for f in fields}
            if use_prov:
                held |= self._provisional_holders(h, now)
            kept = active & held
            for name in active - kept:
                depth[name] = i
            active = kept
            if not active:
                break
        else:
            for name in active:
                depth[name] = len(hashes)
        return {n: d for n, d in depth.items() if d > 0}

    def _holder(self, field: bytes) -> str:
        name = self._fields.get(field)
        if name is None:
            try:
                name = str(json.loads(field)["PodIdentifier"])
            except (ValueError, KeyError, TypeError):
                name = field.decode(errors="replace")
            if len(self._fields) < 100_000:
                self._fields[field] = name
        return name

    def _provisional_holders(self, h: int, now: float) -> set[str]:
        mask = self._provisional_mask(h, now)
        names = self._slot_names
        return {names[s] for s in list(names) if mask >> s & 1}

    def shared_hashes_of(self, name: str) -> set[int]:
        """The hashes Redis says `name` holds (what every replica sees)."""
        return {int(raw) for raw in self.client.smembers(POD_SET_PREFIX + name)}
