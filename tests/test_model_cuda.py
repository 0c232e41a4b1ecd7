"""The model runner and the offline LLM on CUDA (tiny random models). Needs a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvloop import LLM, SamplingParams
from kvloop.config import RunnerConfig
from kvloop.model import load_runner
from tests.test_model_tiny import BS, assert_matches_hf, tiny_hf_model, write_hf_folder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_hf_folder(tiny_hf_model(seed=21), tmp_path_factory.mktemp("cuda") / "m")


def test_auto_device_is_cuda_and_logits_match_transformers(folder):
    hf = tiny_hf_model(seed=21)
    runner = load_runner(RunnerConfig(model=str(folder), dtype="float32", device="auto",
                                      block_size=BS, num_gpu_blocks_override=20))
    assert runner.device.type == "cuda"
    assert runner.kv_caches[0].is_cuda and runner.model.embed_tokens.is_cuda
    assert_matches_hf(runner, hf, np.random.default_rng(1))


def test_llm_on_cuda_matches_cpu_and_seeds_are_batch_independent(folder):
    gpu = LLM(str(folder), block_size=4, num_gpu_blocks_override=256)
    assert gpu.runner.device.type == "cuda" and gpu.runner.dtype in (torch.bfloat16,
                                                                       torch.float16)
    gpu32 = LLM(str(folder), dtype="float32", block_size=4, num_gpu_blocks_override=256)
    cpu = LLM(str(folder), dtype="float32", device="cpu", block_size=4,
              num_gpu_blocks_override=256)
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 3 * i))} for i in range(8)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    for x, y in zip(cpu.generate(prompts, greedy, use_tqdm=False),
                    gpu32.generate(prompts, greedy, use_tqdm=False), strict=True):
        a, b = x.outputs[0], y.outputs[0]
        for pos, (u, v) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
            if u != v:
                assert u in b.logprobs[pos] and v in a.logprobs[pos]
                break
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, seed=42,
                            max_tokens=10, ignore_eos=True, repetition_penalty=1.2,
                            presence_penalty=0.3, frequency_penalty=0.2, n=2)
    alone = gpu.generate(prompts[0], seeded, use_tqdm=False)[0]
    crowd = [SamplingParams(temperature=0.9, max_tokens=8)] * 7
    mixed = gpu.generate(prompts[1:] + prompts[:1], crowd + [seeded], use_tqdm=False)[-1]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in mixed.outputs]
