"""Scheduler overhead: one `schedule()` + `update_from_output()` with 256 running requests.

    python -m kvloop.bench.scheduler [--requests 256] [--budget 8192] [--steps 200]

Decode steady state (every request computes one token per step, blocks fill and get hashed
every 16 steps), prefix caching on, sha256 hashing: the per-step Python cost the engine pays
on top of the forward pass. Target (docs/benchmarking.md#workloads-and-targets): under
2 ms on the 2-core machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvloop.bench.cli_args import HelpFormatter
from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.core.block_pool import BlockPool
from kvloop.core.hashing import BlockHasher
from kvloop.core.kv_cache_manager import KVCacheManager
from kvloop.core.outputs import RunnerOutput
from kvloop.core.request import Request, SamplingParams
from kvloop.core.scheduler import Scheduler


def build(num_requests: int, budget: int, prompt_len: int, steps: int) -> Scheduler:
    blocks_per_req = (prompt_len + steps + 32) // 16 + 2
    cache = CacheConfig(num_gpu_blocks=num_requests * blocks_per_req + 1)
    sched_cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=num_requests,
                                max_model_len=8192)
    pool = BlockPool(cache.num_gpu_blocks, enable_kv_cache_events=True)
    kv = KVCacheManager(pool, cache.block_size, sched_cfg.max_model_len)
    sched = Scheduler(sched_cfg, kv)
    hasher = BlockHasher(16, "sha256")
    params = SamplingParams(max_tokens=100000, ignore_eos=True)
    for i in range(num_requests):
        prompt = [(i * 7919 + j) % 32000 for j in range(prompt_len)]
        sched.add_request(Request(f"r{i}", prompt, params, float(i), hasher))
    return sched


def one_step(sched: Scheduler) -> tuple[float, float]:
    t0 = time.perf_counter()
    out = sched.schedule()
    t1 = time.perf_counter()
    ro = RunnerOutput(req_ids=list(out.num_scheduled_tokens),
                      sampled_token_ids=[[1000] if rid in out.sampling_req_ids else []
                                         for rid in out.num_scheduled_tokens])
    t2 = time.perf_counter()
    sched.update_from_output(out, ro)
    sched.kv.take_events()
    t3 = time.perf_counter()
    return t1 - t0, t3 - t2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    medians = []
    for rep in range(args.repeats):
        sched = build(args.requests, args.budget, args.prompt_len, args.steps)
        while len(sched.running) < args.requests or any(
                r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
            one_step(sched)  # prefill until everyone decodes
        times = [one_step(sched) for _ in range(args.steps)]
        total = [(a + b) * 1e3 for a, b in times]
        sch = statistics.median(a * 1e3 for a, _ in times)
        upd = statistics.median(b * 1e3 for _, b in times)
        med = statistics.median(total)
        p99 = sorted(total)[int(0.99 * (len(total) - 1))]
        medians.append(med)
        print(f"run {rep + 1}: {args.requests} running, budget {args.budget}: "
              f"schedule {sch:.3f} ms + update {upd:.3f} ms = {med:.3f} ms median, "
              f"p99 {p99:.3f} ms")
    print(f"median of {args.repeats} runs: {statistics.median(medians):.3f} ms per step "
          f"(target < 2 ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
