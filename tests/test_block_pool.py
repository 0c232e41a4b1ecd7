"""Exact block-pool and KV-cache-manager behaviour: block ids, free-queue order, events.

Scenarios follow vLLM's tests (docs/vllm-facts.md#conformance-scenarios).
"""

from __future__ import annotations

import pytest

from kvloop.core.block_pool import BlockHashMap, BlockPool, FreeBlockQueue, KVCacheBlock
from kvloop.core.hashing import BlockHasher
from kvloop.events.types import AllBlocksCleared, BlockRemoved, BlockStored, event_int

from .core_helpers import admit, make_manager, make_request


def free_ids(kv):
    return kv.block_pool.free_block_queue.block_ids()


def test_null_block_and_capacity():
    pool = BlockPool(8)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 7
    assert pool.free_block_queue.block_ids() == [1, 2, 3, 4, 5, 6, 7]
    assert pool.get_usage() == 0.0
    pool.check_invariants()


def test_prefill_reuse_and_lru_order():
    kv = make_manager(11)
    common = [0] * 16 + [1] * 16 + [2] * 16
    r0 = make_request("0", common + [3] * 7)
    assert len(r0.block_hashes) == 3
    assert admit(kv, r0) == [1, 2, 3, 4]
    blocks = kv.block_pool.blocks
    assert [blocks[i].block_hash is not None for i in (1, 2, 3, 4)] == [True, True, True, False]
    r1 = make_request("1", common + [3] * 5)
    hits, n = kv.get_computed_blocks(r1)
    assert [b.block_id for b in hits] == [1, 2, 3] and n == 48
    assert admit(kv, r1) == [1, 2, 3, 5]
    assert [blocks[i].ref_cnt for i in (1, 2, 3)] == [2, 2, 2]
    assert kv.block_pool.get_num_free_blocks() == 5
    kv.free(r0)
    kv.free(r1)
    assert free_ids(kv) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    r2 = make_request("2", common + [3] * 6)
    assert admit(kv, r2) == [1, 2, 3, 5]
    assert kv.block_pool.get_num_free_blocks() == 6
    kv.free(r2)
    assert free_ids(kv) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    miss = make_request("3", [99] * 160)
    assert admit(kv, miss) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert kv.block_pool.get_num_free_blocks() == 0
    kv.check_invariants()


def test_decode_growth_hashes_full_blocks_only():
    kv = make_manager(11)
    r = make_request("0", [0] * 16 + [1] * 16 + [2] * 16 + [3] * 7)
    admit(kv, r)
    for t in range(4):
        r.append_output_token_ids(100 + t)
    assert kv.allocate_slots(r, 4) == []
    assert kv.block_pool.blocks[4].block_hash is None
    r.num_computed_tokens += 4
    for t in range(19):
        r.append_output_token_ids(200 + t)
    new = kv.allocate_slots(r, 19)
    assert new is not None and len(new) == 1
    assert kv.block_pool.blocks[4].block_hash is not None
    assert new[0].block_hash is None
    kv.check_invariants()


def test_eviction_order_tail_first():
    kv = make_manager(11)
    r0 = make_request("0", list(range(87)))
    r1 = make_request("1", list(range(100, 148)))
    assert admit(kv, r0) == [1, 2, 3, 4, 5, 6]
    assert admit(kv, r1) == [7, 8, 9]
    assert kv.block_pool.get_num_free_blocks() == 1
    kv.free(r0)
    assert free_ids(kv) == [6, 10, 5, 4, 3, 2, 1]
    kv.free(r1)
    assert free_ids(kv) == [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]
    r2 = make_request("2", list(range(32)) + [7, 7, 7])
    hits, n = kv.get_computed_blocks(r2)
    assert [b.block_id for b in hits] == [1, 2] and n == 32
    assert admit(kv, r2) == [1, 2, 6]
    assert kv.block_pool.get_num_free_blocks() == 7
    kv.check_invariants()


