"""P/D benchmark: `python -m kvloop.bench.pd`.

Simulated fleets of the same size run the same workload through `kvloop router`:

    aggregated   --aggregated N `both` workers (kv-aware routing)
    pd-cost      --prefill P + --decode D workers, remote prefill by the cost model
    pd-always    the same P/D fleet, every prefill remote (vLLM's proxy flow)
    pd-never     the same P/D fleet, every prefill local on the decode workers

The workload (`kvloop bench`, open loop at --rate sessions per second): shared-prefix, long
prompts (--num-groups prefixes of --prefix-len tokens + --suffix-len unique ones), long
outputs (--output-len, EOS ignored). Each run starts from empty worker caches and a fresh
router process (`--pd-speedup` = the workers' --sim-speedup, so the cost model runs at their
pace). Prints TTFT p50/p99, TPOT p50/p99 and throughput per setup (medians over --runs).

Tiny numbers smoke-test the script; a real comparison belongs on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvloop.bench.cli_args import HelpFormatter
from kvloop.bench.router import _fresh_caches
from kvloop.front.launcher import ROUTER_URL_LINE, UrlProcess, kvloop_command
from kvloop.trust import FleetSecret, secret_env

SETUPS = ("aggregated", "pd-cost", "pd-always", "pd-never")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--setups", default=",".join(SETUPS),
                    help=f"comma-separated, from {', '.join(SETUPS)}")
    ap.add_argument("--aggregated", type=int, default=4, help="workers of the aggregated fleet")
    ap.add_argument("--prefill", type=int, default=2, help="prefill workers of the P/D fleet")
    ap.add_argument("--decode", type=int, default=2, help="decode workers of the P/D fleet")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--num-groups", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--suffix-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--rate", type=float, default=2.0, help="sessions per second (open loop)")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--sim-speedup", type=float, default=1.0)
    ap.add_argument("--gpu-blocks", type=int, default=2000,
                    help="KV blocks per worker (--num-gpu-blocks-override)")
    ap.add_argument("--worker-args", default="", help="more `kvloop serve` flags")
    ap.add_argument("--json-out", help="write every run's figures here")
    args = ap.parse_args(argv)
    unknown = set(args.setups.split(",")) - set(SETUPS)
    if unknown:
        ap.error(f"unknown setups {sorted(unknown)}; choose from {SETUPS}")
    return args


def _workload_args(args: argparse.Namespace) -> list[str]:
    return ["--workload", "shared-prefix", "--num-groups", str(args.num_groups),
            "--prefix-len", str(args.prefix_len), "--suffix-len", str(args.suffix_len),
            "--output-len", str(args.output_len), "--num-requests", str(args.num_requests),
            "--rate", str(args.rate)]


def _bench(url: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "kvloop", "bench", "--url", url, *_workload_args(args),
               "--seed", str(seed), "--no-progress", "--json-out", out.name]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"kvloop bench failed:\n{done.stdout}\n{done.stderr}")
        with open(out.name, encoding="utf-8") as f:
            return dict(json.load(f))


def _router(urls: list[tuple[str, str]], pd_policy: str, speedup: float,
            log: Path, secret: FleetSecret) -> UrlProcess:
    """The router, with the fleet's secret in its environment (never on its command line)."""
    flags = ["router", "--port", "0", "--poll-interval", "0.5", "--pd-policy", pd_policy,
             "--pd-speedup", str(speedup)]
    for url, role in urls:
        flags += ["--worker", f"{url},{role}"]
    return UrlProcess(kvloop_command(*flags), log, ROUTER_URL_LINE, secret_env(secret),
                      name="kvloop router")


def _row(setup: str, run: int, s: dict[str, Any]) -> dict[str, Any]:
    def pct(key: str, q: str) -> float | None:
        dist = s.get(key)
        return dist[q] if dist else None
    return {"setup": setup, "run": run, "failed": s["failed"],
            "req_s": s["request_throughput"], "out_tok_s": s["output_throughput"],
            "ttft_p50_ms": pct("ttft_ms", "p50"), "ttft_p99_ms": pct("ttft_ms", "p99"),
            "tpot_p50_ms": pct("tpot_ms", "p50"), "tpot_p99_ms": pct("tpot_ms", "p99"),
            "cache_share": s["cache_share"]}


