"""Tiny random models of each supported family, as Hugging Face folders and as GGUF files
written the way llama.cpp's converter writes that architecture, plus the transformers fp32
greedy reference and an engine driver (alone, batched, chunked, cached, preempted).

Used by test_model_archs.py (and by anything else that needs a tiny Qwen3, Phi-3, Qwen3-MoE
or Llama 3.x model). The tokenizer pieces come from test_model_tiny.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvloop.core.request import SamplingParams
from tests.test_model_tiny import (
    TINY_VOCAB,
    llama_cpp_permute,
    write_gguf_dims,
    write_gguf_tokenizer,
    write_hf_folder,
)

_COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
               bos_token_id=None, eos_token_id=2, pad_token_id=None)

LONGROPE_ORIGINAL = 64     # Phi-3's original context: every test sequence stays below it


def arch_config(arch: str, **overrides: Any):
    """A transformers config of `arch` ("qwen3", "llama3", "phi3", "qwen3moe"), tiny."""
    import transformers

    kwargs: dict[str, Any] = dict(_COMMON)
    if arch == "qwen3":
        cls = transformers.Qwen3Config
        kwargs.update(head_dim=32, rope_parameters={"rope_type": "default",
                                                    "rope_theta": 1e6})
    elif arch == "llama3":
        cls = transformers.LlamaConfig
        kwargs.update(tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    elif arch == "phi3":
        cls = transformers.Phi3Config
        rot = int(16 * 0.75) // 2
        kwargs.update(tie_word_embeddings=True, sliding_window=None,
                      original_max_position_embeddings=LONGROPE_ORIGINAL,
                      rope_parameters={
                          "rope_type": "longrope", "rope_theta": 1e4,
                          "partial_rotary_factor": 0.75,
                          "original_max_position_embeddings": LONGROPE_ORIGINAL,
                          "short_factor": [1.0 + 0.3 * i for i in range(rot)],
                          "long_factor": [2.0 + 1.5 * i for i in range(rot)]})
    elif arch == "qwen3moe":
        cls = transformers.Qwen3MoeConfig
        kwargs.update(num_hidden_layers=3, head_dim=16, moe_intermediate_size=32,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                      mlp_only_layers=[1], decoder_sparse_step=1,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    else:
        raise ValueError(arch)
    kwargs.update(overrides)
    return cls(**kwargs)


def arch_model(arch: str, seed: int = 0, **overrides: Any):
    """A random fp32 model of `arch` (weights ~ N(0, 0.2), larger than the init so that
    differences show; norms too)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(arch_config(arch, **overrides))
    model = model.float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def write_arch_folder(model, folder: Path, old_form: bool = False) -> Path:
    """save_pretrained + tokenizer files; `old_form`: config.json rewritten the way
    transformers 4.x wrote it (`rope_theta` and `rope_scaling` at the top, `num_experts`)."""
    write_hf_folder(model, folder)
    if old_form:
        path = folder / "config.json"
        cfg = json.loads(path.read_text())
        rope = dict(cfg.pop("rope_parameters"))
        cfg["rope_theta"] = rope.pop("rope_theta")
        if "partial_rotary_factor" in rope:
            cfg["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
        if rope.get("rope_type") == "longrope":
            rope["type"] = "su"               # Phi-3's first name for it
            del rope["rope_type"]
        cfg["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
        if "num_local_experts" in cfg:
            cfg["num_experts"] = cfg.pop("num_local_experts")
        cfg.pop("layer_types", None)
        path.write_text(json.dumps(cfg))
    return folder


# --- GGUF, llama.cpp's names per architecture ------------------------------------------------
_GGUF_ARCH = {"qwen3": "qwen3", "llama3": "llama", "phi3": "phi3", "qwen3moe": "qwen3moe"}
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "self_attn.qkv_proj": "attn_qkv",
          "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "mlp.gate_up_proj": "ffn_up",        # phi3: the fused tensor, named ffn_up
          "mlp.gate": "ffn_gate_inp"}


def write_arch_gguf(model, arch: str, path: Path, quant: str | None = None) -> Path:
    """`model` as llama.cpp's converter writes `arch` (F32 tensors; `quant`, e.g. "Q4_0":
    the 2-D and 3-D matrices other than the embedding in that type) + the tiny tokenizer."""
    import gguf

    cfg = model.config
    name = _GGUF_ARCH[arch]
    w = gguf.GGUFWriter(str(path), name)
    _write_hparams(w, cfg, arch)
    write_gguf_tokenizer(w)
    for tensor_name, array in _gguf_tensors(model, arch):
        qtype = _quant_type(tensor_name, array, quant)
        if qtype is None:
            w.add_tensor(tensor_name, array)
        else:
            w.add_tensor(tensor_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _quant_type(name: str, array: np.ndarray, quant: str | None):
    import gguf

    if quant is None or array.ndim < 2 or name.startswith(("token_embd", "output")):
        return None
    if name.endswith("ffn_gate_inp.weight"):          # llama.cpp keeps the router in F32
        return None
    return gguf.GGMLQuantizationType[quant]


def _write_hparams(w, cfg, arch: str) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters
    write_gguf_dims(w, cfg)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if arch in ("qwen3", "qwen3moe"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "phi3":
        _write_longrope(w, cfg, head_dim)
        w.add_sliding_window(cfg.sliding_window or 0)
    if arch == "qwen3moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_bool(f"{w.arch}.expert_weights_norm", bool(cfg.norm_topk_prob))


def _write_longrope(w, cfg, head_dim: int) -> None:
    import math

    rope = cfg.rope_parameters
    original = rope["original_max_position_embeddings"]
    w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * cfg.hidden_size)
                               // cfg.num_attention_heads)
    w.add_rope_scaling_orig_ctx_len(original)
    scale = cfg.max_position_embeddings / original
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))


