"""Decode steps of the real engine, part by part, under each low-bit policy alternating.

    python -m kvloop.bench.steps [--rows 4,8,32] [--context 256] [--steps 24]
                                 [--policy fused=4,8,128 --policy dense=4,8,4 ...]

For each row count R: R greedy requests of `--context` random prompt tokens enter `LLM()`'s
engine, are prefilled, and then decode together; every decode step runs under the next
policy in turn (the start-up crossover's, named `start-up`, then each `--policy NAME=T,H,D`:
`LowBitPolicy(max_tokens=T, max_logits_rows=H, max_decode_tokens=D)`), so drifting load on a
shared machine hits every policy alike. Printed per R and policy, medians over the steps
(the first two of each dropped): the whole `engine.step` and, on the runner's forward thread,
its parts, timed by wall-clock wrappers around the model's own functions:

- `forward`: the runner's forward pass and greedy choice (`ModelRunner._timed_forward`);
- `fused`: the fused decoder stack (`FusedDecode.forward`: every layer in one call);
- `linears`, `attention`: the layer loop's linear layers and attention (when not fused);
- `head`: the LM head (its fused argmax for greedy rows, or its logits).

`engine.step` less `forward` is the engine's own work (schedule, inputs, outputs). Figures
are this machine's at this moment: say how busy it was (`uptime`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

from kvloop.bench.cli_args import HelpFormatter

PARTS = ("forward", "fused", "linears", "attention", "head")
START_UP = "start-up"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvloop.bench.steps", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded)")
    p.add_argument("--rows", default="4,8,32", help="decodes per step, comma-separated")
    p.add_argument("--context", type=int, default=256, help="prompt tokens of each request")
    p.add_argument("--steps", type=int, default=24, help="decode steps per policy")
    p.add_argument("--policy", action="append", default=[], metavar="NAME=T,H,D",
                   help="a low-bit policy to alternate with the start-up one (repeatable)")
    p.add_argument("--json-out", help="write the figures as JSON here")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def parse_policy(text: str) -> tuple[str, Any]:
    """"NAME=T,H,D" -> (NAME, LowBitPolicy(T, H, D))."""
    from kvloop.model.quant import LowBitPolicy

    name, sep, numbers = text.partition("=")
    values = numbers.split(",")
    if not sep or not name or len(values) != 3 or not all(v.strip().isdigit() for v in values):
        raise SystemExit(f"--policy {text!r}: expected NAME=T,H,D (three whole numbers)")
    return name, LowBitPolicy(*(int(v) for v in values))


class PartTimers:
    """Wall-clock seconds spent in wrapped callables while `on`, per part name. Wrappers are
    installed by `wrap` and removed on `close` (the model is left as it was found)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.on = False
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, attr: str, part: Callable[..., str | None] | str) -> None:
        """owner.attr timed under `part`: a name, or a function of the call's arguments
        giving one (None: not timed)."""
        original = getattr(owner, attr)
        had_own = attr in vars(owner)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return original(*args, **kwargs)
            name = part if isinstance(part, str) else part(*args, **kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if name is not None:
                    self.seconds[name] += time.perf_counter() - start

        setattr(owner, attr, timed)
        self._undo.append(lambda: setattr(owner, attr, original) if had_own
                          else delattr(owner, attr))

    def close(self) -> None:
        while self._undo:
            self._undo.pop()()


@contextlib.contextmanager
def timed_parts(llm: Any) -> Iterator[PartTimers]:
    """PartTimers around `llm`'s runner and model (PARTS)."""
    from kvloop.model import llama

    model = llm.runner.model
    timers = PartTimers()
    timers.wrap(type(llm.runner), "_timed_forward", "forward")
    timers.wrap(llama.FusedDecode, "forward", "fused")
    timers.wrap(llama, "paged_attention", "attention")
    timers.wrap(llama.Linear, "forward",
                lambda self, *a, **k: "head" if self is model.lm_head else "linears")
    timers.wrap(llama.Linear, "argmax", "head")
    try:
        yield timers
    finally:
        timers.close()


def measure_rows(llm: Any, rows: int, context: int, steps: int, policies: dict[str, Any],
                 seed: int) -> dict[str, dict[str, float]]:
    """policy -> {"step": ms, part: ms, ...}: medians over `steps` decode steps each (the
    first two dropped) of `rows` requests decoding together, the policies taking turns."""
    from kvloop import SamplingParams

    engine, model = llm.engine, llm.runner.model
    rng = random.Random(f"steps:{seed}:{rows}")
    vocab = llm.runner.vocab_size
    first = min(1000, vocab // 2)             # past the special tokens, as kvloop.bench.offline
    tokens = (steps + 2) * len(policies) + 2
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    requests = []
    for i in range(rows):
        prompt = [rng.randrange(first, vocab) for _ in range(context)]
        requests.append(engine.make_request(f"steps-{rows}-{i}-{time.monotonic_ns()}", prompt,
                                            params))
        engine.add_request(requests[-1])
    saved = model.low_bit
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in policies}
    try:
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in requests):
            engine.step()                                  # the prefills
        with timed_parts(llm) as timers:
            names = list(policies)
            for k in range((steps + 2) * len(names)):
                if not engine.has_unfinished_requests():
                    break
                name = names[k % len(names)]
                model.low_bit = policies[name]
                timers.seconds.clear()
                timers.on = True
                start = time.perf_counter()
                engine.step()
                total = time.perf_counter() - start
                timers.on = False
                samples[name].append({"step": total, **timers.seconds})
    finally:
        model.low_bit = saved
        while engine.has_unfinished_requests():
            engine.step()
    return {name: _medians(runs[2:] or runs) for name, runs in samples.items()}


def _medians(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = ("step", *PARTS)
    return {k: statistics.median(r.get(k, 0.0) for r in runs) * 1e3 for k in keys}


def report(figures: dict[int, dict[str, dict[str, float]]], context: int) -> str:
    head = f"| rows | policy | step ms | {' | '.join(PARTS)} | engine |"
    lines = [f"Decode steps over {context}-token prompts (medians, ms)", "", head,
             "|" + "---|" * (len(PARTS) + 4)]
    for rows, by_policy in figures.items():
        for name, f in by_policy.items():
            parts = " | ".join(f"{f[p]:.2f}" for p in PARTS)
            lines.append(f"| {rows} | {name} | {f['step']:.2f} | {parts} | "
                         f"{f['step'] - f['forward']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from kvloop import LLM

    llm = LLM(args.model, seed=args.seed)
    runner: Any = llm.runner
    policies = {START_UP: runner.model.low_bit, **dict(map(parse_policy, args.policy))}
    print(f"start-up policy: {policies[START_UP]}", flush=True)
    figures = {rows: measure_rows(llm, rows, args.context, args.steps, policies, args.seed)
               for rows in (int(r) for r in args.rows.split(","))}
    print(report(figures, args.context))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump({"context": args.context, "policies": {k: str(v) for k, v in
                                                             policies.items()},
                       "figures": figures}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
