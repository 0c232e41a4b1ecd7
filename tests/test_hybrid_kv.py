"""KV-cache groups (vLLM's hybrid KV cache manager) on a tiny pool: exact block ids, free
counts, prefix hits that every group can serve, events per group.

Groups: one full-attention layer (group 0) and one sliding-window layer (group 1, window 8)
with blocks of 4 tokens: a query at position p sees keys p-7..p, so a sliding-window hit
needs the ceil(7 / 4) = 2 blocks before its end.
"""

from __future__ import annotations

from kvloop.core.block_pool import BlockPool
from kvloop.core.hashing import BlockHasher
from kvloop.core.kv_cache_groups import (
    FULL_ATTENTION,
    SLIDING_WINDOW,
    KVCacheGroupSpec,
    group_size,
    kv_cache_groups,
    layer_slots,
)
from kvloop.core.kv_cache_manager import KVCacheManager
from kvloop.events.types import BlockRemoved, BlockStored, event_int

from .core_helpers import make_request

BS = 4
HASHER = BlockHasher(BS, "sha256", "vllm-none-hash")
GROUPS = (KVCacheGroupSpec(FULL_ATTENTION, (0,)), KVCacheGroupSpec(SLIDING_WINDOW, (1,), 8))


def manager(num_blocks: int = 12) -> KVCacheManager:
    pool = BlockPool(num_blocks, enable_kv_cache_events=True)
    return KVCacheManager(pool, BS, 1024, groups=GROUPS)


def request(rid: str, tokens: list[int]):
    return make_request(rid, tokens, hasher=HASHER)


def ids(kv: KVCacheManager, rid: str) -> list[list[int]]:
    return [kv.get_block_ids(rid), *kv.get_group_block_ids(rid)]


def free_ids(kv: KVCacheManager) -> list[int]:
    return kv.block_pool.free_block_queue.block_ids()


def admit(kv: KVCacheManager, req) -> int:
    hits, n = kv.get_computed_group_blocks(req)
    assert kv.allocate_group_slots(req, req.num_tokens - n, n, hits) is not None
    req.num_computed_tokens = req.num_tokens
    kv.check_invariants()
    return n


def decode(kv: KVCacheManager, req, token: int) -> None:
    """One decode step: slots for the last token, then the sampled token appended."""
    assert kv.allocate_group_slots(req, 1) is not None
    req.num_computed_tokens += 1
    req.append_output_token_ids(token)
    kv.check_invariants()


def test_groups_of_a_layer_pattern():
    # Gemma 3's pattern: five sliding layers, then a global one
    windows = [8, 8, 8, 8, 8, None] * 2
    groups = kv_cache_groups(windows)
    assert [(g.kind, g.layers) for g in groups] == [
        (FULL_ATTENTION, (5, 11)), (SLIDING_WINDOW, (0, 1)), (SLIDING_WINDOW, (2, 3)),
        (SLIDING_WINDOW, (4, 6)), (SLIDING_WINDOW, (7, 8)), (SLIDING_WINDOW, (9, 10))]
    assert group_size(groups) == 2
    assert layer_slots(groups, 12)[:7] == [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (0, 0),
                                           (3, 1)]
    assert kv_cache_groups([None] * 3) == (KVCacheGroupSpec(FULL_ATTENTION, (0, 1, 2)),)
    assert kv_cache_groups([8] * 2) == (KVCacheGroupSpec(SLIDING_WINDOW, (0, 1), 8),)


def test_sliding_window_blocks_are_freed_while_the_request_runs():
    kv = manager()
    r = request("r", list(range(10)))
    assert admit(kv, r) == 0
    assert ids(kv, "r") == [[1, 2, 3], [4, 5, 6]]
    assert kv.block_pool.get_num_free_blocks() == 5
    decode(kv, r, 100)             # computes position 10: it sees 3..10, block 0 still
    assert ids(kv, "r") == [[1, 2, 3], [4, 5, 6]]
    decode(kv, r, 101)             # position 11 sees 4..11: block 0 (tokens 0-3) is out
    assert ids(kv, "r") == [[1, 2, 3], [0, 5, 6]]
    assert free_ids(kv) == [7, 8, 9, 10, 11, 4]   # a cached block goes to the tail
    decode(kv, r, 102)             # position 12 opens block 3 in both groups
    assert ids(kv, "r") == [[1, 2, 3, 7], [0, 5, 6, 8]]
    assert free_ids(kv) == [9, 10, 11, 4]
    for t in range(103, 107):       # positions 13..16: at 15 block 1 (4-7) is out too
        decode(kv, r, t)
    assert ids(kv, "r") == [[1, 2, 3, 7, 9], [0, 0, 6, 8, 10]]
    assert free_ids(kv) == [11, 4, 5]
    kv.free(r)
    assert kv.block_pool.get_num_free_blocks() == 11
    kv.check_invariants()


def test_prefix_hit_needs_the_window_before_the_hit_point():
    kv = manager(16)
    prompt = list(range(20))                      # 5 full blocks
    a = request("a", prompt)
    admit(kv, a)
    for t in range(4):                            # positions 20..23
        decode(kv, a, 200 + t)
    assert ids(kv, "a") == [[1, 2, 3, 4, 5, 11], [0, 0, 0, 0, 10, 12]]
    assert free_ids(kv) == [13, 14, 15, 8, 7, 6, 9]
    # the same prompt: at most 19 tokens -> 4 blocks; a hit at 16 needs group 1's blocks
    # 2 and 3 (tokens 9..15 for the query at 16): freed, but still cached
    b = request("b", prompt)
    hits, n = kv.get_computed_group_blocks(b)
    assert n == 16
    assert [[x.block_id for x in h] for h in hits] == [[1, 2, 3, 4], [0, 0, 8, 9]]
    kv.free(a)
    assert free_ids(kv) == [12, 11, 13, 14, 15, 8, 7, 6, 9, 5, 4, 3, 2, 1, 10]
    kv.block_pool.get_new_blocks(6)               # evicts group 1's block 2 (id 8)
    hits, n = kv.get_computed_group_blocks(b)
    # no hit at 16 or 12 (each needs block 2); at 8 group 1 has blocks 0 and 1 (6, 7)
    assert n == 8
    assert [[x.block_id for x in h] for h in hits] == [[1, 2], [6, 7]]


