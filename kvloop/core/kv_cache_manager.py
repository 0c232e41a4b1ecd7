"""The KV cache manager: which blocks each request holds, prefix lookups, slot allocation.

Owner: only the manager maps requests to blocks (`req_to_blocks`) and counts how many of a
request's blocks are cached (`num_cached_block`). Block state itself belongs to the pool.

Regions of one request at `allocate_slots` (vLLM's layout):

    | computed | new prefix hit | new tokens | lookahead |
    |<-- held blocks -->|                     (adopted, then allocated)
                        |<---------- to be allocated ---------->|
    |<-------- to be cached (full blocks, known tokens only) -->|
"""

from __future__ import annotations

from kvloop.core.block_pool import BlockPool, KVCacheBlock
from kvloop.core.request import Request, RequestStatus
from kvloop.events.types import KVEvent
from kvloop.wire import PrefixCacheStats


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Single full-attention group, vLLM's rules (see docs/vllm-facts.md#kv-cache)."""

    def __init__(self, block_pool: BlockPool, block_size: int, max_model_len: int,
                 enable_caching: bool = True, watermark: float = 0.0):
        self.block_pool = block_pool
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.watermark_blocks = int(watermark * block_pool.num_gpu_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    # --- lookup ---------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix: whole blocks, at most `num_tokens - 1` tokens.

        Mutates nothing (hit blocks are touched only when `allocate_slots` succeeds).
        """
        if not self.enable_caching or request.sampling_params.skips_prefix_cache:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        get = self.block_pool.get_cached_block
        for h in request.block_hashes[:max_blocks]:
            blk = get(h)
            if blk is None:
                break
            hits.append(blk)
        return hits, len(hits) * self.block_size

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
    def _num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                new_computed_blocks: list[KVCacheBlock]) -> int:
        held = self.req_to_blocks.get(request_id)
        num_new = cdiv(num_tokens, self.block_size) - len(new_computed_blocks) - (
            len(held) if held else 0)
        evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return num_new + evictable_hits

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_lookahead_tokens: int = 0, full_sequence_must_fit: bool = False,
                       has_scheduled_reqs: bool = True, num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False) -> list[KVCacheBlock] | None:
        """Give `request` slots for `num_new_tokens` more tokens (after adopting prefix hits).

        Returns the newly allocated blocks, or None (and changes nothing) when they do not
        fit. On success: hit blocks are touched and adopted, new blocks are taken from the
        free-queue front, and every newly full block of known tokens is cached.
        With `full_sequence_must_fit` (admission), the whole current sequence must fit.
        `num_external_computed_tokens` (a KV connector's load) count as computed but get
        slots here; with `delay_cache_blocks` nothing is cached now (an asynchronous load
        caches its blocks when it reports: `cache_blocks`). `num_new_tokens` may be 0 only
        with external tokens.
        """
        if num_new_tokens < 0 or (num_new_tokens == 0 and num_external_computed_tokens <= 0):
            raise ValueError("num_new_tokens must be greater than 0")
        hits = new_computed_blocks or []
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        total_computed = min(num_local_computed + num_external_computed_tokens,
                             self.max_model_len)
        watermark = 0
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING,
                                                     RequestStatus.PREEMPTED):
            watermark = self.watermark_blocks
        free = self.block_pool.get_num_free_blocks()
        rid = request.request_id
        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            if self._num_blocks_to_allocate(rid, full, hits) + watermark > free:
                return None
        need_slot = min(total_computed + num_new_tokens + num_lookahead_tokens,
                        self.max_model_len)
        if self._num_blocks_to_allocate(rid, need_slot, hits) + watermark > free:
            return None

        req_blocks = self.req_to_blocks.get(rid)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[rid] = []
        if hits:
            self.block_pool.touch(hits)
            if rid not in self.num_cached_block:
                req_blocks.extend(hits)
                self.num_cached_block[rid] = len(hits)
        num_new_blocks = cdiv(need_slot, self.block_size) - len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        req_blocks.extend(new_blocks)
        if self.enable_caching and not delay_cache_blocks:
            self.cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Cache the request's full blocks of its first `num_tokens` tokens (a no-op without
        prefix caching)."""
        if not self.enable_caching:
            return
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        num_full = min(num_tokens, len(request.block_hashes) * self.block_size) // self.block_size
        if num_cached >= num_full:
            return
        extra = None
        if request.sampling_params.cache_salt is not None or request.lora_name is not None:
            extra = [request.block_extra_keys(i) for i in range(num_full)]
        self.block_pool.cache_full_blocks(
            self.req_to_blocks[rid], request.block_hashes, num_cached, num_full,
            self.block_size, request.all_token_ids, extra, request.lora_name)
        self.num_cached_block[rid] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first (tails are evicted first)."""
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        self.num_cached_block.pop(rid, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_num_cached_blocks(self, request_id: str) -> int:
        """How many of the request's leading blocks are in the prefix cache (for a request
        waiting for remote KV: its local hit)."""
        return self.num_cached_block.get(request_id, 0)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

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
        """Pool invariants, plus: each block's ref count equals the number of requests
        holding it, and a request's cached-block count never exceeds its blocks."""
        self.block_pool.check_invariants()
        holders: dict[int, int] = {}
        for rid, blocks in self.req_to_blocks.items():
            assert self.num_cached_block.get(rid, 0) <= len(blocks), f"{rid} cached > held"
            for b in blocks:
                if not b.is_null:
                    holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for b in self.block_pool.blocks:
            if not b.is_null:
                assert b.ref_cnt == holders.get(b.block_id, 0), \
                    f"{b}: ref count {b.ref_cnt} != holders {holders.get(b.block_id, 0)}"
