"""Quantized weights kept quantized: GGUF's 4-bit and 8-bit blocks as torch matmul operands.

Scope: turn a GGUF tensor's raw blocks into the operands of torch's built-in weight-only
matmuls, and run them; which matmul a step uses is `llama.Linear`'s choice.

- 4-bit (Q4_0, Q4_1, Q4_K): every group of 32 weights along a row is `q * scale + offset`
  with q in 0..15 (Q4_0: scale d, offset -8d; Q4_1: scale d, offset m; Q4_K: per 32-weight
  sub-block scale d * sc and offset -dmin * mn, from the super-block's 6-bit codes). That is
  what kvloop's own kernel (`cpu_ops.q4_matmul`: for 1-2 rows int16 activations per group
  and integer dot products, as llama.cpp's Q4 x Q8 but finer; from 3 rows the groups
  dequantized to fp32 in registers against fp32 rows) runs, and exactly the group-32
  asymmetric format of `aten._weight_int4pack_mm_for_cpu`, `x @ ((q - 8) * scale + zero).T`
  with zero = offset + 8 * scale (used where kvloop's CPU ops are not built): the GGUF's
  own nibbles either way, no re-quantization of the weights.
- 8-bit (Q8_0, used for the tied embedding / LM head): kvloop's kernel
  (`cpu_ops.q8_matmul`) runs the file's int8 values and per-32 scales, reordered once at
  load into blocks of 16 output columns (`q8_column_blocks`: the columns in vector lanes);
  torch's
  `aten._weight_int8pack_mm` (the fallback) has one scale per output row, so there the rows
  are re-quantized (at most half a per-row step off the file's values).

`kvloop.model.gguf.unpack_q4` reads (q, scale, offset) out of the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvloop.model import cpu_ops
from kvloop.model.gguf import GROUP, INT4_TYPES, INT8_TYPES, RawTensor, unpack_q4, unpack_q8

# Activations enter torch's low-bit CPU kernels in bf16: their fast path (the fp32 one is
# scalar, ~100x slower on these shapes).
KERNEL_DTYPE = torch.bfloat16

KERNELS = ("kvloop", "torch")


class _QuantWeight:
    """What both low-bit weights share: shape, activation dtype, the kernel (validated:
    "kvloop" only where kvloop's CPU ops are built; default: kvloop's where built) and the
    tensors the kernel reads."""

    tensors: tuple[torch.Tensor, ...]

    def __init__(self, shape: torch.Size, dtype: torch.dtype, kernel: str | None, bits: int):
        self.out_features, self.in_features = shape
        self.dtype = dtype
        self._ops = cpu_ops.load()
        self.kernel = kernel or ("kvloop" if self._ops is not None else "torch")
        if self.kernel not in KERNELS or (self.kernel == "kvloop" and self._ops is None):
            raise ValueError(f"{bits}-bit kernel {self.kernel!r} is not available")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


class Int4Weight(_QuantWeight):
    """W [out, in] as 4-bit groups of 32 with a scale and offset each: `matmul(x)` = x @ W.T.

    Two kernels: "kvloop" (`cpu_ops.q4_matmul`, the default where kvloop's CPU ops are
    built: the GGUF's byte layout, fp32 scale and offset; 1-2 rows of activations quantized
    to int16 per group with integer dot products, more rows in fp32 against weights
    dequantized in registers, or on AVX512_BF16 with `bf16_x` 3+ rows rounded to bf16
    against the nibbles; any activation dtype) and "torch"
    (`aten._weight_int4pack_mm_for_cpu`: torch's packing, bf16 scale, zero and activations).

    `tensors`: the kernel's operands. On kvloop's, `rows` (qs, scale, offset in the GGUF's
    layout) and then `blocks`: with `bf16_x` where the CPU's kernel variant has the block
    kernel (`cpu_ops.has_q4_block_kernel`), the same weight a second time in column blocks
    (`q4_column_blocks`), which its bf16 rows then read; else none.
    """

    blocks: tuple[torch.Tensor, ...] = ()

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                 dtype: torch.dtype = KERNEL_DTYPE, kernel: str | None = None,
                 bf16_x: bool = False):
        """q uint8 [out, in] (0..15); scale, offset fp32 [out, in / 32]. `bf16_x`: kvloop's
        kernel may round fp32 x to bf16 at the rows its bf16 kernels take (3+ on AVX512_BF16;
        `Precision.low_bit_bf16_x`)."""
        super().__init__(q.shape, dtype, kernel, 4)
        self.bf16_x = bf16_x
        if self.kernel == "kvloop":
            groups = q.view(self.out_features, -1, 2, GROUP // 2)       # [out, G, 2, 16]
            self.rows = ((groups[:, :, 0] | (groups[:, :, 1] << 4)).reshape(
                self.out_features, -1).contiguous(), scale.contiguous(), offset.contiguous())
            if bf16_x and self._ops.has_q4_block_kernel():
                self.blocks = q4_column_blocks(*self.rows, self._ops.q4_block_columns)
            self.tensors = self.rows + self.blocks
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            zero = offset + 8.0 * scale
            self.tensors = (packed, torch.stack([scale.t(), zero.t()], dim=-1).to(dtype)
                            .contiguous())

    @classmethod
    def from_raw(cls, parts: list[RawTensor], dtype: torch.dtype = KERNEL_DTYPE,
                 kernel: str | None = None, bf16_x: bool = False) -> Int4Weight:
        """Rows of several raw tensors stacked (a fused QKV or gate/up projection)."""
        unpacked = [unpack_q4(p) for p in parts]
        q, scale, offset = (torch.from_numpy(np.concatenate([u[i] for u in unpacked]))
                            for i in range(3))
        return cls(q, scale, offset, dtype, kernel, bf16_x)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] (any float dtype) -> [T, out] in x's dtype."""
        if self.kernel == "kvloop":
            return self._ops.q4_matmul(x.contiguous(), *self.rows, bf16_x=self.bf16_x,
                                       blocks=self.blocks)
        packed, scales_and_zeros = self.tensors
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(self.dtype), packed, GROUP,
                                                       scales_and_zeros)
        return y.to(x.dtype)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T] int64: each row's argmax of `matmul(x)` (the first of equal
        maxima), exactly; on kvloop's kernel without writing the row whole
        (`cpu_ops.q4_matmul_argmax`)."""
        if self.kernel == "kvloop":
            return self._ops.q4_matmul_argmax(x.contiguous(), *self.rows,
                                              bf16_x=self.bf16_x)[0]
        return self.matmul(x).argmax(dim=-1)

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in fp32 as the kernel sees it (for tests)."""
        eye = torch.eye(self.in_features, dtype=torch.float32 if self.kernel == "kvloop"
                        else self.dtype)
        return self.matmul(eye).float().t().contiguous()


