
"""Speculative decoding benchmark: n-gram and suffix drafts against plain decoding, offline.

    python -m kvloop.bench.spec [--model PATH] [--methods ngram,suffix] [--ks 0,2,4]
                                [--concurrency 1,8] [--workloads copy,chat,random]
                                [--num-requests 16] ...

For each workload, concurrency c, method and k (0: no speculation, run once), one engine
(`LLM.from_runner` over one loaded model, `max_num_seqs` = c, so at most c requests decode
together) runs the same requests, greedy with EOS ignored, and reports:

- output tok/s: output tokens / wall time of the whole run;
- acceptance: accepted / drafted tokens, and the mean acceptance length (1 + accepted per
  draft, vLLM's figure), from `LLM.get_metrics()`;
- passes: output tokens - accepted drafts, the model's token-emitting passes summed over
  the requests (what speculation saves, independent of the machine's load);
- speedup over k = 0 at the same workload and concurrency;
- whether every output equals k = 0's token for token (greedy speculation must not change
  them; a "no" is a bug, or a near-tie that batching flips).

Methods: `ngram` (prompt lookup, `--prompt-lookup-min/max`) and `suffix` (suffix decoding
with vLLM's defaults: trees of depth 24 over the request and the last 10,000 responses; k is
its maximum draft length). Workloads: `copy` asks the model to repeat or lightly edit a
paragraph of real text that is in its prompt (chat template applied), cycling through 4
paragraphs under 3 instructions, so the output repeats the prompt and earlier answers, as
an agent loop repeats tool output (repetitive); `chat` asks open-ended questions (16, each
once up to --num-requests 16), with nothing to copy (non-repetitive); `random` is random
token ids in (a small model's greedy answer to noise tends to loop, so its drafts do
match). Prompts are the same for every run, so the prefix cache and suffix decoding's
global tree start empty each time (a fresh engine each time).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

from kvloop.bench.cli_args import HelpFormatter

PARAGRAPHS = (
    "The harbour town wakes before the sun. Fishing boats slide out past the stone "
    "breakwater while the bakery on the corner pulls its first loaves from the oven, and "
    "the smell of bread drifts down to the quay where gulls wait on the railings for "
    "whatever the night crews leave behind.",
    "To repot a houseplant, water it a day ahead, choose a pot one size larger with a "
    "drainage hole, loosen the roots gently, set the plant at the same depth as before, "
    "fill around it with fresh soil, press lightly, and water again until it drains.",
    "The committee met on Tuesday to review the budget for the new library wing. After a "
    "long discussion about heating costs and the price of shelving, members agreed to "
    "delay the decision until the architect sends revised drawings next month.",
    "A good bicycle check takes five minutes: squeeze both brakes, spin each wheel to see "
    "that it runs true, press the tyres to feel their pressure, look at the chain for "
    "rust, and make sure the saddle and handlebars are tight before you ride.",
)
INSTRUCTIONS = (
    "Repeat the following paragraph exactly, word for word:\n\n{text}",
    "Rewrite the following paragraph, changing only the first sentence:\n\n{text}",
    "Correct any mistakes in this paragraph and return the whole paragraph:\n\n{text}",
)


METHODS = ("ngram", "suffix")
WORKLOADS = ("copy", "chat", "random")
QUESTIONS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold.",
    "What are three good habits for staying healthy while working from home?",
    "Describe the water cycle to a ten-year-old.",
    "Give me some ideas for a birthday party for a seven-year-old who loves dinosaurs.",
    "Why do leaves change colour in autumn?",
    "Write a polite email asking a neighbour to trim a tree that blocks the sun.",
    "What is the difference between weather and climate?",
    "Suggest a three-day itinerary for a first visit to Lisbon.",
    "How does a bicycle stay upright when it moves?",
    "Write a haiku about a rainy Monday morning.",
    "What should I pack for a weekend of camping in the mountains?",
    "Explain what a budget is and why a family might keep one.",
    "Describe the taste of a ripe mango to someone who has never had one.",
    "What are the pros and cons of learning to play the piano as an adult?",
    "Tell me about the history of the printing press in a few paragraphs.",
)


@dataclass
class Result:
    workload: str
    concurrency: int
    method: str      # "-" for k = 0
    k: int
    output_tokens: int
    seconds: float
    tok_per_s: float
    drafted: int
    accepted: int
    acceptance_rate: float
    mean_acceptance_length: float
    passes: int = 0   # token-emitting passes over all requests: output tokens - accepted
    speedup: float = 1.0
    same_as_k0: bool = True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvloop.bench.spec", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: cores)")
    p.add_argument("--methods", default="ngram,suffix", help="ngram, suffix")
    p.add_argument("--ks", default="0,2,4", help="num_speculative_tokens values (0: off)")
    p.add_argument("--concurrency", default="1,8", help="max_num_seqs values")
    p.add_argument("--workloads", default="copy,chat,random", help=", ".join(WORKLOADS))
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--input-len", type=int, default=256, help="random workload's prompts")
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=5)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="KV blocks (default: from the KV cache size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    args.ks = _ints(p, "--ks", args.ks)
    args.concurrency = _ints(p, "--concurrency", args.concurrency)
    args.workloads = args.workloads.split(",")
    args.methods = args.methods.split(",")
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad or min(args.ks) < 0 or min(args.concurrency) < 1:
        p.error(f"--workloads takes {', '.join(WORKLOADS)}; --ks >= 0; --concurrency >= 1")
    if [m for m in args.methods if m not in METHODS]:
        p.error(f"--methods takes {', '.join(METHODS)}")
    return args


def _ints(p: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        p.error(f"{flag} expects comma-separated integers, got {text!r}")
        raise


def copy_prompts(tokenizer: Any, n: int, max_len: int) -> list[list[int]]:
    """`n` chat prompts asking to repeat or edit a paragraph (cycling through the pairs),
    each paragraph shortened by whole words until the prompt has at most `max_len` tokens."""
    pairs = [(i, t) for i in INSTRUCTIONS for t in PARAGRAPHS]
    prompts = []
    for j in range(n):
        instruction, text = pairs[j % len(pairs)]
        words = text.split()
        ids = _encode(tokenizer, instruction.format(text=text))
        while len(ids) > max_len and len(words) > 1:
            words = words[:max(1, len(words) - 5)]
            ids = _encode(tokenizer, instruction.format(text=" ".join(words)))
        prompts.append(ids)
    return prompts


def _encode(tokenizer: Any, content: str) -> list[int]:
    """The chat prompt of one user message (plain text without a chat template)."""
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer.encode(content))
    chat = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                         add_generation_prompt=True)
    return list(tokenizer.encode(chat, add_special_tokens=False))


def chat_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    """`n` open-ended chat questions (cycling through `QUESTIONS`): nothing to copy."""
    return [_encode(tokenizer, QUESTIONS[j % len(QUESTIONS)]) for j in range(n)]


def workload_prompts(workload: str, runner: Any, tokenizer: Any,
                     args: argparse.Namespace) -> list[list[int]]:
    if workload == "copy":
        return copy_prompts(tokenizer, args.num_requests,
                            runner.max_model_len - args.output_len - 1)
    if workload == "chat":
        return chat_prompts(tokenizer, args.num_requests)
    return random_prompts(runner.vocab_size, args.num_requests, args.input_len, args.seed)


def random_prompts(vocab_size: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    low = min(1000, vocab_size // 2)
    return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(n)]


def speculative(method: str, k: int, args: argparse.Namespace) -> Any:
    """The engine's SpeculativeConfig for (method, k); None for k = 0."""
    from kvloop.config import SpeculativeConfig

    if not k:
        return None
    if method == "suffix":
        return SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": k})
    return SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=args.prompt_lookup_min,
                             prompt_lookup_max=args.prompt_lookup_max)


