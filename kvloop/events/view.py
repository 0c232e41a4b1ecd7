"""CacheView: one worker's prefix cache as its KV events describe it.

Owner: a CacheView is changed only by `apply` / `apply_event` / `clear`, from one thread.

Rules (the block pool's, seen from outside):
- `BlockStored` adds one physical copy of each listed hash. The same hash may be stored twice
  (two blocks with the same content), so copies are counted.
- `BlockRemoved` removes one copy of each listed hash (with `keep_blocks`: the latest copy in
  the event's medium, so a block held by several tiers keeps the right ones); a hash leaves
  the view at 0 copies.
  Removing a hash the view does not hold is ignored (counted in `unknown_removes`).
- `AllBlocksCleared` empties the view.

With `keep_blocks=True` the view also keeps, per hash, what a snapshot needs to rebuild a
consumer's state with chains intact: parent hash, token ids, block size, extra keys and the
rest of the event's fields. `snapshot_events()` then lists the view as BlockStored events,
parents before children, one copy per event beyond the first.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import msgspec

from kvloop.events.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEvent,
    KVEventBatch,
)


class _Block(msgspec.Struct, gc=False):
    """What a snapshot needs of one kept block (not GC-tracked: there may be millions)."""

    parent: ExternalBlockHash | None
    token_ids: tuple[int, ...]
    extra_keys: Any
    metas: list[tuple[Any, ...]]   # one per physical copy, in store order (tier, locality...)


def _meta(ev: BlockStored) -> tuple[Any, ...]:
    """The fields shared by every block of one event (a chain is cut where they differ)."""
    return (ev.block_size, ev.lora_id, ev.medium, ev.lora_name, ev.group_idx,
            ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window, ev.locality,
            ev.ownership, ev.session_id)


def _drop_copy(metas: list[tuple[Any, ...]], medium: str | None,
               group: int | None = None) -> None:
    """Forget one copy: the latest in `medium` (`_meta`'s third field) and KV-cache group
    (its fifth; None counts as group 0), else the latest in `medium`, else the latest."""
    for same_group in (True, False):
        for i in range(len(metas) - 1, -1, -1):
            if metas[i][2] == medium and (not same_group or (metas[i][4] or 0) == (group or 0)):
                del metas[i]
                return
    metas.pop()


class CacheView:
    """Block hash -> number of physical copies, built by applying KV events in order."""

    def __init__(self, keep_blocks: bool = False):
        self.keep_blocks = keep_blocks
        self._copies: dict[ExternalBlockHash, int] = {}
        self._info: dict[ExternalBlockHash, _Block] = {}
        self.unknown_removes = 0

    # --- queries --------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._copies)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._copies

    def hashes(self) -> set[ExternalBlockHash]:
        """Every hash with at least one copy."""
        return set(self._copies)

    def copies(self, block_hash: ExternalBlockHash) -> int:
        return self._copies.get(block_hash, 0)

    def num_blocks(self) -> int:
        """Physical blocks: the sum of copies."""
        return sum(self._copies.values())

    # --- updates --------------------------------------------------------------------------
    def apply(self, batch: KVEventBatch | Iterable[KVEvent]) -> None:
        """Apply a batch (or a list of events) in order."""
        events = batch.events if isinstance(batch, KVEventBatch) else batch
        for ev in events:
            self.apply_event(ev)

    def apply_event(self, ev: KVEvent) -> None:
        if isinstance(ev, BlockStored):
            self._store(ev)
        elif isinstance(ev, BlockRemoved):
            self._remove(ev.block_hashes, ev.medium, ev.group_idx)
        elif isinstance(ev, AllBlocksCleared):
            self.clear()
        else:
            raise TypeError(f"not a KV event: {ev!r}")

    def clear(self) -> None:
        self._copies.clear()
        self._info.clear()

    def _store(self, ev: BlockStored) -> None:
        copies = self._copies
        if not self.keep_blocks:
            for h in ev.block_hashes:
                copies[h] = copies.get(h, 0) + 1
            return
        info, meta = self._info, _meta(ev)
        bs, toks, extra = ev.block_size, ev.token_ids, ev.extra_keys
        parent = ev.parent_block_hash
        for i, h in enumerate(ev.block_hashes):
            n = copies.get(h, 0)
            copies[h] = n + 1
            if n == 0:
                ek = extra[i] if extra is not None and i < len(extra) else None
                info[h] = _Block(parent, tuple(toks[i * bs:(i + 1) * bs]), ek, [meta])
            else:
                info[h].metas.append(meta)
            parent = h

    def _remove(self, hashes: Iterable[ExternalBlockHash], medium: str | None = None,
                group: int | None = None) -> None:
        copies = self._copies
        for h in hashes:
            n = copies.get(h)
            if n is None:
                self.unknown_removes += 1
            elif n > 1:
                copies[h] = n - 1
                block = self._info.get(h)
                if block is not None:
                    _drop_copy(block.metas, medium, group)
            else:
                del copies[h]
                self._info.pop(h, None)

    # --- snapshots ------------------------------------------------------------------------
    def _parent_first_order(self) -> list[ExternalBlockHash]:
        """Every hash once, depth first from the roots: each after its parent (when the
        parent is in the view), the blocks of a chain one after another."""
        info = self._info
        children: dict[ExternalBlockHash, list[ExternalBlockHash]] = {}
        roots: list[ExternalBlockHash] = []
        for h, b in info.items():
            if b.parent is not None and b.parent in info and b.parent != h:
                children.setdefault(b.parent, []).append(h)
            else:
                roots.append(h)
        order: list[ExternalBlockHash] = []
        done: set[ExternalBlockHash] = set()
        for root in roots:
            stack = [root]
            while stack:
                h = stack.pop()
                if h in done:
                    continue
                done.add(h)
                order.append(h)
                stack.extend(reversed(children.get(h, ())))  # first child continues the run
        if len(order) < len(info):  # a parent cycle (impossible for real hashes)
            order.extend(h for h in info if h not in done)
        return order

    def snapshot_events(self, max_blocks_per_event: int = 1024) -> list[BlockStored]:
        """The view as BlockStored events that rebuild it exactly when applied to an empty
        view: chains intact (each block's parent and tokens as stored), parents before
        children, then one single-block event per extra copy of a hash."""
        if not self.keep_blocks:
            raise RuntimeError("snapshot_events() needs CacheView(keep_blocks=True)")
        if max_blocks_per_event < 1:
            raise ValueError("max_blocks_per_event must be >= 1")
        order = self._parent_first_order()
        events = list(self._chain_events(order, max_blocks_per_event))
        for h in self._copies:
            for meta in self._info[h].metas[1:]:
                events.append(self._event_of([h], meta))
        return events

    def _chain_events(self, order: list[ExternalBlockHash],
                      limit: int) -> Iterator[BlockStored]:
        """Consecutive blocks that chain, with equal event fields, become one event."""
        info = self._info
        run: list[ExternalBlockHash] = []
        for h in order:
            b = info[h]
            if run and (len(run) >= limit or b.parent != run[-1]
                        or b.metas[0] != info[run[-1]].metas[0]):
                yield self._event_of(run)
                run = []
            run.append(h)
        if run:
            yield self._event_of(run)

    def _event_of(self, run: list[ExternalBlockHash],
                  meta: tuple[Any, ...] | None = None) -> BlockStored:
        """One event for `run` (a chain), with its first block's first copy's fields
        (`meta`: another copy's)."""
        info = self._info
        first = info[run[0]]
        (bs, lora_id, medium, lora_name, group_idx, kind, window, locality, ownership,
         session_id) = meta or first.metas[0]
        tokens: list[int] = []
        for h in run:
            tokens.extend(info[h].token_ids)
        return BlockStored(
            block_hashes=list(run), parent_block_hash=first.parent, token_ids=tokens,
            block_size=bs, lora_id=lora_id, medium=medium, lora_name=lora_name,
            extra_keys=[info[h].extra_keys for h in run], group_idx=group_idx,
            kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window, locality=locality,
            ownership=ownership, session_id=session_id)
