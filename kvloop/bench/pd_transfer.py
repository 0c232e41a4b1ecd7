"""KV transfer time of the real model: `python -m kvloop.bench.pd_transfer`.

Starts a prefill worker and a decode worker (`kvloop serve`, the embedded model unless
--model, both with a KvloopConnector) and runs vLLM's proxy flow for prompts of each
--lengths (random token ids): the prefill leg (`do_remote_decode`, max_tokens 1), then the
decode leg with the returned `kv_transfer_params` (max_tokens 1), so the decode worker loads
every block of the prompt and computes one token. Per prompt length it prints the blocks and
bytes moved and the load time the decode worker measured (`kvloop:kv_transfer_time_seconds`:
admission to the load's end, handshake excluded after the first request), per prompt and per
block, medians of --repeats, for each --transports. The decode worker runs without prefix
caching, so every prompt moves all its blocks.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

import httpx

from kvloop.bench.cli_args import HelpFormatter
from kvloop.config import DEFAULT_BLOCK_SIZE
from kvloop.front.launcher import ServeProcess
from kvloop.trust import INTERNAL_TOKEN_HEADER, PURPOSE_INTERNAL_HTTP, FleetSecret, secret_env
from kvloop.wire import PREFILL_PARAMS

TIME = "kvloop:kv_transfer_time_seconds"
BYTES = "kvloop:kv_transfer_bytes_total"
SECRET = FleetSecret.generate()     # the two workers' fleet secret (in their environment)
FLEET = {INTERNAL_TOKEN_HEADER: SECRET.token(PURPOSE_INTERNAL_HTTP)}   # a router's proof


def _worker_args(model: str | None, transport: str, extra: list[str]) -> list[str]:
    cfg = {"kv_connector": "KvloopConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"transport": transport}}
    return [*(["--model", model] if model else []), "--kv-transfer-config", json.dumps(cfg),
            "--no-enable-prefix-caching", *extra]


def _one(p: ServeProcess, d: ServeProcess, prompt: list[int]) -> tuple[float, float]:
    """One proxy flow; (seconds, bytes) of the decode worker's load."""
    t0, b0 = d.metric(TIME + "_sum"), d.metric(BYTES, side="recv")
    r = httpx.post(p.url + "/v1/completions", timeout=600, headers=FLEET, json={
        "prompt": prompt, "max_tokens": 1, "min_tokens": 1, "temperature": 0,
        "kv_transfer_params": PREFILL_PARAMS})
    r.raise_for_status()
    params = r.json()["kv_transfer_params"]
    if not params:
        raise RuntimeError(f"the prefill worker handed on nothing: {r.text}")
    r = httpx.post(d.url + "/v1/completions", timeout=600, headers=FLEET, json={
        "prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_transfer_params": params})
    r.raise_for_status()
    return d.metric(TIME + "_sum") - t0, d.metric(BYTES, side="recv") - b0


def run(args: argparse.Namespace) -> None:
    rng = random.Random(0)
    lengths = [int(x) for x in args.lengths.split(",")]
    extra = args.worker_args.split()
    for transport in args.transports.split(","):
        with tempfile.TemporaryDirectory(prefix="kvloop-pd-transfer-") as tmp, \
                ServeProcess(_worker_args(args.model, transport, extra),
                             Path(tmp) / "p.log", secret_env(SECRET)).start() as p, \
                ServeProcess(_worker_args(args.model, transport, extra),
                             Path(tmp) / "d.log", secret_env(SECRET)).start() as d:
            _one(p, d, [rng.randrange(1000, 40000) for _ in range(32)])   # handshake
            print(f"\ntransport {transport}")
            print(f"{'tokens':>7s} {'blocks':>7s} {'MB':>8s} {'load ms':>9s} "
                  f"{'ms/block':>9s} {'MB/s':>8s}   (medians of {args.repeats})")
            for n in lengths:
                runs = [_one(p, d, [rng.randrange(1000, 40000) for _ in range(n)])
                        for _ in range(args.repeats)]
                secs = statistics.median(s for s, _ in runs)
                nbytes = statistics.median(b for _, b in runs)
                blocks = -(-n // DEFAULT_BLOCK_SIZE)
                print(f"{n:7d} {blocks:7d} {nbytes / 1e6:8.2f} {1e3 * secs:9.1f} "
                      f"{1e3 * secs / blocks:9.2f} {nbytes / 1e6 / secs:8.0f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded)")
    ap.add_argument("--lengths", default="16,256,1000,2000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--transports", default="tcp,shm")
    ap.add_argument("--worker-args", default="", help="more `kvloop serve` flags")
    run(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