def test_hash_reset_on_reuse():
    kv = make_manager(2)
    r0 = make_request("0", list(range(16)))
    admit(kv, r0)
    kv.free(r0)
    assert kv.block_pool.blocks[1].block_hash is not None
    r1 = make_request("1", list(range(50, 65)))
    assert admit(kv, r1) == [1]
    assert kv.block_pool.blocks[1].block_hash is None
    assert len(kv.block_pool.cached_block_hash_to_block) == 0


def test_hit_blocks_are_not_evicted_for_their_own_request():
    kv = make_manager(3)
    r0 = make_request("0", list(range(16)))
    admit(kv, r0)
    r1 = make_request("1", list(range(16, 32)))
    admit(kv, r1)
    kv.free(r0)
    kv.free(r1)
    r2 = make_request("2", list(range(32)))
    hits, n = kv.get_computed_blocks(r2)
    assert [b.block_id for b in hits] == [1] and n == 16
    assert admit(kv, r2) == [1, 2]


def test_caching_disabled():
    kv = make_manager(5, block_size=4, caching=False)
    r0 = make_request("0", list(range(10)), hasher=None)
    assert admit(kv, r0) == [1, 2, 3]
    kv.free(r0)
    assert free_ids(kv) == [3, 2, 1, 4]
    r1 = make_request("1", list(range(16)), hasher=None)
    assert kv.get_computed_blocks(r1) == ([], 0)
    assert admit(kv, r1) == [3, 2, 1, 4]
    r2 = make_request("2", list(range(4)), hasher=None)
    assert kv.allocate_slots(r2, 4) is None
    assert kv.take_events() == []


def test_cache_salt_separates_prefixes():
    kv = make_manager(20)
    base = list(range(50))
    a = make_request("a", base, cache_salt="salt1")
    admit(kv, a)
    same = make_request("b", base, cache_salt="salt1")
    assert kv.get_computed_blocks(same)[1] == 48
    other = make_request("c", base, cache_salt="salt2")
    assert kv.get_computed_blocks(other)[1] == 0
    plain = make_request("d", base)
    assert kv.get_computed_blocks(plain)[1] == 0
    assert a.block_hashes[1] != plain.block_hashes[1]  # the salt taints the whole chain


def test_failed_allocation_leaves_ref_counts():
    kv = make_manager(11)
    r0 = make_request("0", list(range(48)))
    r1 = make_request("1", list(range(96)))
    admit(kv, r0)
    assert admit(kv, r1) == [1, 2, 3, 4, 5, 6]
    kv.free(r1)  # blocks 4,5,6 free but cached: 7 free in all
    filler = make_request("f", list(range(500, 532)))
    admit(kv, filler)  # takes 2 uncached free blocks from the front
    assert kv.block_pool.get_num_free_blocks() == 5
    big = make_request("big", list(range(96)) + list(range(900, 960)))
    hits, n = kv.get_computed_blocks(big)
    assert n == 96 and [b.ref_cnt for b in hits] == [1, 1, 1, 0, 0, 0]
    # needs 10 blocks: 6 hits (3 of them evictable) + 4 new -> 7 > 5 free
    assert kv.allocate_slots(big, 60, n, hits) is None
    assert [b.ref_cnt for b in hits] == [1, 1, 1, 0, 0, 0]
    kv.check_invariants()


def test_reset_prefix_cache():
    kv = make_manager(6)
    r = make_request("0", list(range(40)))
    admit(kv, r)
    kv.take_events()
    assert kv.reset_prefix_cache() is False
    kv.free(r)
    assert kv.reset_prefix_cache() is True
    assert len(kv.block_pool.cached_block_hash_to_block) == 0
    assert all(b.block_hash is None for b in kv.block_pool.blocks)
    assert kv.take_events() == [AllBlocksCleared()]


