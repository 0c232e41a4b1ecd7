"""The simulator's KV tiers (exact LRU contents and events) and the tier benchmark."""

from __future__ import annotations

import pytest

from kvloop.bench.tiers import POLICIES, FleetConfig, FleetSim, compare, workloads
from kvloop.events.types import (
    TIER_DEVICE,
    TIER_DISK,
    TIER_HOST,
    TIER_SHARED,
    BlockRemoved,
    BlockStored,
)
from kvloop.sim.kv_store import SIM_KV_BYTES_PER_TOKEN
from kvloop.sim.tiers import SimSharedStore, SimTier, TieredKVCache

D, H, K, S = TIER_DEVICE, TIER_HOST, TIER_DISK, TIER_SHARED
BS = 4


def tokens(n_blocks: int, base: int = 0) -> list[int]:
    return list(range(base, base + n_blocks * BS))


def described(ev: BlockStored | BlockRemoved) -> tuple:
    if isinstance(ev, BlockStored):
        return ("stored", ev.medium, ev.locality, ev.block_hashes, ev.parent_block_hash,
                len(ev.token_ids), ev.block_size)
    return ("removed", ev.medium, ev.locality, ev.block_hashes)


def test_write_through_eviction_and_reload_with_exact_events():
    cache = TieredKVCache(2, BS, [SimTier(H, 3)])
    evs = cache.admit([1, 2], tokens(2))
    assert [described(e) for e in evs] == [
        ("stored", "GPU", None, [1, 2], None, 8, BS),
        ("stored", "CPU", None, [1, 2], None, 8, BS)]
    evs = cache.admit([3, 4], tokens(2, 100))        # evicts 1, 2 from the device pool
    assert [described(e) for e in evs] == [
        ("stored", "GPU", None, [3, 4], None, 8, BS),
        ("removed", "GPU", None, [1, 2]),
        ("stored", "CPU", None, [3, 4], None, 8, BS),
        ("removed", "CPU", None, [1])]               # host holds 3 blocks
    assert cache.lookup([1, 2, 9], 3 * BS) == ()     # block 1 is gone everywhere
    assert cache.lookup([2], 2 * BS) == (H,)
    assert cache.lookup([3, 4], 2 * BS + 1) == (D, D)
    assert cache.lookup([3, 4], 2 * BS) == (D,)      # the last prompt token is never cached
    # reloading 2 from host brings it to the device; host keeps it (no new host event)
    evs = cache.admit([2], tokens(1, 4))
    assert [described(e) for e in evs] == [("stored", "GPU", None, [2], None, 4, BS),
                                           ("removed", "GPU", None, [3])]
    nbytes = SIM_KV_BYTES_PER_TOKEN * BS
    assert cache.load_seconds((D, H, H)) == pytest.approx(2 * nbytes / 20e9)


def test_disk_and_a_shared_store_publish_their_medium_and_locality():
    store = SimSharedStore(SimTier(S, 8, bandwidth=1e9), store_id="s1")
    a = TieredKVCache(1, BS, [SimTier(K, 4, bandwidth=2e9)], store)
    b = TieredKVCache(1, BS, [], store)
    evs = a.admit([1, 2], tokens(2))
    assert [described(e)[:3] for e in evs] == [
        ("stored", "GPU", None), ("removed", "GPU", None),
        ("stored", "STORAGE", "LOCAL"), ("stored", "STORAGE", "REMOTE")]
    assert evs[2].block_hashes == [1, 2] and evs[3].parent_block_hash is None
    assert b.lookup([1, 2, 3], 3 * BS) == (S, S)    # b reads what a wrote
    assert a.lookup([1, 2, 3], 3 * BS) == (K, K)    # after a device miss, all from below
    nbytes = SIM_KV_BYTES_PER_TOKEN * BS
    assert b.load_seconds((S, S)) == pytest.approx(2 * nbytes / 1e9)


def test_tiers_are_checked():
    with pytest.raises(ValueError):
        SimTier("tape", 4)
    with pytest.raises(ValueError):
        TieredKVCache(4, BS, [SimTier(S, 4)])


def test_tier_aware_routing_beats_tier_blind_routing_on_ttft_at_equal_throughput():
    fleet = FleetConfig(device_blocks=64, host_blocks=512)
    blind = {k: POLICIES[k] for k in ("kv-aware, device tier only", "tier-aware")}
    result = compare(fleet, scale=0.5, policies=blind)
    for name, w in result["workloads"].items():
        b, t = w["runs"]["kv-aware, device tier only"], w["runs"]["tier-aware"]
        assert t["requests"] == b["requests"] == w["requests"]
        assert t["hit_rate"][H] > b["hit_rate"][H], name
        assert t["ttft_mean_s"] < b["ttft_mean_s"], name
        assert t["requests_per_s"] >= 0.98 * b["requests_per_s"], name   # no less served
        assert t["alarms"] == [], name              # predictions matched what was served


def test_the_router_is_told_by_frames_and_predicts_the_tier_served():
    wl, _ = workloads(scale=0.1)["shared-document"]
    sim = FleetSim(FleetConfig(num_workers=2, device_blocks=8, host_blocks=256), *POLICIES[
        "tier-aware"]).bind(wl)
    out = sim.run(wl, rate=0.2)          # one at a time: no provisional guesses
    assert out["requests"] == wl.num_requests
    ws = {w.name: w for w in sim.router.registry.all()}
    # what the verifier saw: every predicted token was served, per tier
    for w in ws.values():
        assert w.verifier.found_by_tier == w.verifier.predicted_by_tier
    assert sum(w.verifier.predicted_by_tier.get(H, 0) for w in ws.values()) > 0
