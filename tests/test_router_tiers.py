"""The router's view of KV tiers below the device: tier names, the index per tier and shared
store, tier-weighted credit, vLLM/Dynamo offload events (both forms), per-tier verification."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvloop.core.hashing import block_hashes
from kvloop.events.nats_plane import decode_dynamo, encode_dynamo
from kvloop.events.protocol import BatchDecoder
from kvloop.events.types import (
    TIER_DEVICE,
    TIER_DISK,
    TIER_HOST,
    TIER_SHARED,
    BlockRemoved,
    BlockStored,
    event_int,
    tier_of,
)
from kvloop.router.config import CostConfig, IndexConfig
from kvloop.router.index import PrefixIndex
from kvloop.router.registry import CONFIG_MISMATCH, PREDICTIONS_MISS, WorkerSpec
from kvloop.router.scorer import Candidate, RouteRequest, estimate_cost, kv_aware, tier_credit

from .test_router_core import BS, desc, make_router

D, H, K, S = TIER_DEVICE, TIER_HOST, TIER_DISK, TIER_SHARED
PROMPT = list(range(100, 164))            # 4 blocks of 16
HASHES = [event_int(h) for h in block_hashes(PROMPT, BS, "sha256", "s")]


# --- names -----------------------------------------------------------------------------------
@pytest.mark.parametrize("medium,locality,tier", [
    (None, None, D), ("GPU", None, D), ("CPU", None, H), ("CPU_PINNED", None, H),
    ("STORAGE", None, K), ("STORAGE", "LOCAL", K), ("STORAGE", "REMOTE", S),
    ("storage", "remote", S), ("host_pinned", None, H), ("disk", None, K),
    ("external", None, S), ("device", None, D), ("TAPE", None, None)])
def test_tier_of_vllm_sglang_and_dynamo_names(medium, locality, tier):
    assert tier_of(medium, locality) == tier


@pytest.mark.parametrize("storage_tier,tier", [
    ("device", D), ("host_pinned", H), ("disk", K), ("external", S), ("STORAGE", K)])
def test_dynamo_events_keep_their_tier(storage_tier, tier):
    payload = msgspec.json.encode({"worker_id": 7, "storage_tier": storage_tier, "event": {
        "event_id": 3, "data": {"stored": {"parent_hash": None, "blocks": [
            {"block_hash": 11, "tokens_hash": 5}]}}, "dp_rank": 0}})
    _, _, batch = decode_dynamo(payload, BS)
    ev = batch.events[0]
    assert tier_of(ev.medium, ev.locality) == tier
    # and what kvloop publishes on the plane names the tier back
    again = msgspec.json.decode(encode_dynamo([ev], 7, 3, 0)[0])
    assert again["storage_tier"] == tier


# --- the index -------------------------------------------------------------------------------
def index(**kw: Any) -> PrefixIndex:
    idx = PrefixIndex(IndexConfig(provisional_ttl_s=0, **kw))
    for name in ("a", "b", "c"):
        idx.add_worker(name, 100)
    return idx


def test_match_tiers_extends_the_device_prefix_with_the_best_lower_tier():
    idx = index()
    h0, h1, h2, h3 = HASHES
    idx.store("a", [h0, h1])
    idx.store("a", [h1, h2], TIER_HOST)
    idx.store("a", [h2, h3], TIER_DISK)
    idx.store("b", [h0], TIER_DISK)
    idx.store("b", [h1], TIER_HOST)
    idx.store("c", [h1, h2, h3])          # no block 0: nothing usable
    idx.store("b", [h2])                  # on b's device after a miss: an engine loads
                                          # what follows a miss from below, so it ends b's
    assert idx.match(HASHES) == {"a": 2}             # the device tier alone
    assert idx.match_tiers(HASHES) == {"a": (D, D, H, K), "b": (K, H)}
    assert idx.tier_blocks("a") == {D: 2, H: 2, K: 2, S: 0}
    # the GPU copy of block 1 goes: host still holds it
    idx.remove("a", [h1])
    assert idx.match_tiers(HASHES, ["a"]) == {"a": (D, H, H, K)}
    idx.remove("a", [h2], TIER_HOST)
    assert idx.match_tiers(HASHES, ["a"]) == {"a": (D, H, K, K)}
    idx.clear_worker("a")
    assert idx.match_tiers(HASHES) == {"b": (K, H)}
    assert idx.tier_blocks("a") == {D: 0, H: 0, K: 0, S: 0}
    idx.check_invariants()
    idx.check_lower_invariants()


def test_a_shared_store_is_read_by_every_worker_naming_it():
    idx = index()
    idx.set_shared_store("a", "redis://store-1")
    idx.set_shared_store("b", "redis://store-1")
    idx.store("a", HASHES[:3], TIER_SHARED)
    assert idx.match_tiers(HASHES) == {"a": (S, S, S), "b": (S, S, S)}
    idx.store("b", HASHES[:1])            # b's own device copy of block 0 is better
    assert idx.match_tiers(HASHES)["b"] == (D, S, S)
    idx.remove("b", HASHES[2:3], TIER_SHARED)   # one copy in the store: gone for all
    assert idx.match_tiers(HASHES) == {"a": (S, S), "b": (D, S)}
    # a worker naming no store keeps its shared-tier blocks to itself
    idx.store("c", HASHES[:2], TIER_SHARED)
    assert idx.match_tiers(HASHES, ["c"]) == {"c": (S, S)}
    assert idx.tier_blocks("c")[S] == 2 and idx.tier_blocks("a")[S] == 2
    # clearing a worker's cache leaves the store
    idx.clear_worker("a")
    assert idx.match_tiers(HASHES, ["a", "b"]) == {"a": (S, S), "b": (D, S)}


def test_lower_tiers_are_lru_bounded_and_count_copies():
    idx = index(max_lower_blocks=2)
    idx.store("a", HASHES[:1], TIER_HOST)
    idx.store("a", HASHES[:1], TIER_HOST)     # a second copy
    r = idx.store("a", HASHES[1:3], TIER_HOST)
    assert (r.added, r.evicted) == (2, 1)     # block 0 was the oldest
    assert idx.match_tiers(HASHES, ["a"]) == {}
    idx.store("a", HASHES[1:2], TIER_HOST)
    assert idx.remove("a", HASHES[1:2], TIER_HOST).removed == 0   # one copy left
    assert idx.remove("a", HASHES[1:2], TIER_HOST).removed == 1
    idx.check_lower_invariants()


# --- scoring ---------------------------------------------------------------------------------
def test_tier_credit_is_exact_per_block():
    cfg = CostConfig(host_cache_hit_weight=0.75, disk_cache_hit_weight=0.25,
                     shared_cache_hit_weight=0.5)
    req = RouteRequest(prompt_tokens=65, block_size=16)
    c = Candidate("a", cached_blocks=4, tiers=(D, H, K, S))
    assert tier_credit(c, req, cfg) == 16 * (1 + 0.75 + 0.25 + 0.5)
    # the last prompt token is never cached: 64 tokens use 3 blocks at most
    assert tier_credit(c, RouteRequest(64, 16), cfg) == 16 * 2.0
    assert tier_credit(Candidate("a", cached_blocks=3), req, cfg) == 48   # no tiers: device
    cold = estimate_cost(Candidate("x"), req, cfg)
    warm = estimate_cost(c, req, cfg)
    assert cold - warm == pytest.approx((1 + cfg.marginal_work_weight) * 16 * 2.5)


def test_the_device_holder_beats_the_host_holder_and_a_host_holder_beats_a_cold_worker():
    cfg = CostConfig()
    req = RouteRequest(prompt_tokens=65, block_size=16)
    on_host = Candidate("a", cached_blocks=4, tiers=(H, H, H, H))
    on_gpu = Candidate("b", cached_blocks=4, tiers=(D, D, D, D))
    cold = Candidate("c")
    assert kv_aware([on_host, on_gpu, cold], req, cfg).worker == "b"
    assert kv_aware([on_host, cold], req, cfg).worker == "a"
    # a host weight of 0 ignores the tier: the host holder is no better than a cold worker
    blind = dataclasses.replace(cfg, host_cache_hit_weight=0.0)
    costs = kv_aware([on_host, cold], req, blind).costs
    assert costs["a"] == costs["c"]


@pytest.mark.parametrize("field", ["host_cache_hit_weight", "disk_cache_hit_weight",
                                   "shared_cache_hit_weight"])
def test_tier_weights_are_checked(field):
    with pytest.raises(ValueError, match=field):
        CostConfig(**{field: 1.5})


# --- interop: vLLM offload events as vLLM writes them ----------------------------------------
def vllm_frame(*events: dict[str, Any]) -> bytes:
    """A batch in vLLM's wire layout: [ts, [event maps, `type` first], dp_rank]."""
    return msgspec.msgpack.encode([1700000000.5, list(events), 0])


