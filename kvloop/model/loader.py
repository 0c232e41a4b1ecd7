"""Model files -> (ModelConfig, parameters): GGUF files and Hugging Face folders.

Scope: weights and shape hyper-parameters only (the tokenizer lives in
`kvloop.front.tokenizer`). Parameters come back under Hugging Face Llama names
(`model.layers.0.self_attn.q_proj.weight`...), so both sources feed the same model code.

GGUF notes: llama.cpp's converter permutes the rows of Q and K for the "llama" architecture
(interleaved rotary pairs); `_unpermute_qk` restores Hugging Face's half-split layout. A
`rope_freqs.weight` tensor (Llama 3.1 scaling) is kept as `rope_freq_factors`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvloop.core.kv_cache_groups import KVCacheGroupSpec, group_size, kv_cache_groups
from kvloop.locate import ModelNotFoundError, find_model_path, model_name_for
from kvloop.model.gguf import RawTensor

HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                    "Qwen2ForCausalLM": "qwen2", "Gemma3ForCausalLM": "gemma3"}
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "gemma3")
_HF_MODEL_TYPES = {"gemma3_text": "gemma3"}
_GGUF_PERMUTED_QK = ("llama", "mistral")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: "linear" or "llama3" (Llama 3.1); None type = plain RoPE."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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
    # sliding-window attention: the window (tokens a query sees, itself included) and each
    # layer's type ("sliding_attention" / "full_attention"); no types: every layer slides
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # Gemma 3 (`kvloop.model.gemma3`): the sliding layers' RoPE base, the attention scale's
    # 1/sqrt(query_pre_attn_scalar), the MLP activation and a tanh cap on the logits
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    hidden_activation: str = "silu"
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        if self.architecture not in GGUF_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; "
                             f"supported: {', '.join(GGUF_ARCHITECTURES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.rope_scaling.rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope scaling {self.rope_scaling.rope_type!r}")
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"{len(self.layer_types)} layer_types for "
                             f"{self.num_hidden_layers} layers")
        unknown = set(self.layer_types) - set(LAYER_TYPES)
        if unknown:
            raise ValueError(f"unsupported layer types {sorted(unknown)}; "
                             f"supported: {', '.join(LAYER_TYPES)}")

    def layer_window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: full attention)."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def kv_cache_groups(self) -> tuple[KVCacheGroupSpec, ...]:
        """The KV-cache groups of the layers (`kvloop.core.kv_cache_groups`)."""
        return kv_cache_groups([self.layer_window(i) for i in range(self.num_hidden_layers)])

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token of one block, per byte of element size: a block holds
        the layers of one KV-cache group (all layers for a model of one attention type)."""
        return 2 * group_size(self.kv_cache_groups) * self.num_key_value_heads * self.head_dim


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
}
_GGUF_GEMMA3_LAYER_NAMES = {   # Gemma 3's four norms (llama.cpp's names) and q/k norms
    **_GGUF_LAYER_NAMES,
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                      "output_norm.weight": "model.norm.weight",
                      "output.weight": "lm_head.weight",
                      "rope_freqs.weight": "rope_freq_factors"}


