"""Qwen3, Llama 3.x (llama3 RoPE), Phi-3 (fused projections, partial LongRoPE) and Qwen3-MoE
on kvloop's engine against transformers fp32, from a Hugging Face folder and from a GGUF file
written with llama.cpp's names for the architecture.

For each: greedy tokens equal to transformers' token for token, and each token's logprob
within 1e-4, for a request alone, in a batch, in small chunks (a 5-token budget), after a
prefix-cache hit, and after a preemption (a pool too small for the batch).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from kvloop.config import RunnerConfig
from kvloop.model import load_runner
from kvloop.model.loader import hf_config, load_model
from kvloop.model.quant import low_bit_supported
from tests.arch_helpers import (
    LONGROPE_ORIGINAL,
    MAX_TOKENS,
    Run,
    arch_model,
    make_engine,
    reference_greedy,
    run_engine,
    write_arch_folder,
    write_arch_gguf,
)
from tests.test_model_tiny import TINY_VOCAB

BS = 4
POOL = 64


def _prompts() -> dict[str, list[int]]:
    rng = np.random.default_rng(7)
    tok = lambda n: rng.integers(3, TINY_VOCAB, n).tolist()  # noqa: E731
    a = tok(14)
    return {"a": a, "b": a[:8] + tok(5), "c": tok(6)}       # b shares a's first 2 blocks


def _runner(path):
    return load_runner(RunnerConfig(model=str(path), dtype="float32", device="cpu",
                                    block_size=BS, num_threads=1,
                                    num_gpu_blocks_override=POOL))


def _assert_matches(run: Run, expected: dict[str, tuple[list[int], list[float]]],
                    what: str) -> None:
    for rid, (tokens, logprobs) in expected.items():
        assert run.tokens[rid] == tokens, f"{what}, request {rid}"
        got = run.logprobs[rid]
        assert len(got) == MAX_TOKENS
        worst = max(abs(x - y) for x, y in zip(got, logprobs, strict=True))
        assert worst <= 1e-4, f"{what}, request {rid}: logprob off by {worst}"


CASES = [("qwen3", "hf"), ("qwen3", "hf-old"), ("qwen3", "gguf"),
         ("llama3", "hf"), ("llama3", "hf-old"), ("llama3", "gguf"),
         ("phi3", "hf"), ("phi3", "hf-old"), ("phi3", "gguf"),
         ("qwen3moe", "hf"), ("qwen3moe", "hf-old"), ("qwen3moe", "gguf")]


@pytest.mark.parametrize("arch,source", CASES, ids=[f"{a}-{s}" for a, s in CASES])
def test_greedy_equals_transformers_however_scheduled(tmp_path, arch, source):
    # llama.cpp's qwen3moe has no dense layers: the GGUF model has experts in every layer
    overrides = {"mlp_only_layers": []} if (arch, source) == ("qwen3moe", "gguf") else {}
    hf = arch_model(arch, seed=1, **overrides)
    if source == "gguf":
        path = write_arch_gguf(hf, arch, tmp_path / "m.gguf")
    else:
        path = write_arch_folder(hf, tmp_path / "m", old_form=source == "hf-old")
    runner = _runner(path)
    prompts = _prompts()
    expected = {rid: reference_greedy(hf, ids) for rid, ids in prompts.items()}

    for rid, ids in prompts.items():                               # alone
        _assert_matches(run_engine(make_engine(runner, POOL), {rid: ids}),
                        {rid: expected[rid]}, "alone")
    engine = make_engine(runner, POOL)
    batched = run_engine(engine, prompts)
    _assert_matches(batched, expected, "batched")
    assert batched.prefix_hits["b"] == 8                         # b hit a's two blocks
    again = run_engine(engine, {"a2": prompts["a"]})               # a's 3 full blocks cached
    assert again.prefix_hits == {"a2": 12}
    _assert_matches(again, {"a2": expected["a"]}, "cached")
    chunked = run_engine(make_engine(runner, POOL, budget=5), prompts)
    _assert_matches(chunked, expected, "chunked")
    tiny = run_engine(make_engine(runner, 8), prompts)
    assert tiny.preempted, "the tiny pool should have forced a preemption"
    _assert_matches(tiny, expected, "preempted")


def test_config_forms_agree_and_name_the_parts(tmp_path):
    """transformers 5's config.json and the older form give the same ModelConfig; the parts
    each family needs are read."""
    for arch in ("qwen3", "llama3", "phi3", "qwen3moe"):
        hf = arch_model(arch)
        new = json.loads((write_arch_folder(hf, tmp_path / arch) / "config.json").read_text())
        old = json.loads((write_arch_folder(hf, tmp_path / f"{arch}-old", old_form=True)
                          / "config.json").read_text())
        assert "rope_parameters" in new and "rope_parameters" not in old
        assert hf_config(new) == hf_config(old), arch
    phi = hf_config(new := json.loads((tmp_path / "phi3" / "config.json").read_text()))
    assert (phi.architecture, phi.head_dim, phi.rotary_dim) == ("phi3", 16, 12)
    assert phi.rope_scaling.rope_type == "longrope"
    assert phi.rope_scaling.attention_factor == pytest.approx(
        math.sqrt(1 + math.log(256 / LONGROPE_ORIGINAL) / math.log(LONGROPE_ORIGINAL)))
    moe = hf_config(json.loads((tmp_path / "qwen3moe" / "config.json").read_text()))
    assert moe.moe is not None and moe.qk_norm
    assert (moe.moe.num_experts, moe.moe.num_experts_per_tok, moe.moe.sparse_layers,
            moe.moe.norm_topk_prob) == (8, 2, (0, 2), True)
    assert "num_local_experts" in json.loads(
        (tmp_path / "qwen3moe" / "config.json").read_text())
    llama = hf_config(json.loads((tmp_path / "llama3" / "config.json").read_text()))
    assert (llama.rope_scaling.rope_type, llama.rope_scaling.factor,
            llama.rope_scaling.original_max_position_embeddings) == ("llama3", 8.0, 16)
    assert new["architectures"] == ["Phi3ForCausalLM"]


def test_gguf_and_folder_load_the_same_weights(tmp_path):
    """Both loaders end in the same names and values: fused and stacked tensors split,
    llama's Q/K unpermuted, partial-RoPE rows reordered alike; GGUF's config equals the
    folder's where GGUF carries the field."""
    for arch in ("qwen3", "llama3", "phi3", "qwen3moe"):
        overrides = {"mlp_only_layers": []} if arch == "qwen3moe" else {}
        hf = arch_model(arch, seed=2, **overrides)
        folder = load_model(str(write_arch_folder(hf, tmp_path / arch)))
        gguf = load_model(str(write_arch_gguf(hf, arch, tmp_path / f"{arch}.gguf")))
        assert gguf.config.architecture == folder.config.architecture
        assert (gguf.config.head_dim, gguf.config.rotary_dims, gguf.config.moe) == (
            folder.config.head_dim, folder.config.rotary_dims, folder.config.moe)
        names = set(folder.weights) - {"lm_head.weight"}
        assert names <= set(gguf.weights), sorted(names - set(gguf.weights))
        for name in names:
            assert torch.equal(gguf.weights[name], folder.weights[name]), (arch, name)