def stored_map(hashes: list[int], medium: str, block_size: int = BS,
               tokens: list[int] | None = None, parent: int | None = None,
               **extra: Any) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens or [], "block_size": block_size, "lora_id": None,
            "medium": medium, "lora_name": None, **extra}


def removed_map(hashes: list[int], medium: str, **extra: Any) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, **extra}


def fed_router():
    r, clock, subs = make_router()
    r.register(WorkerSpec("http://w:1"), desc())
    r.register(WorkerSpec("http://w:2"), desc())
    return r, clock, subs


def feed(subs, worker: str, *events: dict[str, Any]) -> None:
    subs[worker].feed.on_batch(BatchDecoder().decode(vllm_frame(*events)))


def test_pre_024_placeholders_are_mapped_through_the_device_hashes_they_mirror():
    r, _, subs = fed_router()
    feed(subs, "w:1", stored_map(HASHES[:2], "GPU", tokens=PROMPT[:32]))
    # vLLM < 0.24: CPU-tier events with block_size 0 and no tokens; 999 mirrors nothing known
    feed(subs, "w:1", stored_map(HASHES[:2] + [999], "CPU", block_size=0))
    f = subs["w:1"].feed
    assert f.refusing is None and not r.registry.get("w:1").alarms
    assert (f.counters.placeholders_mapped, f.counters.placeholders_ignored) == (2, 1)
    feed(subs, "w:1", removed_map(HASHES[:2], "GPU"))      # evicted from the GPU
    assert r.index.match_tiers(HASHES) == {"w:1": (H, H)}
    routed = r.route(PROMPT + [1])
    assert routed.worker.name == "w:1" and routed.predicted_tokens == 32


