"""A long embeddings or `prompt_logprobs` request beside a decode (issue 37, item 6), on the
embedded model: with `attention_keys_per_token` set (what `--max-num-batched-tokens auto`
measures), each chunk is charged for the keys it attends (`kvloop.core.chunk_cost`), so
chunks late in the long prompt shorten and no step holds more than the budget's worth of
work; the decode gets its token in every step; the results equal the unchunked ones.

Counted, not timed: the exact chunk of every step, the decode's token in every step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvloop import LLM, PoolingParams, SamplingParams
from kvloop.core.chunk_cost import chunk_cost, fit_chunk
from kvloop.llm import engine_config

pytestmark = pytest.mark.slow   # the embedded model: seconds on a loaded machine

BUDGET = 64
KEYS = 96                 # attended keys per budget token (the real model measures ~500)
LONG = 700                # tokens of the long request
POOL_BLOCKS = 80          # 16-token blocks: the long prompt, the decode and room to spare
NUM_TOP = 3


@pytest.fixture(scope="module")
def llm():
    threads = torch.get_num_threads()
    llm = LLM(dtype="float32", device="cpu", num_gpu_blocks_override=POOL_BLOCKS,
              num_threads=1, low_bit_max_tokens=0, enable_prefix_caching=False)
    yield llm
    torch.set_num_threads(threads)
    llm.shutdown()


@pytest.fixture(scope="module")
def long_prompt(llm) -> list[int]:
    text = " ".join(f"Line {i}: the river carried salt and stories to the sea." for i in range(80))
    ids = llm.get_tokenizer().encode(text)[:LONG]
    assert len(ids) == LONG
    return ids


def fair_llm(llm: LLM, keys: int | None) -> LLM:
    """An engine over the same runner with a budget of `BUDGET` tokens and `keys`."""
    cfg = engine_config(llm.runner.max_model_len, max_num_batched_tokens=BUDGET,
                        check_invariants=True, enable_prefix_caching=False)
    cfg = dataclasses.replace(cfg, scheduler=dataclasses.replace(
        cfg.scheduler, attention_keys_per_token=keys))
    return LLM.from_runner(llm.runner, llm.get_tokenizer(), cfg, POOL_BLOCKS)


def run_beside_a_decode(fair: LLM, long_prompt: list[int], params: SamplingParams,
                        pooling: PoolingParams | None) -> tuple[list[int], list]:
    """A decode running, then the long request added; steps until the long one finishes.
    Returns the long one's chunk per step and its outputs; asserts the decode got one token
    in every one of those steps and that no step's charge passed the budget."""
    engine = fair.engine
    decode = engine.make_request("decode", [1, 2, 3, 4, 5], SamplingParams(
        temperature=0.0, max_tokens=10_000, ignore_eos=True))
    engine.add_request(decode)
    while decode.num_output_tokens == 0:
        engine.step()
    engine.add_request(engine.make_request("long", long_prompt, params,
                                           pooling_params=pooling))
    chunks: list[int] = []
    outs = []
    for _ in range(10 * LONG):
        computed = engine.scheduler.requests["long"].num_computed_tokens
        res = engine.step()
        sched = res.scheduler_output.num_scheduled_tokens
        assert sched["decode"] == 1
        assert [len(o.new_token_ids) for o in res.outputs if o.request_id == "decode"] == [1]
        charge = sum(chunk_cost(n, computed if rid == "long" else 0, None if rid == "decode"
                                else engine.config.scheduler.attention_keys_per_token)
                     for rid, n in sched.items())
        assert charge <= BUDGET
        chunks.append(sched["long"])
        outs += [o for o in res.outputs if o.request_id == "long"]
        if any(o.finished for o in outs):
            break
    engine.abort_requests(["decode"])
    while engine.has_unfinished_requests():
        engine.step()
    return chunks, outs


def expected_chunks(keys: int | None) -> list[int]:
    """The chunk of each step: the longest whose charge fits the budget left by the decode."""
    chunks, computed = [], 0
    while computed < LONG:
        n = fit_chunk(LONG - computed, BUDGET - 1, computed, keys)
        chunks.append(n)
        computed += n
    return chunks


def test_chunk_cost_and_fit() -> None:
    assert chunk_cost(1, 5000, 10) == 1                        # a decode is one token
    assert chunk_cost(64, 0, None) == 64
    assert chunk_cost(4, 100, 100) == 4 + 5                    # 4 * 102.5 keys / 100, rounded up
    assert fit_chunk(500, 63, 0, None) == 63
    assert fit_chunk(500, 63, 600, 96) == 8                    # 8 + ceil(8 * 604.5 / 96) = 59
    assert chunk_cost(9, 600, 96) > 63
    assert fit_chunk(500, 1, 10_000, 1) == 1                   # progress: one token fits
    assert fit_chunk(500, 0, 0, None) == 0


def test_a_long_embedding_takes_its_share_of_each_step(llm, long_prompt) -> None:
    chunks, outs = run_beside_a_decode(fair_llm(llm, KEYS), long_prompt,
                                       SamplingParams(max_tokens=1), PoolingParams())
    want = expected_chunks(KEYS)
    assert chunks == want
    assert want[0] > 4 * want[-1] and len(want) > 2 * -(-LONG // (BUDGET - 1))
    [out] = outs
    whole = llm.embed({"prompt_token_ids": long_prompt}, use_tqdm=False)[0]   # one step
    assert torch.allclose(torch.tensor(out.pooling_output), torch.tensor(whole.outputs.embedding),
                          atol=1e-5)


def test_a_long_prompt_logprobs_request_takes_its_share_of_each_step(llm, long_prompt) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=NUM_TOP)
    chunks, outs = run_beside_a_decode(fair_llm(llm, KEYS), long_prompt, params, None)
    assert chunks == expected_chunks(KEYS)
    got: dict[int, dict[int, float]] = {}
    for o in outs:
        if o.new_prompt_logprobs is not None:
            chunk = o.new_prompt_logprobs
            for j, entry in enumerate(chunk.entries):
                got[chunk.first_position + j] = {
                    **dict(zip(entry.top_token_ids, entry.top_logprobs, strict=True)),
                    entry.token_id: entry.logprob}
    whole = llm.generate([{"prompt_token_ids": long_prompt}], params, use_tqdm=False)[0]
    assert sorted(got) == list(range(1, LONG))
    for pos in range(1, LONG):
        want = whole.prompt_logprobs[pos]
        assert set(got[pos]) == set(want), pos
        for tid, lp in want.items():
            assert abs(got[pos][tid] - lp.logprob) <= 1e-4, (pos, tid)


def test_without_keys_every_token_costs_one(llm, long_prompt) -> None:
    """vLLM's rule (the default, and any fixed budget): full chunks at every position."""
    chunks, _ = run_beside_a_decode(fair_llm(llm, None), long_prompt,
                                    SamplingParams(max_tokens=1), PoolingParams())
    assert chunks == expected_chunks(None) == [63] * (LONG // 63) + [LONG % 63]
