"""Paged attention over a flattened batch: write K/V by `slot_mapping`, read by block table.

The KV cache of one layer is one tensor `[2, num_kv_heads, num_blocks, block_size, head_dim]`
(K then V; head-major, so gathering a request's blocks with one `index_select` yields
`[kv_heads, tokens, head_dim]`, ready for batched matmuls with no transpose copy). Slot `s`
is token `s % block_size` of block `s // block_size`; block 0 is the engine's null block
(never holds live data, used as padding in block tables).

A step's tokens are laid out decodes first, then prefill chunks (vLLM's order):

    | d0 d1 ... d(D-1) | chunk 0 ......... | chunk 1 ... |
      one query token    q_len tokens of one request each,
      per request        after `context_len` computed ones

- decodes (q_len == 1) attend together: their blocks are gathered into a padded
  `[kv_heads * D, L, head_dim]` copy, then two batched matmuls with an fp32 masked softmax
  between them (all query heads of a KV head at once, no repeat of K/V for GQA; CPU SDPA
  with a mask is 10-30x slower on these shapes);
- each prefill chunk attends with SDPA: `is_causal` when it has no computed context, else
  an explicit lower-right causal mask over `context_len + q_len` keys gathered from the cache
  (SDPA's `is_causal` is top-left aligned, wrong once a prefix is cached).

Everything here is metadata built once per step by the runner (`AttentionMetadata`), shared by
all layers; there is no module-global state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One request's chunk of more than one query token."""

    start: int                       # first token of the chunk in the flattened batch
    end: int                         # one past its last token
    context_len: int                 # tokens computed before this chunk (cached prefix)
    block_ids: torch.Tensor | None   # [num_blocks] covering context + chunk; None if no context
    mask: torch.Tensor | None        # [q_len, context_len + q_len] bool, True = attend


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, for every layer."""

    slot_mapping: torch.Tensor                   # [num_tokens] int64: where each token's K/V goes
    num_decodes: int = 0                         # the first num_decodes tokens are decodes
    decode_block_ids: torch.Tensor | None = None  # [D * max_blocks] int64, rows 0-padded
    decode_bias: torch.Tensor | None = None      # [1, D, 1, max_blocks * block_size] fp32:
                                                 # 0 where a key exists, -inf past seq_len
    prefills: list[PrefillChunk] = field(default_factory=list)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's keys and values.  k, v: [T, kv_heads, head_dim]."""
    _, kv_heads, _, _, head_dim = kv_cache.shape
    kv_cache[0].view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
    kv_cache[1].view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, v.transpose(0, 1))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] (this step's, already written
    to `kv_cache`). Returns [T, heads * head_dim]."""
    num_tokens, heads, head_dim = q.shape
    if meta.num_decodes == num_tokens:
        return _decode_attention(q, kv_cache, meta, scale)
    out = torch.empty(num_tokens, heads * head_dim, dtype=q.dtype, device=q.device)
    if meta.num_decodes:
        out[:meta.num_decodes] = _decode_attention(q[:meta.num_decodes], kv_cache, meta, scale)
    for chunk in meta.prefills:
        out[chunk.start:chunk.end] = _chunk_attention(q, k, v, kv_cache, chunk, scale)
    return out


def _decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float) -> torch.Tensor:
    """q: [D, heads, head_dim] -> [D, heads * head_dim]; one query per request."""
    assert meta.decode_block_ids is not None and meta.decode_bias is not None
    num_reqs, heads, head_dim = q.shape
    kv_heads = kv_cache.shape[1]
    group = heads // kv_heads
    keys = _gather(kv_cache[0], meta.decode_block_ids, num_reqs)    # [K*D, L, hd]
    values = _gather(kv_cache[1], meta.decode_block_ids, num_reqs)
    length = keys.shape[1]
    queries = (q.view(num_reqs, kv_heads, group, head_dim).transpose(0, 1)
               .reshape(kv_heads * num_reqs, group, head_dim))        # [K*D, G, hd]
    scores = torch.bmm(queries, keys.transpose(1, 2))                 # [K*D, G, L]
    scores = scores.view(kv_heads, num_reqs, group, length).float() * scale + meta.decode_bias
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(kv_heads * num_reqs, group, length)
    out = torch.bmm(probs, values)                                    # [K*D, G, hd]
    return out.view(kv_heads, num_reqs, group * head_dim).transpose(0, 1).reshape(
        num_reqs, heads * head_dim)


def _chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     kv_cache: torch.Tensor, chunk: PrefillChunk,
                     scale: float) -> torch.Tensor:
    """Causal attention of one chunk over its context and itself -> [q_len, heads*head_dim]."""
    query = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)   # [1, heads, c, head_dim]
    if chunk.context_len == 0:
        keys = k[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, c, hd]
        values = v[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(query, keys, values, is_causal=True,
                                             scale=scale, enable_gqa=True)
    else:
        assert chunk.block_ids is not None
        total = chunk.context_len + (chunk.end - chunk.start)
        keys = _gather(kv_cache[0], chunk.block_ids, 1)[:, :total].unsqueeze(0)
        values = _gather(kv_cache[1], chunk.block_ids, 1)[:, :total].unsqueeze(0)
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=chunk.mask,
                                             scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(chunk.end - chunk.start, -1)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, num_reqs: int) -> torch.Tensor:
    """cache: [kv_heads, num_blocks, block_size, hd]; block_ids: [num_reqs * nb] (row-major)
    -> [kv_heads * num_reqs, nb * block_size, hd], a contiguous copy in token order."""
    kv_heads, _, block_size, head_dim = cache.shape
    blocks = cache.index_select(1, block_ids)          # [K, num_reqs * nb, block_size, hd]
    return blocks.view(kv_heads * num_reqs, -1, head_dim)


def lower_right_causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """[q_len, kv_len] bool: query i (at position kv_len - q_len + i) sees keys <= it."""
    rows = torch.arange(q_len, device=device).unsqueeze(1) + (kv_len - q_len)
    return torch.arange(kv_len, device=device).unsqueeze(0) <= rows