def test_a_hit_in_the_full_group_alone_is_no_hit():
    kv = manager(16)
    a = request("a", list(range(12)))
    admit(kv, a)
    decode(kv, a, 300)
    decode(kv, a, 301)                            # group 1's block 0 (id 4) is freed
    assert ids(kv, "a") == [[1, 2, 3, 7], [0, 5, 6, 8]]
    assert free_ids(kv)[-1] == 4
    kv.block_pool.get_new_blocks(kv.block_pool.get_num_free_blocks())   # evicts it
    b = request("b", list(range(8)) + [99])
    assert kv.block_pool.get_cached_block(b.block_hashes[0], 0) is not None
    hits, n = kv.get_computed_group_blocks(b)
    assert n == 0 and hits == ([], [])            # group 1 lacks block 0: no hit at all
    # a longer prompt hits at 12 (group 1 needs only blocks 1 and 2 there)
    c = request("c", list(range(12)) + [99])
    hits, n = kv.get_computed_group_blocks(c)
    assert n == 12 and [[x.block_id for x in h] for h in hits] == [[1, 2, 3], [0, 5, 6]]


def test_events_carry_the_group():
    kv = manager()
    r = request("r", list(range(8)))
    admit(kv, r)
    stored = [e for e in kv.take_events() if isinstance(e, BlockStored)]
    assert [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
            for e in stored] == [(0, "full_attention", None), (1, "sliding_window", 8)]
    assert stored[0].block_hashes == stored[1].block_hashes == [
        event_int(h) for h in r.block_hashes]
    kv.free(r)
    kv.block_pool.get_new_blocks(11)           # evicts all four cached blocks
    removed = [(e.group_idx, e.block_hashes[0]) for e in kv.take_events()
               if isinstance(e, BlockRemoved)]
    assert sorted(removed) == sorted((g, event_int(h)) for g in (0, 1) for h in r.block_hashes)


def test_every_group_adopts_its_hits_before_any_allocates():
    """A free hit of group 1 at the front of the free queue must not become group 0's new
    block (both groups' layers would then write one block)."""
    kv = manager()
    a = request("a", list(range(8)))
    c = request("c", list(range(50, 58)))
    admit(kv, a)
    admit(kv, c)
    kv.free(a)
    kv.free(c)
    assert free_ids(kv) == [9, 10, 11, 2, 1, 4, 3, 6, 5, 8, 7]
    kv.block_pool.get_new_blocks(3)            # the unhashed front: 9, 10, 11
    b = request("b", list(range(8)) + [99])
    hits, n = kv.get_computed_group_blocks(b)
    assert n == 8 and [[x.block_id for x in h] for h in hits] == [[1, 2], [3, 4]]
    assert kv.allocate_group_slots(b, 1, n, hits) is not None
    # all four hits leave the free queue first; then each group takes one new block (a
    # group-by-group order would hand group 0 block 4, group 1's hit, at the front then)
    assert ids(kv, "b") == [[1, 2, 6], [3, 4, 5]]
    assert free_ids(kv) == [8, 7]


def test_random_operations_keep_invariants_and_never_serve_a_stale_window():
    """Random admissions (shared prefixes), decodes, frees and preemptions on a tiny pool:
    after every operation the manager's invariants hold; every hit block is cached for its
    group under the request's own hash at that position; a full group's hit is whole and a
    sliding group's hit holds every block of the window before the hit point."""
    import random

    rnd = random.Random(7)
    kv = manager(20)
    running = []
    stems = [list(range(10, 22)), list(range(40, 48))]
    for step in range(400):
        op = rnd.random()
        if op < 0.35 and len(running) < 4:
            prompt = rnd.choice(stems) + [rnd.randrange(60, 70) for _ in range(rnd.randrange(9))]
            if running and rnd.random() < 0.3:     # a running request's whole sequence
                prompt = list(running[0].all_token_ids) + [99]
            req = request(f"r{step}", prompt)
            hits, n = kv.get_computed_group_blocks(req)
            check_hits(kv, req, hits, n)
            if kv.allocate_group_slots(req, req.num_tokens - n, n, hits) is not None:
                req.num_computed_tokens = req.num_tokens
                running.append(req)
        elif op < 0.8 and running:
            req = rnd.choice(running)
            if kv.allocate_group_slots(req, 1) is None:
                kv.free(req)                        # preempted: back to nothing
                running.remove(req)
            else:
                req.num_computed_tokens += 1
                req.append_output_token_ids(rnd.randrange(60, 70))
        elif running:
            kv.free(running.pop(rnd.randrange(len(running))))
        kv.check_invariants()


def check_hits(kv: KVCacheManager, req, hits, n: int) -> None:
    num = n // BS
    for g, (spec, blocks) in enumerate(zip(GROUPS, hits, strict=True)):
        assert len(blocks) == num
        window = spec.sliding_window
        first = 0 if window is None else max(0, num * BS - window + 1) // BS
        for i, b in enumerate(blocks):
            if i < first:
                continue                           # before the window: may be null
            assert not b.is_null and b.block_hash == req.block_hashes[i] and b.group_id == g
