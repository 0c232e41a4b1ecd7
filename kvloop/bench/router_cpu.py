"""Router CPU seconds per request: what one routed request costs the router process.

    python -m kvloop.bench.router_cpu [--workers 2] [--requests 48] [--concurrency 4]
                                      [--prompt-words 1100] [--profile OUT.prof]

Starts `--workers` simulated workers (`kvloop serve sim`, `kvloop.router.fleet`) and one
`kvloop router` process in front of them, sends warm-up requests, then `--requests` streamed
`/v1/completions` of ~1,500-token text prompts (8 shared prefixes + unique suffixes) at
`--concurrency`, and reports the router process's CPU seconds (user + system, every thread,
from /proc) per request. `--profile` runs the router under cProfile (timed by CPU seconds)
and writes its profile there (the figures are then the profiler's, not the router's).

`cpu_seconds(pid)` is the reusable piece: `kvloop.bench.routers` reads any router's CPU with
it (a kvloop router, SMG, Envoy).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvloop.router.fleet import Fleet, FleetConfig

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
         "every jovial bank clerk near old river stones and bright summer fields").split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (all its threads; not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])   # utime, stime (fields 14 and 15 of stat)
    return ticks / os.sysconf("SC_CLK_TCK")


def text_prompts(n: int, prefixes: int, words: int, seed: int = 0) -> list[str]:
    """`n` prompts of ~`words` words: one of `prefixes` shared prefixes (7/8 of the words)
    and a unique suffix."""
    rng = random.Random(seed)
    shared = [" ".join(rng.choice(WORDS) for _ in range(words * 7 // 8)) for _ in range(prefixes)]
    return [f"{shared[i % prefixes]} {i}: " + " ".join(rng.choice(WORDS) for _ in
                                                      range(words // 8)) for i in range(n)]


@dataclass(frozen=True)
class Result:
    requests: int
    cpu_s: float
    wall_s: float

    @property
    def cpu_ms_per_request(self) -> float:
        return 1000 * self.cpu_s / self.requests


def stream_all(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> None:
    """Streamed /v1/completions of every prompt, `concurrency` at a time; every answer read
    to its end and checked."""
    todo = list(prompts)
    lock = threading.Lock()
    errors: list[str] = []

    def worker() -> None:
        with httpx.Client(timeout=120) as client:
            while True:
                with lock:
                    if not todo:
                        return
                    prompt = todo.pop()
                body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                        "stream": True}
                with client.stream("POST", url + "/v1/completions", json=body) as r:
                    lines = [ln for ln in r.iter_lines() if ln]
                if r.status_code != 200 or lines[-1] != "data: [DONE]":
                    errors.append(f"{r.status_code}: {lines[-2:]}")

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")


# the router under cProfile timed by CPU (not wall) seconds, its profile written on exit
_PROFILED = """
import cProfile, sys, time
out = sys.argv[1]
sys.argv = ["kvloop", *sys.argv[2:]]
from kvloop.cli import main
profile = cProfile.Profile(time.process_time)
profile.enable()
try:
    main()
finally:
    profile.disable()
    profile.dump_stats(out)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_router(workers: list[str], profile: str | None) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [sys.executable, *(["-c", _PROFILED, profile] if profile else ["-m", "kvloop"]),
           "router", "--host", "127.0.0.1", "--port", str(port)]
    for w in workers:
        cmd += ["--worker", w]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited with {proc.returncode}")
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the router did not become healthy within 120 s")


def measure(url: str, pid: int, prompts: list[str], concurrency: int,
            max_tokens: int) -> Result:
    """The router's CPU seconds over streaming `prompts` through it."""
    c0, t0 = cpu_seconds(pid), time.monotonic()
    stream_all(url, prompts, concurrency, max_tokens)
    return Result(len(prompts), cpu_seconds(pid) - c0, time.monotonic() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvloop.bench.router_cpu",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prompt-words", type=int, default=1100, help="~1,500 tokens")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--sim-speedup", type=float, default=20.0)
    p.add_argument("--profile", default=None, help="run the router under cProfile, to here")
    a = p.parse_args(argv)
    fleet = Fleet(FleetConfig(a.workers, "sim", ("both",),
                              ("--sim-speedup", str(a.sim_speedup),
                               "--num-gpu-blocks-override", "400"),
                              start_timeout_s=120, stop_timeout_s=10, echo_output=False))
    fleet.start()
    try:
        router, url = start_router([w.url for w in fleet.specs()], a.profile)
        try:
            prompts = text_prompts(a.warmup + a.requests, 8, a.prompt_words, seed=1)
            stream_all(url, prompts[:a.warmup], a.concurrency, a.max_tokens)
            r = measure(url, router.pid, prompts[a.warmup:], a.concurrency, a.max_tokens)
        finally:
            router.send_signal(signal.SIGINT)
            try:
                router.wait(30)
            except subprocess.TimeoutExpired:
                router.kill()
    finally:
        fleet.stop()
    print(json.dumps({"requests": r.requests, "router_cpu_s": round(r.cpu_s, 3),
                      "router_cpu_ms_per_request": round(r.cpu_ms_per_request, 2),
                      "wall_s": round(r.wall_s, 2), "concurrency": a.concurrency,
                      "prompt_words": a.prompt_words, "max_tokens": a.max_tokens}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
