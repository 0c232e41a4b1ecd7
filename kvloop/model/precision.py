"""What `--dtype` means for each tensor class of the model: one `Precision`, chosen once.

Scope: the choice, not the kernels. A `Precision` names three dtypes:

- `activations`: the residual stream, the norms and their weights, RoPE, attention scores
  and softmax, the embedding table, the LM head and the logits;
- `matmul`: the dense weights of the decoder layers and the rows of x entering them (a
  layer's output comes back in `activations`; the accumulators are fp32 in every kernel
  kvloop runs on CPU);
- `kv_cache`: the paged cache's values: `activations` (`--kv-cache-dtype auto`), or bf16
  beside fp32 activations (`--kv-cache-dtype bfloat16`, and `auto` on the mixed path below:
  half the bytes; RoPE's result is rounded as it is written, and every reader widens it
  exactly, so scores, softmax and P V stay fp32). A quantized cache (fp8, int8) is codes and
  scales instead (`kvloop.model.kv_quant`), whatever this says.

The 4-bit and 8-bit weights of a GGUF stay as stored whatever the dtype
(`kvloop.model.quant`); what enters their kernels is `activations`, except that where
`matmul` is bf16 a layer's 4-bit matmul may round fp32 x to bf16 at 3+ rows
(`low_bit_bf16_x`), as the dense layer matmuls round it.

`--dtype auto` on a CPU with bf16 dot products (AVX512_BF16, AMX, Arm BF16) is *mixed*: fp32
everywhere precision decides tokens, bf16 only inside the dense layer matmuls (the steps with
many tokens, where oneDNN's bf16 kernels are 1.5-2.5x faster than fp32) and in the KV cache
(`--kv-cache-dtype auto` there: half the bytes a decode reads; the same answers, measured);
on other CPUs fp32, the cache too.
Measured on the embedded model (docs/cpu-performance.md, "Precision"): all-bf16 kept 13 of 24
greedy chat answers of transformers fp32, mixed and fp32 kept all 24. `--dtype bfloat16` or
`float16` is vLLM's meaning, everything in that dtype: the user's explicit trade. On CUDA
`auto` is bf16 (fp16 where bf16 is not supported) everywhere, as vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvloop.config import DTYPE_ALIASES, check_dtype, resolve_kv_cache_dtype

DTYPES: dict[str, torch.dtype] = {alias: getattr(torch, name)
                                   for alias, name in DTYPE_ALIASES.items()}


@dataclass(frozen=True)
class Precision:
    """The dtypes of a model's tensor classes (module docstring)."""

    activations: torch.dtype
    matmul: torch.dtype
    kv_values: torch.dtype | None = None    # the cache's, where not `activations`

    @property
    def low_bit_bf16_x(self) -> bool:
        """Whether a decoder layer's 4-bit matmul may round fp32 x to bf16 at the rows its
        bf16 kernels take (3+ rows on AVX512_BF16: `bf16_x` of `cpu_ops.q4_matmul`): where
        the layer matmuls are bf16, whose dense kernels round the same x. Bf16 x takes those
        kernels as it is; under fp32 layer matmuls x is never rounded."""
        return self.matmul == torch.bfloat16

    @property
    def kv_cache(self) -> torch.dtype:
        return self.kv_values or self.activations

    @classmethod
    def uniform(cls, dtype: torch.dtype) -> Precision:
        return cls(dtype, dtype)

    def describe(self) -> str:
        """One phrase for the start-up log, e.g. "fp32, bf16 layer matmuls"."""
        parts = [_short(self.activations)]
        if self.matmul != self.activations:
            parts.append(f"{_short(self.matmul)} layer matmuls")
        if self.kv_cache != self.activations:
            parts.append(f"{_short(self.kv_cache)} KV cache")
        return ", ".join(parts)


def resolve_precision(dtype: str, device: torch.device,
                      kv_cache_dtype: str = "auto") -> Precision:
    """`--dtype` (vLLM's values) and `--kv-cache-dtype` on `device` -> the Precision (module
    docstring). ValueError for a bf16 cache beside fp16 activations (no kernel reads it)."""
    base = _resolve_activations(dtype, device)
    kv = resolve_kv_cache_dtype(kv_cache_dtype)
    if kv == "auto" and base.activations == torch.float32 and base.matmul == torch.bfloat16:
        kv = "bfloat16"             # the mixed path's cache: bf16 (module docstring)
    if kv != "bfloat16" or base.activations == torch.bfloat16:
        return base
    if base.activations != torch.float32:
        raise ValueError(f"--kv-cache-dtype bfloat16 needs fp32 or bf16 activations; --dtype "
                         f"{dtype} runs {_short(base.activations)} (use --kv-cache-dtype auto)")
    return Precision(base.activations, base.matmul, torch.bfloat16)


def _resolve_activations(dtype: str, device: torch.device) -> Precision:
    check_dtype(dtype)
    if dtype != "auto":
        return Precision.uniform(DTYPES[dtype])
    if device.type == "cuda":
        return Precision.uniform(torch.bfloat16 if torch.cuda.is_bf16_supported()
                                 else torch.float16)
    if cpu_has_native_bf16():
        return Precision(torch.float32, torch.bfloat16)
    return Precision.uniform(torch.float32)


def cpu_has_native_bf16() -> bool:
    """True when the CPU flags advertise bf16 dot products (x86 avx512_bf16/amx, Arm bf16)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            info = f.read()
    except OSError:
        return False
    flags: set[str] = set()
    for line in info.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        dtype, str(dtype))
