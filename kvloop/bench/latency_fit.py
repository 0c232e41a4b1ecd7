"""`python -m kvloop.bench.latency_fit`: time the real ModelRunner, rewrite the sim's latency file.

Drives a real EngineCore (scheduler, block pool) with the real model runner through a grid
of workloads (single prefill chunks of several sizes, decode batches of several widths and
context lengths, and the mixed steps between them), times every `runner.execute` call, and
fits the linear model of `kvloop.sim.latency` by non-negative least squares:

    step_s = base_s + per_token_s*tokens + per_seq_s*seqs + per_ctx_token_s*context_tokens

This is a measurement tool, with the benchmarks: it loads the model (and torch) when run,
never when imported. The simulator (`kvloop.sim`) only reads the file this writes and stays
free of torch. The machine should be otherwise idle.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from kvloop.bench.cli_args import HelpFormatter
from kvloop.config import CacheConfig, EngineConfig, RunnerConfig, SchedulerConfig
from kvloop.core.engine import EngineCore
from kvloop.core.outputs import RunnerOutput, SchedulerOutput
from kvloop.core.request import SamplingParams
from kvloop.sim.latency import COEFFICIENTS, DEFAULT_LATENCY_FILE, StepFeatures

PREFILL_SIZES = (16, 64, 128, 256, 512)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32)
DECODE_CONTEXTS = (32, 256)
DECODE_STEPS = 6


class TimedRunner:
    """Wraps a runner; records (features, seconds) of every non-empty `execute`."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.samples: list[tuple[StepFeatures, float]] = []

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        result: RunnerOutput = self.inner.execute(out)
        dt = time.perf_counter() - t0
        if not out.is_empty:
            self.samples.append((StepFeatures.of(out), dt))
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()


def run_workload(engine: EngineCore, rng: random.Random, prompts: Sequence[int],
                 max_tokens: int, vocab: int, tag: str) -> None:
    """Run requests with these prompt lengths to completion (random tokens, no EOS)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, n in enumerate(prompts):
        ids = [rng.randrange(vocab) for _ in range(n)]
        engine.add_request(engine.make_request(f"{tag}-{i}", ids, params))
    while engine.has_unfinished_requests():
        engine.step()


def measure(runner: Any, repeats: int, seed: int = 0) -> list[tuple[StepFeatures, float]]:
    """Time the runner over the workload grid, `repeats` times (after one warm-up pass)."""
    timed = TimedRunner(runner)
    cfg = EngineConfig(
        cache=CacheConfig(num_gpu_blocks=runner.num_gpu_blocks,
                          enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64,
                                  max_model_len=runner.max_model_len))
    engine = EngineCore(cfg, timed, num_gpu_blocks=runner.num_gpu_blocks)
    rng = random.Random(seed)
    vocab = int(runner.vocab_size)
    run_workload(engine, rng, [64, 64], 4, vocab, "warmup")
    timed.samples.clear()
    for r in range(repeats):
        for n in PREFILL_SIZES:
            run_workload(engine, rng, [n], 1, vocab, f"p{r}-{n}")
        for b in DECODE_BATCHES:
            for ctx in DECODE_CONTEXTS:
                run_workload(engine, rng, [ctx] * b, DECODE_STEPS, vocab, f"d{r}-{b}-{ctx}")
    return timed.samples


def aggregate(samples: Sequence[tuple[StepFeatures, float]]) -> list[tuple[StepFeatures, float]]:
    """One sample per distinct step (same features across repeats): the median time, which
    drops the spikes a shared machine adds."""
    groups: dict[StepFeatures, list[float]] = {}
    for f, t in samples:
        groups.setdefault(f, []).append(t)
    return [(f, statistics.median(ts)) for f, ts in groups.items()]


def fit(samples: Sequence[tuple[StepFeatures, float]]) -> dict[str, float]:
    """Non-negative least squares of the relative error (rows weighted by 1/time), so short
    decode steps count as much as long prefills; active set over the four unknowns."""
    x = np.array([[1.0, f.num_tokens, f.num_seqs, f.context_tokens] for f, _ in samples])
    y = np.array([t for _, t in samples])
    w = 1.0 / np.maximum(y, 1e-9)
    xw, yw = x * w[:, None], y * w
    active = list(range(4))
    coef = np.zeros(4)
    while active:
        sol, *_ = np.linalg.lstsq(xw[:, active], yw, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return dict(zip(COEFFICIENTS, (float(c) for c in coef), strict=True))


def quality(samples: Sequence[tuple[StepFeatures, float]], coef: dict[str, float]
            ) -> dict[str, float]:
    pred = [coef["base_s"] + coef["per_token_s"] * f.num_tokens + coef["per_seq_s"] * f.num_seqs
            + coef["per_ctx_token_s"] * f.context_tokens for f, _ in samples]
    obs = [t for _, t in samples]
    mean = statistics.fmean(obs)
    ss_res = sum((o - p) ** 2 for o, p in zip(obs, pred, strict=True))
    ss_tot = sum((o - mean) ** 2 for o in obs) or 1.0
    rel = [abs(o - p) / o for o, p in zip(obs, pred, strict=True) if o > 0]
    return {"r2": 1 - ss_res / ss_tot, "median_abs_rel_error": statistics.median(rel)}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvloop.bench.latency_fit", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--model", default=None, help="model to measure (default: embedded)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=3,
                    help="passes over the workload grid (medians drop load spikes)")
    ap.add_argument("--out", default=str(DEFAULT_LATENCY_FILE))
    args = ap.parse_args(argv)
    rc = RunnerConfig(model=args.model, dtype=args.dtype, max_model_len=2048)
    from kvloop.model import load_runner

    runner = load_runner(rc)
    t0 = time.monotonic()
    raw = measure(runner, args.repeats)
    samples = aggregate(raw)
    coef = fit(samples)
    q = quality(samples, coef)
    data = {
        "model": runner.model_name,
        "machine": f"{_cpu_name()}, {os.cpu_count()} CPUs, torch {version('torch')}, "
                   f"dtype {args.dtype}",
        "formula": "step_s = base_s + per_token_s*tokens + per_seq_s*seqs"
                   " + per_ctx_token_s*context_tokens",
        "provisional": False,
        "source": f"fitted by `python -m kvloop.bench.latency_fit` on {time.strftime('%Y-%m-%d')}: "
                  f"{len(raw)} timed runner steps in {time.monotonic() - t0:.0f} s, median per "
                  f"distinct step ({len(samples)}), non-negative least squares of the "
                  f"relative error; load average {os.getloadavg()[0]:.1f} at the end",
        "fit": {k: round(v, 4) for k, v in q.items()} | {"samples": len(samples)},
        "coefficients": {k: float(f"{v:.4g}") for k, v in coef.items()},
    }
    Path(args.out).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(data, indent=2))
    runner.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
