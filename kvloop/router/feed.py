"""One worker's KV-event feed into the global index, with verification.

Owner: one `EventFeed` per worker, driven by that worker's subscriber thread, so batches
of one worker are applied in the order the subscriber delivers them (per-worker ordered
ingestion); different workers' feeds run side by side.

Each batch is checked before it is applied:
- `block_size` of every BlockStored must equal the fleet's;
- a root block (no parent, no extra keys) must hash, with the fleet's algorithm and seed,
  to the hash the worker reported. This catches a different hash seed or algorithm on the
  first prompt the worker caches, with certainty, instead of a silent 0% hit rate.
A failed check refuses the worker's events from then on (its entries are dropped) and
raises a `config_mismatch` alarm naming the field; routing to it becomes load-only.

Tiers (`medium`, `locality`: `kvloop.events.types.tier_of`): each event applies to the tier
it names. Only a device-tier event can be a `config_mismatch`; below the device:
- a placeholder (vLLM before 0.24: `block_size` 0, no tokens) mirrors device blocks: hashes
  the worker holds on its device are indexed in the event's tier (`placeholders_mapped`),
  the others are counted and ignored (`placeholders_ignored`);
- a block size other than the fleet's (an offloading block of several device blocks, whose
  one hash names its last device block) is counted and ignored (`tier_size_skipped`);
- an unknown medium is counted and ignored (`unknown_medium`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kvloop.core.hashing import BlockHasher
from kvloop.events.types import (
    TIER_DEVICE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    event_int,
    tier_of,
)
from kvloop.router.groups import FULL_ATTENTION, GroupSpec, group_key, is_hybrid, unknown_kind
from kvloop.router.index import BlockIndex, to_u64
from kvloop.router.registry import EventCounters

log = logging.getLogger("kvloop.router")

MismatchHandler = Callable[[str, str], None]


class EventFeed:
    """Applies one worker's event batches to the index (called from its subscriber)."""

    def __init__(self, worker: str, index: BlockIndex, hasher: BlockHasher | None,
                 counters: EventCounters, on_mismatch: MismatchHandler,
                 on_signal: Callable[[str, bool], None]):
        self.worker = worker
        self.index = index
        self.hasher = hasher
        self.counters = counters
        self.on_mismatch = on_mismatch
        self.on_signal = on_signal
        self.refusing: str | None = None if hasher is not None else "no fleet hash spec"
        self._lock = threading.Lock()

    # --- subscriber callbacks -------------------------------------------------------------
    def on_batch(self, batch: Any) -> None:
        """Apply one decoded batch (anything with `.events`), in order."""
        with self._lock:
            self.on_signal(self.worker, False)
            self.counters.batches += 1
            if self.refusing is not None:
                self.counters.refused += 1
                return
            for ev in getattr(batch, "events", ()):
                if not self._apply(ev):
                    return

    def on_clear(self, reason: str, cache_gone: bool = True) -> None:
        """The subscriber resets this worker's view before a snapshot or replay: its cache
        is gone (`cache_gone`: a new epoch, a restart), or only this router's view of it is
        no longer whole (a join, a gap, a reconnection: replicas sharing the index keep
        theirs)."""
        with self._lock:
            if self.refusing is not None:
                return  # a stopped or refused feed holds nothing; never clear a successor's
            index = self.index
            dropped = (index.clear_worker if cache_gone else index.forget_worker)(self.worker)
            self.counters.cleared += 1
            by = self.counters.clears_by_reason
            by[reason] = by.get(reason, 0) + 1
        log.info("index: cleared worker %s (%s, %d entries dropped)", self.worker, reason,
                 dropped)

    def on_heartbeat(self) -> None:
        self.on_signal(self.worker, True)

    def on_touch(self, hashes: list[int | bytes]) -> None:
        """Recency notice: these blocks were cache hits (refreshes their LRU position)."""
        with self._lock:
            if self.refusing is None:
                self.index.touch(self.worker, hashes)

    def refuse(self, reason: str) -> None:
        """Stop indexing this worker's events and drop what it holds."""
        with self._lock:
            self.refusing = reason
            self.index.clear_worker(self.worker)

    # --- events ---------------------------------------------------------------------------
    def _apply(self, ev: Any) -> bool:
        if isinstance(ev, BlockStored):
            tier = self._tier(ev)
            if tier is None:
                return True
            if tier != TIER_DEVICE:
                self._store_lower(ev, tier)
                return True
            problem = self._check_stored(ev) or self._note_group(ev)
            if problem is not None:
                self.refusing = problem
                self.index.clear_worker(self.worker)
                self.on_mismatch(self.worker, problem)
                return False
            self.counters.stored_blocks += len(ev.block_hashes)
            self.index.store(self.worker, _group_keys(ev.block_hashes, ev.group_idx))
        elif isinstance(ev, BlockRemoved):
            tier = self._tier(ev)
            if tier is None:
                return True
            self.counters.removed_blocks += len(ev.block_hashes)
            self.index.remove(self.worker, _group_keys(ev.block_hashes, ev.group_idx), tier)
        elif isinstance(ev, AllBlocksCleared):
            self.counters.cleared += 1
            self.index.clear_worker(self.worker)
        return True

    def _note_group(self, ev: BlockStored) -> str | None:
        """Learn the event's KV-cache group; a kind the router cannot predict hits for is a
        problem (the worker's events are refused and an alarm raised, never silent misses).
        """
        group = ev.group_idx or 0
        spec = GroupSpec(ev.kv_cache_spec_kind or FULL_ATTENTION,
                         ev.kv_cache_spec_sliding_window)
        if self.counters.groups.get(group) == spec:
            return None
        problem = unknown_kind(spec)
        if problem is not None:
            return f"its model has {problem} (group {group})"
        self.counters.groups[group] = spec
        if is_hybrid(self.counters.groups):
            log.info("index: worker %s has KV-cache groups %s", self.worker,
                     dict(sorted(self.counters.groups.items())))
        return None

    def _tier(self, ev: BlockStored | BlockRemoved) -> str | None:
        tier = tier_of(ev.medium, ev.locality)
        if tier is None:
            self.counters.unknown_medium += len(ev.block_hashes)
        return tier

    def _store_lower(self, ev: BlockStored, tier: str) -> None:
        """A BlockStored below the device (see the module docstring)."""
        c = self.counters
        assert self.hasher is not None
        hashes: list[int | bytes] = list(ev.block_hashes)
        if ev.block_size == 0 and not ev.token_ids:
            held = self.index.held(self.worker, hashes)
            c.placeholders_mapped += len(held)
            c.placeholders_ignored += len(hashes) - len(held)
            hashes = list(held)
        elif ev.block_size != self.hasher.block_size:
            c.tier_size_skipped += len(hashes)
            return
        c.tier_stored[tier] = c.tier_stored.get(tier, 0) + len(hashes)
        self.index.store(self.worker, hashes, tier)

    def _check_stored(self, ev: BlockStored) -> str | None:
        """A mismatch description, or None when the event agrees with the fleet's hashing."""
        hasher = self.hasher
        assert hasher is not None
        if ev.block_size != hasher.block_size:
            return (f"block size {ev.block_size} in its KV events, the fleet uses "
                    f"{hasher.block_size}")
        if ev.parent_block_hash is not None or not ev.block_hashes:
            return None
        if ev.lora_name is not None or (ev.extra_keys and ev.extra_keys[0] is not None):
            return None
        tokens = ev.token_ids[:hasher.block_size]
        if len(tokens) < hasher.block_size:
            return None
        ours = event_int(hasher.hash_range(tokens, None, 0)[0])
        self.counters.verified_roots += 1
        if ours != to_u64(ev.block_hashes[0]):
            return (f"its block hashes differ from the fleet's ({hasher.algo}, seed "
                    f"{hasher.seed!r}): a different hash seed or algorithm")
        return None


def _group_keys(hashes: list[int | bytes], group: int | None) -> list[int | bytes]:
    """Index keys of one group's hashes (group 0 or none: the hashes as they are)."""
    if not group:
        return hashes
    return [group_key(to_u64(h), group) for h in hashes]