def test_self_describing_offload_events_in_every_tier():
    r, _, subs = fed_router()
    parent = None
    for i, (medium, loc) in enumerate([("GPU", None), ("CPU", None), ("STORAGE", "LOCAL"),
                                       ("STORAGE", "REMOTE")]):
        extra = {"locality": loc} if loc else {}
        feed(subs, "w:1", stored_map([HASHES[i]], medium, tokens=PROMPT[16 * i:16 * i + 16],
                                     parent=parent, **extra))
        parent = HASHES[i]
    assert r.index.match_tiers(HASHES, ["w:1"]) == {"w:1": (D, H, K, S)}
    c = subs["w:1"].feed.counters
    assert c.tier_stored == {H: 1, K: 1, S: 1} and c.stored_blocks == 1
    # the removals of each tier apply to that tier only
    feed(subs, "w:1", removed_map([HASHES[1]], "GPU"), removed_map([HASHES[2]], "CPU"))
    assert r.index.match_tiers(HASHES, ["w:1"]) == {"w:1": (D, H, K, S)}
    feed(subs, "w:1", removed_map([HASHES[1]], "CPU"))
    assert r.index.match_tiers(HASHES, ["w:1"]) == {"w:1": (D,)}


def test_offload_blocks_of_another_size_or_medium_are_counted_never_a_mismatch():
    r, _, subs = fed_router()
    feed(subs, "w:1", stored_map(HASHES[3:4], "CPU", block_size=4 * BS, tokens=PROMPT),
         stored_map(HASHES[:1], "TAPE", tokens=PROMPT[:16]))
    c = subs["w:1"].feed.counters
    assert (c.tier_size_skipped, c.unknown_medium) == (1, 1)
    assert subs["w:1"].feed.refusing is None and not r.registry.get("w:1").alarms
    # a device-tier event of another block size still is one
    feed(subs, "w:2", stored_map(HASHES[:1], "GPU", block_size=0))
    assert CONFIG_MISMATCH in r.registry.get("w:2").alarms


