"""Model files -> (ModelConfig, parameters): GGUF files and Hugging Face folders.

Scope: weights and shape hyper-parameters only (the tokenizer lives in
`kvloop.front.tokenizer`). Parameters come back under Hugging Face Llama names
(`model.layers.0.self_attn.q_proj.weight`...), so both sources feed the same model code:
fused checkpoints are split (Phi-3's `qkv_proj` and `gate_up_proj`), and a mixture of
experts' weights come back one 2-D tensor per expert (`mlp.experts.3.gate_proj.weight`,
the router `mlp.gate.weight`), whether the file stacks them (GGUF's `ffn_gate_exps`,
transformers 5's `mlp.experts.gate_up_proj`) or not.

Layout notes: llama.cpp's converter permutes the rows of Q and K for the "llama"
architecture (interleaved rotary pairs); `_unpermute_qk` restores Hugging Face's half-split
layout. Where RoPE turns only the first `rotary_dim` of each head (Phi-4-mini: 3/4), the Q
and K rows of each head (and a per-head Q/K norm's weight) are reordered once at load
(`rotary_order`) so that kvloop's half-split rotary kernel pairs the same dimensions as
Hugging Face's and leaves the rest unturned; Q.K is unchanged by the reordering. A
`rope_freqs.weight` tensor (Llama 3.1 scaling) is kept as `rope_freq_factors`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np
import torch

from kvloop.locate import (
    GGUF_ARCHITECTURES,
    ModelNotFoundError,
    find_model_path,
    gguf_family,
    hf_family,
    model_name_for,
)
from kvloop.model.gguf import RawTensor

T = TypeVar("T", torch.Tensor, RawTensor)

_GGUF_PERMUTED_QK = ("llama", "mistral")
_QK_NORM = ("qwen3", "qwen3moe")          # RMSNorm over each head's Q and K before RoPE
ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: "linear", "llama3" (Llama 3.1) or "longrope" (Phi-3: per-pair
    `short_factor` below `original_max_position_embeddings`, `long_factor` from there on,
    cos and sin times `attention_factor`); "default" = plain RoPE."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True)
class MoEConfig:
    """A sparse mixture-of-experts MLP (Qwen3-MoE): each token's router picks
    `num_experts_per_tok` of `num_experts` SwiGLU experts of width `moe_intermediate_size`,
    weighted by their softmax probabilities (renormalized over the picked ones when
    `norm_topk_prob`); `sparse_layers`: the layers that have it (the others a dense MLP)."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]

    def __post_init__(self) -> None:
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                             f"1..num_experts={self.num_experts}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape hyper-parameters of a Llama-family decoder (HF config.json names)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rotary_dim: int | None = None          # None: the whole head (Phi-4-mini turns 3/4)
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        if self.architecture not in GGUF_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; "
                             f"supported: {', '.join(GGUF_ARCHITECTURES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.rope_scaling.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope scaling {self.rope_scaling.rope_type!r}; "
                             f"supported: {', '.join(ROPE_TYPES)}")
        rot = self.rotary_dims
        if rot % 2 or not 0 < rot <= self.head_dim:
            raise ValueError(f"rotary_dim={rot} must be even and at most head_dim")

    @property
    def rotary_dims(self) -> int:
        """How many dimensions of each head RoPE turns."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def qk_norm(self) -> bool:
        """Whether each head's Q and K are RMS-normalized before RoPE (Qwen3)."""
        return self.architecture in _QK_NORM

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, per byte of element size."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim


@dataclass
class LoadedModel:
    """Parameters under Hugging Face names; `quantized`: the same names' undecoded GGUF
    blocks for the tensors stored in a type `kvloop.model.quant` runs (4-bit, Q8_0)."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    path: str
    name: str
    quantized: dict[str, RawTensor] = field(default_factory=dict)


# --- locating -------------------------------------------------------------------------------
def resolve_model_path(model: str | None) -> str:
    """None -> the embedded SmolLM2 GGUF; else a .gguf file or an HF folder with config.json
    (`kvloop.locate.find_model_path`; weights need the folder's config.json)."""
    path = find_model_path(model)
    if not path.endswith(".gguf") and not (Path(path) / "config.json").is_file():
        raise ModelNotFoundError(f"model {model!r} is a Hugging Face folder without "
                                 "config.json: a tokenizer, not a model to load")
    return path


def load_model(model: str | None) -> LoadedModel:
    """Read the config and all parameters (float tensors, not yet cast or fused)."""
    path = resolve_model_path(model)
    quantized: dict[str, RawTensor] = {}
    if path.endswith(".gguf"):
        config, weights, quantized = load_gguf(path)
    else:
        config, weights = load_hf_folder(path)
    weights = to_kvloop_layout(config, weights)
    quantized = to_kvloop_layout(config, quantized)
    return LoadedModel(config, weights, path, model_name_for(model), quantized)


# --- GGUF -----------------------------------------------------------------------------------
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",     # stacked [experts, out, in]
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
# llama.cpp's phi3 keeps Hugging Face's fused gate_up_proj under the name ffn_up
_GGUF_ARCH_LAYER_NAMES = {"phi3": {"ffn_up.weight": "mlp.gate_up_proj.weight"}}
_GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                      "output_norm.weight": "model.norm.weight",
                      "output.weight": "lm_head.weight",
                      "rope_freqs.weight": "rope_freq_factors"}
