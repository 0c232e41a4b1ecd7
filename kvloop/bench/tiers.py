"""Tier-aware routing on a simulated fleet: `python -m kvloop.bench.tiers`.

A discrete-event simulation (virtual time, seconds of wall time) of N simulated workers, each
a `kvloop.sim.tiers.TieredKVCache` (a device pool plus host and/or disk tiers, optionally one
shared store), in front of the real router core (`kvloop.router.router.Router`: its index,
feeds, scorer and self-verification). Workers publish their KV events as vLLM does; each
batch is encoded to vLLM's msgpack wire format and decoded by the subscriber's decoder
before it reaches the router's feed, at the virtual time it happens.

A worker prefills one request at a time (FIFO): TTFT = wait + load from lower tiers
(`block bytes / tier bandwidth`) + chunked prefill of the uncached tokens (the simulator's
fitted step-time model). Decoding overlaps other prefills (continuous batching) and only
delays the request's completion. Multi-turn sessions send their next turn after the answer
plus a think time.

Policies compared: round-robin; kv-aware crediting the device tier only (what a router sees
of a worker whose offload events it drops: tier-blind); kv-aware crediting every tier as
the device; tier-aware (per-tier weights, the defaults). Printed per policy: prefix hit rate
by tier (share of prompt tokens), TTFT p50/p99, throughput.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import itertools
import json
import math
import random
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from kvloop.bench.report import percentile
from kvloop.bench.workloads import (
    Session,
    Workload,
    multi_turn_workload,
    shared_prefix_workload,
)
from kvloop.core.hashing import BlockHasher
from kvloop.events.protocol import BatchDecoder
from kvloop.events.types import (
    TIER_DEVICE,
    TIERS,
    KVEvent,
    KVEventBatch,
    event_int,
)
from kvloop.router.config import CostConfig, HashSpec, IndexConfig, RouterConfig
from kvloop.router.registry import WorkerDescription, WorkerSpec
from kvloop.router.router import Router
from kvloop.sim.latency import LatencyModel, StepFeatures
from kvloop.sim.runner import default_token
from kvloop.sim.tiers import SimSharedStore, SimTier, TieredKVCache
from kvloop.wire import KVEventsInfo

BLOCK_SIZE = 16
HASH_SEED = "tiers-bench"
PREFILL_BUDGET = 2048          # tokens per prefill step (kvloop's max_num_batched_tokens)


@dataclass(frozen=True)
class FleetConfig:
    """The simulated fleet: per worker a device pool, tiers below it, a shared store."""

    num_workers: int = 4
    device_blocks: int = 64
    host_blocks: int = 512
    disk_blocks: int = 0
    shared_blocks: int = 0
    speedup: float = 1.0
    think_s: float = 2.0       # mean pause between a multi-turn answer and the next turn


POLICIES: dict[str, tuple[str, CostConfig]] = {
    "round-robin": ("round-robin", CostConfig()),
    "kv-aware, device tier only": ("kv-aware", CostConfig(
        host_cache_hit_weight=0.0, disk_cache_hit_weight=0.0, shared_cache_hit_weight=0.0)),
    "kv-aware, every tier as device": ("kv-aware", CostConfig(
        host_cache_hit_weight=1.0, disk_cache_hit_weight=1.0, shared_cache_hit_weight=1.0)),
    "tier-aware": ("kv-aware", CostConfig()),
}


@dataclass
class _Request:
    session: int
    turn: int
    arrival: float
    tokens: list[int]
    max_tokens: int
    hashes: list[int] = field(default_factory=list)
    worker: str = ""
    routed: Any = None
    tiers: tuple[str, ...] = ()
    first_token: float = 0.0


@dataclass
class _Worker:
    name: str
    cache: TieredKVCache
    queue: deque[_Request] = field(default_factory=deque)
    busy: bool = False


class FleetSim:
    """One run: a workload through the router with one policy (see the module docstring)."""

    def __init__(self, fleet: FleetConfig, policy: str, cost: CostConfig, seed: int = 0):
        self.fleet = fleet
        self.now = 0.0
        self.router = Router(RouterConfig(policy=policy, cost=cost, random_seed=seed,
                                          hash_spec=HashSpec(BLOCK_SIZE, "sha256", HASH_SEED),
                                          index=IndexConfig(provisional_ttl_s=2.0)),
                             clock=lambda: self.now)
        self.hasher = BlockHasher(BLOCK_SIZE, "sha256", HASH_SEED)
        self.latency = LatencyModel.from_file(speedup=fleet.speedup)
        self.rng = random.Random(f"tiers-bench:{seed}")
        shared = SimSharedStore(SimTier("external", fleet.shared_blocks)) \
            if fleet.shared_blocks else None
        self.workers: dict[str, _Worker] = {}
        self._sessions: dict[int, Session] = {}
        for i in range(fleet.num_workers):
            spec = WorkerSpec(f"http://sim-{i}:8000")
            self.router.register(spec, _description(fleet, shared))
            self.workers[spec.name] = _Worker(spec.name, TieredKVCache(
                fleet.device_blocks, BLOCK_SIZE, _tiers(fleet), shared))
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._decoder = BatchDecoder()
        self.done: list[_Request] = []

    # --- the event loop ---------------------------------------------------------------------
    def at(self, t: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), action))

    def run(self, workload: Workload, rate: float) -> dict[str, Any]:
        """Sessions start as a Poisson process of `rate` per second; returns the summary."""
        t = 0.0
        for s in workload.sessions:
            self.at(t, functools.partial(self._turn, s, 0, []))
            t += self.rng.expovariate(rate)
        while self._events:
            self.now, _, action = heapq.heappop(self._events)
            action()
        return self.summary(workload)

    def _turn(self, session: Session, k: int, history: list[int]) -> None:
        turn = session.turns[k]
        tokens = history + list(turn.new_token_ids)
        req = _Request(session.session_id, k, self.now, tokens, turn.max_tokens)
        req.hashes = [event_int(h) for h in self.hasher.hash_range(tokens, None, 0)]
        req.routed = self.router.route(tokens, expected_output_tokens=turn.max_tokens)
        req.worker = req.routed.worker.name
        w = self.workers[req.worker]
        w.queue.append(req)
        if not w.busy:
            self._start(w)

    def _start(self, w: _Worker) -> None:
        req = w.queue.popleft()
        w.busy = True
        req.tiers = w.cache.lookup(req.hashes, len(req.tokens))
        cached = len(req.tiers) * BLOCK_SIZE
        service = w.cache.load_seconds(req.tiers) + self._prefill_s(len(req.tokens), cached)
        self.at(self.now + service, lambda: self._prefilled(w, req))

    def _prefill_s(self, prompt: int, cached: int) -> float:
        """Chunked prefill of the uncached tokens, one sequence per step."""
        total, done = 0.0, cached
        while done < prompt:
            n = min(PREFILL_BUDGET, prompt - done)
            done += n
            total += self.latency.features_time(StepFeatures(n, 1, done))
        return total

    def _prefilled(self, w: _Worker, req: _Request) -> None:
        req.first_token = self.now
        self._publish(w, w.cache.admit(req.hashes, req.tokens))
        self.router.first_token(req.routed.ticket)
        decode = sum(self.latency.features_time(StepFeatures(1, 1, len(req.tokens) + i))
                     for i in range(req.max_tokens))
        self.at(self.now + decode, lambda: self._completed(req))
        w.busy = False
        if w.queue:
            self._start(w)

    def _completed(self, req: _Request) -> None:
        self.router.finish(req.routed.ticket, len(req.tiers) * BLOCK_SIZE)
        self.done.append(req)
        session = self._sessions[req.session]
        if req.turn + 1 < len(session.turns):
            answer = [default_token(f"{req.session}-{req.turn}", i) for i in
                      range(req.max_tokens)]
            history = req.tokens + answer
            pause = self.rng.expovariate(1.0 / self.fleet.think_s)
            self.at(self.now + pause, lambda: self._turn(session, req.turn + 1, history))

    def _publish(self, w: _Worker, events: list[KVEvent]) -> None:
        """Through vLLM's wire format to the router's feed of `w`."""
        if not events:
            return
        payload = msgspec.msgpack.encode(KVEventBatch(ts=self.now, events=events))
        feed = self.router.feed(w.name)
        assert feed is not None
        feed.on_batch(self._decoder.decode(payload))

    # --- results ----------------------------------------------------------------------------
    def summary(self, workload: Workload) -> dict[str, Any]:
        prompt = sum(len(r.tokens) for r in self.done)
        by_tier = {t: 0 for t in TIERS}
        for r in self.done:
            for t in r.tiers:
                by_tier[t] += BLOCK_SIZE
        ttft = [r.first_token - r.arrival for r in self.done]
        span = max(self.now, 1e-9)
        alarms = sorted({a for w in self.router.registry.all() for a in w.alarms})
        return {
            "requests": len(self.done),
            "hit_rate": {t: round(n / prompt, 4) for t, n in by_tier.items()},
            "ttft_p50_s": round(percentile(ttft, 50), 4),
            "ttft_p99_s": round(percentile(ttft, 99), 4),
            "ttft_mean_s": round(sum(ttft) / len(ttft), 4),
            "requests_per_s": round(len(self.done) / span, 4),
            "output_tokens_per_s": round(sum(r.max_tokens for r in self.done) / span, 2),
            "makespan_s": round(span, 2),
            "alarms": alarms,
        }

    def bind(self, workload: Workload) -> FleetSim:
        """Use `workload`'s sessions (their later turns follow the answers)."""
        self._sessions = {s.session_id: s for s in workload.sessions}
        return self


