"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) on a flattened varlen batch.

One forward pass runs every scheduled token of every request at once: `input_ids` and
`positions` are `[T]`, all linear layers see `[T, hidden]`, and only attention looks at
request boundaries (through `AttentionMetadata`, see attention.py). Logits are computed only
for the rows in `logits_indices` (the tokens that sample).

Deviations from Hugging Face's LlamaForCausalLM (same math otherwise):
- Q, K and V are one fused projection, gate and up another (weights concatenated at load);
- the KV cache is paged (written by slot, read by block table), not a per-request tensor;
- the final norm and the LM head run on the sampled rows only; logits come back in fp32;
- no dropout, no training path, no sliding window.
Classes appear in forward order; shapes in comments use T = tokens in the step,
H = heads, K = kv heads, D = head_dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvloop.model.attention import AttentionMetadata, paged_attention, write_kv
from kvloop.model.loader import ModelConfig


class Linear(nn.Module):
    """y = x @ W.T (+ b). W: [out, in].

    On CPU in bf16 the weight is reordered once into oneDNN's blocked layout and applied
    with `mkldnn._linear_pointwise` (no per-call reorder, 1.1-2x faster than `F.linear` for
    the skinny matmuls of decode); elsewhere it is `F.linear`. Both give identical results.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.packed = _can_pack(weight)
        if self.packed:
            weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


_PACK_BATCH_HINT = 64


def _can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


class RMSNorm(nn.Module):
    """x / rms(x) * w: one fused `F.rms_norm` (fp32 statistics for bf16 inputs; Hugging Face
    rounds x / rms(x) to the model dtype before the weight multiply: at most 1 ulp apart)."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps
        self.shape = (weight.shape[0],)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.shape, self.weight, self.eps)


class Rotary(nn.Module):
    """RoPE tables for positions [0, max_positions): cos, sin [max_positions, D/2] (fp32)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device,
                 freq_factors: torch.Tensor | None = None):
        super().__init__()
        inv_freq = rope_inv_freq(config, device)
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.to(device=device, dtype=torch.float32)
        angles = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float32),
                             inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> cos, sin [T, 1, D/2] in `dtype`, broadcasting over heads."""
        return (self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype))


def rope_inv_freq(config: ModelConfig, device: torch.device) -> torch.Tensor:
    """Inverse frequencies [D/2] with the model's base and scaling ("linear", "llama3")."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    scaling = config.rope_scaling
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling.factor, scaling.low_freq_factor,
                                scaling.high_freq_factor,
                                scaling.original_max_position_embeddings)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low: float, high: float,
                     old_context: int) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short kept, a smooth ramp between."""
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    ramp = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(medium, ramp, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D], halves rotated (Hugging Face's rotate_half layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, qkv: Linear, o_proj: Linear):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        self.qkv_proj = qkv
        self.o_proj = o_proj
        d = self.head_dim
        self.split = [(self.num_heads + self.num_kv_heads) * d, self.num_kv_heads * d]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qk, v = self.qkv_proj(x).split(self.split, dim=-1)          # [T, (H + 2K) * D]
        qk = apply_rope(qk.view(num_tokens, -1, self.head_dim), cos, sin)   # [T, H + K, D]
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        write_kv(kv_cache, k, v, meta.slot_mapping)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)   # [T, H * D]
        return self.o_proj(out)                                      # [T, hidden]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused."""

    def __init__(self, gate_up: Linear, down: Linear):
        super().__init__()
        self.gate_up_proj = gate_up
        self.down_proj = down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)             # [T, 2 * ffn]
        return self.down_proj(F.silu(gate) * up)                     # [T, hidden]


class DecoderLayer(nn.Module):
    def __init__(self, attn: Attention, mlp: MLP, input_norm: RMSNorm, post_norm: RMSNorm):
        super().__init__()
        self.input_layernorm = input_norm
        self.self_attn = attn
        self.post_attention_layernorm = post_norm
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding -> N decoder layers -> final norm -> LM head (tied or not)."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 dtype: torch.dtype, device: torch.device, max_positions: int):
        super().__init__()
        self.config = config
        self.dtype = dtype
        get = _WeightGetter(weights, dtype, device)
        self.embed_tokens = nn.Parameter(get("model.embed_tokens.weight"), requires_grad=False)
        self.layers = nn.ModuleList(
            [_build_layer(config, get, f"model.layers.{i}.")
             for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(get("model.norm.weight"), config.rms_norm_eps)
        tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        self.lm_head = Linear(self.embed_tokens.data if tied else get("lm_head.weight"))
        factors = weights.get("rope_freq_factors")
        self.rotary = Rotary(config, max_positions, device, factors)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]; logits_indices: [S] -> logits [S, vocab] fp32."""
        h = F.embedding(input_ids, self.embed_tokens)                # [T, hidden]
        cos, sin = self.rotary(positions, h.dtype)                   # [T, 1, D/2]
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h = layer(h, cos, sin, kv_cache, meta)
        h = self.norm(h[logits_indices])                             # [S, hidden]
        return self.lm_head(h).float()                               # [S, vocab]


class _WeightGetter:
    """Fetch a named parameter, cast and moved; a clear error when it is missing."""

    def __init__(self, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device):
        self.weights, self.dtype, self.device = weights, dtype, device

    def __call__(self, *names: str) -> torch.Tensor:
        missing = [n for n in names if n not in self.weights]
        if missing:
            raise KeyError(f"model weights lack {', '.join(missing)}")
        parts = [self.weights[n].to(device=self.device, dtype=self.dtype) for n in names]
        return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=0)

    def optional(self, *names: str) -> torch.Tensor | None:
        if not all(n in self.weights for n in names):
            return None
        return self(*names)


def _build_layer(config: ModelConfig, get: _WeightGetter, prefix: str) -> DecoderLayer:
    a = prefix + "self_attn."
    qkv_names = [f"{a}q_proj", f"{a}k_proj", f"{a}v_proj"]
    qkv = Linear(get(*[n + ".weight" for n in qkv_names]),
                 get.optional(*[n + ".bias" for n in qkv_names]))
    attn = Attention(config, qkv, Linear(get(a + "o_proj.weight"),
                                         get.optional(a + "o_proj.bias")))
    m = prefix + "mlp."
    mlp = MLP(Linear(get(m + "gate_proj.weight", m + "up_proj.weight")),
              Linear(get(m + "down_proj.weight")))
    eps = config.rms_norm_eps
    return DecoderLayer(attn, mlp, RMSNorm(get(prefix + "input_layernorm.weight"), eps),
                        RMSNorm(get(prefix + "post_attention_layernorm.weight"), eps))
