"""Llama-family decoder (Llama, Mistral, Qwen2/3, Qwen3-MoE, Phi-3, SmolLM2) on a flattened
varlen batch.

One forward pass runs every scheduled token of every request at once: `input_ids` and
`positions` are `[T]`, all linear layers see `[T, hidden]`, and only attention looks at
request boundaries (through `AttentionMetadata`, see attention.py). Logits are computed only
for the rows in `logits_indices` (the tokens that sample).

Deviations from Hugging Face's LlamaForCausalLM (same math otherwise):
- Q, K and V are one fused projection, gate and up another (weights concatenated at load);
- the KV cache is paged (written by slot, read by block table), not a per-request tensor;
- the final norm and the LM head run on the sampled rows only; logits come back in fp32;
- no dropout, no training path;
- sliding-window layers (Mistral, Qwen2 with `use_sliding_window`, Gemma 3) read their own
  KV-cache group's metadata (`StepInputs.meta_of`), which bounds what each query sees;
- Qwen3's per-head Q/K RMSNorm runs on the fused projection's rows, in place;
- partial RoPE (Phi-4-mini) runs on Q/K rows reordered at load (`loader.rotary_order`);
  LongRoPE picks its short or long factors per position (long from
  `original_max_position_embeddings` on), where transformers picks them for the whole
  sequence by its length: the same for every sequence shorter than that;
- a mixture of experts (`SparseMoE`) runs each expert once per step on the rows routed to
  it (grouped by expert), not as a per-token loop.
Classes appear in forward order; shapes in comments use T = tokens in the step,
H = heads, K = kv heads, D = head_dim. Inside the forward pass submodules are called through
`.forward` (no hooks are used; nn.Module's call wrapper costs ~200 calls per step).
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from kvloop.config import LoRAConfig
from kvloop.core.kv_cache_groups import layer_slots
from kvloop.model import cpu_ops
from kvloop.model.attention import AttentionMetadata, paged_attention, rope_and_cache
from kvloop.model.gguf import RawTensor
from kvloop.model.loader import ModelConfig
from kvloop.model.lora import (
    ATTN_PARTS,
    MLP_PARTS,
    LinearLoRA,
    LoRASlots,
    LoRAStep,
    module_shapes,
)
from kvloop.model.precision import Precision
from kvloop.model.quant import (
    Int4Weight,
    LowBitPolicy,
    LowBitWeight,
    low_bit_weight,
    rehome_low_bit,
)
from kvloop.model.step import StepInputs


class Linear(nn.Module):
    """y = x @ W.T (+ b). W: [out, in].

    On CPU in bf16 and fp32 the weight is reordered once into oneDNN's blocked layout and
    applied with `mkldnn._linear_pointwise` (no per-call reorder; bf16: 1.1-2x faster than
    `F.linear` for the skinny matmuls of decode; fp32 on the AVX2 dev box: 1.5-3x at 8 rows,
    up to 1.3x at 256); elsewhere it is `F.linear`. Both give the same results (fp32: to
    rounding, the summation order differs).
    `low_bit` (optional): the same weight kept 4- or 8-bit (`kvloop.model.quant`), used when
    the caller asks for it (`forward(x, low_bit=True)`: a step with few tokens).
    `lora` (set by `LlamaModel.enable_lora`): the layer's adapter slots; a step's `LoRAStep`
    adds each adapter's low-rank product to its rows, whichever matmul ran.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 low_bit: LowBitWeight | None = None):
        super().__init__()
        self.packed = _can_pack(weight)
        if self.packed:
            weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.low_bit = low_bit
        self.lora: LinearLoRA | None = None

    def forward(self, x: torch.Tensor, low_bit: bool = False,
                lora: LoRAStep | None = None) -> torch.Tensor:
        y = self._base(x, low_bit)
        if lora is not None and self.lora is not None:
            self.lora.add_(y, x, lora)
        return y

    def argmax(self, x: torch.Tensor, low_bit: bool = False) -> torch.Tensor:
        """x [T, in] -> [T] int64: each row's argmax of `forward(x, low_bit)` (no LoRA), the
        first of equal maxima, exactly; the low-bit weight's fused kernel where it serves
        (the output rows never written whole)."""
        if low_bit and self.low_bit is not None and self.bias is None:
            return self.low_bit.argmax(x)
        return self._base(x, low_bit).argmax(dim=-1)

    def _base(self, x: torch.Tensor, low_bit: bool) -> torch.Tensor:
        if low_bit and self.low_bit is not None:
            y = self.low_bit.matmul(x)
            return y if self.bias is None else y + self.bias
        if x.dtype != self.weight.dtype:     # a mixed precision: the matmul alone in its dtype
            return self._dense(x.to(self.weight.dtype)).to(x.dtype)
        return self._dense(x)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


