"""How good is each precision path: the perplexity of a shipped text, per `--dtype` and per
`--kv-cache-dtype`, and the greedy answers to 24 chat questions per KV cache dtype.

    python -m kvloop.bench.quality [--dtypes auto,float32,bfloat16] [--ctx 512]
                                   [--kv-cache-dtypes int8,fp8_e4m3,fp8_e5m2] [--skip-chat]
                                   [--skip-hf] [--skip-llamacpp] [--json-out F]

The text (`kvloop/bench/data/quality_text.txt`, written for this repository) is tokenized
once with the model's tokenizer and cut into windows of `--ctx` tokens, as llama.cpp's
`llama-perplexity` cuts it: in each window the first half is context only and every token of
the second half is scored by the log-probability the model gives it after all the tokens
before it in the window. Perplexity is exp of the mean negative log-probability over every
scored token. The sides:

- kvloop, once per `--dtype` (its default settings otherwise: the low-bit weights where the
  start-up crossover picks them), through vLLM's `prompt_logprobs` (so any path can be
  measured from outside the same way, also over HTTP);
- Hugging Face transformers, fp32, on the same GGUF (the ground truth: every other side's
  mean |log-probability difference| per scored token is against it);
- kvloop once per `--kv-cache-dtypes` entry, with `--dtype float32` (`KV_BASE_DTYPE`), so
  the quantized cache is all that differs from the `float32` side;
- llama.cpp's `llama-perplexity` on the same GGUF and text, from the build
  `python -m kvloop.bench.llamacpp build` made (skipped, and said so, when there is none);
  it tokenizes the text itself.

The chat set (`data/chat_questions.json`, unless `--skip-chat`): each question alone, greedy,
`CHAT_TOKENS` tokens, dense fp32 weights (`low_bit_max_tokens` 0: no start-up crossover
differs between runs), once on the unquantized cache (the fp32 path) and once per KV cache
dtype: how many answers equal the fp32 path's, and how many leading tokens they keep.

A benchmark script, not a test: it checks nothing and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

TEXT = Path(__file__).parent / "data" / "quality_text.txt"
CHAT_QUESTIONS = Path(__file__).parent / "data" / "chat_questions.json"
CHAT_TOKENS = 32
DEFAULT_DTYPES = ("auto", "float32", "bfloat16")
DEFAULT_KV_CACHE_DTYPES = ("int8", "fp8_e4m3", "fp8_e5m2")
KV_BASE_DTYPE = "float32"
LLAMA_PPL = re.compile(r"Final estimate: PPL = ([0-9.]+)")


@dataclass(frozen=True)
class Window:
    """One window of the text: its tokens, and the index of the first scored token."""

    tokens: list[int]
    first_scored: int

    def targets(self) -> list[int]:
        return self.tokens[self.first_scored:]


@dataclass
class Side:
    """One measured side: its name, perplexity, how many tokens it scored, the mean
    |log-probability difference| per token against transformers fp32 (None: not comparable)
    and the seconds it took."""

    name: str
    perplexity: float
    scored: int
    mean_abs_diff: float | None
    seconds: float


def windows(tokens: list[int], ctx: int) -> list[Window]:
    """Whole windows of `ctx` tokens, the second half of each scored (llama-perplexity's
    rule; a tail shorter than a window is dropped, as there)."""
    return [Window(tokens[s:s + ctx], ctx // 2) for s in range(0, len(tokens) - ctx + 1, ctx)]


def perplexity(logprobs: Sequence[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


@dataclass
class ChatSide:
    """One KV cache dtype on the chat set: answers equal to the fp32 path's, of how many, and
    the leading tokens kept (summed over the questions) of how many."""

    kv_cache_dtype: str
    equal: int
    questions: int
    tokens_kept: int
    tokens: int


def kvloop_logprobs(dtype: str, wins: list[Window], kv_cache_dtype: str = "auto") -> list[float]:
    """The scored tokens' log-probabilities on kvloop's `dtype` path (prompt_logprobs)."""
    from kvloop import LLM, SamplingParams

    llm = LLM(dtype=dtype, device="cpu", kv_cache_dtype=kv_cache_dtype)
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        outs = llm.generate([{"prompt_token_ids": w.tokens} for w in wins], params,
                            use_tqdm=False)
        out: list[float] = []
        for w, o in zip(wins, outs, strict=True):
            entries = o.prompt_logprobs or []
            out += [entries[i][t].logprob  # type: ignore[index]
                    for i, t in enumerate(w.tokens) if i >= w.first_scored]
        return out
    finally:
        llm.shutdown()


def chat_answers(kv_cache_dtype: str) -> list[list[int]]:
    """Greedy answers (token ids) to the chat questions, each alone, on the dense fp32 path
    with `kv_cache_dtype`."""
    from kvloop import LLM, SamplingParams

    llm = LLM(dtype=KV_BASE_DTYPE, device="cpu", low_bit_max_tokens=0,
              kv_cache_dtype=kv_cache_dtype)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=CHAT_TOKENS)
        out = []
        for question in json.loads(CHAT_QUESTIONS.read_text(encoding="utf-8")):
            conversation = [{"role": "user", "content": question}]
            done = llm.chat(conversation, params, use_tqdm=False)
            out.append(list(done[0].outputs[0].token_ids))
        return out
    finally:
        llm.shutdown()


def leading_equal(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two answers share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def measure_chat(kv_cache_dtypes: Sequence[str]) -> list[ChatSide]:
    reference = chat_answers("auto")
    sides = []
    for name in kv_cache_dtypes:
        got = chat_answers(name)
        sides.append(ChatSide(
            name, sum(a == b for a, b in zip(got, reference, strict=True)), len(reference),
            sum(leading_equal(a, b) for a, b in zip(got, reference, strict=True)),
            sum(len(b) for b in reference)))
    return sides


def hf_logprobs(gguf: str, wins: list[Window]) -> list[float]:
    """The same on transformers fp32 (the ground truth)."""
    import torch

    from kvloop.bench.hf_server import load_model

    model, _ = load_model(gguf, "fp32")
    out: list[float] = []
    with torch.no_grad():
        for w in wins:
            logits = model(torch.tensor([w.tokens])).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)
            out += [float(lp[i - 1, t]) for i, t in enumerate(w.tokens) if i >= w.first_scored]
    return out


def llamacpp_perplexity(build_dir: str, gguf: str, ctx: int, threads: int) -> float | None:
    """`llama-perplexity`'s final estimate, or None without a build (said on stderr)."""
    from kvloop.bench.llamacpp import BuildPaths

    binary = BuildPaths(Path(build_dir).expanduser()).binary("llama-perplexity")
    if not binary.is_file():
        print(f"no {binary}: run `python -m kvloop.bench.llamacpp build` (10+ minutes) for "
              "llama.cpp's figure", file=sys.stderr)
        return None
    done = subprocess.run([str(binary), "-m", gguf, "-f", str(TEXT), "-c", str(ctx),
                           "-t", str(threads), "-b", str(ctx)], capture_output=True,
                          text=True, timeout=1200, check=False)
    found = LLAMA_PPL.search(done.stdout + done.stderr)
    return float(found.group(1)) if found else None


