"""Sliding-window models on the whole engine against transformers fp32, token for token.

Tiny random Qwen2 (`use_sliding_window`, layers from `max_window_layers` on slide: a hybrid
of a full-attention group and sliding-window groups) and Mistral (every layer slides), with
a window of 8 tokens and blocks of 4, and prompts of 20-30 tokens, so every request reaches
far past the window and its sliding-window blocks are freed while it runs. Each setup runs
through `LLM` (with the engine's invariant checks after every step): alone, batched,
chunked (8-token steps), cached (shared prefixes, run twice) and preempted (a pool too small
for the batch); the greedy tokens must equal transformers' and the logprobs be within 1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvloop import LLM, SamplingParams
from tests.test_model_tiny import (
    TINY_VOCAB,
    gguf_tokenizer_metadata,
    write_gguf_dims,
    write_hf_folder,
)

WINDOW = 8
MAX_TOKENS = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def tiny_sliding_model(arch: str, seed: int, window: int = WINDOW):
    import transformers

    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=2, sliding_window=window)
    if arch == "qwen2":
        config = transformers.Qwen2Config(num_hidden_layers=3, use_sliding_window=True,
                                          max_window_layers=1, rope_theta=10000.0, **common)
        model_cls = transformers.Qwen2ForCausalLM
    elif arch == "mistral":
        config = transformers.MistralConfig(num_hidden_layers=2, rope_theta=10000.0, **common)
        model_cls = transformers.MistralForCausalLM
    else:
        config = gemma3_config(arch, common)
        model_cls = transformers.Gemma3ForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def gemma3_config(arch: str, common: dict):
    """Gemma 3: four layers (sliding, sliding, global, sliding), query_pre_attn_scalar apart
    from head_dim, local and global RoPE bases apart, a logit cap, tied embeddings. The
    GGUF variant keeps what llama.cpp fixes: every 6th layer global (six layers), local base
    10000, scale 1/sqrt(head_dim), no logit cap."""
    import transformers

    common = {**common, "tie_word_embeddings": True, "head_dim": 16}
    if arch == "gemma3-gguf":
        return transformers.Gemma3TextConfig(
            num_hidden_layers=6, query_pre_attn_scalar=16,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": 10000.0}}, **common)
    return transformers.Gemma3TextConfig(
        num_hidden_layers=4, query_pre_attn_scalar=24, final_logit_softcapping=5.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
        **common)


def reference(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs, each from a full forward pass."""
    seq = list(prompt)
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([seq])).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            token = int(lp.argmax())
            tokens.append(token)
            logprobs.append(float(lp[token]))
            seq.append(token)
    return tokens, logprobs


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    shared = rng.integers(3, TINY_VOCAB, 14).tolist()
    out = [shared + rng.integers(3, TINY_VOCAB, n).tolist() for n in (6, 11, 16)]
    out.append(rng.integers(3, TINY_VOCAB, 23).tolist())
    return out


@pytest.fixture(scope="module", params=["qwen2", "mistral", "gemma3", "gemma3-gguf"])
def setup(request, tmp_path_factory):
    arch = request.param
    model = tiny_sliding_model(arch, seed=3)
    root = tmp_path_factory.mktemp(arch)
    if arch == "gemma3-gguf":
        path = write_gemma3_gguf(model, root / "g.gguf")
    else:
        path = write_hf_folder(model, root / "m")
    want = [reference(model, p) for p in prompts()]
    # the window matters: with a window longer than every sequence some token differs
    unbounded = tiny_sliding_model(arch, seed=3, window=1024)
    unbounded.load_state_dict(model.state_dict())
    assert any(reference(unbounded, p)[0] != w[0]   # (stops at the first prompt that differs)
               for p, w in zip(prompts(), want, strict=True))
    return arch, path, want


def make_llm(folder, **kw) -> LLM:
    kw.setdefault("num_gpu_blocks_override", 96)
    return LLM(str(folder), dtype="float32", device="cpu", block_size=4, num_threads=1,
               check_invariants=True, **kw)


def run(llm: LLM, batch: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], PARAMS, use_tqdm=False)
    got = []
    for out in outs:
        (c,) = out.outputs
        got.append((list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids,
                                                                       strict=True)]))
    return got


def assert_same(got, want) -> None:
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want, strict=True):
        assert tokens == want_tokens
        assert np.allclose(lps, want_lps, atol=1e-4, rtol=0)