_PACK_BATCH_HINT = 64


def _can_pack(weight: torch.Tensor) -> bool:
    if not (weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


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

    def add_(self, x: torch.Tensor, residual: torch.Tensor | None) -> None:
        """residual += x, x = norm(residual), in place (residual None: x = norm(x)); one
        fused op (`cpu_ops.add_rms_norm`)."""
        cpu_ops.add_rms_norm(x, residual, self.weight, self.eps)


class Rotary(nn.Module):
    """RoPE tables for positions [0, max_positions): cos, sin [max_positions, D/2] (fp32),
    applied with `cpu_ops.rope_and_cache` (half-split pairs: Hugging Face's rotate_half).
    Partial RoPE: the pairs past rotary_dim / 2 get cos 1, sin 0 (left as they are); LongRoPE
    scales cos and sin of the turned pairs by its attention factor."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device,
                 freq_factors: torch.Tensor | None = None):
        super().__init__()
        positions = torch.arange(max_positions, device=device, dtype=torch.float32)
        angles = rope_angles(config, positions, device, freq_factors)     # [P, R/2]
        scale = config.rope_scaling.attention_factor
        pad = config.head_dim // 2 - angles.shape[1]
        cos = F.pad(angles.cos() * scale, (0, pad), value=1.0)
        sin = F.pad(angles.sin() * scale, (0, pad), value=0.0)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)


def rope_angles(config: ModelConfig, positions: torch.Tensor, device: torch.device,
                freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Angles [P, rotary_dim / 2] of `positions` [P] (fp32)."""
    scaling = config.rope_scaling
    if scaling.rope_type == "longrope":
        short = torch.outer(positions, _longrope_inv_freq(config, scaling.short_factor, device))
        long = torch.outer(positions, _longrope_inv_freq(config, scaling.long_factor, device))
        is_long = positions[:, None] >= scaling.original_max_position_embeddings
        return torch.where(is_long, long, short)
    inv_freq = rope_inv_freq(config, device)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.to(device=device, dtype=torch.float32)
    return torch.outer(positions, inv_freq)


def _longrope_inv_freq(config: ModelConfig, factors: tuple[float, ...],
                       device: torch.device) -> torch.Tensor:
    return _base_inv_freq(config, device) / torch.tensor(factors, device=device,
                                                         dtype=torch.float32)


def _base_inv_freq(config: ModelConfig, device: torch.device) -> torch.Tensor:
    dim = config.rotary_dims
    exponents = torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim
    return 1.0 / (config.rope_theta ** exponents)


def rope_inv_freq(config: ModelConfig, device: torch.device) -> torch.Tensor:
    """Inverse frequencies [R/2] with the model's base and scaling ("linear", "llama3")."""
    inv_freq = _base_inv_freq(config, device)
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


class Attention(nn.Module):
    """`qk_norm` (Qwen3, Gemma 3): the RMSNorms (weights [D]) of each head's Q and of each
    head's K, applied before RoPE. `group`: the layer's KV-cache group (its attention
    metadata, `StepInputs.meta_of`)."""

    def __init__(self, config: ModelConfig, qkv: Linear, o_proj: Linear,
                 qk_norm: tuple[RMSNorm, RMSNorm] | None = None, group: int = 0):
        super().__init__()
        self.group = group
        self.q_norm: RMSNorm | None = qk_norm[0] if qk_norm is not None else None
        self.k_norm: RMSNorm | None = qk_norm[1] if qk_norm is not None else None
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        self.qkv_proj = qkv
        self.o_proj = o_proj
        d = self.head_dim
        self.split = [(self.num_heads + self.num_kv_heads) * d, self.num_kv_heads * d]

    def forward(self, x: torch.Tensor, rotary: Rotary, kv_cache: torch.Tensor,
                step: StepInputs) -> torch.Tensor:
        num_tokens = x.shape[0]
        low_bit, lora, meta = step.low_bit, step.lora, step.meta_of(self.group)
        qkv = self.qkv_proj.forward(x, low_bit, lora).contiguous()        # [T, (H + 2K) * D]
        if self.q_norm is not None:
            self._norm_qk(qkv.view(num_tokens, -1, self.head_dim))
        rope_and_cache(qkv, step.positions, rotary.cos, rotary.sin, kv_cache, meta,
                       self.num_heads, self.num_kv_heads)
        rows = qkv.view(num_tokens, -1, self.head_dim)               # [T, H + 2K, D]
        q, k, v = rows.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)   # [T, H * D]
        return self.o_proj.forward(out, low_bit, lora)               # [T, hidden]

    def _norm_qk(self, rows: torch.Tensor) -> None:
        """rows [T, H + 2K, D]: each Q and K head RMS-normalized in place."""
        assert self.q_norm is not None and self.k_norm is not None
        h, k = self.num_heads, self.num_kv_heads
        rows[:, :h] = self.q_norm.forward(rows[:, :h])
        rows[:, h:h + k] = self.k_norm.forward(rows[:, h:h + k])


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused."""

    def __init__(self, gate_up: Linear, down: Linear):
        super().__init__()
        self.gate_up_proj = gate_up
        self.down_proj = down

    def forward(self, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        return self.run(x, step.low_bit, step.lora)

    def run(self, x: torch.Tensor, low_bit: bool, lora: LoRAStep | None = None
            ) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x, low_bit, lora).contiguous()  # [T, 2 * ffn]
        return self.down_proj.forward(cpu_ops.silu_and_mul(gate_up), low_bit,
                                      lora)                                # [T, hidden]


class SparseMoE(nn.Module):
    """Qwen3-MoE's sparse MLP: router logits [T, E] -> softmax (fp32) -> top-k experts per
    token (weights renormalized over the k when `norm_topk_prob`) -> each expert, a SwiGLU
    `MLP`, runs once on the rows routed to it (grouped by expert: one matmul per expert
    and projection) -> the weighted outputs summed per token. No adapters (LoRA) here."""

    def __init__(self, router: Linear, experts: list[MLP], top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.gate = router
        self.experts = nn.ModuleList(experts)
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def forward(self, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        probs = self.gate.forward(x).float().softmax(dim=-1)             # [T, E]
        weights, chosen = probs.topk(self.top_k, dim=-1)                 # [T, k] each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = chosen.flatten()                                          # [T * k]
        order = flat.argsort(stable=True)         # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        rows = order // self.top_k                                       # token of each pair
        scale = weights.flatten()[order].to(x.dtype)[:, None]
        out = torch.zeros_like(x)                                        # [T, hidden]
        first = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                mine = rows[first:first + count]
                y = cast(MLP, expert).run(x.index_select(0, mine), step.low_bit)
                out.index_add_(0, mine, y * scale[first:first + count])
                first += count
        return out


class DecoderLayer(nn.Module):
    def __init__(self, attn: Attention, mlp: MLP | SparseMoE, input_norm: RMSNorm,
                 post_norm: RMSNorm):
        super().__init__()
        self.input_layernorm = input_norm
        self.self_attn = attn
        self.post_attention_layernorm = post_norm
        self.mlp = mlp

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, rotary: Rotary,
                kv_cache: torch.Tensor, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the previous layer's output (the embedding for layer 0, residual None);
        residual: the stream so far. -> (this layer's MLP output, the stream before it); the
        stream after the layer is their sum, which the next layer's norm adds first."""
        if residual is None:
            residual, h = h, h.clone()
            self.input_layernorm.add_(h, None)        # h = norm(h)
        else:
            self.input_layernorm.add_(h, residual)    # residual += h; h = norm(residual)
        h = self.self_attn.forward(h, rotary, kv_cache, step)
        self.post_attention_layernorm.add_(h, residual)
        return self.mlp.forward(h, step), residual


