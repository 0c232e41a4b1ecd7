"""Quantized weights kept quantized: GGUF's 4-bit and 8-bit blocks as torch matmul operands.

Scope: turn a GGUF tensor's raw blocks into the operands of torch's built-in weight-only
matmuls, and run them; which matmul a step uses is `llama.Linear`'s choice.

- 4-bit (Q4_0, Q4_1, Q4_K): every group of 32 weights along a row is `q * scale + offset`
  with q in 0..15 (Q4_0: scale d, offset -8d; Q4_1: scale d, offset m; Q4_K: per 32-weight
  sub-block scale d * sc and offset -dmin * mn, from the super-block's 6-bit codes). That is
  exactly the group-32 asymmetric format of `aten._weight_int4pack_mm_for_cpu`, which computes
  `x @ ((q - 8) * scale + zero).T` with zero = offset + 8 * scale: the GGUF's own nibbles are
  used, no re-quantization. `Int4Weight` holds the packed nibbles and the scales and zeros in
  the activation dtype (bf16: the kernel's fast path on CPU; its fp32 path is scalar).
- 8-bit (Q8_0, used for the tied embedding / LM head): Q8_0 scales each 32 weights, torch's
  `aten._weight_int8pack_mm` one scale per output row, so the dequantized rows are
  re-quantized per row (round(w / s), s = max|w| / 127): at most half a per-row step off the
  file's values; the fidelity test (8 chat prompts, greedy, top-5 rule) covers it.

`kvloop.model.gguf.unpack_q4` reads (q, scale, offset) out of the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvloop.model.gguf import GROUP, INT4_TYPES, INT8_TYPES, RawTensor, dequantize_raw, unpack_q4

# Activations enter torch's low-bit CPU kernels in bf16: their fast path (the fp32 one is
# scalar, ~100x slower on these shapes).
KERNEL_DTYPE = torch.bfloat16

class Int4Weight:
    """W [out, in] as packed nibbles + per-group (scale, zero): `matmul(x)` = x @ W.T."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                 dtype: torch.dtype = KERNEL_DTYPE):
        """q uint8 [out, in] (0..15); scale, offset fp32 [out, in / 32]."""
        self.out_features, self.in_features = q.shape
        self.dtype = dtype
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        zero = offset + 8.0 * scale
        self.scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()

    @classmethod
    def from_raw(cls, parts: list[RawTensor], dtype: torch.dtype = KERNEL_DTYPE
                 ) -> Int4Weight:
        """Rows of several raw tensors stacked (a fused QKV or gate/up projection)."""
        unpacked = [unpack_q4(p) for p in parts]
        q, scale, offset = (torch.from_numpy(np.concatenate([u[i] for u in unpacked]))
                            for i in range(3))
        return cls(q, scale, offset, dtype)

    @property
    def nbytes(self) -> int:
        return (self.packed.numel() * self.packed.element_size()
                + self.scales_and_zeros.numel() * self.scales_and_zeros.element_size())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] (any float dtype) -> [T, out] in x's dtype."""
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(self.dtype), self.packed, GROUP,
                                                       self.scales_and_zeros)
        return y.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in fp32 as the kernel sees it (for tests)."""
        eye = torch.eye(self.in_features, dtype=self.dtype)
        return self.matmul(eye).float().t().contiguous()


class Int8Weight:
    """W [out, in] as int8 with one scale per row: `matmul(x)` = x @ W.T."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype = KERNEL_DTYPE):
        """weight: float [out, in], quantized per row (round to nearest, symmetric) with the
        scale as the kernel holds it (in `dtype`, rounded up so no |q| passes 127)."""
        w = weight.float()
        exact = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        self.scale = (exact * (1 + 2.0 ** -7)).to(dtype)
        q = torch.round(w / self.scale.float()[:, None]).clamp_(-127, 127)
        self.q = q.to(torch.int8).contiguous()
        self.out_features, self.in_features = self.q.shape
        self.dtype = dtype

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.to(self.dtype), self.q, self.scale)
        return y.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale.float()[:, None]


LowBitWeight = Int4Weight | Int8Weight


def low_bit_supported(device: torch.device) -> bool:
    """torch's weight-only 4-bit and 8-bit matmuls run on this device (CPU builds)."""
    return (device.type == "cpu"
            and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
            and hasattr(torch.ops.aten, "_weight_int8pack_mm"))


def low_bit_weight(parts: list[RawTensor | None], device: torch.device) -> LowBitWeight | None:
    """The low-bit copy of a weight made of `parts` stacked by rows: 4-bit when every part
    is a 4-bit type, 8-bit for a single Q8_0 tensor; None otherwise (or off this device)."""
    if not parts or any(p is None for p in parts) or not low_bit_supported(device):
        return None
    raws = [p for p in parts if p is not None]
    if all(r.kind in INT4_TYPES for r in raws):
        return Int4Weight.from_raw(raws)
    if len(raws) == 1 and raws[0].kind in INT8_TYPES:
        return Int8Weight(torch.from_numpy(dequantize_raw(raws[0])))
    return None


@dataclass(frozen=True)
class LowBitPolicy:
    """Which steps use the low-bit weights: the decoder layers when the step has at most
    `max_tokens` tokens, the LM head when at most `max_logits_rows` rows sample (0: never)."""

    max_tokens: int = 0
    max_logits_rows: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 0 or self.max_logits_rows < 0:
            raise ValueError("low-bit thresholds must be >= 0")

    def layers(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_tokens

    def head(self, num_rows: int) -> bool:
        return num_rows <= self.max_logits_rows
