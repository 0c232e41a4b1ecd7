"""Prefill/decode disaggregation with the model runner: real KV bytes over the side channel.

- The blocks D loads hold exactly P's bytes, over TCP and over shared memory (a tiny random
  Llama, fp32), and no shared-memory file is left behind.
- Greedy output through P -> D equals the aggregated engine's, for the embedded
  SmolLM2-135M (prompt lengths 1, 15, 16, 17 and 48, with and without chunked prefill) and for
  the tiny model at 2000 tokens. D computes the last prompt token alone, the aggregated
  engine within the prompt's pass (docs/vllm-facts.md#disaggregation): the ids must be equal,
  the logprobs within 1e-4, and a differing id is accepted only as a near-tie flip (the two
  candidates within 1e-5 on both sides), after which the runs are not compared further.
"""

from __future__ import annotations

import glob
import json
from typing import Any

import pytest
import torch

from kvloop import LLM
from kvloop.config import RunnerConfig
from kvloop.core.engine import EngineCore
from kvloop.core.request import SamplingParams
from kvloop.kv_transfer import shm
from kvloop.model import load_runner
from kvloop.model.runner import ModelRunner
from kvloop.trust import FleetSecret
from kvloop.wire import EngineCoreOutput, TopLogprobs
from tests.test_model_tiny import tiny_hf_model, write_tiny_gguf
from tests.test_pd_engine import PREFILL, Stats, kv_config, make_engine, run_until, settle

pytestmark = pytest.mark.processes     # the engines listen on side channels


def share_weights(runner: ModelRunner, blocks: int) -> ModelRunner:
    """Another runner over the same weights, with KV caches of its own."""
    return ModelRunner(runner.model, runner.config, num_gpu_blocks=blocks,
                       block_size=runner.block_size, max_model_len=runner.max_model_len,
                       device=runner.device, model_name=runner.model_name)


def model_engine(runner: ModelRunner, blocks: int, *, pd: bool, chunked: bool = True,
                 budget: int = 512, **extra: Any) -> EngineCore:
    """P, D (pd: a connector over the runner's KV) or the aggregated engine; no prefix
    caching, so every prompt is computed the same way on each."""
    mine = share_weights(runner, blocks)
    kv = kv_config(**extra) if pd else None
    return make_engine(mine, mine.kv_block_store, blocks, kv, block_size=runner.block_size,
                       caching=False, budget=budget, max_model_len=runner.max_model_len,
                       chunked=chunked)


def greedy(engine: EngineCore, rid: str, prompt: list[int], max_tokens: int,
           params: dict[str, Any] | None = None,
           stats: Stats | None = None) -> tuple[list[TopLogprobs], EngineCoreOutput]:
    extra = {"kv_transfer_params": params} if params is not None else None
    sp = SamplingParams(max_tokens=max_tokens, min_tokens=1, temperature=0, logprobs=2,
                        ignore_eos=True, extra_args=extra)
    engine.add_request(engine.make_request(rid, prompt, sp))
    outs: dict[str, list[EngineCoreOutput]] = {}
    run_until(engine, lambda: outs.get(rid) and outs[rid][-1].finished, 120,
              f"request {rid}", stats, outs)
    return [lp for o in outs[rid] for lp in o.new_logprobs or []], outs[rid][-1]


def assert_same_greedy(ref: list[TopLogprobs], got: list[TopLogprobs]) -> None:
    assert len(ref) == len(got)
    for pos, (a, b) in enumerate(zip(ref, got, strict=True)):
        if a.token_id != b.token_id:
            for x in (a, b):
                assert set(x.top_token_ids) == {a.token_id, b.token_id}, (pos, a, b)
                assert abs(x.top_logprobs[0] - x.top_logprobs[1]) < 1e-5, (pos, a, b)
            return
        assert abs(a.logprob - b.logprob) < 1e-4, (pos, a.logprob, b.logprob)


def pd_run(p: EngineCore, d: EngineCore, rid: str, prompt: list[int], max_tokens: int,
           d_stats: Stats | None = None) -> tuple[list[TopLogprobs], dict[str, Any]]:
    """P's leg, then D's: D's logprobs, and the params P handed on."""
    p_lps, p_last = greedy(p, f"{rid}-p", prompt, 1, dict(PREFILL))
    params = p_last.kv_transfer_params
    assert params is not None
    d_lps, d_last = greedy(d, f"{rid}-d", prompt, max_tokens, params, d_stats)
    assert d_lps[0].token_id == p_lps[0].token_id        # P's dropped token is D's first
    assert d_last.finish_reason == "length"
    settle(p)
    return d_lps, params


# --- the tiny model: bytes and transports ------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> ModelRunner:
    path = write_tiny_gguf(tiny_hf_model(seed=5, max_position_embeddings=2100),
                           tmp_path_factory.mktemp("pd") / "tiny.gguf")
    return load_runner(RunnerConfig(model=str(path), dtype="float32", device="cpu",
                                    block_size=16, num_gpu_blocks_override=140,
                                    max_model_len=2100, num_threads=1))


def shm_files() -> set[str]:
    return set(glob.glob("/dev/shm/kvloop-*"))


