"""Outputs of one request queued behind each other are processed as one (`merge_outputs`,
`serving.merge_held`): the same text, tokens, logprobs and finish as processing them one by
one, with the embedded model's tokenizer (multi-byte characters split across tokens) and the
byte tokenizer (stop strings at any byte)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest

from kvloop.front.byte_tokenizer import ByteTokenizer
from kvloop.front.processor import OutputOptions, OutputState, merge_outputs
from kvloop.front.tokenizer import Tokenizer
from kvloop.server.client import QueueItem
from kvloop.server.serving import ClientDisconnected, merge_held
from kvloop.wire import EngineCoreOutput, PromptLogprobsChunk, TopLogprobs

SMOL_TEXT = ("Déjà vu: 東京 is 3,776 m below Fuji's top 🗻; naïve café owners say "
             "\"ok\" <|im_end|> twice. Then: ok, ok.")


@dataclass
class Streamed:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    stop_reason: int | str | None
    num_deltas: int


def _stream(state: OutputState, outputs: list[EngineCoreOutput]) -> Streamed:
    deltas = [state.process(o) for o in outputs]
    return Streamed("".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids],
                    [lp.logprob for d in deltas for lp in d.logprobs], state.finish_reason,
                    state.stop_reason, len(deltas))


def _steps(rng: random.Random, ids: list[int], finish: str, stop_reason: int | None,
           logprobs: bool) -> list[EngineCoreOutput]:
    """`ids` as the engine would send them: 1-3 tokens a step, the last one finishing."""
    outs, i = [], 0
    while i < len(ids):
        k = rng.randint(1, 3)
        chunk = ids[i:i + k]
        lps = ([TopLogprobs(t, -0.1 * (i + j), 1, [t], [-0.1 * (i + j)])
                for j, t in enumerate(chunk)] if logprobs else None)
        outs.append(EngineCoreOutput("r", chunk, new_logprobs=lps))
        i += k
    outs[-1].finish_reason, outs[-1].stop_reason = finish, stop_reason
    return outs


def _merged(outs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
    merged = []
    for rid, item in merge_held([("r", o) for o in outs]):
        assert rid == "r" and isinstance(item, EngineCoreOutput)
        merged.append(item)
    return merged


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return Tokenizer.from_model(None)


CASES: list[dict[str, Any]] = [
    {},
    {"stop": ("ok",)},
    {"stop": ("ok", "café"), "include_stop_str_in_output": True},
    {"stop": (" is",), "min_tokens": 6},
    {"stop": ("🗻",)},
    {"skip_special_tokens": False},
]


@pytest.mark.parametrize("options", CASES)
@pytest.mark.parametrize("finish", ["length", "eos", "stop_token"])
@pytest.mark.parametrize("logprobs", [False, True])
def test_merged_outputs_stream_what_the_steps_stream(smol: Tokenizer, options: dict[str, Any],
                                                     finish: str, logprobs: bool) -> None:
    ids = smol.encode(SMOL_TEXT, add_special_tokens=False)
    stop_reason = None
    if finish != "length":
        ids = [*ids, smol.eos_token_id]
        stop_reason = smol.eos_token_id if finish == "stop_token" else None
    reason = "length" if finish == "length" else "stop"
    for seed in range(5):
        outs = _steps(random.Random(seed), ids, reason, stop_reason, logprobs)
        opts = OutputOptions(**options)
        one_by_one = _stream(OutputState(smol, [1, 2, 3], opts), outs)
        merged = _merged(outs)
        at_once = _stream(OutputState(smol, [1, 2, 3], opts), merged)
        assert len(merged) == 1 and at_once.num_deltas == 1
        assert at_once.text == one_by_one.text
        assert at_once.token_ids == one_by_one.token_ids
        assert at_once.logprobs == one_by_one.logprobs
        assert (at_once.finish_reason, at_once.stop_reason) == (one_by_one.finish_reason,
                                                                one_by_one.stop_reason)
    assert one_by_one.text   # the case streams something


def test_every_split_of_a_byte_stream_with_stop_strings_streams_the_same() -> None:
    tok = ByteTokenizer()
    text = "abcab ab, ba: c"
    opts = OutputOptions(stop=("ab,", "a:"), min_tokens=2)
    rng = random.Random(7)
    for _ in range(50):
        outs = _steps(rng, list(text.encode()), "length", None, False)
        cut = rng.randint(1, len(outs))     # the handler fell behind for the outputs from `cut`
        merged = outs[:cut - 1] + _merged(outs[cut - 1:])
        assert (_stream(OutputState(tok, [1], opts), merged).text
                == _stream(OutputState(tok, [1], opts), outs).text == "abcab ")


def test_what_cannot_merge_keeps_its_place() -> None:
    a1, a2 = EngineCoreOutput("a", [1]), EngineCoreOutput("a", [2], finish_reason="length")
    b1, b2 = EngineCoreOutput("b", [7]), EngineCoreOutput("b", [8])
    prompt_lps = EngineCoreOutput("b", [9], new_prompt_logprobs=PromptLogprobsChunk(0, []))
    b3 = EngineCoreOutput("b", [10])
    gone = ClientDisconnected()
    held: list[QueueItem] = [("a", a1), ("b", b1), ("a", a2), ("b", b2), ("b", prompt_lps),
                             ("a", EngineCoreOutput("a", [3])), ("b", b3), (None, gone),
                             ("b", EngineCoreOutput("b", [11]))]
    merged = merge_held(held)
    assert [(r, getattr(o, "new_token_ids", None)) for r, o in merged] == [
        ("a", [1, 2]),      # finished: nothing merges into it
        ("b", [7, 8]),
        ("b", [9]),         # prompt logprobs: it neither merges nor takes anything in
        ("a", [3]),
        ("b", [10]),
        (None, None),       # nothing jumps an exception, nothing after it merges
        ("b", [11])]
    assert merged[0][1].finish_reason == "length"
    assert merge_held([("b", b1), (None, gone), ("b", b2)]) == [("b", b1), (None, gone),
                                                               ("b", b2)]


def test_merge_refuses_outputs_that_do_not_add_up() -> None:
    lp = [TopLogprobs(1, -0.5, 1, [1], [-0.5])]
    plain, with_lp = EngineCoreOutput("r", [1]), EngineCoreOutput("r", [1], new_logprobs=lp)
    assert merge_outputs(plain, with_lp) is None and merge_outputs(with_lp, plain) is None
    assert merge_outputs(EngineCoreOutput("r", [], "error", error="x"), plain) is None
    assert merge_outputs(plain, EngineCoreOutput("r", [], "error", error="x")) is None
    assert merge_outputs(EngineCoreOutput("r", [1], "length"), plain) is None
    both = merge_outputs(with_lp, EngineCoreOutput("r", [2], new_logprobs=lp * 1))
    assert both is not None and both.new_token_ids == [1, 2] and both.new_logprobs == lp + lp
