"""The sampler on hand-made logits: exact where the math is exact, bounded where it samples."""

from __future__ import annotations

import math

import pytest
import torch

from kvloop.core.request import SamplingParams
from kvloop.model.sampler import Sampler, SamplingRow, apply_penalties


def row(output=(), prompt=(1, 2), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output))


def logits_of(*rows_values: list[float]) -> torch.Tensor:
    return torch.tensor(rows_values, dtype=torch.float32)


def test_greedy_takes_the_argmax():
    out = Sampler()(logits_of([0.1, 3.0, 2.0], [5.0, 1.0, 0.0]),
                    [row(temperature=0.0), row(temperature=0.0)])
    assert out.token_ids == [1, 0]
    assert out.logprobs == [None, None]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = [9.0, 8.0, 7.0, 1.0]
    params = dict(temperature=0.0, eos_token_id=0, stop_token_ids=(1,), min_tokens=2,
                  max_tokens=5)
    out = Sampler()(logits_of(logits, logits, logits),
                    [row((), **params), row((5,), **params), row((5, 6), **params)])
    assert out.token_ids == [2, 2, 0]


def test_min_tokens_masks_eos_even_with_ignore_eos():
    out = Sampler()(logits_of([9.0, 1.0]), [row(temperature=0.0, eos_token_id=0,
                                                 ignore_eos=True, min_tokens=1)])
    assert out.token_ids == [1]


def test_penalties_follow_vllm_formulas():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5, 3.0])
    r = row(output=(2, 2, 3), prompt=(0, 1), repetition_penalty=2.0, presence_penalty=0.5,
            frequency_penalty=0.25)
    apply_penalties(logits, r)
    # tokens 0, 1 (prompt) and 2, 3 (output) are repeated; 2 twice, 3 once
    expected = [2.0 / 2, -2.0 * 2, 1.0 / 2 - 0.5 - 0.5, 0.5 / 2 - 0.5 - 0.25, 3.0]
    assert logits.tolist() == pytest.approx(expected)


def test_penalties_change_the_greedy_choice():
    out = Sampler()(logits_of([3.0, 2.9]), [row(output=(0,), temperature=0.0,
                                                  frequency_penalty=1.0)])
    assert out.token_ids == [1]


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = [0.0, 1.0, 0.9, 0.8]
    sampler = Sampler(seed=1)
    rows = [row(temperature=1.0, top_k=1), row(temperature=1.0, top_p=0.01)] * 50
    out = sampler(logits_of(*[logits] * 100), rows)
    assert set(out.token_ids) == {1}


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().tolist()
    out = Sampler(seed=2)(logits_of(*[logits] * 400), [row(top_p=0.7)] * 400)
    assert set(out.token_ids) == {0, 1}          # 0.6 < 0.7, so the second token stays
    out = Sampler(seed=2)(logits_of(*[logits] * 400), [row(top_p=0.6)] * 400)
    assert set(out.token_ids) == {0}


def test_top_k_and_min_p_cut_the_tail():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist()
    out = Sampler(seed=3)(logits_of(*[logits] * 400), [row(top_k=2)] * 400)
    assert set(out.token_ids) == {0, 1}
    out = Sampler(seed=3)(logits_of(*[logits] * 400), [row(min_p=0.2)] * 400)
    assert set(out.token_ids) == {0, 1, 2}        # 0.05 < 0.2 * 0.5


def test_temperature_sampling_follows_the_softmax():
    logits = [1.0, 0.0, -1.0, 0.5]
    n = 4000
    out = Sampler(seed=4)(logits_of(*[logits] * n), [row(temperature=0.5)] * n)
    expected = torch.softmax(torch.tensor(logits) / 0.5, dim=0)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / n
    for p, f in zip(expected.tolist(), counts.tolist(), strict=True):
        assert abs(p - f) < 4 * math.sqrt(p * (1 - p) / n) + 1e-3


def test_seeded_rows_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(5, 1000)
    seeded = row(output=(7, 8), temperature=1.0, seed=1234)
    alone = Sampler(seed=0)(logits[2:3].clone(), [seeded]).token_ids[0]
    others = [row(temperature=1.0) for _ in range(4)]
    batch = Sampler(seed=99)(logits.clone(), others[:2] + [seeded] + others[2:]).token_ids
    assert batch[2] == alone
    # the next position draws new noise: over many positions tokens vary
    draws = {Sampler()(logits[2:3].clone(), [row(output=(0,) * k, temperature=1.0, seed=1234)])
             .token_ids[0] for k in range(20)}
    assert len(draws) > 1


def test_logprobs_are_raw_with_rank_and_top_n():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    out = Sampler()(logits.clone(), [row(temperature=0.0, logprobs=2, repetition_penalty=2.0,
                                         output=(1,), prompt=(0,))])
    lp = out.logprobs[0]
    raw = torch.log_softmax(logits[0], dim=0)
    token = out.token_ids[0]
    assert token == 2                               # the penalty moved the choice off 1
    assert lp.sampled_logprob == pytest.approx(raw[2].item())
    assert lp.sampled_rank == 2
    assert lp.top_token_ids == [1, 2]
    assert lp.top_logprobs == pytest.approx([raw[1].item(), raw[2].item()])