def test_a_worker_naming_a_shared_store_sees_what_another_put_there():
    r, _, subs = make_router()
    store = msgspec.structs.replace(desc(), kv_shared_store="redis://kv-store:6379/0")
    r.register(WorkerSpec("http://w:1"), store)
    r.register(WorkerSpec("http://w:2"), msgspec.structs.replace(store, epoch="e2"))
    r.register(WorkerSpec("http://w:3"), desc(epoch="e3"))
    feed(subs, "w:1", stored_map(HASHES, "STORAGE", tokens=PROMPT, locality="REMOTE"))
    assert r.index.match_tiers(HASHES) == {"w:1": (S,) * 4, "w:2": (S,) * 4}


# --- per-tier self-verification --------------------------------------------------------------
def test_the_alarm_names_the_tier_whose_predictions_miss():
    r, clock, subs = make_router()
    r.register(WorkerSpec("http://w:1"), desc())
    feed(subs, "w:1", stored_map(HASHES[:2], "GPU", tokens=PROMPT[:32]),
         stored_map(HASHES[2:], "CPU", tokens=PROMPT[32:], parent=HASHES[1]))
    for _ in range(4):
        clock.t += 5
        routed = r.route(PROMPT + [1])
        assert routed.predicted_tokens == 64 and routed.ticket.tiers == (D, D, H, H)
        r.first_token(routed.ticket)
        r.finish(routed.ticket, 16, "ok")       # the worker found one device block only
    [alarm] = r.check_liveness()
    assert alarm.kind == PREDICTIONS_MISS and "tier device disagrees (4 of them)" in alarm.detail
    v = r.registry.get("w:1").verifier
    assert v.predicted_by_tier == {D: 128, H: 128} and v.found_by_tier == {D: 64}


def test_a_host_tier_that_never_serves_is_blamed():
    r, clock, subs = make_router()
    r.register(WorkerSpec("http://w:1"), desc())
    feed(subs, "w:1", stored_map(HASHES[:1], "GPU", tokens=PROMPT[:16]),
         stored_map(HASHES[1:], "CPU", tokens=PROMPT[16:], parent=HASHES[0]))
    for _ in range(4):
        clock.t += 5
        routed = r.route(PROMPT + [1])
        r.first_token(routed.ticket)
        r.finish(routed.ticket, 16, "ok")       # the device block, never the host ones
    [alarm] = r.check_liveness()
    assert "tier host_pinned disagrees (4 of them)" in alarm.detail


def test_metrics_show_tiers():
    r, _, subs = fed_router()
    feed(subs, "w:1", stored_map(HASHES[:2], "GPU", tokens=PROMPT[:32]),
         stored_map(HASHES[:2] + [5], "CPU", block_size=0))
    text = r.metrics.render().decode()
    assert 'kvloop_router_worker_tier_blocks{tier="host_pinned",worker="w:1"} 2.0' in text
    assert ('kvloop_router_worker_tier_events_total{outcome="placeholder_ignored",'
            'worker="w:1"} 1.0') in text


def test_removed_events_of_vllm_keep_their_medium_through_the_decoder():
    batch = BatchDecoder().decode(vllm_frame(removed_map([1, 2], "CPU"),
                                             stored_map([3], "CPU", block_size=0)))
    rem, st = batch.events
    assert isinstance(rem, BlockRemoved) and rem.medium == "CPU"
    assert isinstance(st, BlockStored) and st.block_size == 0 and st.token_ids == []


