
"""Offline benchmark: kvloop's engine against Hugging Face transformers on the same weights.

    python -m kvloop.bench.offline [--model PATH] [--dtype auto] [--repeats 3] ...

Prints, for each side, in one run (medians over `--repeats` runs of each figure):
- prefill tok/s: one prompt of `--prefill-len` (512) tokens, time to its first token;
- single-stream decode tok/s: one request, `--decode-tokens` (128) tokens after the first;
- throughput: `--num-requests` (64) requests of `--input-len` (256) random tokens in and
  `--output-len` (128) out, output tokens per second of wall time;
then the kvloop / transformers ratio of each (`--skip-throughput` leaves the third out;
`--json-out FILE` also writes the figures as JSON). transformers runs `LlamaForCausalLM` built from
kvloop's own dequantized weights, in the same dtype, with `generate()` (greedy, EOS ignored;
its throughput figure is one batch of all requests, all the same length). Both models stay
loaded and the runs alternate (kvloop, HF, kvloop, HF...), so drifting load on a shared
machine hits both sides alike. Prompts are random token ids, fresh for every run, so no
prefix-cache hit flatters kvloop.

`--kv-cache-dtype` runs kvloop's side with that KV cache. `--kv-decode-sweep auto,int8,...`
instead measures only single-stream decode tok/s per KV cache dtype after a random prompt of
each `--sweep-contexts` length (512 and 4,096: the long one is where reading the KV cache
dominates a decode step), one engine per dtype, medians of `--repeats`, and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from kvloop.bench.cli_args import HelpFormatter


@dataclass
class Figures:
    prefill: float
    decode: float
    throughput: float | None   # None: not measured (--skip-throughput)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvloop.bench.offline", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: cores)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes")
    p.add_argument("--skip-hf", action="store_true", help="kvloop figures only")
    p.add_argument("--skip-throughput", action="store_true",
                   help="prefill and single-stream decode only")
    p.add_argument("--kv-cache-dtype", default="auto", help="kvloop's KV cache dtype")
    p.add_argument("--kv-decode-sweep", default="",
                   help="comma-separated KV cache dtypes: measure decode tok/s per dtype "
                        "and context length only (default: off)")
    p.add_argument("--sweep-contexts", default="512,4096",
                   help="context lengths of --kv-decode-sweep, comma-separated")
    p.add_argument("--json-out", help="write the setup and the figures as JSON here")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def median_of(repeats: int, fn: Callable[[], float]) -> float:
    return statistics.median(fn() for _ in range(repeats))


class PromptMaker:
    """Fresh random prompts (token ids in [1000, vocab), past the special tokens; the upper
    half of a tiny test model's vocabulary), so prefix caching never hits."""

    def __init__(self, vocab_size: int, seed: int):
        import random

        self.rng = random.Random(seed)
        self.vocab = vocab_size
        self.first = min(1000, vocab_size // 2)

    def __call__(self, length: int) -> list[int]:
        return [self.rng.randrange(self.first, self.vocab) for _ in range(length)]


# --- kvloop ---------------------------------------------------------------------------------
def kvloop_measures(args: argparse.Namespace, llm: Any,
                    prompts: PromptMaker) -> dict[str, Callable[[], float]]:
    """One callable per figure; each call is one fresh measurement."""
    from kvloop import SamplingParams

    def prefill() -> float:
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate({"prompt_token_ids": prompts(args.prefill_len)}, params, use_tqdm=False)
        return args.prefill_len / (time.perf_counter() - t0)

    def decode() -> float:
        return _kvloop_decode_rate(llm, prompts(16), args.decode_tokens)

    def throughput() -> float:
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        batch = [{"prompt_token_ids": prompts(args.input_len)}
                 for _ in range(args.num_requests)]
        t0 = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        return args.num_requests * args.output_len / (time.perf_counter() - t0)

    _kvloop_decode_rate(llm, prompts(16), 4)  # warm-up
    return {"prefill": prefill, "decode": decode, "throughput": throughput}


def _kvloop_decode_rate(llm: Any, prompt: list[int], tokens: int) -> float:
    """Tokens per second after the first token, stepping the engine directly."""
    from kvloop import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True)
    engine.add_request(engine.make_request(f"bench-decode-{time.monotonic_ns()}", prompt,
                                           params))
    engine.step()                                         # prefill + first token
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return tokens / (time.perf_counter() - t0)


# --- Hugging Face transformers ----------------------------------------------------------------
_HF_REBUILT = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM"}


def build_hf_model(model: str | None, dtype: Any) -> Any:
    """A Hugging Face folder: transformers' own model of it (any family it knows); a GGUF
    file: LlamaForCausalLM (or Qwen2/Mistral) with kvloop's dequantized weights."""
    import transformers

    from kvloop.model.loader import load_model, resolve_model_path

    path = resolve_model_path(model)
    if not path.endswith(".gguf"):
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        return hf_model.eval().requires_grad_(False)
    loaded = load_model(model)
    cfg = loaded.config
    if cfg.architecture not in _HF_REBUILT:
        raise ValueError(f"the transformers side rebuilds only {', '.join(_HF_REBUILT)} "
                         f"from a GGUF file, not {cfg.architecture}: pass the Hugging Face "
                         "folder, or --skip-hf")
    cls_name = _HF_REBUILT[cfg.architecture]
    config_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    hf_config = config_cls(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, pad_token_id=0)
    hf = getattr(transformers, cls_name)(hf_config)
    weights = {k: v for k, v in loaded.weights.items() if k != "rope_freq_factors"}
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise RuntimeError(f"weights do not fit transformers: missing={missing}, "
                           f"unexpected={unexpected}")
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    return hf.to(dtype).eval().requires_grad_(False)


def hf_measures(args: argparse.Namespace, hf: Any,
                prompts: PromptMaker) -> dict[str, Callable[[], float]]:
    import torch

    def generate(batch: list[list[int]], new_tokens: int) -> None:
        ids = torch.tensor(batch)
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

    def prefill() -> float:
        t0 = time.perf_counter()
        generate([prompts(args.prefill_len)], 1)
        return args.prefill_len / (time.perf_counter() - t0)

    def decode() -> float:
        prompt = prompts(16)
        t0 = time.perf_counter()
        generate([prompt], 1)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        generate([prompt], args.decode_tokens + 1)
        return args.decode_tokens / max(time.perf_counter() - t0 - first, 1e-9)

    def throughput() -> float:
        t0 = time.perf_counter()
        generate([prompts(args.input_len) for _ in range(args.num_requests)], args.output_len)
        return args.num_requests * args.output_len / (time.perf_counter() - t0)

    generate([prompts(16)], 4)  # warm-up
    return {"prefill": prefill, "decode": decode, "throughput": throughput}


def measure(args: argparse.Namespace, sides: list[dict[str, Callable[[], float]]]
            ) -> list[Figures]:
    """Medians of `repeats` runs per figure; the sides alternate run by run, so a change in
    the machine's load hits both alike."""
    keys = ("prefill", "decode") if args.skip_throughput else ("prefill", "decode", "throughput")
    results: list[dict[str, list[float]]] = [{} for _ in sides]
    for key in keys:
        for _ in range(args.repeats):
            for side, out in zip(sides, results, strict=True):
                out.setdefault(key, []).append(side[key]())
    return [Figures(statistics.median(r["prefill"]), statistics.median(r["decode"]),
                    statistics.median(r["throughput"]) if "throughput" in r else None)
            for r in results]


# --- report ---------------------------------------------------------------------------------
def report(args: argparse.Namespace, setup: dict[str, Any], ours: Figures,
           theirs: Figures | None) -> str:
    lines = [f"model {setup['model']}  dtype {setup['dtype']}  threads {setup['threads']}  "
             f"KV blocks {setup['blocks']}  budget {args.max_num_batched_tokens}  "
             f"repeats {args.repeats} (medians)",
             f"{'figure':<44}{'kvloop':>10}{'HF':>10}{'ratio':>8}"]
    rows = [(f"prefill tok/s ({args.prefill_len}-token prompt)", "prefill"),
            (f"single-stream decode tok/s ({args.decode_tokens} tokens)", "decode"),
            (f"output tok/s ({args.num_requests} x {args.input_len} in / "
             f"{args.output_len} out)", "throughput")]
    for label, key in rows:
        ours_v = getattr(ours, key)
        if ours_v is None:
            continue
        if theirs is None:
            lines.append(f"{label:<44}{ours_v:>10.1f}{'-':>10}{'-':>8}")
        else:
            theirs_v = getattr(theirs, key)
            lines.append(f"{label:<44}{ours_v:>10.1f}{theirs_v:>10.1f}"
                         f"{ours_v / theirs_v:>7.2f}x")
    return "\n".join(lines)


def kv_decode_sweep(args: argparse.Namespace) -> dict[str, dict[int, float]]:
    """Decode tok/s per KV cache dtype and context length (medians of `repeats`); each
    prompt is prefilled in one step (the budget covers the longest), then timed from its
    first token."""
    from kvloop import LLM

    contexts = [int(c) for c in args.sweep_contexts.split(",")]
    rates: dict[str, dict[int, float]] = {}
    for name in args.kv_decode_sweep.split(","):
        llm = LLM(args.model, dtype=args.dtype, seed=args.seed,
                  max_num_batched_tokens=max(args.max_num_batched_tokens, max(contexts) + 16),
                  kv_cache_memory=args.kv_cache_memory, num_threads=args.threads,
                  kv_cache_dtype=name)
        try:
            rates[name] = _decode_rates(args, llm, contexts)
        finally:
            llm.shutdown()
    return rates


def _decode_rates(args: argparse.Namespace, llm: Any, contexts: list[int]) -> dict[int, float]:
    prompts = PromptMaker(llm.runner.vocab_size, args.seed)
    _kvloop_decode_rate(llm, prompts(16), 4)  # warm-up
    rates = {}
    for ctx in contexts:
        def rate(length: int = ctx) -> float:
            return _kvloop_decode_rate(llm, prompts(length), args.decode_tokens)
        rates[ctx] = median_of(args.repeats, rate)
    return rates


def sweep_report(args: argparse.Namespace, rates: dict[str, dict[int, float]]) -> str:
    contexts = next(iter(rates.values())).keys()
    lines = [f"single-stream decode tok/s ({args.decode_tokens} tokens), dtype {args.dtype}, "
             f"repeats {args.repeats} (medians)", "",
             "| --kv-cache-dtype | " + " | ".join(f"{c} context" for c in contexts) + " |",
             "|---|" + "---|" * len(contexts)]
    lines += [f"| {name} | " + " | ".join(f"{r[c]:.1f}" for c in contexts) + " |"
              for name, r in rates.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from kvloop import LLM

    if args.kv_decode_sweep:
        rates = kv_decode_sweep(args)
        print(sweep_report(args, rates))
        if args.json_out:
            with open(args.json_out, "w", encoding="utf-8") as f:
                json.dump({"threads": torch.get_num_threads(), "decode": rates}, f, indent=2)
                f.write("\n")
        return
    llm = LLM(args.model, dtype=args.dtype, seed=args.seed,
              max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory=args.kv_cache_memory, num_threads=args.threads,
              kv_cache_dtype=args.kv_cache_dtype)
    runner: Any = llm.runner
    prompts = PromptMaker(runner.vocab_size, args.seed)
    setup = {"model": runner.model_name, "dtype": str(runner.dtype).removeprefix("torch."),
             "threads": torch.get_num_threads(), "blocks": runner.num_gpu_blocks}
    sides = [kvloop_measures(args, llm, prompts)]
    if not args.skip_hf:
        sides.append(hf_measures(args, build_hf_model(args.model, runner.dtype), prompts))
    figures = measure(args, sides)
    print(report(args, setup, figures[0], figures[1] if len(figures) > 1 else None))
    if args.json_out:
        write_json(args.json_out, args, setup, figures)


def write_json(path: str, args: argparse.Namespace, setup: dict[str, Any],
               figures: list[Figures]) -> None:
    """{"setup": ..., "kvloop": {prefill, decode, throughput}, "hf": ... (when measured)};
    figures in tokens per second, None where not measured."""
    run = {k: getattr(args, k) for k in ("prefill_len", "decode_tokens", "repeats")}
    doc: dict[str, Any] = {"setup": {**setup, **run}, "kvloop": asdict(figures[0])}
    if len(figures) > 1:
        doc["hf"] = asdict(figures[1])
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