class Int8Weight(_QuantWeight):
    """W [out, in] as int8 groups of 32 with a scale each (Q8_0): `matmul(x)` = x @ W.T.

    Kernels: "kvloop" (`cpu_ops.q8_matmul`: the file's int8 values and scales, exactly, in
    `q8_column_blocks` order; int16 activations per group) or "torch"
    (`aten._weight_int8pack_mm`, one scale per row: the rows re-quantized, round(w / s) with
    s = max|w| / 127 rounded up to a bf16 number, at most half a step off the file's values).
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = KERNEL_DTYPE,
                 kernel: str | None = None):
        """q int8 [out, in]; scale fp32 [out, in / 32]."""
        super().__init__(q.shape, dtype, kernel, 8)
        if self.kernel == "kvloop":
            self.tensors = q8_column_blocks(q, scale.float(), self._ops.q8_block_columns)
        else:
            self.tensors = _per_row_int8(q.float() * scale.float().repeat_interleave(GROUP, 1),
                                         dtype)

    @classmethod
    def from_raw(cls, raw: RawTensor, dtype: torch.dtype = KERNEL_DTYPE,
                 kernel: str | None = None) -> Int8Weight:
        q, scale = unpack_q8(raw)
        return cls(torch.from_numpy(q), torch.from_numpy(scale), dtype, kernel)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "kvloop":
            return self._ops.q8_matmul(x.contiguous(), *self.tensors, self.out_features)
        q, scale = self.tensors
        return torch.ops.aten._weight_int8pack_mm(x.to(self.dtype), q, scale).to(x.dtype)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T] int64: each row's argmax of `matmul(x)` (the first of equal
        maxima), exactly; on kvloop's kernel without writing the row whole
        (`cpu_ops.q8_matmul_argmax`: greedy decoding's LM head)."""
        if self.kernel == "kvloop":
            return self._ops.q8_matmul_argmax(x.contiguous(), *self.tensors,
                                              self.out_features)[0]
        return self.matmul(x).argmax(dim=-1)

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in fp32 as the kernel holds it (for tests)."""
        if self.kernel == "kvloop":
            blocks, block_scales = self.tensors
            q, scale = q8_from_column_blocks(blocks, block_scales, self.out_features,
                                             self._ops.q8_block_columns)
            return q.float() * scale.repeat_interleave(GROUP, 1)
        q, scale = self.tensors
        return q.float() * scale.float()[:, None]


def q4_column_blocks(qs: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, columns: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit qs uint8 [N, K / 2] (nibble byte i of a group: weights i and i + 16), scale and
    offset fp32 [N, K / 32] in the layout of kvloop's block kernel (csrc/kernels.h,
    `kQ4Columns`): N padded with zero rows to whole blocks of `columns` output columns; per
    block, group and nibble byte, that byte of every column of the block side by side ->
    (qs [N', K / 2], scale [N', K / 32], offset [N', K / 32]); the same bytes as many."""
    qs, scale, offset = _padded_to_blocks(columns, qs, scale, offset)
    rows, half = qs.shape
    blocks = qs.view(-1, columns, half // (GROUP // 2), GROUP // 2).permute(0, 2, 3, 1)
    return (blocks.reshape(rows, half).contiguous(), _scale_blocks(scale, columns),
            _scale_blocks(offset, columns))


def q8_column_blocks(q: torch.Tensor, scale: torch.Tensor, columns: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """q int8 [N, K] and scale fp32 [N, K / 32] in the layout of kvloop's 8-bit kernel
    (csrc/kernels.h, `kQ8Columns`): N padded with zero rows to whole blocks of `columns`
    output columns; per block, group and pair of k, the pair of every column of the block
    side by side -> (q [N', K], scale [N', K / 32]), N' = N padded; the same bytes as many."""
    q, scale = _padded_to_blocks(columns, q, scale)
    rows, k = q.shape
    blocks = q.view(-1, columns, k // GROUP, GROUP // 2, 2).permute(0, 2, 3, 1, 4)
    return blocks.reshape(rows, k).contiguous(), _scale_blocks(scale, columns)


def _padded_to_blocks(columns: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each of `tensors` [N, ...] with zero rows appended up to a whole number of blocks of
    `columns` output columns."""
    pad = -tensors[0].shape[0] % columns
    if not pad:
        return tensors
    return tuple(torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) for t in tensors)


def _scale_blocks(scale: torch.Tensor, columns: int) -> torch.Tensor:
    """Per-group values [N', G] (N' whole blocks of `columns`) laid out per block and group,
    the block's columns side by side: as [N' / columns, G, columns], out[b, g, j] =
    scale[b * columns + j, g]; returned [N', G]."""
    rows, groups = scale.shape
    return scale.view(-1, columns, groups).permute(0, 2, 1).reshape(rows, groups).contiguous()


def q8_from_column_blocks(q: torch.Tensor, scale: torch.Tensor, n: int, columns: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """`q8_column_blocks`' inverse: (q [n, K], scale [n, K / 32])."""
    padded, k = q.shape
    blocks = q.view(-1, k // GROUP, GROUP // 2, columns, 2).permute(0, 3, 1, 2, 4)
    scales = scale.view(-1, k // GROUP, columns).permute(0, 2, 1)
    return blocks.reshape(padded, k)[:n], scales.reshape(padded, -1)[:n]


def _per_row_int8(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(q int8 [out, in], scale [out] in `dtype`): symmetric per row, the scale rounded up in
    `dtype` so no |q| passes 127."""
    exact = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    scale = (exact * (1 + 2.0 ** -7)).to(dtype)
    q = torch.round(weight / scale.float()[:, None]).clamp_(-127, 127)
    return q.to(torch.int8).contiguous(), scale


LowBitWeight = Int4Weight | Int8Weight


def low_bit_supported(device: torch.device) -> bool:
    """torch's weight-only 4-bit and 8-bit matmuls run on this device (CPU builds)."""
    return (device.type == "cpu"
            and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
            and hasattr(torch.ops.aten, "_weight_int8pack_mm"))


def low_bit_weight(parts: list[RawTensor | None], device: torch.device,
                   bf16_x: bool = False) -> LowBitWeight | None:
    """The low-bit copy of a weight made of `parts` stacked by rows: 4-bit when every part
    is a 4-bit type (`bf16_x`: Int4Weight's), 8-bit for a single Q8_0 tensor; None
    otherwise (or off this device)."""
    if not parts or any(p is None for p in parts) or not low_bit_supported(device):
        return None
    raws = [p for p in parts if p is not None]
    if all(r.kind in INT4_TYPES for r in raws):
        return Int4Weight.from_raw(raws, bf16_x=bf16_x)
    if len(raws) == 1 and raws[0].kind in INT8_TYPES:
        return Int8Weight.from_raw(raws[0])
    return None


def rehome_low_bit(weights: list[LowBitWeight]) -> None:
    """Move the CPU tensors of every weight into one buffer of 2 MiB pages
    (`cpu_ops.huge_page_copies`: a decode step streams them all); same values."""
    copies = iter(cpu_ops.huge_page_copies([t for w in weights for t in w.tensors]))
    for w in weights:
        w.tensors = tuple(next(copies) for _ in w.tensors)


@dataclass(frozen=True)
class LowBitPolicy:
    """Which steps use the low-bit weights: the decoder layers when the step has at most
    `max_tokens` tokens, the LM head when at most `max_logits_rows` rows sample (0: never);
    a step of decodes alone (one token per request) with at most `max_decode_tokens` tokens
    runs every layer fused (`llama.FusedDecode`, low-bit; None: as `max_tokens` says)."""

    max_tokens: int = 0
    max_logits_rows: int = 0
    max_decode_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 0 or self.max_logits_rows < 0 or (self.max_decode_tokens or 0) < 0:
            raise ValueError("low-bit thresholds must be >= 0")

    def layers(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_tokens

    def head(self, num_rows: int) -> bool:
        return num_rows <= self.max_logits_rows

    def fused_decode(self, num_tokens: int) -> bool:
        limit = self.max_tokens if self.max_decode_tokens is None else self.max_decode_tokens
        return num_tokens <= limit
