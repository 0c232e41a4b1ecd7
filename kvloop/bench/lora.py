"""LoRA benchmark: decode throughput with 0, 1, 4 and 8 adapters in the batch, offline.

    python -m kvloop.bench.lora [--model PATH] [--adapters 0,1,4,8] [--rank 16]
                                [--num-requests 16] [--output-len 64] [--input-len 64] ...

One `LLM` (the model loaded once, `--enable-lora` with `max_loras` = the largest count) runs
the same requests once per count n: with n = 0 every request uses the base model, else the
requests take adapters 1..n in turn, so every step mixes n adapters. Adapters are random PEFT
folders of rank `--rank` on every target module (q/k/v/o/gate/up/down), written to a
temporary folder (no download, no peft needed). Each run starts with an empty prefix cache
and reports output tokens / wall time and its ratio to the base model's.

Run it on a quiet machine: on a shared one the figures measure the neighbours.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass
class Result:
    adapters: int
    output_tokens: int
    seconds: float
    tok_per_s: float
    vs_base: float = 1.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvloop.bench.lora", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: cores)")
    p.add_argument("--adapters", default="0,1,4,8", help="adapter counts to compare")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--write-adapter", default=None, metavar="DIR",
                   help="only write one random (untrained) PEFT adapter of --rank for --model "
                        "into DIR and exit: a folder to try --lora-modules with")
    args = p.parse_args(argv)
    try:
        args.adapters = [int(x) for x in args.adapters.split(",")]
    except ValueError:
        p.error(f"--adapters expects comma-separated integers, got {args.adapters!r}")
    if min(args.adapters) < 0 or args.rank < 1 or args.num_requests < 1:
        p.error("--adapters >= 0, --rank >= 1, --num-requests >= 1")
    return args


def write_random_adapter(folder: Path, config: Any, rank: int, seed: int) -> Path:
    """A PEFT adapter folder for `config` (a `kvloop.model.loader.ModelConfig`): rank
    `rank` on every target module, small random A and B (so outputs change, stay sane)."""
    import torch
    from safetensors.torch import save_file

    from kvloop.model.lora import (
        ADAPTER_CONFIG,
        ADAPTER_WEIGHTS,
        ATTN_PARTS,
        TARGET_MODULES,
        module_shapes,
    )

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (out_f, in_f) in module_shapes(config).items():
            block = "self_attn" if module in (*ATTN_PARTS, "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / ADAPTER_WEIGHTS))
    (folder / ADAPTER_CONFIG).write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
         "target_modules": list(TARGET_MODULES), "bias": "none"}))
    return folder


def run(args: argparse.Namespace) -> list[Result]:
    from kvloop import LLM, LoRARequest, SamplingParams

    most = max(max(args.adapters), 1)
    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads, seed=args.seed,
              enable_lora=True, max_loras=most, max_lora_rank=args.rank,
              max_num_seqs=args.num_requests)
    try:
        vocab = llm.runner.vocab_size   # type: ignore[attr-defined]
        rng = random.Random(args.seed)
        prompts = [{"prompt_token_ids": [rng.randrange(min(1000, vocab // 2), vocab)
                                         for _ in range(args.input_len)]}
                   for _ in range(args.num_requests)]
        sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        with tempfile.TemporaryDirectory(prefix="kvloop-lora-bench-") as tmp:
            config = llm.runner.config   # type: ignore[attr-defined]
            loras = [LoRARequest(f"bench-{i}", i + 1, str(write_random_adapter(
                Path(tmp) / f"a{i}", config, args.rank, args.seed + i))) for i in range(most)]
            llm.generate(prompts[:1], sp, use_tqdm=False, lora_request=loras[0])   # warm-up
            results = [_one(llm, prompts, sp, loras, n) for n in args.adapters]
    finally:
        llm.shutdown()
    base = next((r.tok_per_s for r in results if r.adapters == 0), None)
    for r in results:
        r.vs_base = r.tok_per_s / base if base else float("nan")
    return results


def _one(llm: Any, prompts: list[dict[str, Any]], sp: Any, loras: list[Any], n: int
         ) -> Result:
    llm.engine.reset_prefix_cache()
    per_prompt = [None if n == 0 else loras[i % n] for i in range(len(prompts))]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=per_prompt)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return Result(n, tokens, seconds, tokens / seconds)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.write_adapter:
        from kvloop.model.loader import load_model

        folder = write_random_adapter(Path(args.write_adapter), load_model(args.model).config,
                                      args.rank, args.seed)
        print(f"a random rank-{args.rank} PEFT adapter in {folder}: "
              f"kvloop serve --enable-lora --lora-modules NAME={folder}")
        return 0
    results = run(args)
    print(f"{'adapters':>8} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'vs base':>8}")
    for r in results:
        print(f"{r.adapters:>8} {r.output_tokens:>7} {r.seconds:>8.2f} {r.tok_per_s:>8.1f} "
              f"{r.vs_base:>8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
