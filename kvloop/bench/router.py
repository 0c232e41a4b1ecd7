"""Routing decision latency with a large index: `python -m kvloop.bench.router`.

Builds a router (no HTTP, no sockets) with W simulated workers and an index of B
(block, worker) entries, then times `Router.route()` end to end (hash the prompt's full
blocks with sha256 + the fleet seed, match the index, score every worker with the cost
model, add provisional entries, open the ticket) and its parts. Queried prompts share
prefixes that several workers hold at different depths, so matches walk deep chains.

Prints p50/p99 per prompt length and phase, per run, and the median over runs.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time

from kvloop.router.config import HashSpec, IndexConfig, LivenessConfig, RouterConfig
from kvloop.router.registry import WorkerDescription, WorkerSpec
from kvloop.router.router import Router


def build_router(num_workers: int, num_blocks: int, seed: int = 0) -> tuple[Router, list]:
    """A router whose index holds `num_blocks` entries over `num_workers` workers."""
    per_worker = num_blocks // num_workers
    cfg = RouterConfig(hash_spec=HashSpec(16, "sha256", "bench"),
                       index=IndexConfig(max_blocks=num_blocks + 1_000_000,
                                         provisional_ttl_s=2.0),
                       liveness=LivenessConfig())
    router = Router(cfg)
    names = []
    for i in range(num_workers):
        spec = WorkerSpec(f"http://10.0.0.{i}:8000")
        router.register(spec, WorkerDescription(
            model="sim", block_size=16, hash_algo="sha256", hash_seed="bench",
            capacity_blocks=per_worker + 10_000, events_endpoint="tcp://127.0.0.1:9",
            role="both",
            epoch="e"))
        names.append(spec.name)
    rng = random.Random(seed)
    prefixes = _prefix_prompts(rng, 64, 256 * 16)
    chains = [router.block_hashes(p) for p in prefixes]
    for j, chain in enumerate(chains):  # each prefix on 3 workers, at different depths
        for k in range(3):
            name = names[(j + 5 * k) % num_workers]
            router.index.store(name, chain[:len(chain) >> k])
    for name in names:  # fill the rest with unrelated blocks
        missing = per_worker - router.index.worker_blocks(name)
        router.index.store(name, (rng.getrandbits(64) for _ in range(max(0, missing))))
    return router, prefixes


def _prefix_prompts(rng: random.Random, n: int, length: int) -> list[list[int]]:
    return [[rng.randrange(32000) for _ in range(length)] for _ in range(n)]


def _percentiles(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return xs[len(xs) // 2], xs[min(len(xs) - 1, int(len(xs) * 0.99))]


def time_phases(router: Router, prompts: list[list[int]], n: int,
                rng: random.Random) -> dict[str, list[float]]:
    """Per-call seconds of route() and of its parts, over `n` random prompts."""
    out: dict[str, list[float]] = {"route": [], "hash": [], "match": []}
    workers = [w.name for w in router.registry.all()]
    for _ in range(n):
        p = prompts[rng.randrange(len(prompts))]
        t0 = time.perf_counter()
        routed = router.route(p)
        t1 = time.perf_counter()
        router.first_token(routed.ticket)
        router.finish(routed.ticket, routed.predicted_tokens, "ok")
        t2 = time.perf_counter()
        hashes = router.block_hashes(p)
        t3 = time.perf_counter()
        router.index.match(hashes, workers)
        t4 = time.perf_counter()
        out["route"].append(t1 - t0)
        out["hash"].append(t3 - t2)
        out["match"].append(t4 - t3)
    return out


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--lengths", default="1024,4096", help="prompt lengths in tokens")
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    rss0 = _rss_mb()
    t0 = time.perf_counter()
    router, prefixes = build_router(args.workers, args.blocks)
    print(f"index: {router.index.num_blocks():,} entries, {router.index.num_hashes():,} "
          f"hashes, {args.workers} workers; built in {time.perf_counter() - t0:.1f}s; "
          f"max RSS +{_rss_mb() - rss0:.0f} MB")
    rng = random.Random(1)
    for length in (int(x) for x in args.lengths.split(",")):
        prompts = [p[:length - 32] + [rng.randrange(32000) for _ in range(32)]
                   for p in prefixes]
        _report(length, [time_phases(router, prompts, args.decisions, rng)
                         for _ in range(args.runs)])
    return 0


def _report(length: int, runs: list[dict[str, list[float]]]) -> None:
    for phase in ("route", "hash", "match"):
        p50s, p99s = zip(*(_percentiles(r[phase]) for r in runs), strict=True)
        per_run = ", ".join(f"{a * 1e6:.0f}/{b * 1e6:.0f}" for a, b in
                            zip(p50s, p99s, strict=True))
        print(f"prompt {length:5d} tokens  {phase:6s} p50 {statistics.median(p50s) * 1e6:7.0f} "
              f"us  p99 {statistics.median(p99s) * 1e6:7.0f} us   (runs p50/p99: {per_run})")


if __name__ == "__main__":
    raise SystemExit(main())