# --- P/D: a lower-tier hit adds its load time to the TTFT estimate ---------------------------
def test_a_host_tier_hit_on_the_prefill_worker_adds_its_load_time_to_the_estimate():
    from .test_router_pd import make_pd_router

    prompt = list(range(3000, 5000))              # 125 blocks
    hashes = [event_int(h) for h in block_hashes(prompt, BS, "sha256", "s")]
    remote_s = {}
    for medium in ("GPU", "CPU"):
        r, _, subs = make_pd_router()
        r.config = dataclasses.replace(r.config, cost=CostConfig(host_cache_hit_weight=0.5))
        subs["p:1"].feed.on_batch(BatchDecoder().decode(vllm_frame(
            stored_map(hashes, medium, tokens=prompt))))
        routed = r.route_pd(prompt + [1])
        assert routed.prefill is not None and routed.prefill.predicted_tokens == 2000
        assert routed.prefill.ticket.tiers == ((D,) if medium == "GPU" else (H,)) * 125
        remote_s[medium] = routed.decision.estimate.remote_s
    # half of each host block's tokens count as prefill work: its load time
    assert remote_s["CPU"] > 1.5 * remote_s["GPU"]


# --- randomized: the index against a plain model of who holds what ---------------------------
def _reference(holds: dict[tuple[str, str], set[int]], stores: dict[str, str | None],
               name: str, hashes: list[int]) -> tuple[str, ...]:
    """The tiers `name` uses for `hashes`: device prefix, then host, disk, shared store."""
    out: list[str] = []
    for h in hashes:
        if len(out) == out.count(D) and h in holds[name, D]:
            out.append(D)
            continue
        store = stores[name] or f"own:{name}"
        found = next((t for t, key in ((H, name), (K, name), (S, store))
                      if h in holds[key, t]), None)
        if found is None:
            break
        out.append(found)
    return tuple(out)


OPS = st.lists(st.tuples(st.sampled_from(["store", "remove", "clear"]),
                         st.sampled_from(["a", "b", "c"]), st.sampled_from([D, H, K, S]),
                         st.lists(st.integers(0, 5), min_size=1, max_size=4)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_match_tiers_equals_a_plain_model(ops):
    idx = index()
    stores: dict[str, str | None] = {"a": "s1", "b": "s1", "c": None}
    for name, sid in stores.items():
        idx.set_shared_store(name, sid)
    holds: dict[tuple[str, str], set[int]] = defaultdict(set)
    copies: dict[tuple[str, str, int], int] = defaultdict(int)
    for op, name, tier, hashes in ops:
        key = (stores[name] or f"own:{name}") if tier == S else name
        if op == "store":
            idx.store(name, hashes, tier)
            for h in hashes:
                holds[key, tier].add(h)
                copies[key, tier, h] = 1 if tier == S else copies[key, tier, h] + 1
        elif op == "remove":
            idx.remove(name, hashes, tier)
            for h in hashes:
                if copies[key, tier, h] > 0:
                    copies[key, tier, h] -= 1
                    if copies[key, tier, h] == 0:
                        holds[key, tier].discard(h)
        else:
            idx.clear_worker(name)
            for t in (D, H, K):
                holds[name, t].clear()
                for h in range(6):
                    copies[name, t, h] = 0
        idx.check_invariants()
        idx.check_lower_invariants()
        probe = list(range(6))
        want = {n: _reference(holds, stores, n, probe) for n in stores}
        assert idx.match_tiers(probe) == {n: t for n, t in want.items() if t}


def test_the_router_flags_set_the_tier_weights():
    import argparse

    from kvloop.router.cli_args import add_router_args, router_config

    p = argparse.ArgumentParser()
    add_router_args(p)
    cost = router_config(p.parse_args([
        "--router-host-cache-hit-weight", "0.75", "--router-disk-cache-hit-weight", "0.25",
        "--router-shared-cache-hit-weight", "0"])).cost
    assert [cost.tier_weight(t) for t in (D, H, K, S)] == [1.0, 0.75, 0.25, 0.0]
    assert router_config(p.parse_args([])).cost == CostConfig()
