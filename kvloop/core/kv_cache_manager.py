"""The KV cache manager: which blocks each request holds, prefix lookups, slot allocation.

Owner: only the manager maps requests to blocks and counts how many of a request's blocks
are cached, one `GroupTable` per KV-cache group (`kvloop.core.kv_cache_groups`: one group
for a model whose layers all attend fully; full-attention and sliding-window groups for a
hybrid model, vLLM's hybrid KV cache manager). Block state itself belongs to the pool.

A sliding-window group (window W) keeps only what a query can still see: before each
allocation, its blocks wholly before token `num_computed_tokens - W + 1` go back to the pool
(their places in the table become the null block), and a prefix hit there needs only the
`ceil((W - 1) / block_size)` blocks before the hit point.

Regions of one request at `allocate_slots` (vLLM's layout):

    | computed | new prefix hit | new tokens | lookahead |
    |<-- held blocks -->|                     (adopted, then allocated)
                        |<---------- to be allocated ---------->|
    |<-------- to be cached (full blocks, known tokens only) -->|
"""

from __future__ import annotations

from collections.abc import Sequence

from kvloop.core.block_pool import BlockPool, KVCacheBlock
from kvloop.core.kv_cache_groups import FULL_ONLY, KVCacheGroupSpec
from kvloop.core.request import Request, RequestStatus
from kvloop.events.types import KVEvent
from kvloop.wire import PrefixCacheStats

GroupBlocks = tuple[list[KVCacheBlock], ...]   # one list per KV-cache group, group order


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class GroupTable:
    """One KV-cache group's block tables (vLLM's `SingleTypeKVCacheManager`).

    Owner of `req_to_blocks` (request -> its blocks of this group, logical order; a sliding
    window's blocks that fell out of the window are the pool's null block) and
    `num_cached_block` (how many leading blocks are cached for this group).
    """

    def __init__(self, pool: BlockPool, block_size: int, group_id: int,
                 spec: KVCacheGroupSpec):
        self.pool = pool
        self.block_size = block_size
        self.group_id = group_id
        self.spec = spec
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}

    def find_longest_cache_hit(self, hashes: Sequence[bytes], max_blocks: int
                               ) -> list[KVCacheBlock]:
        """Full attention: the longest run of cached blocks from block 0. Sliding window:
        scanning from the right, the first run of `num_needed_blocks` cached blocks (or a
        shorter run reaching block 0) ends the hit; the blocks before it are null blocks."""
        get, gid = self.pool.get_cached_block, self.group_id
        needed = self.spec.num_needed_blocks(self.block_size)
        if needed is None:
            hits: list[KVCacheBlock] = []
            for h in hashes[:max_blocks]:
                blk = get(h, gid)
                if blk is None:
                    break
                hits.append(blk)
            return hits
        out = [self.pool.null_block] * max_blocks
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            blk = get(hashes[i], gid)
            if blk is None:
                run = 0
                continue
            out[i] = blk
            run += 1
            if run >= needed:
                return out[:i + run]
        return out[:run]

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Sliding window: free the blocks no query from `num_computed_tokens` on can see
        (every token before `num_computed_tokens - window + 1`), newest first; their places
        become the null block. Full attention: nothing."""
        window = self.spec.sliding_window
        blocks = self.req_to_blocks.get(request_id)
        if window is None or not blocks:
            return
        first_useful = max(0, num_computed_tokens - window + 1) // self.block_size
        removed: list[KVCacheBlock] = []
        null = self.pool.null_block
        for i in range(min(first_useful, len(blocks)) - 1, -1, -1):
            if blocks[i] is null:
                break
            removed.append(blocks[i])
            blocks[i] = null
        self.pool.free_blocks(removed)

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                               hits: list[KVCacheBlock]) -> int:
        held = self.req_to_blocks.get(request_id)
        num_new = cdiv(num_tokens, self.block_size) - len(hits) - (len(held) if held else 0)
        evictable_hits = sum(1 for b in hits if b.ref_cnt == 0 and not b.is_null)
        return num_new + evictable_hits

    def adopt(self, request_id: str, hits: list[KVCacheBlock]) -> None:
        """Touch `hits` (out of the free queue) and adopt them (first allocation only).
        Every group adopts before any allocates: a free hit block of one group must not
        be handed to another as a new block."""
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        if hits:
            self.pool.touch(hits)
            if request_id not in self.num_cached_block:
                req_blocks.extend(hits)
                self.num_cached_block[request_id] = len(hits)

    def allocate(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Take blocks for `num_tokens` -> the new blocks. Assumes they fit
        (`num_blocks_to_allocate`)."""
        req_blocks = self.req_to_blocks[request_id]
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(req_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        num_full = min(num_tokens, len(request.block_hashes) * self.block_size) // self.block_size
        if num_cached >= num_full:
            return
        extra = None
        if request.sampling_params.cache_salt is not None or request.lora_name is not None:
            extra = [request.block_extra_keys(i) for i in range(num_full)]
        self.pool.cache_full_blocks(
            self.req_to_blocks[rid], request.block_hashes, num_cached, num_full,
            self.block_size, request.all_token_ids, extra, request.lora_name,
            self.group_id, self.spec)
        self.num_cached_block[rid] = num_full

    def free(self, request_id: str) -> None:
        """Release the request's blocks of this group, last block first."""
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))


