"""KV-cache groups: which layers share one block table (vLLM's hybrid KV cache manager).

A model whose layers all attend fully has one group: every layer's K/V for token t sits in
the same block, and a request has one block table. A model that mixes full-attention and
sliding-window layers (Gemma 3, Qwen2/Mistral with a window) splits its layers into groups
of one attention type each, and a request holds one block table per group; all groups draw
from the one block pool. Each group has the same number of layers (`group_size`, the
smallest type's layer count; vLLM's rule, without its padding), so layer j of every group
shares one KV tensor: a block id means "these tokens of layer j of the group that owns the
block", and the memory of one block is `group_size` layers, not all of them.

Pure data: the manager (`kvloop.core.kv_cache_manager`) and the runner read these specs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"      # vLLM's `KVCacheSpecKind` values (KV event field)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV-cache group: its attention type, its window (sliding only) and its layers."""

    kind: str
    layers: tuple[int, ...]
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in (FULL_ATTENTION, SLIDING_WINDOW):
            raise ValueError(f"unknown KV-cache group kind {self.kind!r}")
        if (self.kind == SLIDING_WINDOW) != (self.sliding_window is not None):
            raise ValueError("a sliding-window group needs a window; a full one has none")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    def num_needed_blocks(self, block_size: int) -> int | None:
        """Blocks before a hit point that a prefix hit needs present (None: all of them):
        the last `window - 1` tokens, as vLLM counts."""
        if self.sliding_window is None:
            return None
        return -(-(self.sliding_window - 1) // block_size)


FULL_ONLY = (KVCacheGroupSpec(FULL_ATTENTION, ()),)


def kv_cache_groups(layer_windows: Sequence[int | None]) -> tuple[KVCacheGroupSpec, ...]:
    """Layer i's window (None: full attention) -> the groups, full attention first, then
    windows in increasing size. One attention type: one group of every layer."""
    by_window: dict[int | None, list[int]] = {}
    for i, w in enumerate(layer_windows):
        by_window.setdefault(w, []).append(i)
    if len(by_window) <= 1:
        w = next(iter(by_window), None)
        return (_spec(w, tuple(range(len(layer_windows)))),)
    size = min(len(layers) for layers in by_window.values())
    groups: list[KVCacheGroupSpec] = []
    for w in sorted(by_window, key=lambda k: (k is not None, k or 0)):
        layers = by_window[w]
        groups.extend(_spec(w, tuple(layers[i:i + size])) for i in range(0, len(layers), size))
    return tuple(groups)


def _spec(window: int | None, layers: tuple[int, ...]) -> KVCacheGroupSpec:
    if window is None:
        return KVCacheGroupSpec(FULL_ATTENTION, layers)
    return KVCacheGroupSpec(SLIDING_WINDOW, layers, window)


def group_size(groups: Sequence[KVCacheGroupSpec]) -> int:
    """KV tensors the runner allocates: the most layers in one group."""
    return max(len(g.layers) for g in groups)


def layer_slots(groups: Sequence[KVCacheGroupSpec], num_layers: int
                ) -> list[tuple[int, int]]:
    """Layer i -> (its group, its KV tensor: its index within the group)."""
    out: list[tuple[int, int] | None] = [None] * num_layers
    for g, spec in enumerate(groups):
        for j, layer in enumerate(spec.layers):
            out[layer] = (g, j)
    missing = [i for i, s in enumerate(out) if s is None]
    if missing:
        raise ValueError(f"layers {missing} are in no KV-cache group")
    return [s for s in out if s is not None]