def _gguf_tensors(model, arch: str):
    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    yield "token_embd.weight", sd.pop("model.embed_tokens.weight")
    yield "output_norm.weight", sd.pop("model.norm.weight")
    head = sd.pop("lm_head.weight", None)
    if not cfg.tie_word_embeddings:
        yield "output.weight", head
    yield from _extra_tensors(model, arch)
    for i in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{i}."
        mine = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
        yield from _experts(mine, i)
        for local, value in mine.items():
            stem = local.removesuffix(".weight")
            if stem in _LAYER:
                yield f"blk.{i}.{_LAYER[stem]}.weight", np.ascontiguousarray(
                    _llama_permuted(arch, stem, value, cfg))


def _llama_permuted(arch: str, stem: str, value: np.ndarray, cfg) -> np.ndarray:
    if arch != "llama3":
        return value
    if stem == "self_attn.q_proj":
        return llama_cpp_permute(value, cfg.num_attention_heads)
    if stem == "self_attn.k_proj":
        return llama_cpp_permute(value, cfg.num_key_value_heads)
    return value


def _experts(layer: dict[str, np.ndarray], i: int):
    """transformers' stacked experts (gate_up_proj [E, 2F, H], down_proj [E, H, F]) ->
    llama.cpp's ffn_{gate,up,down}_exps [E, out, in]; popped from `layer`."""
    if "mlp.experts.gate_up_proj" not in layer:
        return
    gate_up = layer.pop("mlp.experts.gate_up_proj")
    half = gate_up.shape[1] // 2
    yield f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(gate_up[:, :half])
    yield f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(gate_up[:, half:])
    yield f"blk.{i}.ffn_down_exps.weight", np.ascontiguousarray(
        layer.pop("mlp.experts.down_proj"))


def _extra_tensors(model, arch: str):
    """llama.cpp's generated tensors: rope_freqs (Llama 3.1: the divisor of each inverse
    frequency, taken from transformers' own llama3 frequencies) and Phi-3's LongRoPE
    factors."""
    cfg = model.config
    rope = cfg.rope_parameters
    if arch == "llama3":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, torch.device("cpu"))
        dim = cfg.hidden_size // cfg.num_attention_heads
        base = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))
        yield "rope_freqs.weight", (base / scaled).numpy().astype(np.float32)
    if arch == "phi3":
        yield "rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32)
        yield "rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32)


# --- the reference and the engine ------------------------------------------------------------
MAX_TOKENS = 6


def reference_greedy(model, prompt: list[int], steps: int = MAX_TOKENS
                     ) -> tuple[list[int], list[float]]:
    """transformers fp32 greedy: (tokens, each one's logprob), each step a full forward."""
    seq = list(prompt)
    tokens, logprobs = [], []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0, -1].float()
        lp = torch.log_softmax(logits, dim=-1)
        tok = int(lp.argmax())
        tokens.append(tok)
        logprobs.append(float(lp[tok]))
        seq.append(tok)
    return tokens, logprobs


@dataclass
class Run:
    """What an engine produced per request: tokens, their logprobs, and what happened."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[float]] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)
    prefix_hits: dict[str, int] = field(default_factory=dict)


def make_engine(runner, num_blocks: int, budget: int = 2048):
    from kvloop.core.engine import EngineCore
    from kvloop.llm import engine_config

    config = engine_config(runner.max_model_len, block_size=runner.block_size,
                           max_num_batched_tokens=budget, check_invariants=True)
    return EngineCore(config, runner, num_gpu_blocks=num_blocks)


def run_engine(engine, prompts: dict[str, list[int]], out: Run | None = None) -> Run:
    """Add every prompt (greedy, MAX_TOKENS, logprobs) and step until all finish (bounded)."""
    out = out or Run()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1,
                            ignore_eos=True)
    for rid, ids in prompts.items():
        engine.add_request(engine.make_request(rid, ids, params))
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        result = engine.step()
        assert result.record is not None
        out.preempted.update(result.record.preempted)
        out.prefix_hits.update(result.record.admitted)
        for o in result.outputs:
            out.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            out.logprobs.setdefault(o.request_id, []).extend(
                lp.logprob for lp in o.new_logprobs or [])
    assert not engine.has_unfinished_requests()
    return out
