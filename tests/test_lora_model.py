"""LoRA adapters on the model runner against transformers + peft (fp32, tiny random Llama).

Adapters are made here with peft (random A and B, so each changes the output); kvloop reads
their saved folders. One step mixes two adapters and the base model; every sampled row's
logits must match the peft model of its adapter (or the bare base) on the full sequence.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvloop.config import LoRAConfig, RunnerConfig
from kvloop.core.request import RequestStatus
from kvloop.model import load_runner
from kvloop.model.lora import LoRAError
from tests.test_model_tiny import (
    BS,
    TINY_VOCAB,
    _cached,
    _new,
    _step,
    tiny_hf_model,
    write_hf_folder,
)

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base, folder: Path, seed: int, rank: int = 4, alpha: int = 8,
                 targets: list[str] | None = None, std: float = 0.3):
    """A peft LoRA on a copy of `base` with random (nonzero, N(0, std)) A and B, saved under
    `folder` -> the peft model (eval, fp32)."""
    import peft

    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ALL_MODULES,
                          init_lora_weights=False, lora_dropout=0.0)
    model = peft.get_peft_model(copy.deepcopy(base), cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, std)
    model.save_pretrained(str(folder))
    return model.eval()


def _last_logits(model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([seq])).logits[0, -1].float()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = tiny_hf_model("llama", seed=21)
    folder = write_hf_folder(base, root / "base")
    x = make_adapter(base, root / "x", seed=1)
    y = make_adapter(base, root / "y", seed=2, rank=2, alpha=3, targets=["q_proj", "v_proj",
                                                                          "down_proj"])
    return base, folder, {"x": (x, root / "x"), "y": (y, root / "y")}


def _runner(folder: Path, max_loras: int, max_cpu_loras: int | None = None):
    return load_runner(RunnerConfig(
        model=str(folder), dtype="float32", device="cpu", block_size=BS, num_threads=1,
        num_gpu_blocks_override=40, low_bit_max_tokens=0,
        lora=LoRAConfig(max_loras=max_loras, max_lora_rank=8, max_cpu_loras=max_cpu_loras)))


def _with_lora(new, name):
    return dataclasses.replace(new, lora_name=name)


def test_mixed_batch_matches_peft_per_adapter(tiny):
    """Step 1: A (x), B (y), C (base), D (x) prompts in one batch; step 2: their decodes.
    Each row equals its own adapter's peft logits; adapters do change the output."""
    base, folder, adapters = tiny
    runner = _runner(folder, max_loras=2)
    for name, (_, path) in adapters.items():
        runner.add_lora(name, str(path))
    rng = np.random.default_rng(7)
    prompts = {r: rng.integers(3, TINY_VOCAB, 5).tolist() for r in "ABCD"}
    lora = {"A": "x", "B": "y", "C": None, "D": "x"}
    ref = {"x": adapters["x"][0], "y": adapters["y"][0], None: base}
    blocks = {"A": [1, 2], "B": [3, 4], "C": [5, 6], "D": [7, 8]}
    news = [_with_lora(_new(r, prompts[r], blocks[r], 0, 5), lora[r]) for r in "ABCD"]
    inputs, logits = runner.forward(_step(new=news, sampling=set("ABCD")))
    assert inputs is not None and inputs.step.lora is not None
    seqs = {r: prompts[r] + [int(logits[i].argmax())]
            for i, r in enumerate(inputs.sampling_req_ids)}
    for i, r in enumerate(inputs.sampling_req_ids):
        diff = (logits[i] - _last_logits(ref[lora[r]], prompts[r])).abs().max().item()
        assert diff <= 1e-4, f"{r} ({lora[r]}): {diff}"
        base_diff = (logits[i] - _last_logits(base, prompts[r])).abs().max().item()
        assert lora[r] is None or base_diff > 1e-2, f"{r}: the adapter changed nothing"
    cached = [_cached(r, seqs[r], 5, 1) for r in "ABCD"]
    inputs, logits = runner.forward(_step(cached=cached, sampling=set("ABCD")))
    assert inputs is not None
    for i, r in enumerate(inputs.sampling_req_ids):
        diff = (logits[i] - _last_logits(ref[lora[r]], seqs[r])).abs().max().item()
        assert diff <= 1e-4, f"{r} decode ({lora[r]}): {diff}"