def run_one(runner: Any, tokenizer: Any, args: argparse.Namespace, prompts: list[list[int]],
            concurrency: int, method: str, k: int) -> tuple[Result, list[list[int]]]:
    """One engine, one workload, one (concurrency, method, k): the result and every output."""
    from kvloop import LLM, SamplingParams
    from kvloop.llm import engine_config

    spec = speculative(method, k, args)
    config = engine_config(runner.max_model_len,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           max_num_seqs=concurrency, speculative=spec, log_stats=True)
    llm = LLM.from_runner(runner, tokenizer, config, runner.num_gpu_blocks)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    metrics = {m.name: m for m in llm.get_metrics()}
    drafts = getattr(metrics.get("vllm:spec_decode_num_drafts"), "value", 0)
    drafted = getattr(metrics.get("vllm:spec_decode_num_draft_tokens"), "value", 0)
    accepted = getattr(metrics.get("vllm:spec_decode_num_accepted_tokens"), "value", 0)
    n_out = sum(len(t) for t in tokens)
    return Result(workload="", concurrency=concurrency, method=method if k else "-", k=k,
                  output_tokens=n_out,
                  seconds=seconds, tok_per_s=n_out / seconds if seconds > 0 else 0.0,
                  drafted=drafted, accepted=accepted,
                  acceptance_rate=accepted / drafted if drafted else 0.0,
                  mean_acceptance_length=1 + accepted / drafts if drafts else 1.0,
                  passes=n_out - accepted), tokens


