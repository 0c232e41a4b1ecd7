
"""Structured-output benchmark: a json_schema workload against the same workload unconstrained.

    python -m kvloop.bench.structured [--model PATH] [--num-requests 16] [--output-len 64]

One run sends `--num-requests` requests with the same prompts both ways, greedy, to the
offline engine (kvloop's `LLM`, stepped directly so every step's record is seen):
constrained by `SCHEMA` (a bounded JSON object: strings with maxLength, an enum, integers in a
range, a short array), or unconstrained with EOS ignored. Each side's figure is output tokens
per second of wall time (medians over `--repeats` runs; the sides alternate, so a change in
the machine's load hits both; prefix caching is off, so both compute every prompt). The
schema is compiled once before the runs (its compile time is printed; the runs hit the
engine's grammar cache). For the constrained side it also prints, summed over the steps:
the forward-pass time, the grammar-bitmask time, and the share of the bitmask time that the
forward pass hid (the two ran at once, as vLLM overlaps them).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from kvloop.bench.cli_args import HelpFormatter

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "role": {"enum": ["engineer", "teacher", "doctor", "artist"]},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 12},
                   "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 16},
                                   "zip": {"type": "integer", "minimum": 0,
                                           "maximum": 99999}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "role", "age", "skills", "address"],
}
PROMPT = "Describe person number {i} of a small company as a JSON object:"


@dataclass
class Run:
    """One side of one run."""

    tokens: int = 0
    seconds: float = 0.0
    forward_s: float = 0.0
    bitmask_s: float = 0.0
    hidden_s: float = 0.0
    finish: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvloop.bench.structured", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: cores)")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64, help="max_tokens of each request")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def workload(llm: Any, args: argparse.Namespace, constrained: bool) -> list[tuple[list[int], Any]]:
    """(prompt ids, params) of every request of one side."""
    from kvloop import SamplingParams, StructuredOutputsParams

    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len,
                            ignore_eos=not constrained, structured_outputs=so)
    tok = llm.get_tokenizer()
    return [(tok.encode(PROMPT.format(i=i)), params) for i in range(args.num_requests)]


def run_side(llm: Any, requests: list[tuple[list[int], Any]], tag: str) -> Run:
    """Add every request, step the engine until all finish; totals of the step records."""
    engine = llm.engine
    run = Run()
    t0 = time.perf_counter()
    for i, (ids, params) in enumerate(requests):
        engine.add_request(engine.make_request(f"{tag}-{i}", ids, params))
    while engine.has_unfinished_requests():
        result = engine.step()
        for out in result.outputs:
            run.tokens += len(out.new_token_ids)
            if out.finish_reason is not None:
                run.finish[out.finish_reason] = run.finish.get(out.finish_reason, 0) + 1
        rec = result.record
        if rec is not None:
            run.forward_s += rec.forward_s
            run.bitmask_s += rec.bitmask_s
            run.hidden_s += rec.bitmask_hidden_s
    run.seconds = time.perf_counter() - t0
    return run


def compile_seconds(llm: Any) -> float:
    """The schema's compile time (it then stays in the engine's grammar cache)."""
    from kvloop import StructuredOutputsParams

    manager = llm.engine.structured_output
    if manager is None:
        raise SystemExit("this model's engine has no grammar backend")
    manager.backend  # noqa: B018  (built first: its import is not compile time)
    t0 = time.perf_counter()
    manager.validate(StructuredOutputsParams(json=SCHEMA))
    return time.perf_counter() - t0


def report(args: argparse.Namespace, compile_s: float, free: list[Run],
           constrained: list[Run]) -> str:
    med = statistics.median
    free_tps, json_tps = med(r.tokens_per_s for r in free), med(r.tokens_per_s for r in constrained)
    bitmask = sum(r.bitmask_s for r in constrained)
    hidden = sum(r.hidden_s for r in constrained)
    forward = sum(r.forward_s for r in constrained)
    last = constrained[-1]
    lines = [f"{args.num_requests} requests, max_tokens {args.output_len}, repeats "
             f"{args.repeats} (medians); schema compile {compile_s * 1000:.1f} ms",
             f"{'side':<16}{'output tok/s':>14}{'tokens':>9}",
             f"{'unconstrained':<16}{free_tps:>14.1f}{free[-1].tokens:>9}",
             f"{'json_schema':<16}{json_tps:>14.1f}{last.tokens:>9}   finish {last.finish}",
             f"json_schema / unconstrained: {json_tps / free_tps if free_tps else 0.0:.3f}",
             f"constrained steps, all runs: forward {forward:.3f} s, bitmask {bitmask * 1000:.1f} "
             f"ms, hidden behind the forward {hidden * 1000:.1f} ms "
             f"({hidden / bitmask if bitmask else 0.0:.1%} of the bitmask time)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from kvloop import LLM

    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads, seed=args.seed,
              max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=False)   # both sides compute every prompt
    try:
        compile_s = compile_seconds(llm)
        free, constrained = [], []
        for rep in range(args.repeats):
            free.append(run_side(llm, workload(llm, args, False), f"free-{rep}"))
            constrained.append(run_side(llm, workload(llm, args, True), f"json-{rep}"))
        print(report(args, compile_s, free, constrained))
    finally:
        llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
