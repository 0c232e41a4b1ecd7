"""The cost model and the policies, on exact candidate snapshots."""

from __future__ import annotations

import pytest

from kvloop.router.config import CostConfig
from kvloop.router.scorer import (
    BOUNDED_LOAD,
    COLD,
    HOT_PREFIX_REPLICA,
    LOAD_ONLY,
    LOAD_OVERRIDE,
    PREFIX_HIT,
    Candidate,
    RouteRequest,
    estimate_cost,
    hit_tokens,
    kv_aware,
    make_policy,
    rendezvous,
    saturated,
)

CFG = CostConfig(decode_token_cost=16.0, marginal_work_weight=0.0)
REQ = RouteRequest(prompt_tokens=160, block_size=16, prefix_key=123, expected_output_tokens=0)


def test_hit_tokens_never_covers_the_last_prompt_token():
    assert hit_tokens(10, 160, 16) == 144   # 160 tokens: at most 9 blocks reusable
    assert hit_tokens(3, 160, 16) == 48
    assert hit_tokens(10, 161, 16) == 160
    assert hit_tokens(5, 0, 16) == 0


def test_cost_terms_add_up_in_tokens():
    c = Candidate("a", cached_blocks=4, in_flight=3, prefilling=1, queued_prefill_tokens=100,
                  running=2, waiting=2)
    # queued 100 + unknown waiting (2 - 1) * 160 + own (160 - 64) + 16 * max(3, 4)
    assert estimate_cost(c, REQ, CFG) == 100 + 160 + 96 + 64
    assert estimate_cost(Candidate("a", cached_blocks=4, load_only=True), REQ, CFG) == 160


def test_marginal_work_keeps_a_sibling_with_its_prefilling_prefix():
    cfg = CostConfig(decode_token_cost=16.0, marginal_work_weight=1.0)
    req = RouteRequest(prompt_tokens=49, block_size=16)
    # holder: the first sibling (49 uncached tokens) is still prefilling there
    holder = Candidate("a", cached_blocks=3, in_flight=1, prefilling=1,
                       queued_prefill_tokens=49)
    assert estimate_cost(holder, req, cfg) == 49 + 2 * 1 + 16
    assert estimate_cost(Candidate("b"), req, cfg) == 2 * 49
    assert kv_aware([holder, Candidate("b")], req, cfg).worker == "a"
    # without the marginal-work term the idle worker would look cheaper
    assert kv_aware([holder, Candidate("b")], req, CFG).worker == "b"


def test_kv_shortage_costs_the_tokens_to_recompute():
    req = RouteRequest(prompt_tokens=160, block_size=16, expected_output_tokens=32)
    full = Candidate("a", capacity_blocks=20, kv_usage=0.9)   # 2 free blocks, 12 needed
    assert estimate_cost(full, req, CFG) == 160 + 10 * 16
    assert estimate_cost(Candidate("b", capacity_blocks=20), req, CFG) == 160


def test_new_prefixes_go_where_they_evict_least():
    req = RouteRequest(prompt_tokens=160, block_size=16, expected_output_tokens=16)
    cfg = CostConfig(eviction_weight=0.5, marginal_work_weight=0.0)
    full = Candidate("a", capacity_blocks=40, indexed_blocks=35)   # 11 new blocks: 6 out
    roomy = Candidate("b", capacity_blocks=40, indexed_blocks=10)
    assert estimate_cost(full, req, cfg) == 160 + 0.5 * 6 * 16
    assert estimate_cost(roomy, req, cfg) == 160
    assert kv_aware([full, roomy], req, cfg).worker == "b"


def test_longest_prefix_wins_at_equal_load():
    d = kv_aware([Candidate("a", cached_blocks=2), Candidate("b", cached_blocks=6),
                  Candidate("c")], REQ, CFG)
    assert (d.worker, d.reason, d.credited_cached_tokens) == ("b", PREFIX_HIT, 96)
    assert d.costs == {"a": 128.0, "b": 64.0, "c": 160.0}


def test_load_outweighs_a_short_prefix():
    d = kv_aware([Candidate("a", cached_blocks=2, in_flight=2, prefilling=2,
                            queued_prefill_tokens=300),
                  Candidate("b")], REQ, CFG)
    assert (d.worker, d.reason) == ("b", LOAD_OVERRIDE)


def test_cold_prefix_ties_follow_the_rendezvous_order():
    cands = [Candidate(n) for n in ("a", "b", "c", "d")]
    for key in range(20):
        d = kv_aware(cands, RouteRequest(64, 16, prefix_key=key), CFG)
        assert d.reason == COLD
        assert d.worker == max("abcd", key=lambda n: rendezvous(key, n))


