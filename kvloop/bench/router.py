"""Router benchmarks: `python -m kvloop.bench.router latency|fleet`.

latency: routing decision latency with a large index. Builds a router (no HTTP, no sockets)
with W simulated workers and an index of B (block, worker) entries, then times
`Router.route()` end to end (hash the prompt's full blocks with sha256 + the fleet seed,
match the index, score every worker with the cost model, add provisional entries, open the
ticket) and its parts. Queried prompts share prefixes that several workers hold at different
depths, so matches walk deep chains.

Prints p50/p99 per prompt length and phase, per run, and the median over runs. With
`--indexes memory,redis` the same index is built in memory and in Redis (block -> workers in
a redis-server: `--redis-url`, else one started on a free local port for the run) and both
are timed, one after the other, in the same sitting.

fleet: `kvloop bench` through `kvloop router` in front of N simulated workers, for each
policy and workload: throughput, TTFT p50/p99 and the cache-hit share. Each run starts from
empty worker caches and a fresh router process; the table shows the median of the runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import resource
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvloop.bench.cli_args import HelpFormatter
from kvloop.front.launcher import ROUTER_URL_LINE, UrlProcess, kvloop_command
from kvloop.router.config import HashSpec, IndexConfig, LivenessConfig, RouterConfig
from kvloop.router.registry import WorkerDescription, WorkerSpec
from kvloop.router.router import Router
from kvloop.wire import KVEventsInfo


def build_router(num_workers: int, num_blocks: int, seed: int = 0,
                 index_url: str | None = None) -> tuple[Router, list]:
    """A router whose index holds `num_blocks` entries over `num_workers` workers (in Redis
    at `index_url`, else in memory)."""
    per_worker = num_blocks // num_workers
    cfg = RouterConfig(hash_spec=HashSpec(16, "sha256", "bench"),
                       index=IndexConfig(max_blocks=num_blocks + 1_000_000,
                                         provisional_ttl_s=2.0, url=index_url),
                       liveness=LivenessConfig())
    router = Router(cfg)
    names = []
    for i in range(num_workers):
        spec = WorkerSpec(f"http://10.0.0.{i}:8000")
        capacity = per_worker + 10_000
        router.register(spec, WorkerDescription(
            model="sim", served_model_names=["sim"], role="both", block_size=16,
            hash_algo="sha256", hash_seed="bench", enable_prefix_caching=True,
            num_gpu_blocks=capacity + 1, kv_capacity_blocks=capacity, max_model_len=8192,
            max_num_batched_tokens=512, max_num_seqs=256, epoch="e",
            kv_events=KVEventsInfo(endpoint="tcp://127.0.0.1:9", replay_endpoint=None,
                                   topic="", recency=False),
            version="bench", api_key_required=False, api_key_accepted=False))
        names.append(spec.name)
    rng = random.Random(seed)
    prefixes = _prefix_prompts(rng, 64, 256 * 16)
    chains = [router.block_hashes(p) for p in prefixes]
    for j, chain in enumerate(chains):  # each prefix on 3 workers, at different depths
        for k in range(3):
            name = names[(j + 5 * k) % num_workers]
            router.index.store(name, chain[:len(chain) >> k])
    for name in names:  # fill the rest with unrelated blocks, in store calls of 10,000
        missing = max(0, per_worker - router.index.worker_blocks(name))
        for start in range(0, missing, 10_000):
            n = min(10_000, missing - start)
            router.index.store(name, [rng.getrandbits(64) for _ in range(n)])
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


def _noise_floor(n: int, reps: int = 300) -> tuple[float, float]:
    """p50/p99 of a fixed CPU task about as long as one decision: what the machine (other
    processes taking the CPU) adds to any p99 measured here."""
    data = bytes(1024)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        for _ in range(reps):
            hashlib.sha256(data).digest()
        times.append(time.perf_counter() - t0)
    return _percentiles(times)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    lat = sub.add_parser("latency", help="decision latency with a large index",
                         formatter_class=HelpFormatter)
    lat.add_argument("--workers", type=int, default=16)
    lat.add_argument("--blocks", type=int, default=1_000_000)
    lat.add_argument("--lengths", default="1024,4096", help="prompt lengths in tokens")
    lat.add_argument("--decisions", type=int, default=2000)
    lat.add_argument("--runs", type=int, default=3)
    lat.add_argument("--indexes", default="memory",
                     help="comma-separated: memory, redis (default: memory)")
    lat.add_argument("--redis-url", default=None,
                     help="a running Redis to use for --indexes redis (its database is "
                          "flushed); default: a redis-server started for the run")
    fl = sub.add_parser("fleet", help="kvloop bench through the router, per policy",
                        formatter_class=HelpFormatter)
    fl.add_argument("--workers", type=int, default=8)
    fl.add_argument("--policies", default="kv-aware,round-robin,least-loaded")
    fl.add_argument("--workloads", default="shared-prefix,multi-turn")
    fl.add_argument("--runs", type=int, default=3)
    fl.add_argument("--concurrency", type=int, default=32)
    fl.add_argument("--sim-speedup", type=float, default=4.0)
    fl.add_argument("--gpu-blocks", type=int, default=400,
                    help="KV blocks per worker (--num-gpu-blocks-override)")
    fl.add_argument("--worker-args", default="", help="more `kvloop serve` flags")
    fl.add_argument("--json-out", help="write every run's figures here")
    fl.add_argument("--event-plane", choices=("zmq", "nats"), default="zmq",
                    help="how KV events reach the router: each worker's ZMQ publisher, or a "
                         "nats-server the benchmark starts (workers and router on it)")
    args = ap.parse_args(argv)
    if args.mode == "fleet":
        return run_fleet_bench(args)
    return run_latency(args)


def run_latency(args: argparse.Namespace) -> int:
    kinds = [k.strip() for k in args.indexes.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ("memory", "redis")]
    if bad or not kinds:
        raise SystemExit(f"--indexes: choose from memory, redis (got {args.indexes!r})")
    for kind in kinds:
        if kind == "memory":
            _latency_of(args, None)
        elif args.redis_url is not None:
            _latency_of(args, args.redis_url)
        else:
            with _local_redis() as url:
                _latency_of(args, url)
    return 0


def _local_redis() -> Any:
    """A redis-server on a free local port for the run (a context manager of its URL)."""
    import contextlib
    import socket

    from kvloop.router.services import local_redis

    @contextlib.contextmanager
    def run() -> Any:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with local_redis("127.0.0.1", port) as srv:
            yield f"redis://{srv.host}:{srv.port}"
    return run()


def _latency_of(args: argparse.Namespace, index_url: str | None) -> None:
    if index_url is not None:
        import redis

        redis.Redis.from_url(index_url).flushdb()
    what = "redis " + index_url.rsplit("@", 1)[-1] if index_url else "memory"
    rss0 = _rss_mb()
    t0 = time.perf_counter()
    router, prefixes = build_router(args.workers, args.blocks, index_url=index_url)
    print(f"index ({what}): {router.index.num_blocks():,} entries, "
          f"{router.index.num_hashes():,} hashes, {args.workers} workers; built in "
          f"{time.perf_counter() - t0:.1f}s; max RSS +{_rss_mb() - rss0:.0f} MB")
    rng = random.Random(1)
    noise = _noise_floor(args.decisions)
    print(f"noise floor (a fixed CPU task, same sitting): p50 {noise[0] * 1e6:.0f} us "
          f"p99 {noise[1] * 1e6:.0f} us")
    for length in (int(x) for x in args.lengths.split(",")):
        prompts = [p[:length - 32] + [rng.randrange(32000) for _ in range(32)]
                   for p in prefixes]
        _report(length, [time_phases(router, prompts, args.decisions, rng)
                         for _ in range(args.runs)])


def _report(length: int, runs: list[dict[str, list[float]]]) -> None:
    for phase in ("route", "hash", "match"):
        p50s, p99s = zip(*(_percentiles(r[phase]) for r in runs), strict=True)
        per_run = ", ".join(f"{a * 1e6:.0f}/{b * 1e6:.0f}" for a, b in
                            zip(p50s, p99s, strict=True))
        print(f"prompt {length:5d} tokens  {phase:6s} p50 {statistics.median(p50s) * 1e6:7.0f} "
              f"us  p99 {statistics.median(p99s) * 1e6:7.0f} us   (runs p50/p99: {per_run})")


# --- fleet: kvloop bench through kvloop router ---------------------------------------------
WORKLOAD_ARGS = {
    # 16 prefixes of 1024 tokens; a worker's cache holds about 4 of them (400 blocks)
    "shared-prefix": ["--workload", "shared-prefix", "--num-groups", "16",
                      "--prefix-len", "1024", "--suffix-len", "64", "--output-len", "32",
                      "--num-requests", "256"],
    # 64 conversations of 4 turns: 512 tokens, then 64 per turn, 32 tokens per answer
    "multi-turn": ["--workload", "multi-turn", "--num-requests", "64", "--num-turns", "4",
                   "--input-len", "512", "--turn-len", "64", "--output-len", "32"],
}


def _start_router(policy: str, workers: list[str], log_path: Path,
                  event_plane: str | None = None,
                  env: dict[str, str] | None = None) -> UrlProcess:
    """`env`: the fleet's secret and NATS credentials (never on the command line)."""
    args = ["router", "--port", "0", "--policy", policy, "--poll-interval", "0.5"]
    if event_plane is not None:
        args += ["--event-plane", event_plane]
    for url in workers:
        args += ["--worker", url]
    return UrlProcess(kvloop_command(*args), log_path, ROUTER_URL_LINE, env,
                      name="kvloop router")