def mean_abs_diff(a: Sequence[float], b: Sequence[float] | None) -> float | None:
    if b is None or len(a) != len(b):
        return None
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def measure(args: argparse.Namespace) -> list[Side]:
    from kvloop.front.tokenizer import load_vocabulary
    from kvloop.locate import find_model_path

    gguf = find_model_path(args.model)
    tokenizer = load_vocabulary(gguf).tokenizer
    wins = windows(tokenizer.encode(TEXT.read_text(encoding="utf-8")), args.ctx)
    if not wins:
        raise SystemExit(f"the text has fewer than --ctx {args.ctx} tokens")
    sides: list[Side] = []
    truth: list[float] | None = None
    if not args.skip_hf:
        start = time.perf_counter()
        truth = hf_logprobs(gguf, wins)
        sides.append(Side("transformers fp32", perplexity(truth), len(truth), 0.0,
                          time.perf_counter() - start))
    for dtype in args.dtypes.split(","):
        start = time.perf_counter()
        lps = kvloop_logprobs(dtype, wins)
        sides.append(Side(f"kvloop --dtype {dtype}", perplexity(lps), len(lps),
                          mean_abs_diff(lps, truth), time.perf_counter() - start))
    for name in _kv_cache_dtypes(args):
        start = time.perf_counter()
        lps = kvloop_logprobs(KV_BASE_DTYPE, wins, name)
        sides.append(Side(f"kvloop --dtype {KV_BASE_DTYPE} --kv-cache-dtype {name}",
                          perplexity(lps), len(lps), mean_abs_diff(lps, truth),
                          time.perf_counter() - start))
    if not args.skip_llamacpp:
        start = time.perf_counter()
        ppl = llamacpp_perplexity(args.build_dir, gguf, args.ctx, args.threads)
        if ppl is not None:
            scored = len(wins) * (args.ctx - args.ctx // 2 - 1)
            sides.append(Side("llama.cpp llama-perplexity", ppl, scored, None,
                              time.perf_counter() - start))
    return sides


def _kv_cache_dtypes(args: argparse.Namespace) -> list[str]:
    return [n for n in args.kv_cache_dtypes.split(",") if n]


def chat_table(sides: list[ChatSide]) -> str:
    lines = [f"the chat set ({CHAT_QUESTIONS.name}), greedy, {CHAT_TOKENS} tokens, each question "
             f"alone, --dtype {KV_BASE_DTYPE} dense, against the same path on the unquantized "
             "cache", "",
             "| --kv-cache-dtype | answers equal | leading tokens kept |", "|---|---|---|"]
    lines += [f"| {s.kv_cache_dtype} | {s.equal} / {s.questions} | {s.tokens_kept} / "
              f"{s.tokens} |" for s in sides]
    return "\n".join(lines)


def table(sides: list[Side], ctx: int) -> str:
    lines = [f"perplexity of kvloop/bench/data/quality_text.txt, windows of {ctx} tokens, "
             "the second half of each scored", "",
             "| side | perplexity | tokens scored | mean abs logprob diff vs transformers fp32 "
             "| seconds |", "|---|---|---|---|---|"]
    for s in sides:
        diff = "-" if s.mean_abs_diff is None else f"{s.mean_abs_diff:.4f}"
        lines.append(f"| {s.name} | {s.perplexity:.3f} | {s.scored} | {diff} | "
                     f"{s.seconds:.1f} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from kvloop.bench.llamacpp import DEFAULT_BUILD_DIR

    p = argparse.ArgumentParser(prog="python -m kvloop.bench.quality", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", help="GGUF file (default: the embedded model)")
    p.add_argument("--dtypes", default=",".join(DEFAULT_DTYPES),
                   help="kvloop --dtype values to measure, comma-separated")
    p.add_argument("--kv-cache-dtypes", default=",".join(DEFAULT_KV_CACHE_DTYPES),
                   help=f"kvloop --kv-cache-dtype values to measure (with --dtype "
                        f"{KV_BASE_DTYPE}), comma-separated; '' for none")
    p.add_argument("--skip-chat", action="store_true",
                   help="no chat-set comparison of the KV cache dtypes")
    p.add_argument("--ctx", type=int, default=512, help="window length in tokens")
    p.add_argument("--threads", type=int, default=2, help="llama-perplexity's threads")
    p.add_argument("--build-dir", default=DEFAULT_BUILD_DIR, help="llama.cpp's build folder")
    p.add_argument("--skip-hf", action="store_true", help="no transformers side")
    p.add_argument("--skip-llamacpp", action="store_true", help="no llama.cpp side")
    p.add_argument("--json-out", help="also write the figures as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.ctx < 4:
        raise SystemExit("--ctx must be at least 4")
    sides = measure(args)
    print(table(sides, args.ctx))
    chat = [] if args.skip_chat else measure_chat(_kv_cache_dtypes(args))
    if chat:
        print()
        print(chat_table(chat))
    if args.json_out:
        figures = {"perplexity": [asdict(s) for s in sides], "chat": [asdict(c) for c in chat]}
        Path(args.json_out).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
