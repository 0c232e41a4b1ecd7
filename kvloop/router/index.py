"""The global prefix index: block hash -> the workers that hold that block.

Owner: this module is the only place that changes which workers hold which blocks.

Layout (llm-d's design, in Python terms):

    shards[h % num_shards].blocks : {block hash -> bitmask of worker slots}   (writers lock)
    workers[name].lru             : OrderedDict {block hash -> store count}  (oldest first)
    provisional                   : {block hash -> {slot: expiry}}           (routing guesses)

- Writers (one event-ingestion thread per worker) take the worker's lock, then the shard's
  lock of each hash they touch, so per-worker ingestion is ordered and two workers storing
  the same hash never lose each other's bit. Readers (`match`) take no lock: a dict lookup
  returning an int is atomic in Python, so a reader sees each hash either before or after
  a write, never half of one.
- Memory is bounded: one worker holds at most its KV capacity (times a slack) and the whole
  index at most `max_blocks` entries; beyond that the least recently stored entries go first
  (the engine would have evicted them: their BlockRemoved was lost or is late).
- A hash stored twice by one worker (two blocks with the same content) is counted, and only
  leaves the worker when both copies are removed.
- Provisional entries record where the router just sent a prefix, so a burst of siblings
  lands together before the worker's BlockStored arrives; they expire after a TTL unless an
  event confirms them (confirmation turns them into ordinary entries).

Hashes are 64-bit unsigned ints: the engine's `event_int` of each block digest.

Tiers below the device (vLLM's OffloadingConnector, HiCache, KVBM: `kvloop.events.types`
names them) are kept beside the device entries, per worker and tier:

    workers[name].lower[tier] : OrderedDict {block hash -> store count}    (host, disk)
    stores[store id]          : OrderedDict {block hash -> None}            (shared store)

A shared store is one set of blocks whatever worker announced them: every worker whose facts
name that store (`set_shared_store`) reads it; a worker naming none keeps its "shared" blocks
to itself. Lower tiers are bounded by `IndexConfig.max_lower_blocks` per worker and per store
(LRU). `match` answers for the device tier only (the interface of a shared index);
`match_tiers` extends each worker's device prefix with the best lower tier holding each next
block, which is the order an engine uses them: its own pool first, then loads from below.

`BlockIndex` is the interface the router, its feeds and its metrics use; `PrefixIndex` (this
module, the default) and `kvloop.router.redis_index.RedisIndex` (block -> workers shared by
router replicas in Redis, `IndexConfig.url`) implement it; the router picks one
(`kvloop.router.router.make_index`), so this module never imports its subclass.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvloop.events.types import TIER_DEVICE, TIER_DISK, TIER_HOST, TIER_SHARED, TIERS
from kvloop.router.config import IndexConfig

_U64 = (1 << 64) - 1


def to_u64(block_hash: int | bytes) -> int:
    """An event's block hash as an unsigned 64-bit int (bytes: their last 8, big-endian)."""
    if isinstance(block_hash, bytes | bytearray):
        return int.from_bytes(bytes(block_hash[-8:]), "big")
    return int(block_hash) & _U64


@dataclass
class _Shard:
    lock: threading.Lock
    blocks: dict[int, int]


class _WorkerBlocks:
    """One worker's entries in LRU order of their last store; guarded by `lock`."""

    def __init__(self, slot: int, capacity: int):
        self.slot = slot
        self.bit = 1 << slot
        self.capacity = capacity
        self.lock = threading.Lock()
        self.lru: OrderedDict[int, int] = OrderedDict()
        self.evicted = 0
        self.lower: dict[str, OrderedDict[int, int]] = {TIER_HOST: OrderedDict(),
                                                       TIER_DISK: OrderedDict()}
        self.store_id: str | None = None    # the shared store it reads (None: its own)


@dataclass(frozen=True)
class ApplyResult:
    """What one call changed: entries added, removed, and LRU evictions it caused."""

    added: int = 0
    removed: int = 0
    evicted: int = 0


