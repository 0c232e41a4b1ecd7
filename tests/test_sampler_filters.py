"""allowed_token_ids, bad words and logit_bias in the sampler (hand-made logits, exact), their
shape rules in SamplingParams, and vLLM's tokenization of bad words (the embedded tokenizer);
prompt logprobs' positions and entries."""

from __future__ import annotations

import msgspec
import pytest
import torch

from kvloop.core.outputs import prompt_logprob_positions
from kvloop.core.request import SamplingParams
from kvloop.front.processor import bad_words_token_ids
from kvloop.front.tokenizer import Tokenizer
from kvloop.model.sampler import Sampler, SamplingRow, prompt_logprob_entries

LOGITS = [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]


def greedy(output=(), **params) -> int:
    row = SamplingRow(SamplingParams(temperature=0.0, **params), [1, 2], list(output))
    return Sampler()(torch.tensor([LOGITS]), [row]).token_ids[0]


def test_allowed_token_ids_keep_only_those():
    assert greedy(allowed_token_ids=[3, 4]) == 3
    rows = [SamplingRow(SamplingParams(seed=i, allowed_token_ids=[2, 5]), [1], [])
            for i in range(64)]
    out = Sampler()(torch.tensor([LOGITS] * 64), rows)
    assert set(out.token_ids) == {2, 5}


def test_logit_bias_adds_to_the_logit_and_is_clamped():
    assert greedy(logit_bias={4: 4.5}) == 4            # 1.0 + 4.5 > 5.0
    assert greedy(logit_bias={4: 3.5}) == 0            # 1.0 + 3.5 < 5.0
    assert greedy(logit_bias={0: -1.5}) == 1
    params = SamplingParams(logit_bias={"3": 1000.0, 1: -250})   # type: ignore[dict-item]
    assert params.logit_bias == {3: 100.0, 1: -100.0}


def test_bad_words_ban_the_last_token_after_the_others():
    words = ((0,), (3, 1))                              # a one-token word; a two-token one
    assert greedy(bad_words_token_ids=words) == 1       # 0 always banned
    assert greedy((7, 3), bad_words_token_ids=words) == 2   # the output ends with 3: 1 banned
    assert greedy((3, 7), bad_words_token_ids=words) == 1
    assert greedy((), bad_words_token_ids=((3, 1, 4),)) == 0   # longer than the output


def test_filters_come_before_the_logprobs_they_do_not_change():
    row = SamplingRow(SamplingParams(temperature=0.0, logprobs=1, allowed_token_ids=[2]),
                      [1], [])
    out = Sampler()(torch.tensor([LOGITS]), [row])
    assert out.token_ids == [2]
    lp = out.logprobs[0]
    assert lp is not None and lp.sampled_rank == 3 and lp.top_token_ids == [0]   # raw


@pytest.mark.parametrize("kw,message", [
    ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids must be non-negative"),
    ({"logit_bias": {-2: 1.0}}, "logit_bias token ids must be non-negative"),
    ({"bad_words_token_ids": [[]]}, "bad_words_token_ids must be non-empty"),
])
def test_shapes_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


def test_vocabulary_is_checked_by_field():
    for kw, field in [({"logit_bias": {10: 1.0}}, "logit_bias"),
                      ({"allowed_token_ids": [3, 10]}, "allowed_token_ids"),
                      ({"bad_words_token_ids": [[1, 10]]}, "bad_words")]:
        with pytest.raises(ValueError) as e:
            SamplingParams(**kw).check_vocab(10)
        assert str(e.value).split(" ", 1)[0] == field
    SamplingParams(logit_bias={9: 1.0}, allowed_token_ids=[9]).check_vocab(10)


def test_the_wire_carries_the_filters():
    p = SamplingParams(logit_bias={3: 2.0}, allowed_token_ids=[1, 2], bad_words=["x"],
                       bad_words_token_ids=[[4, 5]], prompt_logprobs=2)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p


def test_bad_words_are_tokenized_as_vllm_does():
    tok = Tokenizer.from_model(None)
    words = bad_words_token_ids(["hello", " world peace", ""], tok)
    hello = tuple(tok.encode("hello", add_special_tokens=False))
    spaced = tuple(tok.encode(" hello", add_special_tokens=False))
    assert words[0] == hello
    assert (spaced in words) == (len(spaced) == len(hello) and spaced[0] != hello[0])
    assert tuple(tok.encode("world peace", add_special_tokens=False)) in words
    assert len(words) <= 4          # the empty word bans nothing


def test_prompt_logprob_positions_leave_out_the_last_prompt_token():
    assert list(prompt_logprob_positions(5, 0, 5)) == [0, 1, 2, 3]
    assert list(prompt_logprob_positions(5, 0, 2)) == [0, 1]
    assert list(prompt_logprob_positions(5, 2, 3)) == [2, 3]
    assert list(prompt_logprob_positions(5, 4, 1)) == []
    assert list(prompt_logprob_positions(5, 5, 1)) == []        # a decode step
    assert list(prompt_logprob_positions(1, 0, 1)) == []


def test_prompt_logprob_entries_are_raw_logprobs_with_ranks():
    logits = torch.tensor([LOGITS, LOGITS[::-1]])
    entries = prompt_logprob_entries(logits, [2, 2], 2)
    lp = torch.log_softmax(logits, dim=-1)
    assert [e.sampled_rank for e in entries] == [3, 4]
    assert entries[0].sampled_logprob == pytest.approx(float(lp[0, 2]))
    assert entries[1].top_token_ids == [5, 4]
    assert entries[1].top_logprobs == pytest.approx(lp[1, [5, 4]].tolist())
    assert prompt_logprob_entries(logits, [0, 0], 0)[0].top_token_ids == []