def _tiers(fleet: FleetConfig) -> list[SimTier]:
    out = []
    if fleet.host_blocks:
        out.append(SimTier("host_pinned", fleet.host_blocks))
    if fleet.disk_blocks:
        out.append(SimTier("disk", fleet.disk_blocks))
    return out


def _description(fleet: FleetConfig, shared: SimSharedStore | None) -> WorkerDescription:
    """What a simulated worker's /kvloop/worker would say (epoch unique per worker)."""
    return WorkerDescription(
        model="sim", served_model_names=["sim"], role="both", block_size=BLOCK_SIZE,
        hash_algo="sha256", hash_seed=HASH_SEED, enable_prefix_caching=True,
        num_gpu_blocks=fleet.device_blocks + 1, kv_capacity_blocks=fleet.device_blocks,
        max_model_len=1 << 16, max_num_batched_tokens=PREFILL_BUDGET, max_num_seqs=256,
        epoch=f"sim-{random.random()}", version="sim", api_key_required=False,
        api_key_accepted=False, kv_shared_store=shared.store_id if shared else None,
        kv_events=KVEventsInfo(endpoint="sim://events", replay_endpoint=None, topic="",
                               recency=False))


def workloads(scale: float = 1.0, seed: int = 0) -> dict[str, tuple[Workload, float]]:
    """The two workloads and their session arrival rates (per second)."""
    n = max(1, round(32 * scale))
    return {
        "multi-turn": (multi_turn_workload(n, 4, 512, 64, 32, seed=seed), 1.2),
        "shared-document": (shared_prefix_workload(16, 1024, 32, 16, max(1, round(480 * scale)),
                                                   seed=seed), 3.0),
    }