def _fresh_caches(workers: list[str], admin_key: str) -> None:
    """Empty every worker's prefix cache; one tiny request makes the engine publish the
    AllBlocksCleared (engines flush KV events only inside a step)."""
    import httpx

    for url in workers:
        r = httpx.post(url + "/reset_prefix_cache", timeout=30,
                       headers={"Authorization": f"Bearer {admin_key}"})
        if r.status_code != 200 or not r.json().get("success"):
            raise RuntimeError(f"cannot reset the prefix cache of {url}: {r.text}")
        httpx.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 1}, timeout=30)


def _bench_once(router_url: str, workload: str, concurrency: int, seed: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "kvloop", "bench", "--url", router_url,
               *WORKLOAD_ARGS[workload], "--concurrency", str(concurrency),
               "--seed", str(seed), "--no-progress",
               "--json-out", out.name]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"kvloop bench failed:\n{done.stdout}\n{done.stderr}")
        data = json.load(open(out.name, encoding="utf-8"))
    return data["runs"][0] if "runs" in data else data


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_fleet_bench(args: argparse.Namespace) -> int:
    from kvloop.events.config import NatsPlaneConfig
    from kvloop.router.fleet import Fleet, FleetConfig
    from kvloop.trust import FleetSecret

    nats_port = _free_port() if args.event_plane == "nats" else None
    plane_url = f"nats://127.0.0.1:{nats_port}" if nats_port is not None else None
    worker_args = ("--sim-speedup", str(args.sim_speedup),
                   "--num-gpu-blocks-override", str(args.gpu_blocks),
                   *args.worker_args.split())
    admin_key = secrets.token_urlsafe(16)   # the workers' admin key, for cache resets
    fleet = Fleet(FleetConfig(args.workers, "sim", ("both",),
                              (*worker_args, "--admin-api-key", admin_key), echo_output=False,
                              event_plane=NatsPlaneConfig(
                                  plane_url, user="kvloop-bench",
                                  password=secrets.token_urlsafe(16)) if plane_url else None,
                              nats_port=nats_port, fleet_secret=FleetSecret.generate()))
    results: list[dict] = []
    try:
        urls = [s.url for s in fleet.start()]
        print(f"{args.workers} simulated workers: {' '.join(worker_args)}; KV events over "
              f"{plane_url or 'ZMQ'}", flush=True)
        for workload in args.workloads.split(","):
            for run in range(args.runs):
                for policy in args.policies.split(","):
                    results.append(_one_run(urls, policy, workload, args.concurrency, run,
                                            admin_key, plane_url, fleet.config.env()))
    finally:
        fleet.stop()
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    _fleet_table(results)
    return 0