def load_gguf(path: str
              ) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, RawTensor]]:
    """(config, dequantized weights, undecoded blocks of the 4-bit and Q8_0 tensors), all
    under Hugging Face names, Q and K rows in Hugging Face's order."""
    from kvloop.model.gguf import GGUFFile

    f = GGUFFile(path)
    config = gguf_config(f)
    permuted = config.architecture in _GGUF_PERMUTED_QK
    layer_names = _GGUF_GEMMA3_LAYER_NAMES if config.architecture == "gemma3" else None
    weights: dict[str, torch.Tensor] = {}
    for name, array in f.tensors():
        hf_name = _gguf_to_hf_name(name, layer_names)
        if hf_name is None:
            continue
        tensor = torch.from_numpy(array)
        if layer_names is not None and hf_name.endswith("norm.weight"):
            tensor = tensor - 1.0    # llama.cpp stores Gemma's norms as 1 + w; HF keeps w
        weights[hf_name] = _maybe_unpermute(hf_name, tensor, config) if permuted else tensor
    quantized: dict[str, RawTensor] = {}
    for name, raw in f.raw_tensors():
        hf_name = _gguf_to_hf_name(name, layer_names)
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
    arch = f.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; "
                         f"supported: {', '.join(GGUF_ARCHITECTURES)}")
    heads = int(f.arch_value("attention.head_count"))
    hidden = int(f.arch_value("embedding_length"))
    head_dim = int(f.arch_value("attention.key_length") or f.arch_value("rope.dimension_count")
                   or hidden // heads)
    vocab = f.arch_value("vocab_size")
    if vocab is None:
        vocab = f.tensor_shape("token_embd.weight")[0]
    kwargs: dict[str, Any] = dict(
        architecture=arch, vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(f.arch_value("feed_forward_length")),
        num_hidden_layers=int(f.arch_value("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(f.arch_value("attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(f.arch_value("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(f.arch_value("rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(f),
        max_position_embeddings=int(f.arch_value("context_length", 4096)),
        tie_word_embeddings="output.weight" not in f.tensor_names(),
        attention_bias=any(n.endswith("attn_q.bias") for n in f.tensor_names()))
    if arch == "gemma3":
        kwargs.update(_gguf_gemma3(f, hidden, heads, head_dim))
    return ModelConfig(**kwargs)


def _gguf_gemma3(f: Any, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    """Gemma 3 as llama.cpp runs it: every 6th layer global (or the file's
    `attention.sliding_window_pattern`), local RoPE base 10000, attention scale
    1/sqrt(head_dim) (1/sqrt(hidden / heads) for the 62-layer 27B)."""
    layers = int(f.arch_value("block_count"))
    pattern = f.arch_value("attention.sliding_window_pattern")
    pattern = int(pattern) if isinstance(pattern, int | float) else 6
    scalar = hidden // heads if layers == 62 else head_dim
    return {"sliding_window": int(f.arch_value("attention.sliding_window", 4096)),
            "layer_types": tuple("sliding_attention" if (i + 1) % pattern else
                                 "full_attention" for i in range(layers)),
            "rope_local_theta": 10_000.0, "query_pre_attn_scalar": float(scalar),
            "hidden_activation": "gelu_pytorch_tanh",
            "rms_norm_eps": float(f.arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(f.arch_value("rope.freq_base", 1_000_000.0))}


def _gguf_rope_scaling(f: Any) -> RopeScaling:
    kind = f.arch_value("rope.scaling.type")
    if kind in (None, "none"):
        return RopeScaling()
    if kind == "linear":
        return RopeScaling("linear", factor=float(f.arch_value("rope.scaling.factor", 1.0)))
    raise ValueError(f"unsupported GGUF rope scaling {kind!r}")


def _gguf_to_hf_name(name: str, layer_names: dict[str, str] | None = None) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    names = layer_names or _GGUF_LAYER_NAMES
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}"
    return None


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
    arch = _hf_architecture(cfg)
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type") else None)
    extra = _hf_sliding_window(cfg, arch)
    if arch == "gemma3":
        extra.update(_hf_gemma3(cfg))
    kwargs: dict[str, Any] = dict(
        architecture=arch, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]), num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rope_scaling=_hf_rope_scaling(scaling),
        max_position_embeddings=_hf_context_length(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch == "gemma3")),
        attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)))
    kwargs.update(extra)
    return ModelConfig(**kwargs)


def _hf_context_length(cfg: dict[str, Any]) -> int:
    return int(cfg.get("max_position_embeddings", 4096))


def _hf_sliding_window(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """`sliding_window` and `layer_types` as transformers 5.x reads them: `layer_types`
    when the config lists them; else Qwen2's `use_sliding_window` (off: no window) with
    layers from `max_window_layers` on sliding; else (Mistral) every layer slides."""
    window = cfg.get("sliding_window") or (4096 if arch == "gemma3" else None)
    if arch == "qwen2" and not cfg.get("use_sliding_window", False):
        window = None
    if not window:
        return {}
    types = None if arch == "mistral" else cfg.get("layer_types")   # Mistral: every layer
    if types is None and arch == "gemma3":   # the older form: every `pattern`-th is global
        pattern = int(cfg.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(int(cfg["num_hidden_layers"]))]
    if types is None and arch == "qwen2":
        first = int(cfg.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= first else "full_attention"
                 for i in range(int(cfg["num_hidden_layers"]))]
    return {"sliding_window": int(window), "layer_types": tuple(types or ())}


def _hf_gemma3(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's fields, from transformers 5.x's per-layer-type `rope_parameters` or the
    older `rope_theta` / `rope_local_base_freq` / `rope_scaling` (full layers only)."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not supported (Gemma 3 configs have none)")
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention") or {}
    local = rope.get("sliding_attention") or {}
    scaling = cfg.get("rope_scaling") or (full if full.get("rope_type") else None)
    return {
        "head_dim": int(cfg.get("head_dim") or 256),
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(full.get("rope_theta") or cfg.get("rope_theta") or 1_000_000.0),
        "rope_scaling": _hf_rope_scaling(scaling),
        "rope_local_theta": float(local.get("rope_theta") or cfg.get("rope_local_base_freq")
                                  or 10_000.0),
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or 256),
        "hidden_activation": str(cfg.get("hidden_activation") or "gelu_pytorch_tanh"),
        "final_logit_softcapping": cfg.get("final_logit_softcapping"),
    }


def _hf_architecture(cfg: dict[str, Any]) -> str:
    for name in cfg.get("architectures") or []:
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    model_type = cfg.get("model_type")
    if model_type in _HF_MODEL_TYPES:
        return _HF_MODEL_TYPES[model_type]
    if model_type in GGUF_ARCHITECTURES:
        return str(model_type)
    raise ValueError(f"unsupported model: architectures={cfg.get('architectures')}, "
                     f"model_type={model_type!r}; supported: {', '.join(HF_ARCHITECTURES)}")


def _hf_rope_scaling(scaling: dict[str, Any] | None) -> RopeScaling:
    if not scaling:
        return RopeScaling()
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return RopeScaling()
    return RopeScaling(
        kind, factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            scaling.get("original_max_position_embeddings", 8192)))