GROUPS = {
    "qwen2": [("full_attention", (0,)), ("sliding_window", (1,)), ("sliding_window", (2,))],
    "mistral": [("sliding_window", (0, 1))],
    "gemma3": [("full_attention", (2,)), ("sliding_window", (0,)), ("sliding_window", (1,)),
               ("sliding_window", (3,))],
    "gemma3-gguf": [("full_attention", (5,)), ("sliding_window", (0,)),
                    ("sliding_window", (1,)), ("sliding_window", (2,)),
                    ("sliding_window", (3,)), ("sliding_window", (4,))],
}


def test_groups_of_the_loaded_model(setup):
    arch, path, _ = setup
    llm = make_llm(path)
    try:
        groups = llm.engine.kv_cache_manager.groups
        assert [(g.kind, g.layers) for g in groups] == GROUPS[arch]
        assert {g.sliding_window for g in groups if g.kind == "sliding_window"} == {WINDOW}
    finally:
        llm.shutdown()


def test_alone_batched_and_cached(setup):
    _, folder, want = setup
    llm = make_llm(folder)
    try:
        for i, p in enumerate(prompts()):
            assert_same(run(llm, [p]), [want[i]])
        assert_same(run(llm, prompts()), want)         # batched, and prefix hits now
        stats = llm.engine.kv_cache_manager.block_pool
        assert stats.get_num_free_blocks() == stats.num_usable_blocks
    finally:
        llm.shutdown()


def test_chunked(setup):
    _, folder, want = setup
    llm = make_llm(folder, max_num_batched_tokens=8, max_model_len=64)
    try:
        assert_same(run(llm, prompts()), want)
        assert_same(run(llm, prompts()), want)         # chunks after prefix hits
    finally:
        llm.shutdown()


# the smallest pools that hold one request of max_model_len 40 in every group: two of them
# preempt a request; an all-sliding model (Mistral) never grows past its window, and six
# groups (the GGUF Gemma) admit so conservatively that nothing is preempted
PREEMPT_POOL = {"qwen2": (31, 1), "gemma3": (41, 1), "gemma3-gguf": (61, 0), "mistral": (11, 0)}


def test_tight_pool_and_preempted(setup):
    arch, folder, want = setup
    pool, preemptions = PREEMPT_POOL[arch]
    llm = make_llm(folder, num_gpu_blocks_override=pool, max_model_len=40)
    try:
        assert_same(run(llm, prompts()), want)
        assert llm.engine.scheduler.num_preemptions_total == preemptions
    finally:
        llm.shutdown()


def write_gemma3_gguf(model, path):
    """`model` as llama.cpp's converter writes Gemma 3: its tensor names, norms stored as
    1 + w, Q and K rows as they are, no output tensor (tied)."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    write_gguf_dims(w, cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_sliding_window(cfg.sliding_window)
    w.add_vocab_size(cfg.vocab_size)
    meta = gguf_tokenizer_metadata()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_eos_token_id(2)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"] + 1)
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            w.add_tensor(f"blk.{i}.{gg}.weight", t + 1 if gg.endswith("norm") else t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_auto_budget_calibrates_a_hybrid_model(setup):
    """`--max-num-batched-tokens auto` (kvloop serve's default) times synthetic steps that
    name no KV-cache group but the first: the runner must take them (it failed to start)."""
    arch, folder, want = setup
    if arch != "gemma3":
        pytest.skip("one hybrid model is enough")
    llm = make_llm(folder, max_num_batched_tokens="auto", target_tpot_ms=10_000.0,
                   num_gpu_blocks_override=2048, max_num_seqs=4)
    try:
        assert_same(run(llm, prompts()[:1]), want[:1])
    finally:
        llm.shutdown()


def test_a_bf16_kv_cache_beside_fp32(setup):
    """`--kv-cache-dtype bfloat16` on the windowed paths (their torch attention reads the
    bf16 cache widened): transformers' greedy tokens alone, batched on prefix hits and in
    8-token chunks, the logprobs within what bf16 K and V's rounding moves them (measured
    when written: at most 0.0074 apart, on the GGUF Gemma 3)."""
    _, folder, want = setup
    for kw in ({}, {"max_num_batched_tokens": 8, "max_model_len": 64}):
        llm = make_llm(folder, kv_cache_dtype="bfloat16", **kw)
        try:
            assert {c.dtype for c in llm.runner.kv_caches} == {torch.bfloat16}
            for i, p in enumerate(prompts()):
                assert_close(run(llm, [p]), [want[i]])
            assert_close(run(llm, prompts()), want)
        finally:
            llm.shutdown()


def assert_close(got, want) -> None:
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want, strict=True):
        assert tokens == want_tokens
        assert np.allclose(lps, want_lps, atol=2e-2, rtol=0), np.abs(
            np.array(lps) - np.array(want_lps)).max()