def test_zero_logprobs_gives_only_the_sampled_token():
    out = Sampler()(logits_of([0.0, 1.0]), [row(temperature=0.0, logprobs=0)])
    assert out.logprobs[0].top_token_ids == [] and out.logprobs[0].sampled_rank == 1


# --- rejection sampling (speculative decoding) -------------------------------------------------
def test_greedy_rejection_keeps_the_argmax_chain():
    # request 0: drafts [1, 2, 3] over rows whose argmax is 1, 2, 0 (bonus row: 3)
    # request 1: no drafts; request 2: drafts [2, 0], both accepted, bonus 1
    logits = logits_of([0, 9, 0, 0], [0, 0, 9, 0], [9, 0, 0, 0], [0, 0, 0, 9],
                       [0, 0, 0, 9],
                       [0, 0, 9, 0], [9, 0, 0, 0], [0, 9, 0, 0])
    greedy = row(temperature=0.0)
    out = Sampler().rejection_sample(logits, [greedy] * 3, [[1, 2, 3], [], [2, 0]])
    assert out.token_ids == [[1, 2, 0], [3], [2, 0, 1]]
    assert out.logprobs == [None, None, None]


def test_rows_see_the_drafts_before_them_as_output():
    # min_tokens=2 masks EOS (0) for the first two outputs: row 0 (no output yet) and row 1
    # (one draft before it) must not pick EOS, row 2 (two before it) may
    eos = [9.0, 1.0, 0.0]
    p = dict(temperature=0.0, eos_token_id=0, min_tokens=2)
    out = Sampler().rejection_sample(logits_of(eos, eos, eos), [row(**p)], [[1, 1]])
    assert out.token_ids == [[1, 1, 0]]
    # a repetition penalty on row 1 counts draft 1 as generated
    pen = logits_of([0.0, 2.0, 1.5], [0.0, 2.0, 1.5])
    out = Sampler().rejection_sample(pen, [row(temperature=0.0, repetition_penalty=2.0,
                                               prompt=(0,))], [[1]])
    assert out.token_ids == [[1, 2]]


def test_one_row_requests_match_the_ordinary_sampler():
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    rows = [row(temperature=1.0, seed=5), row(temperature=0.0), row(temperature=0.7, top_k=5),
            row(temperature=1.0, seed=9, logprobs=2)]
    plain = Sampler(seed=3)(logits.clone(), rows)
    spec = Sampler(seed=3).rejection_sample(logits.clone(), rows, [[]] * 4)
    assert spec.token_ids == [[t] for t in plain.token_ids]
    assert spec.logprobs[3] == [plain.logprobs[3]]


def test_random_acceptance_is_vllms_rule_and_keeps_the_distribution():
    # p = softmax(logits): draft 0 is accepted with probability p(0); on rejection the token
    # comes from p without 0; overall the first token is distributed as p
    logits = [math.log(0.5), math.log(0.3), math.log(0.2)]
    n = 4000
    rows = [row(temperature=1.0)] * n
    out = Sampler(seed=6).rejection_sample(logits_of(*[logits, logits] * n), rows, [[0]] * n)
    firsts = torch.tensor([t[0] for t in out.token_ids])
    accepted = sum(len(t) == 2 for t in out.token_ids)
    assert all(len(t) == 1 for t in out.token_ids if t[0] != 0)     # rejected: one token
    assert abs(accepted / n - 0.5) < 4 * math.sqrt(0.25 / n)
    freq = torch.bincount(firsts, minlength=3).float() / n
    for p, f in zip([0.5, 0.3, 0.2], freq.tolist(), strict=True):
        assert abs(p - f) < 4 * math.sqrt(p * (1 - p) / n)
    # a draft outside the vocabulary is always rejected
    bad = Sampler(seed=6).rejection_sample(logits_of(logits, logits), [row(temperature=1.0)],
                                           [[7]])
    assert len(bad.token_ids[0]) == 1 and bad.token_ids[0][0] in (0, 1, 2)


def test_seeded_rejection_does_not_depend_on_the_batch():
    torch.manual_seed(2)
    logits = torch.randn(3, 40)
    seeded = row(output=(4,), temperature=1.0, seed=77)
    draft = int(logits[0].argmax())
    alone = Sampler(seed=0).rejection_sample(logits.clone(), [seeded], [[draft, 3]])
    other = torch.randn(2, 40)
    batch = Sampler(seed=50).rejection_sample(torch.cat([other, logits]).clone(),
                                              [row(temperature=1.0), seeded], [[1], [draft, 3]])
    assert batch.token_ids[1] == alone.token_ids[0]


def test_logprobs_come_per_kept_token():
    logits = logits_of([0.0, 3.0, 1.0], [0.0, 1.0, 3.0], [3.0, 0.0, 1.0])
    out = Sampler().rejection_sample(logits.clone(), [row(temperature=0.0, logprobs=1)],
                                     [[1, 2]])
    assert out.token_ids == [[1, 2, 0]]
    lps = out.logprobs[0]
    raw = torch.log_softmax(logits, dim=-1)
    assert [lp.sampled_logprob for lp in lps] == pytest.approx(
        [raw[0, 1].item(), raw[1, 2].item(), raw[2, 0].item()])
    assert [lp.top_token_ids for lp in lps] == [[1], [2], [0]]
