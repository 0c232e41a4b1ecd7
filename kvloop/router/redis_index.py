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

`forget_worker` (this replica subscribes anew, meets a gap, loses sight of the worker) drops
only the local view: Redis keeps what the others see, so a replica that restarts routes from
the shared view at once. `clear_worker` (the worker's cache is gone) clears it in Redis too. A
`BlockRemoved` of a block this replica never saw stored still removes it from Redis.

A Redis error never fails a decision: `match` falls back to the local view, writes are
dropped (counted in `errors`, logged once a minute).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kvloop.events.config import redact_url
from kvloop.router.config import IndexConfig
from kvloop.router.index import ApplyResult, PrefixIndex, to_u64

log = logging.getLogger("kvloop.router")

DEVICE_TIER = "gpu"
POD_SET_PREFIX = "kvloop:pod:"
ENGINE_PREFIX = "engine:"
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

    def __init__(self, config: IndexConfig, clock: Callable[[], float] = time.monotonic):
        super().__init__(config, clock)
        import redis

        assert config.url is not None
        self.url = redact_url(config.url)
        self._redis_errors: tuple[type[Exception], ...] = (redis.RedisError, OSError)
        self.client = redis.Redis.from_url(redis_url(config.url), password=config.password,
                                           socket_timeout=2.0, socket_connect_timeout=2.0)
        try:
            self.client.ping()
        except self._redis_errors as e:
            raise OSError(f"cannot reach the shared index {self.url}: {e}") from e
        self._unset_script = self.client.register_script(_UNSET)
        self._local = threading.local()
        self._fields: dict[bytes, str] = {}
        self.errors = 0
        self._last_error_log = float("-inf")

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
        try:
            return pipe.execute()   # type: ignore[no-any-return]
        except self._redis_errors as e:
            self._note_error(e)
            return None

    def _note_error(self, e: Exception) -> None:
        self.errors += 1
        now = time.monotonic()
        if now - self._last_error_log >= 60.0:
            self._last_error_log = now
            log.warning("shared index %s: %s (%d errors so far; deciding from this "
                        "router's own view meanwhile)", self.url, e, self.errors)

    # --- writes ---------------------------------------------------------------------------
    def store(self, name: str, hashes: Iterable[int | bytes]) -> ApplyResult:
        result = super().store(name, hashes)
        self._flush()
        return result

    def remove(self, name: str, hashes: Iterable[int | bytes]) -> ApplyResult:
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
        try:
            members = self.client.smembers(pods)
        except self._redis_errors as e:
            self._note_error(e)
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
        pipe = self.client.pipeline(transaction=False)
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