def _one_run(urls: list[str], policy: str, workload: str, concurrency: int, run: int,
             admin_key: str, event_plane: str | None = None,
             env: dict[str, str] | None = None) -> dict:
    _fresh_caches(urls, admin_key)
    with tempfile.TemporaryDirectory(prefix="kvloop-bench-router-") as tmp, \
            _start_router(policy, urls, Path(tmp) / "router.log",
                          event_plane, env).start() as router:
        s = _bench_once(router.url, workload, concurrency, seed=run)
    row = {"policy": policy, "workload": workload, "run": run,
           "failed": s["failed"], "req_s": s["request_throughput"],
           "out_tok_s": s["output_throughput"], "total_tok_s": s["total_token_throughput"],
           "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
           "cache_share": s["cache_share"]}
    print(f"  {workload:13s} {policy:12s} run {run}: {row['req_s']:.2f} req/s, "
          f"TTFT p50 {row['ttft_p50_ms']:.0f} ms p99 {row['ttft_p99_ms']:.0f} ms, "
          f"cache {100 * (row['cache_share'] or 0):.1f}%, failed {row['failed']}", flush=True)
    return row


def _fleet_table(rows: list[dict]) -> None:
    print(f"\n{'workload':13s} {'policy':12s} {'req/s':>7s} {'tok/s':>8s} {'TTFT p50':>9s} "
          f"{'TTFT p99':>9s} {'cache %':>8s}   (medians of {len({r['run'] for r in rows})} runs)")
    keys = sorted({(r["workload"], r["policy"]) for r in rows},
                  key=lambda k: (k[0], ["kv-aware", "least-loaded", "round-robin",
                                        "random"].index(k[1])))
    for workload, policy in keys:
        rs = [r for r in rows if r["workload"] == workload and r["policy"] == policy]

        def med(key: str, rs: list[dict] = rs) -> float:
            return statistics.median(r[key] or 0.0 for r in rs)
        print(f"{workload:13s} {policy:12s} {med('req_s'):7.2f} {med('total_tok_s'):8.0f} "
              f"{med('ttft_p50_ms'):7.0f}ms {med('ttft_p99_ms'):7.0f}ms "
              f"{100 * med('cache_share'):7.1f}%")


if __name__ == "__main__":
    raise SystemExit(main())
