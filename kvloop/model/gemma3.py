"""Gemma 3 text decoder (Gemma3ForCausalLM) on kvloop's flattened varlen batch.

The Llama-family model (`kvloop.model.llama`) with Gemma 3's differences:
- sliding-window and global layers interleaved (`ModelConfig.layer_types`, every 6th layer
  global in the older configs): each layer reads its KV-cache group's metadata, and the
  sliding layers use their own RoPE base (`rope_local_theta`, 10000); global layers use
  `rope_theta` with its scaling;
- four norms per layer (input, post-attention, pre- and post-feedforward), each
  `x / rms(x) * (1 + w)`: kvloop folds the 1 into the weight at load;
- RMSNorm on each query and key head before RoPE (`q_norm`, `k_norm`, also 1 + w);
- attention scaled by `query_pre_attn_scalar ** -0.5`, not `head_dim ** -0.5`;
- the embedding multiplied by sqrt(hidden) (in the weights' dtype, as transformers does);
- GeLU (tanh approximation) in the gated MLP; tied embeddings by default;
- an optional tanh cap on the logits (`final_logit_softcapping`).
Not supported (refused at load): `attn_logit_softcapping` (Gemma 3 configs have none).
Shapes: T = tokens in the step, H = heads, K = kv heads, D = head_dim.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from kvloop.core.kv_cache_groups import layer_slots
from kvloop.model.gguf import RawTensor
from kvloop.model.llama import (
    MLP,
    Attention,
    Linear,
    LlamaModel,
    RMSNorm,
    Rotary,
    _WeightGetter,
)
from kvloop.model.loader import ModelConfig, RopeScaling
from kvloop.model.precision import Precision
from kvloop.model.step import StepInputs


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w): Llama's norm with the 1 folded into the weight."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__((weight.float() + 1.0).to(weight.dtype), eps)


class Gemma3Attention(Attention):
    """Llama's attention with Q/K norms (1 + w) and the scale 1/sqrt(query_pre_attn_scalar)."""

    def __init__(self, config: ModelConfig, qkv: Linear, o_proj: Linear, group: int,
                 q_norm: GemmaRMSNorm, k_norm: GemmaRMSNorm):
        super().__init__(config, qkv, o_proj, (q_norm, k_norm), group)
        assert config.query_pre_attn_scalar is not None
        self.scale = config.query_pre_attn_scalar ** -0.5


class GeluMLP(MLP):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up fused."""

    def forward(self, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        low_bit, lora = step.low_bit, step.lora
        gate_up = self.gate_up_proj.forward(x, low_bit, lora)          # [T, 2 * ffn]
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj.forward(F.gelu(gate, approximate="tanh") * up, low_bit, lora)


class Gemma3DecoderLayer(nn.Module):
    """Sandwich norms: stream += post_attn_norm(attn(input_norm(stream))), then
    stream += post_ff_norm(mlp(pre_ff_norm(stream)))."""

    def __init__(self, attn: Gemma3Attention, mlp: GeluMLP, norms: list[GemmaRMSNorm],
                 sliding: bool):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        (self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
         self.post_feedforward_layernorm) = norms
        self.sliding = sliding
        self.local_rotary: Rotary | None = None     # set by the model (shared, unregistered)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, rotary: Rotary,
                kv_cache: torch.Tensor, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """As `kvloop.model.llama.DecoderLayer.forward`: (this layer's MLP output, the
        stream before it); the next layer's first norm adds them."""
        if residual is None:
            residual, h = h, h.clone()
            self.input_layernorm.add_(h, None)
        else:
            self.input_layernorm.add_(h, residual)
        own = self.local_rotary if self.sliding and self.local_rotary is not None else rotary
        a = self.self_attn.forward(h, own, kv_cache, step)
        a = self.post_attention_layernorm.forward(a)
        self.pre_feedforward_layernorm.add_(a, residual)   # residual += a; a = norm(residual)
        m = self.mlp.forward(a, step)
        return self.post_feedforward_layernorm.forward(m), residual


class Gemma3Model(LlamaModel):
    """`LlamaModel` with Gemma 3's layers, norms, embedding scale and logit cap."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 precision: Precision, device: torch.device, max_positions: int,
                 quantized: dict[str, RawTensor] | None = None):
        super().__init__(config, weights, precision, device, max_positions, quantized)
        self.fused_decode = None
        scale = torch.tensor(config.hidden_size ** 0.5, dtype=torch.float32)
        self.embed_scale = scale.to(self.embed_tokens.dtype).to(device)
        local = dataclasses.replace(config, rope_theta=config.rope_local_theta or 10_000.0,
                                    rope_scaling=RopeScaling())
        self.rotary_local = Rotary(local, max_positions, device)
        for layer in self.layers:
            object.__setattr__(layer, "local_rotary", self.rotary_local)

    def build_layers(self, config: ModelConfig, get: _WeightGetter) -> list[nn.Module]:
        slots = layer_slots(config.kv_cache_groups, config.num_hidden_layers)
        return [_build_layer(config, get, f"model.layers.{i}.", group,
                             config.layer_window(i) is not None)
                for i, (group, _) in enumerate(slots)]

    def build_norm(self, weight: torch.Tensor, eps: float) -> RMSNorm:
        return GemmaRMSNorm(weight, eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens) * self.embed_scale

    def compute_logits(self, h: torch.Tensor, residual: torch.Tensor,
                       logits_indices: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(h, residual, logits_indices)
        cap = self.config.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap


def _build_layer(config: ModelConfig, get: _WeightGetter, prefix: str, group: int,
                 sliding: bool) -> Gemma3DecoderLayer:
    a = prefix + "self_attn."
    qkv_weights = [f"{a}{n}_proj.weight" for n in ("q", "k", "v")]
    eps = config.rms_norm_eps
    attn = Gemma3Attention(
        config, Linear(get(*qkv_weights), low_bit=get.low_bit(*qkv_weights)),
        Linear(get(a + "o_proj.weight"), low_bit=get.low_bit(a + "o_proj.weight")), group,
        GemmaRMSNorm(get.exact(a + "q_norm.weight"), eps),
        GemmaRMSNorm(get.exact(a + "k_norm.weight"), eps))
    m = prefix + "mlp."
    gate_up = (m + "gate_proj.weight", m + "up_proj.weight")
    mlp = GeluMLP(Linear(get(*gate_up), low_bit=get.low_bit(*gate_up)),
                  Linear(get(m + "down_proj.weight"), low_bit=get.low_bit(m + "down_proj.weight")))
    norms = [GemmaRMSNorm(get.exact(prefix + n + ".weight"), eps)
             for n in ("input_layernorm", "post_attention_layernorm",
                       "pre_feedforward_layernorm", "post_feedforward_layernorm")]
    return Gemma3DecoderLayer(attn, mlp, norms, sliding)
