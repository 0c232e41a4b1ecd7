"""Simulated KV tiers below a worker's pool: capacity and load bandwidth per tier, the KV
events a tiered worker publishes, no payload.

A case of the simulator's KV store (`SimKVBlockStore`: a block weighs its modelled bytes and
moves in `nbytes / bandwidth` seconds) for tiers: a `TieredKVCache` is one worker's device
pool (an LRU of `device_blocks`) with optional host and disk tiers of its own and an
optional `SimSharedStore` several workers read and write. Semantics follow vLLM's
OffloadingConnector (write-through):

- `lookup(hashes)`: the engine's hit: the longest prefix on the device, then, block by
  block, the best lower tier holding the next one (at most the prompt's full blocks before
  its last token);
- `admit(...)`: after the request's prefill, every block of the prompt is on the device
  (loaded or computed); each new device block is written through to every tier below it;
  each LRU evicts beyond its capacity.

Every change is reported as vLLM's events, self-describing in every tier (token ids, parent,
block size) with `medium`/`locality` from `kvloop.events.types` (GPU, CPU, STORAGE
LOCAL/REMOTE): what a router indexes. Owner: the cache owns its LRUs; a shared store's LRU
is owned by the store, changed only through the caches that write it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvloop.events.types import (
    LOCALITY_OF_TIER,
    MEDIUM_OF_TIER,
    TIER_DEVICE,
    TIER_DISK,
    TIER_HOST,
    TIER_SHARED,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from kvloop.sim.kv_store import SIM_KV_BYTES_PER_TOKEN

# Load bandwidth (bytes/s) of each tier when none is given: pinned host memory over PCIe,
# an NVMe disk, and a shared store at the simulator's default network (10 Gb/s).
DEFAULT_TIER_BANDWIDTH = {TIER_HOST: 20e9, TIER_DISK: 2e9, TIER_SHARED: 1.25e9}


@dataclass(frozen=True)
class SimTier:
    """One tier below the device: how many blocks it holds and how fast it loads."""

    tier: str
    capacity_blocks: int
    bandwidth: float = 0.0       # bytes/s; 0: `DEFAULT_TIER_BANDWIDTH[tier]`

    def __post_init__(self) -> None:
        if self.tier not in DEFAULT_TIER_BANDWIDTH:
            raise ValueError(f"a simulated tier is one of {sorted(DEFAULT_TIER_BANDWIDTH)}, "
                             f"got {self.tier!r}")
        if self.capacity_blocks < 1 or self.bandwidth < 0:
            raise ValueError("capacity_blocks must be >= 1 and bandwidth >= 0")

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth or DEFAULT_TIER_BANDWIDTH[self.tier]


class SimSharedStore:
    """A store several simulated workers read and write (`store_id` names it to a router)."""

    def __init__(self, tier: SimTier, store_id: str = "sim-store"):
        if tier.tier != TIER_SHARED:
            raise ValueError("a shared store is the external tier")
        self.tier = tier
        self.store_id = store_id
        self.blocks: OrderedDict[int, None] = OrderedDict()


@dataclass
class _Chain:
    """The blocks of one prompt: hashes, tokens per block, block size."""

    hashes: Sequence[int]
    tokens: Sequence[int]
    block_size: int

    def tokens_of(self, i: int, j: int) -> list[int]:
        return list(self.tokens[i * self.block_size:j * self.block_size])

    def parent(self, i: int) -> int | None:
        return self.hashes[i - 1] if i > 0 else None


class TieredKVCache:
    """One simulated worker's device pool and the tiers below it (module docstring)."""

    def __init__(self, device_blocks: int, block_size: int, tiers: Sequence[SimTier] = (),
                 shared: SimSharedStore | None = None):
        if device_blocks < 1:
            raise ValueError("device_blocks must be >= 1")
        self.block_size = block_size
        self.block_nbytes = SIM_KV_BYTES_PER_TOKEN * block_size
        self.capacity = {TIER_DEVICE: device_blocks}
        self.lrus: dict[str, OrderedDict[int, None]] = {TIER_DEVICE: OrderedDict()}
        self.bandwidth: dict[str, float] = {}
        for t in tiers:
            if t.tier == TIER_SHARED:
                raise ValueError("the shared tier is a SimSharedStore")
            self.capacity[t.tier] = t.capacity_blocks
            self.lrus[t.tier] = OrderedDict()
            self.bandwidth[t.tier] = t.bytes_per_s
        self.shared = shared
        if shared is not None:
            self.bandwidth[TIER_SHARED] = shared.tier.bytes_per_s

    def _holders(self) -> list[tuple[str, OrderedDict[int, None]]]:
        """Every tier this worker reads, best first."""
        out = [(t, self.lrus[t]) for t in (TIER_DEVICE, TIER_HOST, TIER_DISK) if t in self.lrus]
        if self.shared is not None:
            out.append((TIER_SHARED, self.shared.blocks))
        return out

    def lookup(self, hashes: Sequence[int], prompt_tokens: int) -> tuple[str, ...]:
        """The tier each block of the usable cached prefix is taken from."""
        usable = hashes[:max(0, prompt_tokens - 1) // self.block_size]
        device = self.lrus[TIER_DEVICE]
        depth = next((i for i, h in enumerate(usable) if h not in device), len(usable))
        tiers = [TIER_DEVICE] * depth
        below = self._holders()[1:]
        for h in usable[depth:]:
            found = next((t for t, lru in below if h in lru), None)
            if found is None:
                break
            tiers.append(found)
        return tuple(tiers)

    def load_seconds(self, tiers: Sequence[str]) -> float:
        """Modelled seconds to load the blocks of `tiers` that are not on the device."""
        return sum(self.block_nbytes / self.bandwidth[t] for t in tiers if t != TIER_DEVICE)

    def admit(self, hashes: Sequence[int], token_ids: Sequence[int]) -> list[KVEvent]:
        """The prompt's full blocks are on the device now; write new ones through below.
        Returns the events, in order."""
        chain = _Chain(hashes, token_ids, self.block_size)
        events: list[KVEvent] = []
        new = [i for i, h in enumerate(hashes) if h not in self.lrus[TIER_DEVICE]]
        for h in hashes:
            self.lrus[TIER_DEVICE].pop(h, None)
        for tier, lru in self._holders():
            if tier == TIER_DEVICE:     # every block is young; only `new` ones are news
                stored = new
                for h in hashes:
                    lru[h] = None
            else:
                stored = [i for i in new if hashes[i] not in lru]
                for i in new:
                    lru[hashes[i]] = None
                    lru.move_to_end(hashes[i])
            events += _stored_runs(chain, stored, tier)
            cap = self.shared.tier.capacity_blocks if tier == TIER_SHARED and self.shared \
                else self.capacity[tier]
            evicted = [lru.popitem(last=False)[0] for _ in range(max(0, len(lru) - cap))]
            if evicted:
                events.append(BlockRemoved(block_hashes=list(evicted),
                                           medium=MEDIUM_OF_TIER[tier],
                                           locality=LOCALITY_OF_TIER.get(tier)))
        return events


def _stored_runs(chain: _Chain, indexes: list[int], tier: str) -> list[KVEvent]:
    """One self-describing BlockStored per consecutive run of `indexes`."""
    events: list[KVEvent] = []
    start = 0
    while start < len(indexes):
        end = start
        while end + 1 < len(indexes) and indexes[end + 1] == indexes[end] + 1:
            end += 1
        i, j = indexes[start], indexes[end] + 1
        events.append(BlockStored(
            block_hashes=list(chain.hashes[i:j]), parent_block_hash=chain.parent(i),
            token_ids=chain.tokens_of(i, j), block_size=chain.block_size, lora_id=None,
            medium=MEDIUM_OF_TIER[tier], lora_name=None, locality=LOCALITY_OF_TIER.get(tier)))
        start = end + 1
    return events
