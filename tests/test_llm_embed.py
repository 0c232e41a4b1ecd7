"""`LLM.embed` on a tiny random Llama: exact against its Hugging Face twin, fast."""

from __future__ import annotations

import pytest
import torch

from kvloop import LLM, PoolingParams
from kvloop.core.request import ContextLengthError
from tests.test_model_tiny import tiny_hf_model, write_tiny_gguf

pytestmark = pytest.mark.slow   # writes and loads a model: seconds on a loaded machine

PROMPTS = [[5, 9, 2, 77, 31, 8, 8, 1, 40], [3], list(range(10, 60))]


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    hf = tiny_hf_model(seed=21)
    path = write_tiny_gguf(hf, tmp_path_factory.mktemp("embed") / "t.gguf")
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=4, num_threads=1,
              num_gpu_blocks_override=64, max_num_batched_tokens=16, check_invariants=True)
    yield llm, hf
    llm.shutdown()


def hf_vector(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf.model(torch.tensor([ids])).last_hidden_state[0, -1].float()


def test_embed_is_the_normalized_last_hidden_state(twins):
    llm, hf = twins
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for out, ids in zip(outs, PROMPTS, strict=True):
        want = torch.nn.functional.normalize(hf_vector(hf, ids), dim=-1)
        assert out.prompt_token_ids == ids
        assert torch.allclose(torch.tensor(out.outputs.embedding), want, atol=1e-5)
    [raw] = llm.embed({"prompt_token_ids": PROMPTS[0]}, PoolingParams(normalize=False),
                      use_tqdm=False)
    assert raw.num_cached_tokens == 8                       # two whole blocks of 4 hit
    assert torch.allclose(torch.tensor(raw.outputs.embedding), hf_vector(hf, PROMPTS[0]),
                          atol=1e-5)
    assert llm.engine.block_pool.get_num_free_blocks() == llm.engine.block_pool.num_usable_blocks


def test_embed_refuses_a_prompt_longer_than_the_context(twins):
    llm, _ = twins
    too_long = [1] * llm.engine.config.scheduler.max_model_len
    with pytest.raises(ContextLengthError):
        llm.embed({"prompt_token_ids": too_long}, use_tqdm=False)
    assert not llm.engine.scheduler.requests