@pytest.mark.parametrize("transport", ["tcp", "shm", "auto"])
def test_d_loads_exactly_p_s_bytes(tiny, transport, monkeypatch):
    before = shm_files()
    written: list[str] = []

    def write_frames(name: str, frames: Any) -> str:    # the real one, watched
        written.append(real_write(name, frames))
        return written[-1]

    real_write = shm.write_frames
    monkeypatch.setattr(shm, "write_frames", write_frames)
    p = model_engine(tiny, 12, pd=True, transport=transport)
    d = model_engine(tiny, 12, pd=True, transport=transport)
    try:
        prompt = list(range(20, 60))                       # 40 tokens: D reads 3 blocks
        p_lps, p_last = greedy(p, "p", prompt, 1, dict(PREFILL))
        params = p_last.kv_transfer_params
        stats = Stats()
        greedy(d, "d", prompt, 3, params, stats)
        assert stats.total.bytes_received == 3 * d.connector.store.block_nbytes
        p_blocks = params["remote_block_ids"]
        d_blocks = [1, 2, 3]                                # D's fresh pool gave these
        p_kv, d_kv = p.runner.kv_caches, d.runner.kv_caches
        for layer in range(len(p_kv)):
            for token in range(39):                         # all D loaded (39 = the last)
                pb, db, slot = p_blocks[token // 16], d_blocks[token // 16], token % 16
                assert torch.equal(p_kv[layer][:, :, pb, slot], d_kv[layer][:, :, db, slot]), \
                    (layer, token)
        settle(p)
        assert len(written) == (0 if transport == "tcp" else 1)   # one host: auto is shm
        assert shm_files() == before                        # D unlinked what P wrote
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("chunked", [False, True], ids=["one-pass", "chunked"])
def test_a_2000_token_prompt_decodes_as_aggregated(tiny, chunked):
    budget = 256 if chunked else 2100
    engines = [model_engine(tiny, 140, pd=pd, chunked=chunked, budget=budget)
               for pd in (True, True, False)]
    p, d, agg = engines
    try:
        prompt = [(7 * i) % 200 + 3 for i in range(2000)]
        ref, _ = greedy(agg, "agg", prompt, 5)
        stats = Stats()
        got, _ = pd_run(p, d, "long", prompt, 5, stats)
        assert stats.total.bytes_received == 125 * d.connector.store.block_nbytes
        assert_same_greedy(ref, got)
        assert all(e.block_pool.get_num_free_blocks() == 139 for e in engines)
    finally:
        for e in engines:
            e.shutdown()


# --- the embedded model: greedy equality ---------------------------------------------------------

TEXT = ("The history of the city begins with a small fishing village on the banks of a wide "
        "river, where traders from the north and the south met every spring to exchange salt, "
        "wool and stories about distant lands. Over the centuries the village grew into a "
        "town, and the town into a city.")


@pytest.mark.parametrize("chunked", [False, True], ids=["one-pass", "chunked-16"])
def test_embedded_greedy_through_p_and_d_equals_aggregated(smollm_fp32_dense, chunked):
    ids = smollm_fp32_dense.get_tokenizer().encode(TEXT)
    assert len(ids) >= 48
    budget = 16 if chunked else 512
    engines = [model_engine(smollm_fp32_dense.runner, 12, pd=pd, chunked=chunked,
                            budget=budget)
               for pd in (True, True, False)]
    p, d, agg = engines
    try:
        for n in (1, 15, 16, 17, 48):
            prompt = ids[:n]
            ref, _ = greedy(agg, f"agg{n}", prompt, 4)
            got, params = pd_run(p, d, f"r{n}", prompt, 4)
            assert params["remote_num_tokens"] == n
            assert_same_greedy(ref, got)
        assert all(e.block_pool.get_num_free_blocks() == 11 for e in engines)
    finally:
        for e in engines:
            e.shutdown()


def test_the_offline_llm_serves_both_legs(tmp_path):
    """`LLM(kv_transfer_config=...)` (a dict, or its JSON): P's RequestOutput carries the
    params, D's output equals D's own aggregated run, P frees on D's Done."""
    path = write_tiny_gguf(tiny_hf_model(seed=6), tmp_path / "t.gguf")
    kv = {"kv_connector": "KvloopConnector", "kv_role": "kv_both"}
    args = dict(dtype="float32", device="cpu", block_size=4, num_threads=1,
                num_gpu_blocks_override=32, check_invariants=True,
                fleet_secret=FleetSecret.generate())
    p, d = LLM(str(path), kv_transfer_config=kv, **args), LLM(str(path), **args,
                                                              kv_transfer_config=json.dumps(kv))
    try:
        prompt = {"prompt_token_ids": list(range(5, 19))}
        ref = d.generate(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                         use_tqdm=False)[0]
        assert ref.kv_transfer_params is None
        (first,) = p.generate(prompt, SamplingParams(
            temperature=0, max_tokens=1, min_tokens=1,
            extra_args={"kv_transfer_params": dict(PREFILL)}), use_tqdm=False)
        params = first.kv_transfer_params
        assert params is not None and params["remote_port"] == p.kv_transfer_info.side_channel_port
        assert first.outputs[0].token_ids == ref.outputs[0].token_ids[:1]
        (out,) = d.generate(prompt, SamplingParams(
            temperature=0, max_tokens=5, ignore_eos=True,
            extra_args={"kv_transfer_params": params}), use_tqdm=False)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert p.wait_for_kv_transfers(5.0)
        assert p.engine.block_pool.get_num_free_blocks() == 31
    finally:
        p.shutdown()
        d.shutdown()