def test_degraded_worker_gets_no_cache_credit():
    d = kv_aware([Candidate("a", cached_blocks=9, load_only=True),
                  Candidate("b", cached_blocks=3)], REQ, CFG)
    assert d.worker == "b" and d.reason == PREFIX_HIT
    d = kv_aware([Candidate("a", load_only=True), Candidate("b", in_flight=1)], REQ, CFG)
    assert d.worker == "a" and d.reason == LOAD_ONLY and d.credited_cached_tokens == 0


def test_saturation_is_relative_to_the_fleet_mean_above_a_floor():
    cfg = CostConfig(load_bound=2.0, saturation_floor=1)
    cands = [Candidate("a", in_flight=4), Candidate("b"), Candidate("c"), Candidate("d")]
    assert saturated(cands[0], cands, cfg)          # 5 > 2 * 5 / 4
    assert not saturated(cands[1], cands, cfg)
    idle = [Candidate("a"), Candidate("b")]
    assert not saturated(idle[0], idle, cfg)        # one request never saturates
    floor = CostConfig(load_bound=2.0, saturation_floor=8)
    assert not saturated(cands[0], cands, floor)    # 5 requests: under the floor
    busy = [Candidate("a", in_flight=12), Candidate("b"), Candidate("c"), Candidate("d")]
    assert saturated(busy[0], busy, floor)          # 13 > max(2 * 13 / 4, 8)


def test_hot_prefix_replicates_when_its_holder_is_saturated():
    holder = Candidate("a", cached_blocks=9, in_flight=6)
    others = [Candidate("b", in_flight=1), Candidate("c", in_flight=1),
              Candidate("d", in_flight=1)]
    # decode cost 0: affinity alone would pile every request onto the holder
    cfg = CostConfig(decode_token_cost=0.0, marginal_work_weight=0.0, load_bound=1.5,
                     saturation_floor=1)
    d = kv_aware([holder, *others], REQ, cfg)
    assert d.reason == HOT_PREFIX_REPLICA and d.worker != "a"
    # the replica is the prefix's rendezvous choice among equally loaded peers
    assert d.worker == max("bcd", key=lambda n: rendezvous(REQ.prefix_key, n))
    # once a replica holds the prefix too, it is preferred over the cold peers
    replica = Candidate(d.worker, cached_blocks=9, in_flight=2)
    rest = [c for c in others if c.name != d.worker]
    d2 = kv_aware([holder, replica, *rest], REQ, cfg)
    assert d2.worker == replica.name and d2.reason == PREFIX_HIT


def test_bounded_load_without_a_prefix():
    cfg = CostConfig(decode_token_cost=0.0, marginal_work_weight=0.0, load_bound=1.0,
                     saturation_floor=1)
    # b looks costlier (5 requests waiting that the router did not send), but a already
    # holds every request this router sent: one more would exceed the bound
    cands = [Candidate("a", in_flight=3), Candidate("b", waiting=5)]
    d = kv_aware(cands, RouteRequest(8, 16, 5), cfg)
    assert (d.worker, d.reason) == ("b", BOUNDED_LOAD)
    # when every worker is saturated, the cheapest stays chosen
    even = [Candidate("a", in_flight=3), Candidate("b", in_flight=3)]
    assert kv_aware(even, RouteRequest(8, 16, 5), cfg).reason == COLD


def test_round_robin_cycles_in_name_order():
    p = make_policy("round-robin", CFG)
    cands = [Candidate("b", cached_blocks=9), Candidate("a")]
    assert [p.choose(cands, REQ).worker for _ in range(4)] == ["a", "b", "a", "b"]


def test_least_loaded_ignores_prefixes_and_rotates_ties():
    p = make_policy("least-loaded", CFG)
    d = p.choose([Candidate("a", cached_blocks=9, in_flight=1), Candidate("b")], REQ)
    assert d.worker == "b"
    tied = [Candidate("a"), Candidate("b")]
    assert {p.choose(tied, REQ).worker for _ in range(2)} == {"a", "b"}


def test_random_policy_is_seeded():
    cands = [Candidate(n) for n in "abcd"]
    picks = [make_policy("random", CFG, seed=3).choose(cands, REQ).worker for _ in range(3)]
    assert len(set(picks)) == 1
    p = make_policy("random", CFG, seed=3)
    assert len({p.choose(cands, REQ).worker for _ in range(40)}) == 4


def test_bad_inputs_are_refused_clearly():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest", CFG)
    with pytest.raises(ValueError, match="no candidate"):
        kv_aware([], REQ, CFG)
    with pytest.raises(ValueError, match="load_bound"):
        CostConfig(load_bound=0.5)