def working_set_blocks(workload: Workload) -> int:
    """Distinct full blocks the workload's prompts hold (answers included for multi-turn)."""
    if workload.name == "multi-turn":
        per = [sum(len(t.new_token_ids) + t.max_tokens for t in s.turns) for s in
               workload.sessions]
        return sum(p // BLOCK_SIZE for p in per)
    p = workload.params
    return p["num_groups"] * p["prefix_len"] // BLOCK_SIZE + \
        p["num_requests"] * p["suffix_len"] // BLOCK_SIZE


def compare(fleet: FleetConfig, scale: float = 1.0, seed: int = 0,
            policies: dict[str, tuple[str, CostConfig]] | None = None) -> dict[str, Any]:
    """Every policy on every workload; the figures as one dict."""
    out: dict[str, Any] = {"fleet": fleet.__dict__, "workloads": {}}
    for name, (wl, rate) in workloads(scale, seed).items():
        ws = working_set_blocks(wl)
        runs = {}
        for label, (policy, cost) in (policies or POLICIES).items():
            runs[label] = FleetSim(fleet, policy, cost, seed).bind(wl).run(wl, rate)
        out["workloads"][name] = {
            "requests": wl.num_requests, "rate_sessions_per_s": rate,
            "working_set_blocks": ws,
            "working_set_x_pool": round(ws / (fleet.device_blocks * fleet.num_workers), 1),
            "runs": runs}
    return out


def format_table(result: dict[str, Any]) -> str:
    lines = []
    for name, w in result["workloads"].items():
        lines.append(f"\n{name}: {w['requests']} requests, working set {w['working_set_blocks']}"
                     f" blocks = {w['working_set_x_pool']}x the fleet's device pools")
        lines.append(f"{'policy':32s} {'device':>7s} {'host':>6s} {'disk':>6s} {'shared':>6s}"
                     f" {'TTFT mean':>9s} {'p50':>7s} {'p99':>7s} {'req/s':>6s}"
                     f" {'out tok/s':>9s}")
        for label, r in w["runs"].items():
            h = r["hit_rate"]
            lines.append(
                f"{label:32s} {h[TIER_DEVICE]:7.1%} {h['host_pinned']:6.1%} {h['disk']:6.1%} "
                f"{h['external']:6.1%} {r['ttft_mean_s']:8.3f}s {r['ttft_p50_s']:6.3f}s "
                f"{r['ttft_p99_s']:6.3f}s {r['requests_per_s']:6.2f} "
                f"{r['output_tokens_per_s']:9.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvloop.bench.tiers", description=__doc__
                                .split("\n")[0])
    d = FleetConfig()
    p.add_argument("--workers", type=int, default=d.num_workers)
    p.add_argument("--device-blocks", type=int, default=d.device_blocks)
    p.add_argument("--host-blocks", type=int, default=d.host_blocks)
    p.add_argument("--disk-blocks", type=int, default=d.disk_blocks)
    p.add_argument("--shared-blocks", type=int, default=d.shared_blocks)
    p.add_argument("--scale", type=float, default=1.0, help="multiplies the request counts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    if a.workers < 1 or not math.isfinite(a.scale) or a.scale <= 0:
        p.error("--workers must be >= 1 and --scale > 0")
    fleet = replace(d, num_workers=a.workers, device_blocks=a.device_blocks,
                    host_blocks=a.host_blocks, disk_blocks=a.disk_blocks,
                    shared_blocks=a.shared_blocks)
    result = compare(fleet, a.scale, a.seed)
    print(format_table(result))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