def run_all(runner: Any, tokenizer: Any, args: argparse.Namespace) -> list[Result]:
    results = []
    for workload in args.workloads:
        prompts = workload_prompts(workload, runner, tokenizer, args)
        for c in args.concurrency:
            results.extend(run_concurrency(runner, tokenizer, args, prompts, c, workload))
    return results


def run_concurrency(runner: Any, tokenizer: Any, args: argparse.Namespace,
                    prompts: list[list[int]], c: int, workload: str) -> list[Result]:
    """k = 0 first (when asked for), then every method at every k > 0, each compared with
    the first run."""
    cases = [("-", 0)] if 0 in args.ks else []
    cases += [(m, k) for m in args.methods for k in sorted(args.ks) if k]
    results: list[Result] = []
    base: tuple[Result, list[list[int]]] | None = None
    for method, k in cases:
        res, tokens = run_one(runner, tokenizer, args, prompts, c, method, k)
        res.workload = workload
        if base is None:
            base = (res, tokens)
        else:
            res.speedup = res.tok_per_s / base[0].tok_per_s if base[0].tok_per_s else 0
            res.same_as_k0 = tokens == base[1]
        results.append(res)
    return results


def report(results: list[Result], setup: dict[str, Any]) -> str:
    lines = [" ".join(f"{k}={v}" for k, v in setup.items()),
             f"{'workload':<9}{'conc':>5}{'method':>7}{'k':>3}{'out tok/s':>11}{'speedup':>9}"
             f"{'accept':>8}{'mean len':>10}{'drafted':>9}{'passes':>8}{'same':>6}"]
    for r in results:
        lines.append(f"{r.workload:<9}{r.concurrency:>5}{r.method:>7}{r.k:>3}"
                     f"{r.tok_per_s:>11.1f}"
                     f"{r.speedup:>8.2f}x{100 * r.acceptance_rate:>7.1f}%"
                     f"{r.mean_acceptance_length:>10.2f}{r.drafted:>9}{r.passes:>8}"
                     f"{'yes' if r.same_as_k0 else 'NO':>6}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from kvloop.config import RunnerConfig
    from kvloop.front.tokenizer import Tokenizer
    from kvloop.model import load_runner

    runner: Any = load_runner(RunnerConfig(model=args.model, dtype=args.dtype, seed=args.seed,
                                           num_threads=args.threads,
                                           num_gpu_blocks_override=args.num_gpu_blocks_override))
    tokenizer = Tokenizer.from_model(args.model)
    setup = {"model": runner.model_name, "dtype": str(runner.dtype).removeprefix("torch."),
             "threads": torch.get_num_threads(), "requests": args.num_requests,
             "output_len": args.output_len,
             "lookup": f"{args.prompt_lookup_min}-{args.prompt_lookup_max}"}
    warm = argparse.Namespace(**{**vars(args), "output_len": 2})
    run_one(runner, tokenizer, warm, copy_prompts(tokenizer, 1, runner.max_model_len - 3), 1,
            args.methods[0], max(args.ks))
    results = run_all(runner, tokenizer, args)
    print(report(results, setup))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"setup": setup, "results": [asdict(r) for r in results]}, f, indent=1)


if __name__ == "__main__":
    main()