class LlamaModel(nn.Module):
    """Embedding -> N decoder layers -> final norm -> LM head (tied or not).

    `precision` says which dtype each tensor class takes (`kvloop.model.precision`): the
    layers' dense weights `precision.matmul`, everything else `precision.activations`.
    `quantized` (a GGUF's undecoded 4-bit / Q8_0 blocks, `LoadedModel.quantized`) gives the
    linear layers a low-bit copy beside the dense one, where the device runs it
    (`kvloop.model.quant.low_bit_supported`); `low_bit` (a `LowBitPolicy`, owned here, set
    once at start-up, default: never) says which steps use it, by their token count.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 precision: Precision, device: torch.device, max_positions: int,
                 quantized: dict[str, RawTensor] | None = None):
        super().__init__()
        self.config = config
        self.precision = precision
        self.dtype = precision.activations
        self.low_bit = LowBitPolicy()
        get = _WeightGetter(weights, precision, device, quantized or {})
        self.embed_tokens = nn.Parameter(get.exact("model.embed_tokens.weight"),
                                         requires_grad=False)
        self.layers = nn.ModuleList(self.build_layers(config, get))
        self.norm = self.build_norm(get.exact("model.norm.weight"), config.rms_norm_eps)
        tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        head = "model.embed_tokens.weight" if tied else "lm_head.weight"
        self.lm_head = Linear(self.embed_tokens.data if tied else get.exact(head),
                              low_bit=get.low_bit(head, exact=True))
        factors = weights.get("rope_freq_factors")
        self.rotary = Rotary(config, max_positions, device, factors)
        if device.type == "cpu":
            rehome_low_bit([linear.low_bit for linear in self.linears()
                            if linear.low_bit is not None])
        self.fused_decode = FusedDecode.build(config, cast(list[DecoderLayer],
                                                           list(self.layers)))

    def build_layers(self, config: ModelConfig, get: _WeightGetter) -> list[nn.Module]:
        """The decoder layers (an architecture's subclass builds its own), each told its
        KV-cache group."""
        return [_build_layer(config, get, f"model.layers.{i}.", i, group)
                for i, (group, _) in enumerate(layer_slots(config.kv_cache_groups,
                                                           config.num_hidden_layers))]

    def build_norm(self, weight: torch.Tensor, eps: float) -> RMSNorm:
        return RMSNorm(weight, eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the first layer's input [T, hidden]."""
        return F.embedding(input_ids, self.embed_tokens)

    def forward(self, step: StepInputs, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """`step` (`kvloop.model.step.StepInputs`: input ids and positions [T], attention
        metadata, logits rows [S], adapter rows) -> logits [S, vocab] fp32."""
        h, residual = self.decode_layers(step, kv_caches)
        return self.compute_logits(h, residual, step.logits_indices)

    def greedy(self, step: StepInputs, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """`forward`'s argmax of each logits row [S] int64, exactly, without the logits where
        the LM head runs low-bit (`greedy_tokens`)."""
        h, residual = self.decode_layers(step, kv_caches)
        return self.greedy_tokens(h, residual, step.logits_indices)

    def decode_layers(self, step: StepInputs, kv_caches: list[torch.Tensor]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The embedding and every decoder layer: (h, residual) [T, hidden] each, before the
        final norm (whose input is their sum). The low-bit policy decides `step.low_bit`
        here; a step with adapter rows, or over a quantized KV cache, takes the layer loop
        (`FusedDecode` has neither LoRA nor quantized KV)."""
        h = self.embed(step.input_ids)                               # [T, hidden]
        residual: torch.Tensor | None = None
        num_tokens = step.num_tokens
        step = step.with_low_bit(self.low_bit.layers(num_tokens))
        if (self.fused_decode is not None and step.lora is None
                and step.meta.num_decodes == num_tokens and step.meta.kv_quant is None
                and self.low_bit.fused_decode(num_tokens)):
            h, residual = self.fused_decode.forward(h, step.positions, self.rotary, kv_caches,
                                                    step.meta)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                h, residual = layer.forward(h, residual, self.rotary, kv_cache, step)
        assert residual is not None
        return h, residual

    def compute_logits(self, h: torch.Tensor, residual: torch.Tensor,
                       logits_indices: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head on the rows `logits_indices` [S] of `decode_layers`'
        output -> logits [S, vocab] fp32. Normalizes `h` in place when every row samples."""
        h = self._final_norm(h, residual, logits_indices)
        return self.lm_head.forward(h, self.low_bit.head(h.shape[0])).float()  # [S, V]

    def greedy_tokens(self, h: torch.Tensor, residual: torch.Tensor,
                      logits_indices: torch.Tensor) -> torch.Tensor:
        """The argmax [S] int64 of each row `compute_logits` returns, exactly (the first of
        equal maxima), without the logits where the LM head runs low-bit (fused with the
        argmax: `Int8Weight.argmax`). For steps whose every row samples greedily and plainly
        (no logprobs, penalties, masks or grammar): the caller's choice."""
        h = self._final_norm(h, residual, logits_indices)
        return self.lm_head.argmax(h, self.low_bit.head(h.shape[0]))

    def _final_norm(self, h: torch.Tensor, residual: torch.Tensor,
                    logits_indices: torch.Tensor) -> torch.Tensor:
        """norm(residual + h) of the rows `logits_indices` [S] -> [S, hidden] (in place in `h`
        when every row samples, in order)."""
        if logits_indices.shape[0] != h.shape[0]:
            h, residual = h[logits_indices], residual[logits_indices]
        self.norm.add_(h, residual)
        return h

    def final_hidden(self, h: torch.Tensor, residual: torch.Tensor,
                     indices: torch.Tensor) -> torch.Tensor:
        """The final-norm hidden states of rows `indices` [P] of `decode_layers`' output
        (copies: `h` is left as is) -> [P, hidden] fp32: what an embedding pools."""
        rows, res = h[indices], residual[indices]
        self.norm.add_(rows, res)
        return rows.float()

    def enable_lora(self, lora: LoRAConfig) -> LoRASlots:
        """Give every decoder layer's linear layers `lora.max_loras` zeroed adapter slots
        (in `precision.activations`) -> the slots' owner."""
        if self.config.moe is not None:
            raise ValueError("LoRA adapters are not supported on a mixture-of-experts model")
        if self.config.rotary_dims != self.config.head_dim:
            raise ValueError("LoRA adapters are not supported on a partial-RoPE model (its Q "
                             "and K rows are reordered at load)")
        layers: list[dict[str, LinearLoRA]] = []
        for layer in cast(list[DecoderLayer], list(self.layers)):
            attn, mlp = layer.self_attn, cast(MLP, layer.mlp)
            modules: dict[str, LinearLoRA] = {}
            for linear, names in ((attn.qkv_proj, ATTN_PARTS), (attn.o_proj, ("o_proj",)),
                                  (mlp.gate_up_proj, MLP_PARTS), (mlp.down_proj, ("down_proj",))):
                linear.lora = self._lora_slots(linear, names, lora)
                modules.update(dict.fromkeys(names, linear.lora))
            layers.append(modules)
        return LoRASlots(self.config, lora, layers)

    def _lora_slots(self, linear: Linear, names: tuple[str, ...], lora: LoRAConfig
                    ) -> LinearLoRA:
        shapes = module_shapes(self.config)
        parts, first = {}, 0
        for name in names:
            parts[name] = (first, shapes[name][0])
            first += shapes[name][0]
        return LinearLoRA(parts, shapes[names[0]][1], lora.max_loras, lora.max_lora_rank,
                          self.dtype, self.embed_tokens.device)

    def linears(self) -> list[Linear]:
        """Every linear layer, the LM head last."""
        return [m for m in self.modules() if isinstance(m, Linear) and m is not self.lm_head
                ] + [self.lm_head]


class FusedDecode:
    """Every decoder layer of a step of decodes (one query token per request) in one call of
    kvloop's CPU ops (`DecodeStack`, csrc/cpu_ops.cpp), with the 4-bit weights: the same
    kernels in the same order as the layer loop with `low_bit`, so the same results, without
    ~250 Python calls and thread hand-offs per step; it runs on kvloop's own thread pool,
    whose workers stay awake through the step (csrc/pool.h). The weights are handed over
    once, at `build`; a step passes only its own tensors.

    `build` returns None (the layer loop serves) unless the CPU ops are built and every
    linear layer has a 4-bit copy on kvloop's kernel and no bias; the stack rounds x at
    3+ rows as those copies do (`Int4Weight.bf16_x`).
    """

    def __init__(self, stack: object):
        self.stack = stack

    @classmethod
    def build(cls, config: ModelConfig, layers: list[DecoderLayer]) -> FusedDecode | None:
        ops = cpu_ops.load()
        if ops is None or not layers or len(config.kv_cache_groups) > 1 or any(
                config.layer_window(i) is not None for i in range(config.num_hidden_layers)):
            return None
        if any(not isinstance(layer.mlp, MLP) or layer.self_attn.q_norm is not None
               for layer in layers) or config.rotary_dims != config.head_dim:
            return None                     # the stack has no MoE, Q/K norm or partial RoPE
        quantized: list[torch.Tensor] = []
        bf16_x: set[bool] = set()
        layouts: set[bool] = set()      # with column blocks (6 tensors a weight) or not (3)
        for layer in layers:
            mlp = cast(MLP, layer.mlp)
            for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                           mlp.gate_up_proj, mlp.down_proj):
                weight = linear.low_bit
                if not (isinstance(weight, Int4Weight) and weight.kernel == "kvloop"
                        and linear.bias is None):
                    return None
                quantized.extend(weight.tensors)
                bf16_x.add(weight.bf16_x)
                layouts.add(bool(weight.blocks))
        if len(bf16_x) != 1 or len(layouts) != 1:
            return None                     # one rounding rule, one layout for the stack's
        norms = [w for layer in layers for w in (layer.input_layernorm.weight.data,
                                                 layer.post_attention_layernorm.weight.data)]
        return cls(ops.DecodeStack(norms, quantized, config.num_attention_heads,
                                   config.num_key_value_heads, config.intermediate_size,
                                   config.rms_norm_eps, config.head_dim ** -0.5,
                                   bf16_x=bf16_x.pop()))

    def forward(self, embedded: torch.Tensor, positions: torch.Tensor, rotary: Rotary,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """embedded [T, hidden] of T decodes -> (h, residual) as the layer loop returns them."""
        assert meta.decode_block_table is not None and meta.decode_seq_lens is not None
        return self.stack.forward(  # type: ignore[attr-defined,no-any-return]
            embedded, kv_caches, positions, meta.slot_mapping, rotary.cos, rotary.sin,
            meta.decode_block_table, meta.decode_seq_lens)


class _WeightGetter:
    """Fetch a named parameter, cast and moved; a clear error when it is missing. A call:
    a layer matmul's weight (`precision.matmul`); `exact`: a norm, the embedding or the LM
    head (`precision.activations`). `low_bit`: the low-bit copy of the named weights, stacked
    by rows (None where any lacks one)."""

    def __init__(self, weights: dict[str, torch.Tensor], precision: Precision,
                 device: torch.device, quantized: dict[str, RawTensor]):
        self.weights, self.precision, self.device = weights, precision, device
        self.quantized = quantized

    def low_bit(self, *names: str, exact: bool = False) -> LowBitWeight | None:
        """`exact`: the LM head's, whose x is never rounded; else a layer matmul's, whose fp32
        x its 4-bit kernel may round to bf16 as the precision says (`low_bit_bf16_x`)."""
        bf16_x = not exact and self.precision.low_bit_bf16_x
        return low_bit_weight([self.quantized.get(n) for n in names], self.device, bf16_x)

    def __call__(self, *names: str) -> torch.Tensor:
        return self._fetch(names, self.precision.matmul)

    def exact(self, *names: str) -> torch.Tensor:
        return self._fetch(names, self.precision.activations)

    def _fetch(self, names: tuple[str, ...], dtype: torch.dtype) -> torch.Tensor:
        missing = [n for n in names if n not in self.weights]
        if missing:
            raise KeyError(f"model weights lack {', '.join(missing)}")
        parts = [self.weights[n].to(device=self.device, dtype=dtype) for n in names]
        return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=0)

    def optional(self, *names: str) -> torch.Tensor | None:
        if not all(n in self.weights for n in names):
            return None
        return self(*names)


def _build_layer(config: ModelConfig, get: _WeightGetter, prefix: str,
                 layer: int, group: int) -> DecoderLayer:
    a = prefix + "self_attn."
    qkv_names = [f"{a}q_proj", f"{a}k_proj", f"{a}v_proj"]
    qkv_weights = [n + ".weight" for n in qkv_names]
    qkv = Linear(get(*qkv_weights), get.optional(*[n + ".bias" for n in qkv_names]),
                 get.low_bit(*qkv_weights))
    eps = config.rms_norm_eps
    qk_norm = ((RMSNorm(get.exact(a + "q_norm.weight"), eps),
                RMSNorm(get.exact(a + "k_norm.weight"), eps)) if config.qk_norm else None)
    attn = Attention(config, qkv, Linear(get(a + "o_proj.weight"),
                                         get.optional(a + "o_proj.bias"),
                                         get.low_bit(a + "o_proj.weight")), qk_norm, group)
    moe = config.moe
    mlp: MLP | SparseMoE
    if moe is not None and layer in moe.sparse_layers:
        m = prefix + "mlp."
        experts = [_build_mlp(get, f"{m}experts.{e}.") for e in range(moe.num_experts)]
        mlp = SparseMoE(Linear(get.exact(m + "gate.weight")), experts,
                        moe.num_experts_per_tok, moe.norm_topk_prob)
    else:
        mlp = _build_mlp(get, prefix + "mlp.")
    return DecoderLayer(attn, mlp, RMSNorm(get.exact(prefix + "input_layernorm.weight"), eps),
                        RMSNorm(get.exact(prefix + "post_attention_layernorm.weight"), eps))


def _build_mlp(get: _WeightGetter, m: str) -> MLP:
    """The SwiGLU under prefix `m` (`model.layers.0.mlp.`, or one expert's)."""
    gate_up = (m + "gate_proj.weight", m + "up_proj.weight")
    return MLP(Linear(get(*gate_up), low_bit=get.low_bit(*gate_up)),
               Linear(get(m + "down_proj.weight"), low_bit=get.low_bit(m + "down_proj.weight")))