def test_batch_equals_each_alone(tiny):
    """The logits of x, y and the base in one step equal each run alone (same runner kind)."""
    _, folder, adapters = tiny
    prompt = np.random.default_rng(3).integers(3, TINY_VOCAB, 6).tolist()

    def run(names: list[str | None]) -> dict[str, torch.Tensor]:
        runner = _runner(folder, max_loras=2)
        for name, (_, path) in adapters.items():
            runner.add_lora(name, str(path))
        news = [_with_lora(_new(f"r{i}", prompt, [2 * i + 1, 2 * i + 2], 0, 6), n)
                for i, n in enumerate(names)]
        inputs, logits = runner.forward(_step(new=news, sampling={n.req_id for n in news}))
        assert inputs is not None
        by_req = dict(zip(inputs.sampling_req_ids, logits, strict=True))
        return {str(n): by_req[f"r{i}"] for i, n in enumerate(names)}

    together = run(["x", "y", None])
    for name in ("x", "y", None):
        alone = run([name])[str(name)]
        assert torch.allclose(together[str(name)], alone, atol=1e-5), name
    assert not torch.allclose(together["x"], together["y"], atol=1e-2)


def test_beyond_max_loras_evicts_and_reloads(tiny):
    """max_loras 1, max_cpu_loras 1: x, y, x in turn, each step correct; every switch copies
    the adapter into the one slot, and the host cache rereads the evicted one from disk."""
    _, folder, adapters = tiny
    runner = _runner(folder, max_loras=1, max_cpu_loras=1)
    for name, (_, path) in adapters.items():
        runner.add_lora(name, str(path))
    slots = runner.lora_slots
    assert slots is not None
    prompt = np.random.default_rng(4).integers(3, TINY_VOCAB, 5).tolist()
    for i, name in enumerate(["x", "y", "x", "x"]):
        rid = f"r{i}"
        new = _with_lora(_new(rid, prompt, [2 * i + 1, 2 * i + 2], 0, 5), name)
        inputs, logits = runner.forward(_step(new=[new], sampling={rid}))
        want = _last_logits(adapters[name][0], prompt)
        assert (logits[0] - want).abs().max().item() <= 1e-4, (i, name)
        assert list(slots.resident) == [name] and list(slots.host) == [name]
    assert slots.num_loads == 3     # x, y, x again; the last step found x resident
    with pytest.raises(RuntimeError, match="max-loras"):
        slots.activate({"x", "y"})


def test_bad_adapters_are_refused(tiny, tmp_path):
    """Rank over --max-lora-rank, a shape for another model, unknown tensors, a path that is
    not a folder, DoRA, a duplicate name: LoRAError, nothing registered."""
    base, folder, adapters = tiny
    runner = _runner(folder, max_loras=1)
    x_path = adapters["x"][1]
    runner.add_lora("x", str(x_path))
    with pytest.raises(LoRAError, match="already"):
        runner.add_lora("x", str(x_path))
    with pytest.raises(LoRAError, match="not a directory"):
        runner.add_lora("f", str(x_path / "adapter_config.json"))
    big = tmp_path / "big"
    make_adapter(base, big, seed=3, rank=16, alpha=16)
    with pytest.raises(LoRAError, match="rank 16"):
        runner.add_lora("big", str(big))
    dora = tmp_path / "dora"
    dora.mkdir()
    cfg = json.loads((x_path / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    (dora / "adapter_model.safetensors").write_bytes((x_path / "adapter_model.safetensors")
                                                     .read_bytes())
    with pytest.raises(LoRAError, match="use_dora"):
        runner.add_lora("dora", str(dora))
    other = tmp_path / "other"
    make_adapter(tiny_hf_model("llama", seed=1, intermediate_size=64), other, seed=4)
    with pytest.raises(LoRAError, match="must be"):
        runner.add_lora("other", str(other))
    from safetensors.torch import save_file

    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "adapter_config.json").write_text(json.dumps(cfg))
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)},
              str(junk / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match="unsupported tensor"):
        runner.add_lora("junk", str(junk))
    assert runner.list_loras() == ["x"]