_GGUF_ROTARY_DIMS = ("phi3",)   # rope.dimension_count is the rotary part, not head_dim


def load_gguf(path: str
              ) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, RawTensor]]:
    """(config, dequantized weights, undecoded blocks of the 4-bit and Q8_0 tensors), all
    under Hugging Face names, Q and K rows in Hugging Face's order."""
    from kvloop.model.gguf import GGUFFile

    f = GGUFFile(path)
    config = gguf_config(f)
    permuted = config.architecture in _GGUF_PERMUTED_QK
    weights: dict[str, torch.Tensor] = {}
    for name, array in f.tensors():
        hf_name = _gguf_to_hf_name(name, config.architecture)
        if hf_name is None:
            continue
        tensor = torch.from_numpy(array)
        weights[hf_name] = _maybe_unpermute(hf_name, tensor, config) if permuted else tensor
    quantized: dict[str, RawTensor] = {}
    for name, raw in f.raw_tensors():
        hf_name = _gguf_to_hf_name(name, config.architecture)
        if hf_name is None:
            continue
        if permuted:
            order = _maybe_unpermute(hf_name, torch.arange(raw.shape[0])[:, None], config)
            raw = raw.permute_rows(order[:, 0].numpy())
        quantized[hf_name] = raw
    if "lm_head.weight" not in weights:
        config = _replace_tied(config, True)
    return config, weights, quantized