def test_longrope_tables_switch_to_long_factors_at_the_original_context():
    """Positions below `original_max_position_embeddings` turn by the short factors, from
    there on by the long ones (transformers' frequencies for a sequence that long), cos and
    sin times the attention factor; the unturned quarter of each head stays cos 1, sin 0."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kvloop.model.llama import Rotary

    hf = arch_model("phi3")
    config = hf_config(hf.config.to_dict() | {"architectures": ["Phi3ForCausalLM"]})
    rotary = Rotary(config, 128, torch.device("cpu"))
    init = ROPE_INIT_FUNCTIONS["longrope"]
    short, factor = init(hf.config, torch.device("cpu"))
    long, _ = init(hf.config, torch.device("cpu"), seq_len=LONGROPE_ORIGINAL + 1)
    assert factor == pytest.approx(config.rope_scaling.attention_factor)
    for pos, inv_freq in ((5, short), (LONGROPE_ORIGINAL - 1, short),
                          (LONGROPE_ORIGINAL, long), (100, long)):
        angles = pos * inv_freq
        torch.testing.assert_close(rotary.cos[pos, :6], angles.cos() * factor)
        torch.testing.assert_close(rotary.sin[pos, :6], angles.sin() * factor)
        assert rotary.cos[pos, 6:].eq(1).all() and rotary.sin[pos, 6:].eq(0).all()


def test_unsupported_architectures_fail_before_loading_with_the_list(tmp_path):
    """A folder or GGUF of another architecture: `kvloop serve`'s start-up check and the
    loader both refuse it with the supported list, before any weight is read."""
    import gguf

    from kvloop.locate import GGUF_ARCHITECTURES, HF_ARCHITECTURES
    from kvloop.server.cli_args import check_architecture

    folder = write_arch_folder(arch_model("qwen3"), tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox")
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "model.safetensors").write_bytes(b"not read")    # loading would fail on this
    writer = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for path, what in ((folder, "unsupported model"),
                       (tmp_path / "x.gguf", "unsupported GGUF architecture 'gpt2'")):
        for refuse in (check_architecture, load_model):
            with pytest.raises(ValueError, match=what) as err:
                refuse(str(path))
            for name in [*HF_ARCHITECTURES, *GGUF_ARCHITECTURES]:
                assert name in str(err.value)
    check_architecture(str(write_arch_gguf(arch_model("phi3"), "phi3", tmp_path / "p.gguf")))


def test_the_memory_plan_counts_every_expert(tmp_path):
    """The KV budget is what is left beside the weights: a mixture of experts' weights are
    counted whole (every expert of every sparse layer), from either file."""
    from kvloop.model.setup import model_weight_bytes

    hf = arch_model("qwen3moe", mlp_only_layers=[])
    params = sum(p.numel() for p in hf.parameters())
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
    assert experts > params // 2                     # the experts are most of the model
    for path in (write_arch_folder(hf, tmp_path / "m"),
                 write_arch_gguf(hf, "qwen3moe", tmp_path / "m.gguf")):
        loaded = load_model(str(path))
        assert model_weight_bytes(loaded.weights, torch.float32) == 4 * params
        assert model_weight_bytes(loaded.weights, torch.bfloat16) == 2 * params


@pytest.mark.skipif(not low_bit_supported(torch.device("cpu")), reason="no low-bit path here")
def test_4bit_experts_run_on_the_low_bit_path(tmp_path):
    """A Qwen3-MoE GGUF with Q4_0 experts (llama.cpp's stacked ffn_*_exps): every expert
    keeps its own rows of the blocks as a 4-bit weight equal to its dequantized dense copy,
    and a step on the low-bit path gives the dense path's greedy tokens."""
    from kvloop.model.llama import MLP, SparseMoE
    from kvloop.model.quant import Int4Weight, LowBitPolicy

    hf = arch_model("qwen3moe", seed=4, mlp_only_layers=[])
    path = write_arch_gguf(hf, "qwen3moe", tmp_path / "q4.gguf", quant="Q4_0")
    runner = load_runner(RunnerConfig(model=str(path), dtype="float32", device="cpu",
                                      block_size=BS, num_threads=1,
                                      num_gpu_blocks_override=POOL, low_bit_max_tokens=0))
    model = runner.model
    for layer in model.layers:
        moe = layer.mlp
        assert isinstance(moe, SparseMoE) and len(moe.experts) == 8
        for expert in moe.experts:
            assert isinstance(expert, MLP)
            for linear in (expert.gate_up_proj, expert.down_proj):
                assert isinstance(linear.low_bit, Int4Weight)
                dense = linear.forward(torch.eye(linear.low_bit.in_features)).t()
                torch.testing.assert_close(linear.low_bit.dequantize(), dense,
                                           rtol=1e-2, atol=2e-3)
    assert model.fused_decode is None                 # the fused stack has no experts
    prompts = _prompts()
    dense = run_engine(make_engine(runner, POOL), prompts)
    rows: list[int] = []
    for layer in model.layers:                 # count the rows the experts' 4-bit matmuls see
        for expert in layer.mlp.experts:
            weight = expert.gate_up_proj.low_bit
            weight.matmul = _counting(weight.matmul, rows)
    model.low_bit = LowBitPolicy(1000, 0)
    low = run_engine(make_engine(runner, POOL), prompts)
    # every token computed (b's 8 cached ones aside) went through 2 experts in each of the
    # 3 layers
    assert low.prefix_hits["b"] == 8
    tokens = sum(len(ids) + MAX_TOKENS - 1 for ids in prompts.values()) - 8
    assert sum(rows) == tokens * 2 * len(model.layers) and len(model.layers) == 3
    for rid in prompts:
        assert low.tokens[rid][:2] == dense.tokens[rid][:2], rid
        assert max(abs(a - b) for a, b in zip(low.logprobs[rid][:2], dense.logprobs[rid][:2],
                                              strict=True)) < 0.1



@pytest.mark.skipif(not low_bit_supported(torch.device("cpu")), reason="no low-bit path here")
@pytest.mark.parametrize("arch", ["phi3", "qwen3"])
def test_4bit_fused_and_reordered_rows_stay_aligned(tmp_path, arch):
    """Phi-3's fused attn_qkv / ffn_up split, and its partial-RoPE Q/K reordering, applied
    to a Q4_0 GGUF's blocks as to the dequantized copy: each linear layer's 4-bit weight
    holds the dense weight's rows in the same order."""
    from kvloop.model.quant import Int4Weight

    path = write_arch_gguf(arch_model(arch, seed=6), arch, tmp_path / "q4.gguf", quant="Q4_0")
    runner = load_runner(RunnerConfig(model=str(path), dtype="float32", device="cpu",
                                      block_size=BS, num_threads=1,
                                      num_gpu_blocks_override=POOL, low_bit_max_tokens=0))
    linears = [m for m in runner.model.linears() if m is not runner.model.lm_head]
    assert len(linears) == 4 * len(runner.model.layers)
    for linear in linears:
        assert isinstance(linear.low_bit, Int4Weight)
        dense = linear.forward(torch.eye(linear.low_bit.in_features)).t()
        torch.testing.assert_close(linear.low_bit.dequantize(), dense, rtol=1e-2, atol=2e-3)


def _counting(matmul, rows: list[int]):
    def run(x):
        rows.append(x.shape[0])
        return matmul(x)
    return run


def test_lora_is_refused_where_adapters_would_not_fit(tmp_path):
    """A mixture of experts has no dense MLP for an adapter, a partial-RoPE model reorders
    its Q/K rows: `--enable-lora` stops the start with the reason."""
    from kvloop.config import LoRAConfig

    for arch, reason in (("qwen3moe", "mixture-of-experts"), ("phi3", "partial-RoPE")):
        runner = _runner(write_arch_folder(arch_model(arch), tmp_path / arch))
        with pytest.raises(ValueError, match=reason):
            runner.enable_lora(LoRAConfig(1, 8))


def test_a_gguf_sliding_window_caps_the_context_as_the_folder_does(tmp_path):
    """Phi-3-mini-4k's window (2047 there): no sliding window runs, so the context stops
    at it, from a GGUF (llama.cpp's `phi3.attention.sliding_window`, 0 for none) as from
    config.json."""
    for window, context in ((40, 40), (None, 256)):
        hf = arch_model("phi3", sliding_window=window)
        for path in (write_arch_folder(hf, tmp_path / f"m{window}"),
                     write_arch_gguf(hf, "phi3", tmp_path / f"m{window}.gguf")):
            assert load_model(str(path)).config.max_position_embeddings == context, path


def test_the_offline_benchmark_runs_on_a_tiny_moe_folder(tmp_path):
    """`python -m kvloop.bench.offline --model DIR` on a tiny Qwen3-MoE folder: both sides
    (transformers' own Qwen3MoeForCausalLM of the folder) give every figure."""
    from kvloop.bench.offline import main

    folder = write_arch_folder(arch_model("qwen3moe", max_position_embeddings=512),
                               tmp_path / "moe")
    out = tmp_path / "figures.json"
    main(["--model", str(folder), "--dtype", "float32", "--threads", "1", "--repeats", "1",
          "--prefill-len", "32", "--decode-tokens", "4", "--num-requests", "2",
          "--input-len", "8", "--output-len", "4", "--kv-cache-memory", str(1 << 22),
          "--json-out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["setup"]["model"] == "moe"
    for side in ("kvloop", "hf"):
        assert all(doc[side][k] > 0 for k in ("prefill", "decode", "throughput")), doc


def test_published_configs_parse():
    """The fields of published config.json files (abridged: what kvloop reads) give the
    shapes those models have."""
    phi4_mini = {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 200064,
        "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
        "num_attention_heads": 24, "num_key_value_heads": 8, "partial_rotary_factor": 0.75,
        "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
        "sliding_window": 262144, "tie_word_embeddings": True, "rope_theta": 10000.0,
        "rope_scaling": {"type": "longrope", "long_factor": [1.0] * 48,
                         "short_factor": [1.0] * 48}}
    phi = hf_config(phi4_mini)
    assert (phi.head_dim, phi.rotary_dims, phi.max_position_embeddings) == (128, 96, 131072)
    assert phi.rope_scaling.attention_factor == pytest.approx(
        math.sqrt(1 + math.log(32) / math.log(4096)))
    qwen3_moe = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "rope_theta": 1000000.0, "rope_scaling": None,
        "max_position_embeddings": 40960, "sliding_window": None, "use_sliding_window": False}
    moe = hf_config(qwen3_moe)
    assert moe.moe is not None and moe.moe.sparse_layers == tuple(range(48))
    assert (moe.moe.num_experts, moe.moe.num_experts_per_tok, moe.head_dim) == (128, 8, 128)
    llama32 = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": True}
    llama = hf_config(llama32)
    assert (llama.rope_theta, llama.tie_word_embeddings, llama.head_dim) == (5e5, True, 64)
    assert (llama.rope_scaling.rope_type, llama.rope_scaling.factor) == ("llama3", 32.0)
    assert llama.rope_scaling.original_max_position_embeddings == 8192
    with pytest.raises(ValueError, match="unsupported rope scaling 'yarn'"):
        hf_config({**qwen3_moe, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