def _run_fleet(args: argparse.Namespace, setups: list[str], aggregated: bool
               ) -> list[dict[str, Any]]:
    """Start one fleet, run its setups --runs times each, stop it."""
    from kvloop.router.fleet import Fleet, FleetConfig

    admin = secrets.token_urlsafe(16)
    secret = FleetSecret.generate()     # the workers' and the router's (P/D needs one)
    worker_args = ("--sim-speedup", str(args.sim_speedup), "--num-gpu-blocks-override",
                   str(args.gpu_blocks), *args.worker_args.split(), "--admin-api-key", admin)
    cfg = (FleetConfig(args.aggregated, "sim", ("both",), worker_args, echo_output=False,
                       fleet_secret=secret)
           if aggregated else
           FleetConfig(0, "sim", worker_args=worker_args, echo_output=False,
                       num_prefill=args.prefill, num_decode=args.decode,
                       fleet_secret=secret))
    fleet = Fleet(cfg)
    rows = []
    try:
        specs = fleet.start()
        workers = [(s.url, s.role) for s in specs]
        for run in range(args.runs):
            for setup in setups:
                _fresh_caches([u for u, _ in workers], admin)
                policy = setup.removeprefix("pd-") if setup != "aggregated" else "cost"
                with tempfile.TemporaryDirectory(prefix="kvloop-bench-pd-") as tmp, \
                        _router(workers, policy, args.sim_speedup,
                                Path(tmp) / "router.log", secret).start() as router:
                    row = _row(setup, run, _bench(router.url, args, seed=run))
                rows.append(row)
                print(_line(row), flush=True)
    finally:
        fleet.stop()
    return rows


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _line(r: dict[str, Any]) -> str:
    return (f"  {r['setup']:11s} run {r['run']}: {_fmt(r['req_s'], '.2f')} req/s, TTFT p50 "
            f"{_fmt(r['ttft_p50_ms'], '.0f')} p99 {_fmt(r['ttft_p99_ms'], '.0f')} ms, TPOT p50 "
            f"{_fmt(r['tpot_p50_ms'], '.1f')} p99 {_fmt(r['tpot_p99_ms'], '.1f')} ms, failed "
            f"{r['failed']}")


def table(rows: list[dict[str, Any]]) -> str:
    """Medians per setup, in `SETUPS` order."""
    keys = ("req_s", "out_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")
    out = [f"{'setup':11s} {'req/s':>7s} {'out tok/s':>9s} {'TTFT p50':>9s} {'TTFT p99':>9s} "
           f"{'TPOT p50':>9s} {'TPOT p99':>9s}   (medians of {len({r['run'] for r in rows})} "
           "runs)"]
    for setup in (s for s in SETUPS if any(r["setup"] == s for r in rows)):
        rs = [r for r in rows if r["setup"] == setup]
        med = {k: statistics.median(r[k] for r in rs) if all(r[k] is not None for r in rs)
               else None for k in keys}
        out.append(f"{setup:11s} {_fmt(med['req_s'], '7.2f')} {_fmt(med['out_tok_s'], '9.0f')} "
                   f"{_fmt(med['ttft_p50_ms'], '7.0f')}ms {_fmt(med['ttft_p99_ms'], '7.0f')}ms "
                   f"{_fmt(med['tpot_p50_ms'], '7.1f')}ms {_fmt(med['tpot_p99_ms'], '7.1f')}ms")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setups = args.setups.split(",")
    pd = [s for s in setups if s != "aggregated"]
    print(f"workload: shared-prefix, {args.num_requests} requests at {args.rate}/s, "
          f"{args.num_groups} x {args.prefix_len} + {args.suffix_len} prompt tokens, "
          f"{args.output_len} out; workers --sim-speedup {args.sim_speedup}", flush=True)
    rows = _run_fleet(args, ["aggregated"], True) if "aggregated" in setups else []
    if pd:
        rows += _run_fleet(args, pd, False)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    print("\n" + table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