def gguf_config(f: Any) -> ModelConfig:
    arch = gguf_family(f.architecture)
    heads = int(f.arch_value("attention.head_count"))
    hidden = int(f.arch_value("embedding_length"))
    rope_dims = f.arch_value("rope.dimension_count")
    partial = arch in _GGUF_ROTARY_DIMS
    head_dim = int(f.arch_value("attention.key_length")
                   or (None if partial else rope_dims) or hidden // heads)
    vocab = f.arch_value("vocab_size")
    if vocab is None:
        vocab = f.tensor_shape("token_embd.weight")[0]
    return ModelConfig(
        architecture=arch, vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(f.arch_value("feed_forward_length")),
        num_hidden_layers=int(f.arch_value("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(f.arch_value("attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(f.arch_value("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(f.arch_value("rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(f),
        max_position_embeddings=_gguf_context_length(f),
        tie_word_embeddings="output.weight" not in f.tensor_names(),
        attention_bias=any(n.endswith("attn_q.bias") for n in f.tensor_names()),
        rotary_dim=int(rope_dims) if partial and rope_dims else None,
        moe=_gguf_moe(f))


def _gguf_context_length(f: Any) -> int:
    """context_length, capped by a sliding window as `_hf_context_length` caps it (llama.cpp
    writes phi3's; 0 there means none)."""
    length = int(f.arch_value("context_length", 4096))
    window = f.arch_value("attention.sliding_window")
    return min(length, int(window)) if window else length


def _gguf_moe(f: Any) -> MoEConfig | None:
    experts = f.arch_value("expert_count")
    if not experts:
        return None
    layers = int(f.arch_value("block_count"))
    names = set(f.tensor_names())
    return MoEConfig(
        num_experts=int(experts), num_experts_per_tok=int(f.arch_value("expert_used_count")),
        moe_intermediate_size=int(f.arch_value("expert_feed_forward_length")),
        norm_topk_prob=bool(f.arch_value("expert_weights_norm", True)),
        sparse_layers=tuple(i for i in range(layers)
                            if f"blk.{i}.ffn_gate_inp.weight" in names))


def _gguf_rope_scaling(f: Any) -> RopeScaling:
    if "rope_factors_long.weight" in f.tensor_names():      # llama.cpp's phi3 LongRoPE
        return RopeScaling(
            "longrope",
            original_max_position_embeddings=int(
                f.arch_value("rope.scaling.original_context_length")),
            short_factor=tuple(float(x) for x in f.tensor("rope_factors_short.weight")),
            long_factor=tuple(float(x) for x in f.tensor("rope_factors_long.weight")),
            attention_factor=float(f.arch_value("rope.scaling.attn_factor", 1.0)))
    kind = f.arch_value("rope.scaling.type")
    if kind in (None, "none"):
        return RopeScaling()
    if kind == "linear":
        return RopeScaling("linear", factor=float(f.arch_value("rope.scaling.factor", 1.0)))
    raise ValueError(f"unsupported GGUF rope scaling {kind!r}")


def _gguf_to_hf_name(name: str, arch: str) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk":
        return None
    local = _GGUF_ARCH_LAYER_NAMES.get(arch, {}).get(parts[2]) or _GGUF_LAYER_NAMES.get(parts[2])
    return f"model.layers.{parts[1]}.{local}" if local else None


def _maybe_unpermute(hf_name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    if ".q_proj." in hf_name:
        return _unpermute_qk(tensor, config.num_attention_heads)
    if ".k_proj." in hf_name:
        return _unpermute_qk(tensor, config.num_key_value_heads)
    return tensor


def _unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation: per head, rows (pair, 2) -> (2, pair)."""
    rows = w.shape[0]
    rest = tuple(w.shape[1:])
    half = rows // num_heads // 2
    return (w.reshape(num_heads, half, 2, *rest).transpose(1, 2)
            .reshape(rows, *rest).contiguous())


def _replace_tied(config: ModelConfig, tied: bool) -> ModelConfig:
    from dataclasses import replace

    return replace(config, tie_word_embeddings=tied)


# --- Hugging Face folders -------------------------------------------------------------------
def load_hf_folder(folder: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    root = Path(folder)
    with open(root / "config.json", encoding="utf-8") as f:
        config = hf_config(json.load(f))
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    return config, weights


def hf_config(cfg: dict[str, Any]) -> ModelConfig:
    """config.json -> ModelConfig: transformers 5's form (`rope_parameters` holding
    rope_theta, the scaling and partial_rotary_factor; `num_local_experts`) and the older one
    (`rope_scaling`, `rope_theta`, `num_experts` at the top)."""
    arch = hf_family(cfg)
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    rope = {**(cfg.get("rope_parameters") or {}), **(cfg.get("rope_scaling") or {})}
    partial = float(rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0)
    return ModelConfig(
        architecture=arch, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]), num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rope_scaling=_hf_rope_scaling(rope, cfg),
        max_position_embeddings=_hf_context_length(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        rotary_dim=int(head_dim * partial) if partial != 1.0 else None,
        moe=_hf_moe(cfg))


def _hf_moe(cfg: dict[str, Any]) -> MoEConfig | None:
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if not experts:
        return None
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    return MoEConfig(
        num_experts=experts, num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        sparse_layers=tuple(i for i in range(int(cfg["num_hidden_layers"]))
                            if i not in dense and (i + 1) % step == 0))


def _hf_context_length(cfg: dict[str, Any]) -> int:
    """max_position_embeddings, capped by a sliding window (not implemented: past the window
    full attention would differ from the model's)."""
    length = int(cfg.get("max_position_embeddings", 4096))
    window = cfg.get("sliding_window")
    if window and cfg.get("use_sliding_window", True):
        length = min(length, int(window))
    return length


def _hf_rope_scaling(rope: dict[str, Any], cfg: dict[str, Any]) -> RopeScaling:
    """`rope`: rope_parameters and rope_scaling merged (either may be absent)."""
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "su":                       # Phi-3's older name for LongRoPE
        kind = "longrope"
    if kind == "default":
        return RopeScaling()
    original = int(rope.get("original_max_position_embeddings")
                   or cfg.get("original_max_position_embeddings") or 8192)
    if kind == "longrope":
        return _longrope(rope, cfg, original)
    return RopeScaling(
        kind, factor=float(rope.get("factor", 1.0)),
        low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original)


def _longrope(rope: dict[str, Any], cfg: dict[str, Any], original: int) -> RopeScaling:
    """Phi-3's LongRoPE; the attention factor as transformers derives it when the config
    has none: sqrt(1 + ln(f) / ln(original)), f = max_position_embeddings / original."""
    factor = float(rope.get("factor")
                   or int(cfg.get("max_position_embeddings", original)) / original)
    attention = rope.get("attention_factor")
    if attention is None:
        attention = (math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0
                     else 1.0)
    return RopeScaling("longrope", factor=factor, original_max_position_embeddings=original,
                       short_factor=tuple(float(x) for x in rope["short_factor"]),
                       long_factor=tuple(float(x) for x in rope["long_factor"]),
                       attention_factor=float(attention))


# --- kvloop's layout ------------------------------------------------------------------------
def to_kvloop_layout(config: ModelConfig, tensors: dict[str, T]) -> dict[str, T]:
    """Both loaders' parameters (torch tensors, or a GGUF's undecoded `RawTensor`s) under the
    names the model code reads: fused Q/K/V and gate/up split, stacked experts one per
    expert, and Q and K rows in rotary order (`rotary_order`) where RoPE is partial."""
    out: dict[str, T] = {}
    for name, tensor in tensors.items():
        out.update(_split_fused(config, name, tensor))
    if config.rotary_dims != config.head_dim:
        out = {name: _rotary_rows(config, name, t) for name, t in out.items()}
    return out


def _split_fused(config: ModelConfig, name: str, tensor: T) -> dict[str, T]:
    """One parameter -> its parts under their own names (itself when it is not fused)."""
    d = config.head_dim
    if (qkv := _split_name(name, "self_attn.qkv_proj.")) is not None:
        prefix, local = qkv
        sizes = [config.num_attention_heads * d, config.num_key_value_heads * d,
                 config.num_key_value_heads * d]
        return _split_rows(tensor, sizes, [f"{prefix}self_attn.{p}.{local}"
                                           for p in ("q_proj", "k_proj", "v_proj")])
    if (gate_up := _split_name(name, "mlp.gate_up_proj.")) is not None:
        prefix, local = gate_up
        half = _num_rows(tensor) // 2
        return _split_rows(tensor, [half, half], [f"{prefix}mlp.{p}.{local}"
                                                  for p in ("gate_proj", "up_proj")])
    experts = _split_name(name, "mlp.experts.")
    if experts is not None and experts[1] in _STACKED_EXPERTS:
        return _split_experts(config, experts[0] + "mlp.experts.", experts[1], tensor)
    return {name: tensor}


def _split_name(name: str, marker: str) -> tuple[str, str] | None:
    """(what comes before `marker`, what comes after) when `name` holds it."""
    before, found, after = name.rpartition(marker)
    return (before, after) if found else None


# stacked experts [experts, out, in] -> the per-expert parts each holds (in row order)
_STACKED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "gate_proj": ("gate_proj",),
                    "up_proj": ("up_proj",), "down_proj": ("down_proj",)}


def _split_experts(config: ModelConfig, prefix: str, part: str, tensor: T) -> dict[str, T]:
    assert config.moe is not None, f"{prefix}{part}: stacked experts in a model without any"
    experts = config.moe.num_experts
    parts = _STACKED_EXPERTS[part]
    rows = _num_rows(tensor) // experts // len(parts)
    names = [f"{prefix}{e}.{p}.weight" for e in range(experts) for p in parts]
    return _split_rows(tensor, [rows] * len(names), names)


def _num_rows(tensor: Any) -> int:
    if isinstance(tensor, torch.Tensor):
        return int(tensor.reshape(-1, tensor.shape[-1]).shape[0]) if tensor.dim() > 1 \
            else int(tensor.shape[0])
    return int(tensor.shape[0])


def _split_rows(tensor: T, sizes: list[int], names: list[str]) -> dict[str, T]:
    out: dict[str, T] = {}
    first = 0
    for name, size in zip(names, sizes, strict=True):
        if isinstance(tensor, torch.Tensor):
            flat = tensor.reshape(-1, tensor.shape[-1]) if tensor.dim() > 1 else tensor
            out[name] = cast(T, flat[first:first + size].contiguous())
        else:
            out[name] = cast(T, tensor.rows(first, first + size))
        first += size
    return out


def rotary_order(head_dim: int, rotary_dim: int) -> list[int]:
    """Per head, kvloop's dimension i <- Hugging Face's dimension order[i]. HF turns the
    pairs (j, j + r/2), j < r/2, of the first r = rotary_dim dimensions and passes the rest;
    kvloop's kernel turns (i, i + D/2), i < D/2, with angle i (zero for i >= r/2, which
    leaves those dimensions as they are): so the turned pairs go to the front of each half
    and the passed dimensions fill the rest."""
    half_r, half_d = rotary_dim // 2, head_dim // 2
    passed = list(range(rotary_dim, head_dim))
    first = list(range(half_r)) + passed[:half_d - half_r]
    second = list(range(half_r, rotary_dim)) + passed[half_d - half_r:]
    return first + second


def _rotary_rows(config: ModelConfig, name: str, tensor: T) -> T:
    per_head = rotary_order(config.head_dim, config.rotary_dims)
    if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
        heads = 1
    elif ".self_attn.q_proj." in name:
        heads = config.num_attention_heads
    elif ".self_attn.k_proj." in name:
        heads = config.num_key_value_heads
    else:
        return tensor
    order = [h * config.head_dim + i for h in range(heads) for i in per_head]
    if isinstance(tensor, torch.Tensor):
        return cast(T, tensor[torch.tensor(order)].contiguous())
    return cast(T, tensor.permute_rows(np.asarray(order)))
