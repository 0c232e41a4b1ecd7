"""The quantized KV cache (`--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2 | int8`): its format,
its two ops (write, decode attention) and their pure-torch twins.

Format. A quantized layer cache is one uint8 tensor `[2, kv_heads, num_blocks, block_size,
head_dim + 4]`: each row (one token's K or V of one KV head) holds `head_dim` one-byte codes
(int8, or fp8 as `torch.float8_e4m3fn` / `torch.float8_e5m2` bits) and then its fp32 scale;
the value is `code * scale`, with `scale = max|x| / QMAX` over the row (127 for int8, 448
for e4m3, 57344 for e5m2), so the row's largest element maps to the code range's end.

Why a scale per row (per token and KV head) rather than per block and head:
- a row is written once, whole, when its token is computed, and never changes: no block
  is ever re-quantized as tokens are appended to it, so a block's bytes are final as soon as
  it is full (prefix caching, tiers and P/D transfer hash and move them as they are), and
  one token's outlier never coarsens its block's other 15 tokens;
- the cost is 4 bytes per `head_dim` codes (6% at head_dim 64), and dequantizing is one
  multiply per key in the attention kernel (q . (scale * codes) = scale * (q . codes)).
Keeping the scale in the row (not in a separate tensor) keeps a block one slice of one
tensor, so `kv_store`, the tiers and the P/D transfer move it with no new code.

int8 rows are rotated first (where head_dim is a power of two): the stored codes are those of
`x @ H`, H the normalized Walsh-Hadamard matrix (orthogonal and symmetric, so `x = (x @ H)
@ H`). Keys often have a few channels far larger than the rest; one scale per row then leaves
the small channels a handful of codes, and the rotation spreads every channel over all of
them. Attention needs no un-rotation of keys (`q . k = (q @ H) . (k @ H)`: the
kernel rotates the query once) and one of the output (`sum p v = (sum p (v @ H)) @ H`).
Measured on the embedded model (docs/cpu-performance.md): it halves int8's mean logprob
error; fp8 (floating point, 3 or 2 mantissa bits at any magnitude) gains nothing from it and
is stored as is.

Where each kind of attention reads the cache: decodes through `decode_attention`, which
dequantizes inside the kernel (the C++ op `kvq_decode_attention`, csrc/attn_kvq.cpp; no
dequantized copy of the cache); prefill chunks gather the request's rows and dequantize
that copy (the same gather the unquantized path makes) and, unlike the unquantized path,
a first chunk reads its own K/V back from the cache too, so a token attends to the same
(quantized) values whether its prefix was computed now, cached, loaded from a tier or
transferred from a prefill engine.

The C++ ops are registered by csrc/attn_kvq.cpp in the CPU ops' build (kvloop.model.cpu_ops)
under the build's name in `torch.ops`; the twins here serve where it is absent and are the
tests' oracle.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from kvloop.config import KV_SCALE_BYTES, quantized_kv_row_bytes, resolve_kv_cache_dtype
from kvloop.model import cpu_ops


@dataclass(frozen=True)
class KVQuant:
    """One quantized KV cache format (module docstring)."""

    name: str                 # a `QUANTIZED_KV_CACHE_DTYPES` entry
    code_dtype: torch.dtype   # how a code's byte reads
    qmax: float               # the largest code magnitude used
    kind: int                 # the C++ ops' id of the format
    rotated: bool             # rows rotated by H before quantizing (head_dim a power of 2)

    def row_bytes(self, head_dim: int) -> int:
        return quantized_kv_row_bytes(head_dim)

    def rotates(self, head_dim: int) -> bool:
        return self.rotated and head_dim > 0 and head_dim & (head_dim - 1) == 0


FORMATS = {
    "int8": KVQuant("int8", torch.int8, 127.0, 1, True),
    "fp8_e4m3": KVQuant("fp8_e4m3", torch.float8_e4m3fn, 448.0, 2, False),
    "fp8_e5m2": KVQuant("fp8_e5m2", torch.float8_e5m2, 57344.0, 3, False),
}


@functools.lru_cache(maxsize=8)
def hadamard(n: int) -> torch.Tensor:
    """The normalized n x n Walsh-Hadamard matrix (Sylvester's order; n a power of two):
    H[i, j] = (-1)^popcount(i & j) / sqrt(n)."""
    i = torch.arange(n)
    bits = torch.bitwise_and(i[:, None], i[None, :])
    parity = torch.zeros(n, n, dtype=torch.long)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return (1 - 2 * parity).float() / n ** 0.5


def kv_quant_for(kv_cache_dtype: str) -> KVQuant | None:
    """The format `--kv-cache-dtype` names; None for "auto" (the activations' dtype)."""
    return FORMATS.get(resolve_kv_cache_dtype(kv_cache_dtype))


def kv_row_bytes(quant: KVQuant | None, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one cache row (one token's K or V of one KV head) in the cache's format."""
    if quant is None:
        return head_dim * torch.empty((), dtype=dtype).element_size()
    return quant.row_bytes(head_dim)


# --- the ops: the extension where built, else the twins ------------------------------------
def _ops(device: torch.device) -> Any:
    module = cpu_ops.load() if device.type == "cpu" else None
    if module is None:
        return None
    return getattr(torch.ops, module.__name__, None)


def rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                   heads: int, kv_heads: int, quant: KVQuant) -> None:
    """`cpu_ops.rope_and_cache` into a quantized cache: RoPE on q and k of `qkv`
    [T, (H + 2K) * D] in place, then k and v quantized into their rows at `slots`."""
    ops = _ops(qkv.device)
    if ops is not None:
        ops.kvq_rope_and_cache(qkv, positions, cos, sin, kv_cache, slots, heads, kv_heads,
                               quant.kind)
    else:
        torch_rope_and_cache(qkv, positions, cos, sin, kv_cache, slots, heads, kv_heads, quant)


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, quant: KVQuant) -> torch.Tensor:
    """`cpu_ops.decode_attention` over a quantized cache: q [R, H, D] -> [R, H * D]."""
    ops = _ops(q.device)
    if ops is not None:
        return ops.kvq_decode_attention(  # type: ignore[no-any-return]
            q, kv_cache, block_table, seq_lens, scale, quant.kind)
    return torch_decode_attention(q, kv_cache, block_table, seq_lens, scale, quant)


# --- the pure-torch twins -------------------------------------------------------------------
def quantize_rows(x: torch.Tensor, quant: KVQuant) -> torch.Tensor:
    """x [..., D] (any float dtype) -> rows [..., D + 4] uint8: codes (of x @ H where the
    format rotates), then the fp32 scale."""
    x = x.float()
    if quant.rotates(x.shape[-1]):
        x = x @ hadamard(x.shape[-1]).to(x.device)
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = amax / quant.qmax
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    y = (x * inv).clamp(-quant.qmax, quant.qmax)
    codes = y.round().to(torch.int8) if quant.code_dtype == torch.int8 else y.to(quant.code_dtype)
    return torch.cat((codes.view(torch.uint8), scale.view(torch.uint8)), dim=-1)


def dequantize_rows(rows: torch.Tensor, quant: KVQuant, dtype: torch.dtype) -> torch.Tensor:
    """rows [..., D + 4] uint8 -> values [..., D] in `dtype` (code * scale in fp32, rotated
    back where the format rotates)."""
    dim = rows.shape[-1] - KV_SCALE_BYTES
    codes = rows[..., :dim].contiguous().view(quant.code_dtype).float()
    scale = rows[..., dim:].contiguous().view(torch.float32)
    values = codes * scale
    if quant.rotates(dim):
        values = values @ hadamard(dim).to(values.device)
    return values.to(dtype)


def torch_rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                         heads: int, kv_heads: int, quant: KVQuant) -> None:
    row = kv_cache.shape[-1]
    rows = cpu_ops.torch_rope(qkv, positions, cos, sin, heads, kv_heads, row - KV_SCALE_BYTES)
    k = quantize_rows(rows[:, heads:heads + kv_heads], quant)      # [T, K, D + 4]
    v = quantize_rows(rows[:, heads + kv_heads:], quant)
    kv_cache[0].view(kv_heads, -1, row).index_copy_(1, slots, k.transpose(0, 1))
    kv_cache[1].view(kv_heads, -1, row).index_copy_(1, slots, v.transpose(0, 1))


def torch_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float,
                           quant: KVQuant) -> torch.Tensor:
    reqs, heads, dim = q.shape
    kv_heads = kv_cache.shape[1]
    row = kv_cache.shape[-1]
    group = heads // kv_heads
    ids = block_table.reshape(-1)
    keys = dequantize_rows(kv_cache[0].index_select(1, ids), quant, torch.float32)
    values = dequantize_rows(kv_cache[1].index_select(1, ids), quant, torch.float32)
    keys = keys.view(kv_heads, reqs, -1, dim)                                  # [K, R, L, D]
    values = values.view(kv_heads, reqs, -1, dim)
    assert row == dim + KV_SCALE_BYTES
    length = keys.shape[2]
    query = q.view(reqs, kv_heads, group, dim).transpose(0, 1).float()        # [K, R, G, D]
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale               # [K, R, G, L]
    beyond = torch.arange(length) >= seq_lens.view(1, reqs, 1, 1)
    probs = torch.softmax(scores.masked_fill(beyond, float("-inf")), dim=-1)
    out = torch.matmul(probs, values)                                          # [K, R, G, D]
    return out.transpose(0, 1).reshape(reqs, heads * dim).to(q.dtype)


def gather_dequantized(cache: torch.Tensor, slots: torch.Tensor, quant: KVQuant,
                       dtype: torch.dtype) -> torch.Tensor:
    """cache [kv_heads, num_blocks, block_size, D + 4] (one of K, V); slots [n] -> the rows
    at those slots dequantized, [kv_heads, n, D] in `dtype` (a prefill chunk's keys)."""
    kv_heads, _, _, row = cache.shape
    return dequantize_rows(cache.reshape(kv_heads, -1, row).index_select(1, slots), quant, dtype)
