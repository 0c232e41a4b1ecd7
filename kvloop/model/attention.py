"""Paged attention over a flattened batch: K/V written by `slot_mapping` (the layer's
`cpu_ops.rope_and_cache`, before attention runs), read by block table.

The KV cache of one layer is one tensor `[2, num_kv_heads, num_blocks, block_size, head_dim]`
(K then V; head-major, so gathering a request's blocks with one `index_select` yields
`[kv_heads, tokens, head_dim]`, ready for batched matmuls with no transpose copy). Slot `s`
is token `s % block_size` of block `s // block_size`; block 0 is the engine's null block
(never holds live data, used as padding in block tables).

A step's tokens are laid out decodes first, then prefill chunks (vLLM's order):

    | d0 d1 ... d(D-1) | chunk 0 ......... | chunk 1 ... |
      one query token    q_len tokens of one request each,
      per request        after `context_len` computed ones

- decodes (q_len == 1) attend together in one `cpu_ops.decode_attention` call: keys and
  values read in place through a block table `[D, max_blocks]`, all query heads of a KV
  head at once (no repeat of K/V for GQA), fp32 softmax (CPU SDPA with a mask is 10-30x
  slower on these shapes; the op's pure-torch twin gathers the blocks into a padded copy);
- each prefill chunk attends in one `cpu_ops.prefill_attention` call: its keys, context
  and its own alike, read in place from the cache at `chunk_slots` (this step's
  `slot_mapping` without context, else its blocks'), lower-right causal (query i at position
  `context_len + i` sees keys up to it), flash style in C++ (key blocks, online softmax,
  tasks per KV head and query tile; no [q_len, keys] scores); its pure-torch twin gathers the
  keys and runs SDPA with the lower-right mask (SDPA's `is_causal` is top-left aligned,
  wrong once a prefix is cached).

Sliding-window layers (window W: a query at position p sees keys p-W+1..p, transformers'
rule) get their own metadata (their KV-cache group's block table, `kvloop.core.
kv_cache_groups`), whose tables begin at the first block a query of the step can see
(the blocks before it are freed by the KV cache manager):
- a chunk reads keys from `key_start` (a block boundary) and its query sees only the last
  W of them (`PrefillChunk.window`, the op's `window`; the twin's mask is
  `cpu_ops.prefill_mask`); a chunk no longer than W attends as a plain causal one;
- decodes whose keys all fit in the window use the C++ op as full attention does; once
  a row reaches past W the step's decodes run `windowed_decode_attention` (torch: gathered
  keys, rows masked from `decode_key_starts`), so the C++ op needs no window argument.

A bf16 cache beside fp32 activations (`--kv-cache-dtype bfloat16`) is written rounded by
the same ops and read widened (the C++ ops take the two dtypes); a prefill chunk reads its
own K and V back from the cache, rounded as the cache holds them, so a token sees the same
values whether its prefix was computed now or came from the prefix cache, a tier or a
prefill engine.

A quantized cache (`--kv-cache-dtype` fp8 or int8; `meta.kv_quant`, kvloop.model.kv_quant)
is written by `kv_quant.rope_and_cache` and read by `kv_quant.decode_attention` (dequantized
in the kernel); every prefill chunk, a first one too, reads its keys and values back from
the cache (dequantized), so a token sees the same values whether its prefix is computed now
or came from the prefix cache, a tier or a prefill engine. A model with sliding-window layers
keeps its KV unquantized, in the activations' dtype or bf16 (the windowed paths read the
cache as it is, widened).

Everything here is metadata built once per step by the runner (`AttentionMetadata`, one per
KV-cache group), shared by the layers of the group; there is no module-global state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvloop.model import cpu_ops, kv_quant
from kvloop.model.kv_quant import KVQuant


@dataclass
class PrefillChunk:
    """One request's chunk of more than one query token."""

    start: int                       # first token of the chunk in the flattened batch
    end: int                         # one past its last token
    context_len: int                 # tokens computed before this chunk (cached prefix)
    block_ids: torch.Tensor | None   # [num_blocks] covering context + chunk; None if no context
    key_start: int = 0               # position of the first key read (block-aligned)
    window: int = 0                  # sliding window W (a query sees the last W keys); 0: none


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, for every layer."""

    slot_mapping: torch.Tensor                   # [num_tokens] int64: where each token's K/V goes
    num_decodes: int = 0                         # the first num_decodes tokens are decodes
    decode_block_table: torch.Tensor | None = None  # [D, max_blocks] int64, rows 0-padded
    decode_seq_lens: torch.Tensor | None = None     # [D] int64: keys of each decode
    # sliding window past W: [D] int64, the first key of each row that its query sees (the
    # table's token index); None: every key up to seq_len (the C++ op)
    decode_key_starts: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    kv_quant: KVQuant | None = None                 # the cache's format (None: unquantized)


def rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                   heads: int, kv_heads: int) -> None:
    """RoPE on q and k of `qkv` in place, this step's K and V into `kv_cache` at
    `meta.slot_mapping`, in the cache's format."""
    if meta.kv_quant is None:
        cpu_ops.rope_and_cache(qkv, positions, cos, sin, kv_cache, meta.slot_mapping, heads,
                               kv_heads)
    else:
        kv_quant.rope_and_cache(qkv, positions, cos, sin, kv_cache, meta.slot_mapping, heads,
                                kv_heads, meta.kv_quant)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] (this step's, already written
    to `kv_cache`, where every path reads them: k and v themselves go unused). Returns
    [T, heads * head_dim]."""
    num_tokens, heads, head_dim = q.shape
    if meta.num_decodes == num_tokens:
        return _decode_attention(q, kv_cache, meta, scale)
    out = torch.empty(num_tokens, heads * head_dim, dtype=q.dtype, device=q.device)
    if meta.num_decodes:
        out[:meta.num_decodes] = _decode_attention(q[:meta.num_decodes], kv_cache, meta, scale)
    for chunk in meta.prefills:
        if meta.kv_quant is None:
            out[chunk.start:chunk.end] = cpu_ops.prefill_attention(
                q[chunk.start:chunk.end], kv_cache,
                chunk_slots(chunk, meta.slot_mapping, kv_cache.shape[3]), scale, chunk.window)
        else:
            out[chunk.start:chunk.end] = _quantized_chunk_attention(
                q, kv_cache, chunk, meta.slot_mapping, meta.kv_quant, scale)
    return out


def _decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float) -> torch.Tensor:
    """q: [D, heads, head_dim] -> [D, heads * head_dim]; one query per request."""
    assert meta.decode_block_table is not None and meta.decode_seq_lens is not None
    if meta.decode_key_starts is not None:
        return windowed_decode_attention(q, kv_cache, meta.decode_block_table,
                                         meta.decode_seq_lens, meta.decode_key_starts, scale)
    if meta.kv_quant is not None:
        return kv_quant.decode_attention(q.contiguous(), kv_cache, meta.decode_block_table,
                                         meta.decode_seq_lens, scale, meta.kv_quant)
    return cpu_ops.decode_attention(q.contiguous(), kv_cache, meta.decode_block_table,
                                    meta.decode_seq_lens, scale)


def windowed_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor,
                              block_table: torch.Tensor, seq_lens: torch.Tensor,
                              key_starts: torch.Tensor, scale: float) -> torch.Tensor:
    """q [D, H, hd]; row r attends to keys [key_starts[r], seq_lens[r]) of its table row
    -> [D, H * hd] (fp32 softmax)."""
    num_reqs, heads, head_dim = q.shape
    num_blocks = block_table.shape[1]
    keys = _gather(kv_cache[0], block_table.reshape(-1), num_reqs)     # [K*D, L, hd]
    values = _gather(kv_cache[1], block_table.reshape(-1), num_reqs)
    kv_heads = kv_cache.shape[1]
    length = num_blocks * kv_cache.shape[3]
    keys = keys.view(kv_heads, num_reqs, length, head_dim).transpose(0, 1)   # [D, K, L, hd]
    values = values.view(kv_heads, num_reqs, length, head_dim).transpose(0, 1)
    query = q.view(num_reqs, kv_heads, heads // kv_heads, head_dim).float()  # [D, K, G, hd]
    scores = torch.matmul(query, keys.float().transpose(2, 3)) * scale       # [D, K, G, L]
    index = torch.arange(length, device=q.device)
    visible = (index >= key_starts[:, None]) & (index < seq_lens[:, None])   # [D, L]
    scores.masked_fill_(~visible[:, None, None, :], float("-inf"))
    out = torch.matmul(scores.softmax(-1), values.float())                   # [D, K, G, hd]
    return out.to(q.dtype).reshape(num_reqs, heads * head_dim)


def chunk_slots(chunk: PrefillChunk, slot_mapping: torch.Tensor,
                block_size: int) -> torch.Tensor:
    """The cache slots of a chunk's keys, from `key_start` to its last token [n] (its own
    K and V last): this step's `slot_mapping` where it has no context, else its blocks'."""
    if chunk.context_len == 0:
        return slot_mapping[chunk.start:chunk.end]
    assert chunk.block_ids is not None
    total = chunk.context_len + (chunk.end - chunk.start) - chunk.key_start
    starts = chunk.block_ids.unsqueeze(1) * block_size
    slots = (starts + torch.arange(block_size, device=starts.device)).reshape(-1)
    return slots[:total]


def _quantized_chunk_attention(q: torch.Tensor, kv_cache: torch.Tensor, chunk: PrefillChunk,
                               slot_mapping: torch.Tensor, quant: KVQuant,
                               scale: float) -> torch.Tensor:
    """A prefill chunk over a quantized cache, as `cpu_ops.prefill_attention`'s twin: SDPA
    over the keys and values (context and chunk alike) read back from the cache and
    dequantized -> [q_len, heads * head_dim]."""
    q_len = chunk.end - chunk.start
    query = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)   # [1, heads, c, head_dim]
    slots = chunk_slots(chunk, slot_mapping, kv_cache.shape[3])
    mask = cpu_ops.prefill_mask(q_len, len(slots), chunk.window, q.device)
    keys = kv_quant.gather_dequantized(kv_cache[0], slots, quant, q.dtype).unsqueeze(0)
    values = kv_quant.gather_dequantized(kv_cache[1], slots, quant, q.dtype).unsqueeze(0)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                         is_causal=mask is None, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1).reshape(q_len, -1)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, num_reqs: int) -> torch.Tensor:
    """cache: [kv_heads, num_blocks, block_size, hd]; block_ids: [num_reqs * nb] (row-major)
    -> [kv_heads * num_reqs, nb * block_size, hd], a contiguous copy in token order."""
    kv_heads, _, block_size, head_dim = cache.shape
    blocks = cache.index_select(1, block_ids)          # [K, num_reqs * nb, block_size, hd]
    return blocks.view(kv_heads * num_reqs, -1, head_dim)
