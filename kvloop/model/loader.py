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

from kvloop.locate import ModelNotFoundError, find_model_path, model_name_for
from kvloop.model.gguf import RawTensor

HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                    "Qwen2ForCausalLM": "qwen2"}
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2")
_GGUF_PERMUTED_QK = ("llama", "mistral")


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

    def __post_init__(self) -> None:
        if self.architecture not in GGUF_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; "
                             f"supported: {', '.join(GGUF_ARCHITECTURES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.rope_scaling.rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope scaling {self.rope_scaling.rope_type!r}")

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
    weights: dict[str, torch.Tensor] = {}
    for name, array in f.tensors():
        hf_name = _gguf_to_hf_name(name)
        if hf_name is None:
            continue
        tensor = torch.from_numpy(array)
        weights[hf_name] = _maybe_unpermute(hf_name, tensor, config) if permuted else tensor
    quantized: dict[str, RawTensor] = {}
    for name, raw in f.raw_tensors():
        hf_name = _gguf_to_hf_name(name)
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
        max_position_embeddings=int(f.arch_value("context_length", 4096)),
        tie_word_embeddings="output.weight" not in f.tensor_names(),
        attention_bias=any(n.endswith("attn_q.bias") for n in f.tensor_names()))


def _gguf_rope_scaling(f: Any) -> RopeScaling:
    kind = f.arch_value("rope.scaling.type")
    if kind in (None, "none"):
        return RopeScaling()
    if kind == "linear":
        return RopeScaling("linear", factor=float(f.arch_value("rope.scaling.factor", 1.0)))
    raise ValueError(f"unsupported GGUF rope scaling {kind!r}")


def _gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}"
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
    return ModelConfig(
        architecture=arch, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]), num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rope_scaling=_hf_rope_scaling(scaling),
        max_position_embeddings=_hf_context_length(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)))


def _hf_context_length(cfg: dict[str, Any]) -> int:
    """max_position_embeddings, capped by a sliding window (not implemented: past the window
    full attention would differ from the model's)."""
    length = int(cfg.get("max_position_embeddings", 4096))
    window = cfg.get("sliding_window")
    if window and cfg.get("use_sliding_window", True):
        length = min(length, int(window))
    return length


def _hf_architecture(cfg: dict[str, Any]) -> str:
    for name in cfg.get("architectures") or []:
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    model_type = cfg.get("model_type")
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