def test_duplicate_hash_map():
    m = BlockHashMap()
    b = [KVCacheBlock(i) for i in range(4)]
    for blk, h in zip(b, [b"h0", b"h1", b"h2", b"h0"], strict=True):
        blk.block_hash = h
        m.insert(h, blk)
    assert {blk.block_id for blk in m.blocks_of(b"h0")} == {0, 3}
    assert m.get_one_block(b"h0") is b[0]
    assert m.pop(b"h1", 1) is b[1] and m.get_one_block(b"h1") is None
    assert m.pop(b"h0", 0) is b[0] and m.get_one_block(b"h0") is b[3]
    assert m.pop(b"h0", 99) is None
    m.pop(b"h2", 2)
    m.pop(b"h0", 3)
    assert len(m) == 0


@pytest.mark.parametrize("n", [2, 3, 10])
def test_kv_events_store_and_remove(n):
    kv = make_manager(n + 1)
    tokens = list(range(n * 16))
    r = make_request("0", tokens)
    admit(kv, r)
    ev = kv.take_events()
    assert ev == [BlockStored(block_hashes=[event_int(h) for h in r.block_hashes],
                              parent_block_hash=None, token_ids=tokens, block_size=16,
                              lora_id=None, medium="GPU", lora_name=None,
                              extra_keys=[None] * n, group_idx=0,
                              kv_cache_spec_kind="full_attention")]
    assert kv.take_events() == []
    kv.free(r)
    r2 = make_request("1", tokens)
    kv.allocate_slots(r2, n * 16)  # no lookup: every cached block is evicted and re-stored
    ev = kv.take_events()
    assert len(ev) == n + 1
    assert ev[:n] == [BlockRemoved(block_hashes=[event_int(h)], medium="GPU", group_idx=0)
                      for h in reversed(r.block_hashes)]
    assert isinstance(ev[n], BlockStored) and len(ev[n].block_hashes) == n


def test_stored_event_parent_is_logical_previous_block():
    kv = make_manager(10)
    r = make_request("0", list(range(20)))
    admit(kv, r)
    first = kv.take_events()
    assert len(first) == 1 and first[0].parent_block_hash is None
    for t in range(12):
        r.append_output_token_ids(500 + t)
    kv.allocate_slots(r, 12)
    (ev,) = kv.take_events()
    assert ev.parent_block_hash == event_int(r.block_hashes[0])
    assert ev.block_hashes == [event_int(r.block_hashes[1])]
    assert ev.token_ids == r.all_token_ids[16:32]


def test_raw_bytes_event_hashes():
    pool = BlockPool(4, enable_kv_cache_events=True, int_event_hashes=False)
    from kvloop.core.kv_cache_manager import KVCacheManager

    kv = KVCacheManager(pool, 16, 1024)
    r = make_request("0", list(range(16)) + [1])
    admit(kv, r)
    (ev,) = kv.take_events()
    assert ev.block_hashes == [r.block_hashes[0]]


def test_free_queue_operations():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.popleft() is blocks[0]
    q.remove(blocks[2])
    assert blocks[1].next_free is blocks[3]
    q.append_n([blocks[2]])
    assert q.block_ids() == [1, 3, 4, 2]
    for _ in range(4):
        q.popleft()
    with pytest.raises(ValueError, match="No free blocks available"):
        q.popleft()
    q.append_n([blocks[0]])
    q.prepend_n([blocks[4], blocks[1]])
    q.prepend_n([blocks[2], blocks[3]])
    assert q.block_ids() == [2, 3, 4, 1, 0]
    assert q.popleft_n(5) == [blocks[i] for i in (2, 3, 4, 1, 0)]
    assert q.num_free_blocks == 0


def test_invariant_check_catches_corruption():
    pool = BlockPool(4)
    pool.blocks[2].ref_cnt = 1  # in the free queue with a reference: corrupt
    with pytest.raises(AssertionError, match="free-queue mismatch"):
        pool.check_invariants()


def test_hasher_matches_request_hashes():
    h = BlockHasher(16, "sha256", "vllm-none-hash")
    r = make_request("0", list(range(30)))
    for t in range(40):
        r.append_output_token_ids(1000 + t)
    from kvloop.core.hashing import block_hashes

    assert r.block_hashes == block_hashes(r.all_token_ids, 16, "sha256", "vllm-none-hash")
    assert h.none_hash.hex().startswith("066b1e89")