class KVCacheManager:
    """vLLM's rules (see docs/vllm-facts.md#kv-cache), over one or more KV-cache groups
    (`groups`, default: one full-attention group; `kvloop.core.kv_cache_groups`).

    The single-group methods (`get_computed_blocks`, `allocate_slots`, `get_block_ids`)
    speak of group 0; the scheduler uses the `*_group*` forms, which carry every group.
    A prefix hit is a length every group can serve (`get_computed_group_blocks`).
    """

    def __init__(self, block_pool: BlockPool, block_size: int, max_model_len: int,
                 enable_caching: bool = True, watermark: float = 0.0,
                 groups: Sequence[KVCacheGroupSpec] = FULL_ONLY):
        self.block_pool = block_pool
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.watermark_blocks = int(watermark * block_pool.num_gpu_blocks)
        self.groups = tuple(groups)
        self.tables = [GroupTable(block_pool, block_size, g, spec)
                       for g, spec in enumerate(self.groups)]
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_groups(self) -> int:
        return len(self.tables)

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        """Group 0's tables (every group holds the same requests)."""
        return self.tables[0].req_to_blocks

    @property
    def num_cached_block(self) -> dict[str, int]:
        return self.tables[0].num_cached_block

    # --- lookup ---------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Group 0's part of `get_computed_group_blocks`."""
        hits, n = self.get_computed_group_blocks(request)
        return hits[0], n

    def get_computed_group_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """Longest cached prefix that every group can serve: whole blocks, at most
        `num_tokens - 1` tokens; each group's hit blocks (null blocks before a sliding
        window's). Groups are asked in turn, each within the length the others allow, until
        the length holds for all (it only shrinks).

        Mutates nothing (hit blocks are touched only when `allocate_slots` succeeds).
        """
        if not self.enable_caching or request.sampling_params.skips_prefix_cache:
            return tuple([] for _ in self.tables), 0
        num_blocks = (request.num_tokens - 1) // self.block_size
        hits = [t.find_longest_cache_hit(request.block_hashes, num_blocks)
                for t in self.tables]
        while any(len(h) != num_blocks for h in hits):
            num_blocks = min(len(h) for h in hits)
            hits = [h if len(h) == num_blocks else
                    t.find_longest_cache_hit(request.block_hashes, num_blocks)
                    for t, h in zip(self.tables, hits, strict=True)]
        return tuple(hits), num_blocks * self.block_size

    def record_prefix_cache_stats(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admission's lookup (tokens), preempted re-lookups apart."""
        if not self.enable_caching or request.sampling_params.skips_prefix_cache:
            return
        s = self.prefix_cache_stats
        if request.num_preemptions > 0:
            s.preempted_requests += 1
            s.preempted_queries += request.num_tokens
            s.preempted_hits += num_hit_tokens
        else:
            s.requests += 1
            s.queries += request.num_tokens
            s.hits += num_hit_tokens

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    # --- allocation -----------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_lookahead_tokens: int = 0, full_sequence_must_fit: bool = False,
                       has_scheduled_reqs: bool = True, num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False) -> list[KVCacheBlock] | None:
        """`allocate_group_slots` of a one-group manager, with group 0's hits and new
        blocks (ValueError with hits on a manager of several groups)."""
        if new_computed_blocks and self.num_groups != 1:
            raise ValueError("allocate_slots takes one group's hits; use allocate_group_slots")
        hits = (new_computed_blocks or [],) + tuple([] for _ in self.tables[1:])
        new = self.allocate_group_slots(
            request, num_new_tokens, num_new_computed_tokens, hits, num_lookahead_tokens,
            full_sequence_must_fit, has_scheduled_reqs, num_external_computed_tokens,
            delay_cache_blocks)
        return None if new is None else new[0]

    def allocate_group_slots(self, request: Request, num_new_tokens: int,
                             num_new_computed_tokens: int = 0,
                             new_computed_blocks: GroupBlocks | None = None,
                             num_lookahead_tokens: int = 0, full_sequence_must_fit: bool = False,
                             has_scheduled_reqs: bool = True,
                             num_external_computed_tokens: int = 0,
                             delay_cache_blocks: bool = False) -> GroupBlocks | None:
        """Give `request` slots for `num_new_tokens` more tokens (after adopting prefix hits)
        in every group.

        Returns the newly allocated blocks of each group, or None (and changes nothing but
        the release below) when they do not fit. First, a sliding-window group releases
        the blocks that no query from `num_computed_tokens` on can see. On success: hit
        blocks are touched and adopted, new blocks are taken from the free-queue front, and
        every newly full block of known tokens is cached.
        With `full_sequence_must_fit` (admission), the whole current sequence must fit.
        `num_external_computed_tokens` (a KV connector's load) count as computed but get
        slots here; with `delay_cache_blocks` nothing is cached now (an asynchronous load
        caches its blocks when it reports: `cache_blocks`). `num_new_tokens` may be 0 only
        with external tokens.
        """
        if num_new_tokens < 0 or (num_new_tokens == 0 and num_external_computed_tokens <= 0):
            raise ValueError("num_new_tokens must be greater than 0")
        hits = new_computed_blocks or tuple([] for _ in self.tables)
        rid = request.request_id
        for table in self.tables:
            table.remove_skipped_blocks(rid, request.num_computed_tokens)
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        total_computed = min(num_local_computed + num_external_computed_tokens,
                             self.max_model_len)
        watermark = 0
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING,
                                                     RequestStatus.PREEMPTED):
            watermark = self.watermark_blocks
        free = self.block_pool.get_num_free_blocks()
        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            if self._num_blocks_to_allocate(rid, full, hits) + watermark > free:
                return None
        need_slot = min(total_computed + num_new_tokens + num_lookahead_tokens,
                        self.max_model_len)
        if self._num_blocks_to_allocate(rid, need_slot, hits) + watermark > free:
            return None
        for table, group_hits in zip(self.tables, hits, strict=True):
            table.adopt(rid, group_hits)
        new_blocks = tuple(t.allocate(rid, need_slot) for t in self.tables)
        if self.enable_caching and not delay_cache_blocks:
            self.cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def _num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                hits: GroupBlocks) -> int:
        return sum(t.num_blocks_to_allocate(request_id, num_tokens, h)
                   for t, h in zip(self.tables, hits, strict=True))

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Cache the request's full blocks of its first `num_tokens` tokens, in every group
        (a no-op without prefix caching)."""
        if not self.enable_caching:
            return
        for table in self.tables:
            table.cache_blocks(request, num_tokens)

    def free(self, request: Request) -> None:
        """Release the request's blocks, group by group, last block first (tails are
        evicted first)."""
        for table in self.tables:
            table.free(request.request_id)

    def get_num_cached_blocks(self, request_id: str) -> int:
        """How many of the request's leading blocks are in the prefix cache (for a request
        waiting for remote KV: its local hit)."""
        return self.tables[0].num_cached_block.get(request_id, 0)

    def get_block_ids(self, request_id: str) -> list[int]:
        """Group 0's block ids of the request."""
        return [b.block_id for b in self.tables[0].req_to_blocks.get(request_id, ())]

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block ids of groups 1.. (empty for a one-group manager)."""
        return [[b.block_id for b in t.req_to_blocks.get(request_id, ())]
                for t in self.tables[1:]]

    def reset_prefix_cache(self) -> bool:
        if not self.block_pool.reset_prefix_cache():
            return False
        self.prefix_cache_stats.reset = True
        return True

    def take_events(self) -> list[KVEvent]:
        return self.block_pool.take_events()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def check_invariants(self) -> None:
        """Pool invariants, plus: each block's ref count equals the number of (request,
        group) tables holding it, every group holds the same requests, and a request's
        cached-block count never exceeds its blocks."""
        self.block_pool.check_invariants()
        holders: dict[int, int] = {}
        for table in self.tables:
            assert table.req_to_blocks.keys() == self.req_to_blocks.keys(), "group drift"
            for rid, blocks in table.req_to_blocks.items():
                assert table.num_cached_block.get(rid, 0) <= len(blocks), f"{rid} cached > held"
                for b in blocks:
                    if not b.is_null:
                        holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for b in self.block_pool.blocks:
            if not b.is_null:
                assert b.ref_cnt == holders.get(b.block_id, 0), \
                    f"{b}: ref count {b.ref_cnt} != holders {holders.get(b.block_id, 0)}"