@pytest.mark.parametrize("alpha", [1e308, -1e308, 1e6])
def test_absurd_lora_alpha_is_refused(tiny, tmp_path, alpha):
    """issue 37 (low): lora_alpha 1e308 is finite but scales B to inf; an absurd scale is
    refused naming it, before any weight is used."""
    _, folder, adapters = tiny
    x_path = adapters["x"][1]
    bad = tmp_path / "alpha"
    bad.mkdir()
    cfg = json.loads((x_path / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": alpha}))
    (bad / "adapter_model.safetensors").write_bytes((x_path / "adapter_model.safetensors")
                                                    .read_bytes())
    runner = _runner(folder, max_loras=1)
    with pytest.raises(LoRAError, match="lora_alpha .* gives a scale"):
        runner.add_lora("alpha", str(bad))
    assert runner.list_loras() == []


def test_nonfinite_lora_weights_are_refused(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    _, folder, adapters = tiny
    x_path = adapters["x"][1]
    bad = tmp_path / "nan"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((x_path / "adapter_config.json").read_text())
    tensors = load_file(str(x_path / "adapter_model.safetensors"))
    key = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match="not finite"):
        _runner(folder, max_loras=1).add_lora("nan", str(bad))


# --- through the engine (offline LLM): scheduler, hashing, waiting ------------------------
def _peft_greedy(model, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(_last_logits(model, seq).argmax()))
    return seq[len(prompt):]


@pytest.fixture(scope="module")
def lora_llm(tiny):
    from kvloop import LLM

    _, folder, _ = tiny
    llm = LLM(str(folder), dtype="float32", device="cpu", block_size=BS, num_threads=1,
              num_gpu_blocks_override=64, low_bit_max_tokens=0, check_invariants=True,
              enable_lora=True, max_loras=1, max_lora_rank=8)
    yield llm
    llm.shutdown()


def test_llm_greedy_equals_peft_and_adapters_share_no_block(tiny, lora_llm):
    """Greedy output per adapter == peft's; with max_loras 1 the y request waits
    (WAITING_FOR_LORA) while x runs, then runs after; the same prompt under x, y and the base
    gets disjoint block hashes, so the second and third see no prefix hit."""
    from kvloop import LoRARequest, SamplingParams

    base, _, adapters = tiny
    prompt = np.random.default_rng(9).integers(3, TINY_VOCAB, 9).tolist()   # 2 full blocks
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    reqs = [LoRARequest("x", 1, str(adapters["x"][1])), LoRARequest("y", 2,
                                                                    str(adapters["y"][1])), None]
    outs = lora_llm.generate([{"prompt_token_ids": prompt}] * 3, sp, use_tqdm=False,
                             lora_request=reqs)
    refs = [adapters["x"][0], adapters["y"][0], base]
    for out, ref in zip(outs, refs, strict=True):
        assert out.outputs[0].token_ids == _peft_greedy(ref, prompt, 5)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 3
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
    again = lora_llm.generate([{"prompt_token_ids": prompt}] * 2, sp, use_tqdm=False,
                              lora_request=[reqs[1], None])
    assert [o.num_cached_tokens for o in again] == [8, 8]     # hits within each namespace
    assert [o.outputs[0].token_ids for o in again] == [outs[1].outputs[0].token_ids,
                                                      outs[2].outputs[0].token_ids]
    engine = lora_llm.engine
    hashes = {name: engine.make_request(f"h{name}", prompt, sp, lora_name=name).block_hashes
              for name in ("x", "y", None)}
    assert len({h for hs in hashes.values() for h in hs}) == 6


def test_engine_refuses_unknown_and_busy_adapters(tiny, lora_llm):
    from kvloop import SamplingParams

    engine = lora_llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=2)
    req = engine.make_request("u1", [5, 6, 7], sp, lora_name="nope")
    engine.add_request(req)
    out = engine.step()
    assert any(o.request_id == "u1" and o.error and "not loaded" in o.error
               for o in out.outputs)
    _, _, adapters = tiny
    engine.add_lora("z", str(adapters["x"][1]))
    if "x" not in engine.list_loras():
        engine.add_lora("x", str(adapters["x"][1]))
    busy = engine.make_request("u2", [5, 6, 7], sp, lora_name="z")
    other = engine.make_request("u3", [5, 6, 7], sp, lora_name="x")
    engine.add_request(busy)
    engine.add_request(other)
    engine.step()
    assert busy.status == RequestStatus.RUNNING          # max_loras 1: x must wait for z
    assert other.status == RequestStatus.WAITING_FOR_LORA
    with pytest.raises(ValueError, match="in use"):
        engine.remove_lora("z")
    while engine.has_unfinished_requests():
        engine.step()
    assert len(other.output_token_ids) == 2
    engine.remove_lora("z")
    assert "z" not in engine.list_loras()


def test_events_and_stats_carry_the_adapter(tiny):
    """BlockStored of an adapter request names it; the step's LoRAStats list the running
    adapter and the one waiting for a slot (max_loras 1)."""
    from kvloop.config import CacheConfig
    from kvloop.core.engine import EngineCore
    from kvloop.core.request import SamplingParams
    from kvloop.events.types import BlockStored
    from kvloop.llm import engine_config

    _, folder, adapters = tiny
    runner = _runner(folder, max_loras=1)
    config = engine_config(runner.max_model_len, block_size=BS, num_gpu_blocks=40,
                           log_stats=True)
    config = dataclasses.replace(
        config, cache=CacheConfig(block_size=BS, num_gpu_blocks=40,
                                  enable_kv_cache_events=True),
        scheduler=dataclasses.replace(config.scheduler, max_loras=1))
    engine = EngineCore(config, runner, num_gpu_blocks=40)
    for name in ("x", "y"):
        engine.add_lora(name, str(adapters[name][1]))
    sp = SamplingParams(temperature=0.0, max_tokens=3)
    for rid, name in (("a", "x"), ("b", "y")):
        engine.add_request(engine.make_request(rid, list(range(3, 12)), sp, lora_name=name))
    result = engine.step()
    assert result.stats is not None and result.stats.lora is not None
    lora = result.stats.lora
    assert (lora.max_lora, lora.running_lora_adapters, lora.waiting_lora_adapters) == (
        1, ["x"], ["y"])
    assert result.events is not None
    stored = [e for e in result.events.events if isinstance(e, BlockStored)]
    assert stored and all(e.lora_name == "x" for e in stored)


@pytest.mark.slow   # four engine runs, over a second
def test_lora_benchmark_runs_on_the_tiny_model(tiny, tmp_path, capsys):
    """`python -m kvloop.bench.lora` end to end on the tiny model (2 requests, 3 tokens):
    one row per adapter count, every request producing its tokens."""
    from kvloop.bench.lora import main

    _, folder, _ = tiny
    out = tmp_path / "lora.json"
    assert main(["--model", str(folder), "--dtype", "float32", "--threads", "1",
                 "--adapters", "0,1,2", "--rank", "4", "--num-requests", "2",
                 "--output-len", "3", "--input-len", "5", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["adapters"] for r in rows] == [0, 1, 2]
    assert all(r["output_tokens"] == 6 and r["tok_per_s"] > 0 for r in rows)
    assert "vs base" in capsys.readouterr().out


def test_a_reloaded_name_never_hits_the_old_weights_blocks(tiny, lora_llm):
    """Unload "r" (x's weights) and load "r" again from y's folder: the same prompt gets no
    prefix hit (vLLM would hit the stale blocks) and y's output; its first load hashes as
    the router does (name only)."""
    from kvloop import LoRARequest, SamplingParams

    _, _, adapters = tiny
    engine = lora_llm.engine
    prompt = np.random.default_rng(11).integers(3, TINY_VOCAB, 9).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    def run(path):
        req = LoRARequest("r", 9, str(path))
        return lora_llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False,
                                 lora_request=req)[0]

    first = run(adapters["x"][1])
    assert engine.scheduler.adapter_slots.hash_key("r") is None
    assert run(adapters["x"][1]).num_cached_tokens == 8
    engine.remove_lora("r")
    engine.add_lora("r", str(adapters["y"][1]))
    again = run(adapters["y"][1])
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == _peft_greedy(adapters["y"][0], prompt, 3)
    assert first.outputs[0].token_ids == _peft_greedy(adapters["x"][0], prompt, 3)
    engine.remove_lora("r")


def test_an_unreadable_adapter_fails_one_request_not_the_engine(tiny, lora_llm, tmp_path):
    """issue 37 (3): max_loras 1, max_cpu_loras 1; adapter "gone" leaves host memory (another
    is read after it), then its folder is removed: its request fails with LORA_UNAVAILABLE,
    the base request in the same steps finishes, the adapter is unloaded (not listed), and a
    later request for it fails the same way. Old code: LoRAError out of the step."""
    import shutil

    from kvloop import SamplingParams
    from kvloop.wire import LORA_UNAVAILABLE

    _, _, adapters = tiny
    engine = lora_llm.engine
    gone = tmp_path / "gone"
    shutil.copytree(adapters["x"][1], gone)
    engine.add_lora("gone", str(gone))
    engine.add_lora("evictor", str(adapters["y"][1]))     # host memory: evictor only
    shutil.rmtree(gone)
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    reqs = [engine.make_request("g1", [5, 6, 7], sp, lora_name="gone"),
            engine.make_request("b1", [5, 6, 8], sp)]
    for r in reqs:
        engine.add_request(r)
    errors: dict[str, str] = {}
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step().outputs:
            if o.error:
                errors[o.request_id] = o.error
    assert list(errors) == ["g1"] and errors["g1"].startswith(LORA_UNAVAILABLE), errors
    assert "gone" in errors["g1"]
    assert reqs[0].status == RequestStatus.FINISHED_ERROR
    assert len(reqs[1].output_token_ids) == 3
    assert "gone" not in engine.list_loras() and "gone" not in engine.runner.list_loras()
    again = engine.make_request("g2", [5, 6, 7], sp, lora_name="gone")
    engine.add_request(again)
    out = engine.step()
    assert [o.error.startswith(LORA_UNAVAILABLE) for o in out.outputs
            if o.request_id == "g2" and o.error] == [True]
    engine.remove_lora("evictor")
