"""KV-cache groups of a hybrid worker (sliding-window and full-attention layers), as the
router sees them in KV events, and the engine's prefix-hit rule over them.

A worker whose model has several KV-cache groups (vLLM's hybrid KV cache manager, kvloop's
`kvloop.core.kv_cache_groups`) caches each block once per group: its `BlockStored` events
carry the group (`group_idx`, `kv_cache_spec_kind`, `kv_cache_spec_sliding_window`), its
`BlockRemoved` events the group index. Group 0's hashes are indexed as they are; group g > 0
under `group_key(hash, g)`, so one group's eviction never hides another's block.

A prefix hit is what every group can serve (the engine's rule, kvloop.core.kv_cache_manager):
a full-attention group needs every block before the hit point, a sliding-window group only
the `ceil((window - 1) / block_size)` blocks before it (a shorter run reaching block 0 is
enough), and the length shrinks until all groups agree. `hit_blocks` replays that rule on the
index, so predicted cached tokens equal the engine's. A kind the router does not know (e.g.
"mamba") cannot be predicted: the feed raises an alarm instead (`unknown_kind`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"
KNOWN_KINDS = (FULL_ATTENTION, SLIDING_WINDOW)


@dataclass(frozen=True)
class GroupSpec:
    """One KV-cache group of a worker, as its BlockStored events describe it."""

    kind: str
    sliding_window: int | None = None


def group_key(block_hash: int, group: int) -> int:
    """The index key of `block_hash` in KV-cache group `group` (group 0: the hash itself)."""
    if group == 0:
        return block_hash
    data = block_hash.to_bytes(8, "big") + group.to_bytes(4, "big")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def unknown_kind(spec: GroupSpec) -> str | None:
    """Why the router cannot predict hits of this group (None: it can)."""
    if spec.kind not in KNOWN_KINDS:
        return (f"a KV-cache group of kind {spec.kind!r}; the router predicts hits only for "
                f"{', '.join(KNOWN_KINDS)} groups")
    if spec.kind == SLIDING_WINDOW and not spec.sliding_window:
        return "a sliding-window KV-cache group without its window in the events"
    return None


def is_hybrid(groups: Mapping[int, GroupSpec]) -> bool:
    """True when the plain longest-prefix match is not the engine's rule."""
    return len(groups) > 1 or any(g.kind != FULL_ATTENTION for g in groups.values())


def hit_blocks(held: Callable[[list[int]], set[int]], hashes: Sequence[int],
               groups: Mapping[int, GroupSpec], max_blocks: int, block_size: int) -> int:
    """Blocks of a prefix hit every group serves; `held(keys)` -> those the worker holds."""
    num = min(max_blocks, len(hashes))
    held_by = {g: held([group_key(h, g) for h in hashes[:num]]) for g in groups}
    keys = {g: [group_key(h, g) for h in hashes[:num]] for g in groups}
    while True:
        lengths = [_group_hit(keys[g][:num], held_by[g], spec, block_size)
                   for g, spec in groups.items()]
        if all(n == num for n in lengths):
            return num
        num = min(lengths)


def _group_hit(keys: list[int], held: set[int], spec: GroupSpec, block_size: int) -> int:
    if spec.kind != SLIDING_WINDOW or spec.sliding_window is None:
        for i, k in enumerate(keys):
            if k not in held:
                return i
        return len(keys)
    needed = -(-(spec.sliding_window - 1) // block_size)
    run = 0
    for i in range(len(keys) - 1, -1, -1):
        if keys[i] not in held:
            run = 0
            continue
        run += 1
        if run >= needed:
            return i + run
    return run