class BlockIndex(Protocol):
    """What the router asks of a prefix index (see `PrefixIndex` for each method's contract).

    `clear_worker`: the worker's cache is gone (AllBlocksCleared, a new epoch, a refusal).
    `forget_worker`: only this router's view of it is no longer whole (a new subscription, a
    gap, the worker unreachable from here): an index shared by replicas keeps what the others
    see; an index of one router clears."""

    config: IndexConfig
    remote: bool   # its lookups do network I/O (a shared index): decide off the event loop

    def add_worker(self, name: str, capacity_blocks: int | None = None) -> None: ...
    def remove_worker(self, name: str) -> int: ...
    def clear_worker(self, name: str) -> int: ...
    def forget_worker(self, name: str) -> int: ...
    def workers(self) -> list[str]: ...
    def set_shared_store(self, name: str, store_id: str | None) -> None: ...
    def store(self, name: str, hashes: Iterable[int | bytes],
              tier: str = TIER_DEVICE) -> ApplyResult: ...
    def touch(self, name: str, hashes: Iterable[int | bytes]) -> int: ...
    def remove(self, name: str, hashes: Iterable[int | bytes],
               tier: str = TIER_DEVICE) -> ApplyResult: ...
    def add_provisional(self, name: str, hashes: Sequence[int]) -> int: ...
    def expire_provisional(self) -> None: ...
    def num_provisional(self) -> int: ...
    def match(self, hashes: Sequence[int], workers: Iterable[str] | None = None,
              include_provisional: bool = True) -> dict[str, int]: ...
    def match_tiers(self, hashes: Sequence[int], workers: Iterable[str] | None = None,
                    include_provisional: bool = True) -> dict[str, tuple[str, ...]]: ...
    def tier_blocks(self, name: str) -> dict[str, int]: ...
    def held(self, name: str, hashes: Iterable[int | bytes]) -> list[int]: ...
    def num_blocks(self) -> int: ...
    def num_hashes(self) -> int: ...
    def worker_blocks(self, name: str) -> int: ...
    def worker_evictions(self, name: str) -> int: ...
    def hashes_of(self, name: str) -> set[int]: ...
    def check_invariants(self) -> None: ...
    def alarms(self) -> list[str]: ...
    def on_lost(self, resync: Callable[[], None]) -> None: ...
    def close(self) -> None: ...


class PrefixIndex:
    """Thread-safe block-hash -> workers map with per-worker LRU bounds.

    Every change of which workers hold a hash goes through `_set` (a worker now holds it) and
    `_unset` (no longer): the transitions a subclass mirrors elsewhere (RedisIndex)."""

    remote = False

    def __init__(self, config: IndexConfig | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config or IndexConfig()
        self._clock = clock
        self._shards = [_Shard(threading.Lock(), {}) for _ in range(self.config.num_shards)]
        self._workers: dict[str, _WorkerBlocks] = {}
        self._slot_names: dict[int, str] = {}
        self._registry_lock = threading.Lock()
        self._total = 0
        self._total_lock = threading.Lock()
        self._prov: dict[int, dict[int, float]] = {}
        self._prov_queue: deque[tuple[float, int, int]] = deque()
        self._prov_lock = threading.Lock()
        self._stores: dict[str, OrderedDict[int, None]] = {}
        self._lower_lock = threading.Lock()    # guards `_stores` (lower[...] use w.lock)

    # --- workers --------------------------------------------------------------------------
    def add_worker(self, name: str, capacity_blocks: int | None = None) -> None:
        """Give `name` a slot. Its cap: `max_blocks_per_worker`, else capacity x slack."""
        cfg = self.config
        cap = cfg.max_blocks_per_worker
        if cap is None:
            cap = (int(capacity_blocks * cfg.capacity_slack) + 1 if capacity_blocks
                   else cfg.max_blocks)
        with self._registry_lock:
            if name in self._workers:
                self._workers[name].capacity = cap
                return
            slot = next(i for i in range(len(self._slot_names) + 1) if i not in self._slot_names)
            self._workers[name] = _WorkerBlocks(slot, cap)
            self._slot_names[slot] = name

    def remove_worker(self, name: str) -> int:
        """Drop every entry of `name` and free its slot; returns the entries dropped."""
        dropped = self.clear_worker(name)
        with self._registry_lock:
            w = self._workers.pop(name, None)
            if w is not None:
                del self._slot_names[w.slot]
        return dropped

    def clear_worker(self, name: str) -> int:
        """Forget everything `name` holds (AllBlocksCleared, new epoch, removal)."""
        w = self._workers.get(name)
        if w is None:
            return 0
        with w.lock:
            hashes = list(w.lru)
            w.lru.clear()
            for h in hashes:
                self._unset(h, w.bit)
            lower = sum(len(t) for t in w.lower.values())
            for t in w.lower.values():
                t.clear()
        self._add_total(-len(hashes))
        self._drop_provisional_of(w.slot)
        return len(hashes) + lower

    def forget_worker(self, name: str) -> int:
        """This router's view of `name` is no longer whole: here, the same as a clear."""
        return self.clear_worker(name)

    def workers(self) -> list[str]:
        return list(self._workers)

    def set_shared_store(self, name: str, store_id: str | None) -> None:
        """`name` reads the shared store `store_id` (from its worker facts; None: none)."""
        self._require(name).store_id = store_id

    # --- events ---------------------------------------------------------------------------
    def store(self, name: str, hashes: Iterable[int | bytes],
              tier: str = TIER_DEVICE) -> ApplyResult:
        """BlockStored: `name` now holds `hashes` in `tier` (device: confirms provisional
        entries; external: the worker's shared store holds them)."""
        if tier != TIER_DEVICE:
            return self._store_lower(self._require(name), [to_u64(h) for h in hashes], tier)
        w = self._require(name)
        added = evicted = 0
        stored = [to_u64(raw) for raw in hashes]
        with w.lock:
            for h in stored:
                count = w.lru.pop(h, 0)
                w.lru[h] = count + 1
                if count == 0:
                    added += 1
                    self._set(h, w.bit)
            self._add_total(added)
            evicted = self._evict_oldest(w, len(w.lru) - w.capacity)
        self._confirm(w.slot, stored)
        evicted += self._enforce_fleet_bound()
        return ApplyResult(added=added, evicted=evicted)

    def touch(self, name: str, hashes: Iterable[int | bytes]) -> int:
        """Recency: move held `hashes` to the young end of `name`'s LRU; returns how many."""
        w = self._workers.get(name)
        if w is None:
            return 0
        moved = 0
        with w.lock:
            for raw in hashes:
                h = to_u64(raw)
                if h in w.lru:
                    w.lru.move_to_end(h)
                    moved += 1
        return moved

    def remove(self, name: str, hashes: Iterable[int | bytes],
               tier: str = TIER_DEVICE) -> ApplyResult:
        """BlockRemoved: one copy of each hash left `name`'s `tier` (a shared store holds
        one copy: it is gone)."""
        if tier != TIER_DEVICE:
            return self._remove_lower(self._require(name), [to_u64(h) for h in hashes], tier)
        w = self._require(name)
        removed = 0
        with w.lock:
            for raw in hashes:
                h = to_u64(raw)
                count = w.lru.get(h)
                if count is None:
                    continue
                if count > 1:
                    w.lru[h] = count - 1
                    continue
                del w.lru[h]
                self._unset(h, w.bit)
                removed += 1
        self._add_total(-removed)
        return ApplyResult(removed=removed)

    def _store_key(self, w: _WorkerBlocks) -> str:
        return w.store_id if w.store_id is not None else f"own:{w.slot}"

    def _store_lower(self, w: _WorkerBlocks, hashes: list[int], tier: str) -> ApplyResult:
        cap = self.config.max_lower_blocks
        added = 0
        if tier == TIER_SHARED:
            with self._lower_lock:
                entries = self._stores.setdefault(self._store_key(w), OrderedDict())
                for h in hashes:
                    added += h not in entries
                    entries[h] = None
                    entries.move_to_end(h)
                evicted = _pop_oldest(entries, len(entries) - cap)
            return ApplyResult(added=added, evicted=evicted)
        with w.lock:
            lru = w.lower[tier]
            for h in hashes:
                count = lru.pop(h, 0)
                lru[h] = count + 1
                added += count == 0
            evicted = _pop_oldest(lru, len(lru) - cap)
        return ApplyResult(added=added, evicted=evicted)

    def _remove_lower(self, w: _WorkerBlocks, hashes: list[int], tier: str) -> ApplyResult:
        removed = 0
        if tier == TIER_SHARED:
            with self._lower_lock:
                entries = self._stores.get(self._store_key(w), OrderedDict())
                for h in hashes:
                    removed += entries.pop(h, 0) is None
            return ApplyResult(removed=removed)
        with w.lock:
            lru = w.lower[tier]
            for h in hashes:
                count = lru.get(h)
                if count is None:
                    continue
                if count > 1:
                    lru[h] = count - 1
                else:
                    del lru[h]
                    removed += 1
        return ApplyResult(removed=removed)

    def _require(self, name: str) -> _WorkerBlocks:
        w = self._workers.get(name)
        if w is None:
            raise KeyError(f"worker {name!r} is not in the index")
        return w

    def _set(self, h: int, bit: int) -> None:
        shard = self._shards[h % len(self._shards)]
        with shard.lock:
            shard.blocks[h] = shard.blocks.get(h, 0) | bit

    def _unset(self, h: int, bit: int) -> None:
        shard = self._shards[h % len(self._shards)]
        with shard.lock:
            mask = shard.blocks.get(h, 0) & ~bit
            if mask:
                shard.blocks[h] = mask
            else:
                shard.blocks.pop(h, None)

    def _add_total(self, delta: int) -> None:
        if delta:
            with self._total_lock:
                self._total += delta

    def _enforce_fleet_bound(self) -> int:
        """Beyond `max_blocks` entries in total, evict the oldest of the largest worker."""
        excess = self._total - self.config.max_blocks
        if excess <= 0:
            return 0
        with self._registry_lock:
            largest = max(self._workers.values(), key=lambda x: len(x.lru))
        with largest.lock:
            return self._evict_oldest(largest, excess)

    def _evict_oldest(self, w: _WorkerBlocks, n: int) -> int:
        """Pop `n` oldest entries of `w` (caller holds `w.lock`)."""
        n = max(0, min(n, len(w.lru)))
        for _ in range(n):
            h, _count = w.lru.popitem(last=False)
            self._unset(h, w.bit)
        w.evicted += n
        self._add_total(-n)
        return n

    # --- provisional entries --------------------------------------------------------------
    def add_provisional(self, name: str, hashes: Sequence[int]) -> int:
        """Record that `name` will soon hold `hashes`; returns how many were new guesses."""
        w = self._workers.get(name)
        ttl = self.config.provisional_ttl_s
        if w is None or ttl <= 0 or not hashes:
            return 0
        now = self._clock()
        expiry = now + ttl
        new = 0
        with self._prov_lock:
            self._expire_locked(now)
            for h in hashes:
                if h in w.lru:
                    continue
                slots = self._prov.setdefault(h, {})
                if w.slot not in slots:
                    new += 1
                slots[w.slot] = expiry
                self._prov_queue.append((expiry, h, w.slot))
        return new

    def _confirm(self, slot: int, hashes: Iterable[int]) -> None:
        if not self._prov:
            return
        with self._prov_lock:
            for h in hashes:
                slots = self._prov.get(h)
                if slots is not None and slots.pop(slot, None) is not None and not slots:
                    del self._prov[h]

    def _drop_provisional_of(self, slot: int) -> None:
        with self._prov_lock:
            for h in [h for h, s in self._prov.items() if slot in s]:
                slots = self._prov[h]
                del slots[slot]
                if not slots:
                    del self._prov[h]

    def _expire_locked(self, now: float) -> None:
        q = self._prov_queue
        while q and q[0][0] <= now:
            expiry, h, slot = q.popleft()
            slots = self._prov.get(h)
            if slots is not None and slots.get(slot) == expiry:
                del slots[slot]
                if not slots:
                    del self._prov[h]

    def expire_provisional(self) -> None:
        with self._prov_lock:
            self._expire_locked(self._clock())

    def num_provisional(self) -> int:
        with self._prov_lock:
            self._expire_locked(self._clock())
            return sum(len(s) for s in self._prov.values())

    def _provisional_mask(self, h: int, now: float) -> int:
        slots = self._prov.get(h)
        if not slots:
            return 0
        mask = 0
        for slot, expiry in list(slots.items()):
            if expiry > now:
                mask |= 1 << slot
        return mask

    # --- lookups --------------------------------------------------------------------------
    def match(self, hashes: Sequence[int], workers: Iterable[str] | None = None,
              include_provisional: bool = True) -> dict[str, int]:
        """Longest consecutive run of `hashes`, from block 0, that each worker holds.

        Returns {worker: blocks} for every candidate with at least one block. Provisional
        entries count as held while they live (unless `include_provisional` is False).
        """
        active = self._mask_of(workers)
        depth_by_slot: dict[int, int] = {}
        now = self._clock()
        use_prov = include_provisional and bool(self._prov)
        shards = self._shards
        n = len(shards)
        for depth, h in enumerate(hashes):
            mask = shards[h % n].blocks.get(h, 0)
            if use_prov:
                mask |= self._provisional_mask(h, now)
            kept = active & mask
            if kept != active:
                self._record_depth(active & ~kept, depth, depth_by_slot)
                active = kept
                if not active:
                    break
        else:
            self._record_depth(active, len(hashes), depth_by_slot)
        names = self._slot_names
        return {names[s]: d for s, d in depth_by_slot.items() if d > 0 and s in names}

    def match_tiers(self, hashes: Sequence[int], workers: Iterable[str] | None = None,
                    include_provisional: bool = True) -> dict[str, tuple[str, ...]]:
        """Per worker, the tier to use for each block of its usable prefix: its device
        prefix (`match`), then, block by block, the best tier below the device holding the
        next one (host, disk, then the shared store it reads) until none does: as an engine
        loads what follows its first device miss from below. Workers with no block are
        left out."""
        device = self.match(hashes, workers, include_provisional)
        names = list(self._workers) if workers is None else list(workers)
        out: dict[str, tuple[str, ...]] = {}
        for name in names:
            w = self._workers.get(name)
            if w is None:
                continue
            depth = device.get(name, 0)
            tiers = [TIER_DEVICE] * depth
            store = self._stores.get(self._store_key(w))
            for h in hashes[depth:]:
                tier = _best_tier(w, h, store)
                if tier is None:
                    break
                tiers.append(tier)
            if tiers:
                out[name] = tuple(tiers)
        return out

    @staticmethod
    def _record_depth(mask: int, depth: int, out: dict[int, int]) -> None:
        while mask:
            low = mask & -mask
            out[low.bit_length() - 1] = depth
            mask ^= low

    def _mask_of(self, workers: Iterable[str] | None) -> int:
        if workers is None:
            return sum(w.bit for w in list(self._workers.values()))
        mask = 0
        for name in workers:
            w = self._workers.get(name)
            if w is not None:
                mask |= w.bit
        return mask

    # --- introspection --------------------------------------------------------------------
    def num_blocks(self) -> int:
        """(block, worker) entries held, provisional ones excluded."""
        return self._total

    def num_hashes(self) -> int:
        return sum(len(s.blocks) for s in self._shards)

    def worker_blocks(self, name: str) -> int:
        w = self._workers.get(name)
        return len(w.lru) if w is not None else 0

    def held(self, name: str, hashes: Iterable[int | bytes]) -> list[int]:
        """Those of `hashes` that `name` holds on its device, in order."""
        w = self._workers.get(name)
        if w is None:
            return []
        with w.lock:
            return [h for h in map(to_u64, hashes) if h in w.lru]

    def tier_blocks(self, name: str) -> dict[str, int]:
        """Entries per tier of `name` (external: the shared store it reads)."""
        w = self._workers.get(name)
        if w is None:
            return {t: 0 for t in TIERS}
        shared = len(self._stores.get(self._store_key(w)) or ())
        return {TIER_DEVICE: len(w.lru), TIER_HOST: len(w.lower[TIER_HOST]),
                TIER_DISK: len(w.lower[TIER_DISK]), TIER_SHARED: shared}

    def worker_evictions(self, name: str) -> int:
        w = self._workers.get(name)
        return w.evicted if w is not None else 0

    def hashes_of(self, name: str) -> set[int]:
        """A copy of the hashes `name` holds (confirmed entries only)."""
        w = self._workers.get(name)
        if w is None:
            return set()
        with w.lock:
            return set(w.lru)

    def check_invariants(self) -> None:
        """Every worker entry has its bit in its shard and vice versa; totals agree."""
        total = 0
        seen: dict[int, int] = {}
        for w in list(self._workers.values()):
            with w.lock:
                total += len(w.lru)
                for h in w.lru:
                    seen[h] = seen.get(h, 0) | w.bit
        flat = {h: m for s in self._shards for h, m in s.blocks.items()}
        assert flat == seen, "shard bitmasks disagree with per-worker entries"
        assert total == self._total, f"total {self._total} != entries {total}"

    def check_lower_invariants(self) -> None:
        """Lower tiers and stores within their bound; copy counts >= 1."""
        cap = self.config.max_lower_blocks
        for w in list(self._workers.values()):
            with w.lock:
                for lru in w.lower.values():
                    assert len(lru) <= cap and all(c >= 1 for c in lru.values())
        with self._lower_lock:
            assert all(len(s) <= cap for s in self._stores.values())

    def alarms(self) -> list[str]:
        """What is wrong with the index itself, for /health (an index in memory: nothing)."""
        return []

    def on_lost(self, resync: Callable[[], None]) -> None:
        """`resync` is called (from another thread) when the index lost entries it cannot
        restore by itself (a shared store that restarted): the router then asks every worker
        for its blocks again. An index in memory loses nothing."""

    def close(self) -> None:
        """Stop what the index runs in the background (nothing here)."""


def _pop_oldest(entries: OrderedDict[int, int] | OrderedDict[int, None], n: int) -> int:
    """Drop the `n` oldest of `entries` (caller holds its lock); returns how many."""
    n = max(0, min(n, len(entries)))
    for _ in range(n):
        entries.popitem(last=False)
    return n


def _best_tier(w: _WorkerBlocks, h: int, store: OrderedDict[int, None] | None) -> str | None:
    """The fastest tier below the device from which `w` can load block `h` (lock-free
    reads: see the module)."""
    for tier in (TIER_HOST, TIER_DISK):
        if h in w.lower[tier]:
            return tier
    if store is not None and h in store:
        return TIER_SHARED
    return None
