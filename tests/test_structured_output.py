"""Structured output in the engine, on CPU and in process: the constraint's rules, the xgrammar
backend over a real (tiny) vocabulary, the bitmask and its application, the compile pool and
its cache, the overlap accounting, and the engine with the real model runner (a tiny random
Llama): a grammar that compiles slowly delays nobody, a batch mixing constrained and free
requests gives the free ones the tokens they get alone, a grammar that does not compile is an
error output, and the offline `LLM` honours `SamplingParams(structured_outputs=...)`."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import jsonschema
import msgspec
import numpy as np
import pytest
import torch

from kvloop import LLM, SamplingParams, StructuredOutputsParams
from kvloop.core.engine import IDLE_BACKOFF_S
from kvloop.core.outputs import GrammarOutput, SchedulerOutput
from kvloop.core.request import Request as LLMRequest
from kvloop.core.request import RequestStatus, StructuredOutputKind
from kvloop.core.structured_output import StructuredOutputManager, fill_rows
from kvloop.core.trace import StepTiming
from kvloop.front.tokenizer import Tokenizer
from kvloop.model.sampler import apply_token_bitmask
from kvloop.structured import backend_for
from tests.test_model_tiny import (
    TINY_VOCAB,
    gguf_tokenizer_metadata,
    tiny_hf_model,
    write_tiny_gguf,
)

EOS = 2


def big_schema(n: int) -> dict:
    """A schema that takes xgrammar long to compile (n objects of enums, arrays, ranges)."""
    return {"type": "object", "required": [f"f{i}" for i in range(n)], "properties": {
        f"f{i}": {"type": "object", "required": ["a", "b", "c"], "properties": {
            "a": {"enum": [f"x{i}_{j}" for j in range(5)]},
            "b": {"type": "array", "items": {"type": "number"}, "maxItems": 4},
            "c": {"type": "integer", "minimum": 0, "maximum": 1000}}}
        for i in range(n)}}


@pytest.fixture(scope="module")
def tiny_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(gguf_tokenizer_metadata(), "tiny")


@pytest.fixture(scope="module")
def backend(tiny_tokenizer):
    return backend_for(tiny_tokenizer, TINY_VOCAB)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tiny_hf_model(seed=21), tmp_path_factory.mktemp("so") / "t.gguf")


@pytest.fixture(scope="module")
def llm(tiny_gguf):
    # fp32: a tiny random model's top logits sit close together, and these tests compare
    # exact tokens across constrained, speculative and plain runs (one precision path)
    llm = LLM(str(tiny_gguf), dtype="float32", device="cpu", block_size=4, num_threads=1,
              num_gpu_blocks_override=128, check_invariants=True)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def spec_llm(tiny_gguf):
    llm = LLM(str(tiny_gguf), dtype="float32", device="cpu", block_size=4, num_threads=1,
              num_gpu_blocks_override=128, check_invariants=True, speculative_config={
                  "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                  "prompt_lookup_max": 3})
    yield llm
    llm.shutdown()


def allowed(bitmask: np.ndarray, row: int = 0) -> set[int]:
    bits = np.unpackbits(bitmask[row].view(np.uint8), bitorder="little")
    return {int(i) for i in np.flatnonzero(bits)}


# --- the constraint --------------------------------------------------------------------------
@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one constraint"),
    ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
    ({"choice": []}, "non-empty list of strings"),
    ({"json": "{not json"}, "json is not valid JSON"),
    ({"json": "[1, 2]"}, "must be a JSON schema"),
    ({"json_object": False}, "json_object must be true"),
    ({"regex": ""}, "regex must not be empty"),
    ({"structural_tag": "{}"}, "structural_tag is not supported"),
    ({"regex": "a", "whitespace_pattern": " "}, "whitespace_pattern is not supported"),
])
def test_the_constraint_is_checked_on_construction_and_on_decode(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)
    wire = msgspec.msgpack.encode({"structured_outputs": fields})
    with pytest.raises(msgspec.ValidationError, match=message):
        msgspec.msgpack.decode(wire, type=SamplingParams)


def test_kind_spec_and_cache_key():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}}
    p = StructuredOutputsParams(json=schema)
    assert p.kind == StructuredOutputKind.JSON
    assert p.spec == json.dumps(schema)          # property order kept: it is the output's
    assert p.key == (StructuredOutputKind.JSON, json.dumps(schema), True)
    assert StructuredOutputsParams(json=schema, disable_any_whitespace=True).key[2] is False
    assert StructuredOutputsParams(choice=["a", "b"]).spec == '["a", "b"]'
    assert StructuredOutputsParams(json_object=True).key == (
        StructuredOutputKind.JSON_OBJECT, "", True)
    sp = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(sp), type=SamplingParams) == sp


# --- the xgrammar backend over the tiny vocabulary -------------------------------------------
def test_the_vocabulary_is_the_tokenizers_with_special_tokens_never_allowed(backend,
                                                                            tiny_tokenizer):
    info = backend.tokenizer_info
    assert info.vocab_size == TINY_VOCAB
    assert sorted(info.special_token_ids) == sorted(tiny_tokenizer.all_special_ids - {EOS})
    assert info.stop_token_ids == [EOS]
    bitmask = backend.allocate_bitmask(1)
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(json_object=True)))
    matcher.fill_next_token_bitmask(bitmask, 0)
    first = allowed(bitmask)
    assert first and not first & tiny_tokenizer.all_special_ids
    # every allowed first token decodes to text a JSON object may start with
    assert {tiny_tokenizer.decode([t]).lstrip()[:1] for t in first} <= {"{", ""}


def test_a_choice_with_quotes_and_newlines_is_matched_exactly(backend, tiny_tokenizer):
    choices = ['say "hi"', "two\nlines", "back\\slash"]
    compiled = backend.compile(StructuredOutputsParams(choice=choices))
    for text in choices:
        matcher = backend.matcher(compiled)
        for tok in tiny_tokenizer.encode(text, add_special_tokens=False):
            assert matcher.accept_token(tok)
        assert not matcher.is_terminated() and matcher.accept_token(EOS)
        assert matcher.is_terminated()
    matcher = backend.matcher(compiled)
    assert all(matcher.accept_token(t) for t in tiny_tokenizer.encode("say", False))
    bitmask = backend.allocate_bitmask(1)
    matcher.fill_next_token_bitmask(bitmask, 0)
    assert EOS not in allowed(bitmask)           # "say" alone is no choice


@pytest.mark.parametrize("fields, message", [
    ({"json": {"type": 5}}, r"^Invalid JSON schema for structured output: .*string"),
    ({"json": {"properties": {"a": {"$ref": "#/nope"}}}}, r"Cannot find field '?nope"),
    ({"regex": "(ab"}, r"^Invalid regex for structured output: .*parenthesis is not closed"),
    ({"grammar": "root ::= foo"}, r"^Invalid grammar for structured output: .*\"foo\""),
])
def test_a_spec_that_does_not_compile_is_a_value_error_naming_the_problem(backend, fields,
                                                                          message):
    with pytest.raises(ValueError, match=message) as info:
        backend.compile(StructuredOutputsParams(**fields))
    assert "/project/" not in str(info.value) and ".cc:" not in str(info.value)


# --- the bitmask: filled with drafts, applied to logits ---------------------------------------
def test_rows_for_drafts_are_the_masks_after_each_draft_and_the_state_is_rolled_back(
        backend, tiny_tokenizer):
    compiled = backend.compile(StructuredOutputsParams(regex="[0-9]{2}-[a-z]{2}"))
    drafts = tiny_tokenizer.encode("12-a", False)
    grammar = backend.matcher(compiled)
    rows = backend.allocate_bitmask(len(drafts) + 2)
    fill_rows(grammar, drafts, rows, 1)
    expected = backend.allocate_bitmask(len(drafts) + 1)
    reference = backend.matcher(compiled)
    for i, tok in enumerate([*drafts, None]):
        reference.fill_next_token_bitmask(expected, i)
        if tok is not None:
            assert reference.accept_token(tok)
    assert (rows[1:] == expected).all() and (rows[0] == -1).all()
    fresh = backend.allocate_bitmask(1)
    grammar.fill_next_token_bitmask(fresh, 0)          # rolled back: at the start again
    assert (fresh[0] == expected[0]).all()


def test_a_refused_draft_stops_the_advance(backend, tiny_tokenizer):
    compiled = backend.compile(StructuredOutputsParams(regex="[0-9]+"))
    x, one = tiny_tokenizer.encode("x", False)[0], tiny_tokenizer.encode("1", False)[0]
    rows = backend.allocate_bitmask(3)
    fill_rows(backend.matcher(compiled), [x, one], rows, 0)
    assert (rows[1] == rows[0]).all() and (rows[2] == rows[0]).all()


def test_drafts_are_cut_to_the_longest_prefix_the_grammar_accepts(backend, tiny_tokenizer):
    manager = StructuredOutputManager(lambda: backend, num_workers=1)
    try:
        req = LLMRequest("r", [5], SamplingParams(structured_outputs=StructuredOutputsParams(
            regex="[0-9]{2}-[a-z]+")))
        manager.grammar_init(req)
        so_req = req.structured_output_request
        while not so_req.poll():
            time.sleep(0.01)
        ids = tiny_tokenizer.encode("12-ab3x", False)
        assert tiny_tokenizer.decode(so_req.valid_prefix(ids)) == "12-ab"
        assert so_req.valid_prefix(ids[:2]) == ids[:2]
        assert so_req.accept_token(ids[0])               # the state was left at the start
    finally:
        manager.shutdown()


def test_apply_token_bitmask_sets_exactly_the_disallowed_logits_to_minus_inf():
    logits = torch.arange(2 * 70, dtype=torch.float32).reshape(2, 70)
    before = logits.clone()
    # 64 bits (tokens 64+ disallowed): tokens 3 and 31 (the sign bit), then token 33
    words = np.array([[(1 << 3) | (1 << 31), 1 << 1]], dtype=np.uint32).view(np.int32)
    apply_token_bitmask(logits, torch.from_numpy(words), [1])
    assert torch.equal(logits[0], before[0])
    keep = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert keep == [3, 31, 33] and logits[1, 33] == before[1, 33]


def test_step_timing_counts_the_bitmask_time_inside_the_forward_window():
    assert StepTiming.of((10.0, 10.5), (10.1, 10.2)) == StepTiming(0.5, pytest.approx(0.1),
                                                                   pytest.approx(0.1))
    t = StepTiming.of((10.0, 10.5), (10.4, 10.7))
    assert (t.forward_s, t.bitmask_s, t.bitmask_hidden_s) == pytest.approx((0.5, 0.3, 0.1))
    assert StepTiming.of((1.0, 2.0), None) == StepTiming(1.0, 0.0, 0.0)
    assert StepTiming.of(None, (1.0, 1.5)).bitmask_hidden_s == 0.0


# --- the manager: pool, cache ----------------------------------------------------------------
def test_grammars_compile_once_per_key_and_failures_are_not_kept(backend):
    built = []

    def factory():
        built.append(1)
        return backend

    manager = StructuredOutputManager(factory, num_workers=1)
    try:
        a = StructuredOutputsParams(regex="[ab]+")
        assert manager._compiled(a) is manager._compiled(StructuredOutputsParams(regex="[ab]+"))
        loose = StructuredOutputsParams(json_object=True)
        tight = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
        assert manager._compiled(loose) is not manager._compiled(tight)
        bad = StructuredOutputsParams(regex="(")
        with pytest.raises(ValueError, match="Invalid regex"):
            manager.validate(bad)
        failed = manager._compiled(bad)
        assert failed.future.exception() is not None
        assert manager._compiled(bad) is not failed     # a failure is compiled again
        assert built == [1]
    finally:
        manager.shutdown()


def test_grammar_bitmask_rows_follow_the_scheduling_order(llm, tiny_tokenizer):
    engine = llm.engine
    manager = engine.structured_output
    digits = SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(
        regex="[0-9]+"))
    requests = {}
    for rid, sp in (("free", SamplingParams(max_tokens=3)), ("c1", digits), ("c2", digits)):
        requests[rid] = req = engine.make_request(rid, [5, 6, 7], sp)
        if req.use_structured_output:
            manager.grammar_init(req)
            while not req.structured_output_request.poll():
                time.sleep(0.01)
    so = SchedulerOutput(num_scheduled_tokens={"c2": 1, "free": 1, "c1": 3},
                         sampling_req_ids={"c2", "free"})
    out = manager.grammar_bitmask(requests, so)
    assert isinstance(out, GrammarOutput)
    assert (out.request_ids, out.num_rows) == (["c2"], [1])   # c1 is mid-prefill
    digit_ids = {tiny_tokenizer.encode(str(d), False)[0] for d in range(10)}
    assert digit_ids <= allowed(out.bitmask) and EOS not in allowed(out.bitmask)
    assert manager.grammar_bitmask(requests, SchedulerOutput(
        num_scheduled_tokens={"free": 1}, sampling_req_ids={"free"})) is None


# --- the engine with the real runner -----------------------------------------------------------
def run_to_end(engine, limit_s: float = 60.0):
    """Step until every request finishes; the outputs and step records."""
    outputs, records = {}, []
    deadline = time.monotonic() + limit_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish in time"
        res = engine.step()
        if res.record is not None and res.executed:
            records.append(res.record)
        for o in res.outputs:
            outputs.setdefault(o.request_id, []).append(o)
        if not res.executed:
            engine.wait_for_work(0.05)   # a grammar still compiling: backs off, no spin
    return outputs, records


def tokens_of(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_a_slow_grammar_does_not_delay_other_requests(llm):
    """The free request gets every token while the big schema compiles: one token a step,
    all twelve before the compile is done (a step that waited for the compile would find it
    done), and the slow request runs once it is."""
    engine = llm.engine
    engine.structured_output.backend  # noqa: B018  (built: its import is not the compile)
    slow = engine.make_request("slow", [5, 6, 7], SamplingParams(
        temperature=0.0, max_tokens=2,
        structured_outputs=StructuredOutputsParams(json=big_schema(400))))
    free = engine.make_request("free", [8, 9, 10], SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True))
    t0 = time.perf_counter()
    engine.add_request(slow)
    engine.add_request(free)
    steps, free_done = [], None
    while free_done is None:
        s0 = time.perf_counter()
        res = engine.step()
        steps.append(time.perf_counter() - s0)
        if any(o.request_id == "free" and o.finished for o in res.outputs):
            free_done = time.perf_counter() - t0
    assert slow.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    assert len(steps) == 12                             # a token in every step
    outputs, _ = run_to_end(engine)
    assert slow.status == RequestStatus.FINISHED_LENGTH_CAPPED and not outputs["slow"][-1].error
    assert engine.block_pool.get_num_free_blocks() == engine.block_pool.num_usable_blocks


def test_wait_for_work_backs_off_while_a_grammar_compiles(llm, monkeypatch):
    """`run_to_end`'s loop (`step()`, then `wait_for_work()` after a step that executed
    nothing, as `LLM` runs it) while its one request's grammar compiles: each idle step is
    followed by a back-off of IDLE_BACKOFF_S, not a spin (without it the loop had stepped
    ~14,000 times a second, each step with the invariant checks), so such steps times the
    back-off fit in the loop's time."""
    engine, idle = llm.engine, [0]   # steps that executed nothing
    step = engine.step

    def counted() -> Any:
        res = step()
        idle[0] += not res.executed
        return res
    monkeypatch.setattr(engine, "step", counted)
    engine.add_request(engine.make_request("compiling", [5, 6, 7], SamplingParams(
        temperature=0.0, max_tokens=2,
        structured_outputs=StructuredOutputsParams(json=big_schema(150)))))  # ~0.15 s, new
    t0 = time.monotonic()
    run_to_end(engine)
    assert idle[0] and idle[0] * IDLE_BACKOFF_S <= time.monotonic() - t0


def test_free_requests_get_the_tokens_they_get_alone_beside_constrained_ones(llm):
    free = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
            SamplingParams(temperature=0.9, seed=5, max_tokens=10, ignore_eos=True)]
    constrained = [SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=s)
                   for s in (StructuredOutputsParams(regex="[a-z]{3,8}"),
                             StructuredOutputsParams(json_object=True),
                             StructuredOutputsParams(choice=["left", "right"]))]
    prompts = ["the cat sat", "a dog ran far"]
    alone = llm.generate(prompts, free, use_tqdm=False)
    mixed = llm.generate([*prompts, "x y z", "p q", "m n"], [*free, *constrained],
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids
                                                           for o in alone]
    assert re.fullmatch("[a-z]{3,8}", mixed[2].outputs[0].text)
    assert mixed[4].outputs[0].text in ("left", "right")


def test_grammars_with_speculative_drafts_keep_the_greedy_output(llm, spec_llm):
    """vLLM's rule: greedy output is the same with and without n-gram drafts; the drafts of
    a constrained request are verified against its bitmask rows (1 + k of them)."""
    params = [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=s)
              for s in (StructuredOutputsParams(regex="(ab )+x"),
                        StructuredOutputsParams(regex="[a-z ]{1,30}"),
                        StructuredOutputsParams(choice=["ab ab ab ab", "ba ba"]))]
    prompts = ["ab ab ab ab ab ab", "the cat the cat the cat", "ab ab ab"]
    plain = llm.generate(prompts, params, use_tqdm=False)
    engine = spec_llm.engine
    tok = spec_llm.get_tokenizer()
    for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(engine.make_request(f"s{i}", tok.encode(prompt), sp))
    outputs, records = run_to_end(engine)
    assert [tokens_of(outputs[f"s{i}"]) for i in range(3)] == [
        o.outputs[0].token_ids for o in plain]
    drafts = sum(w.draft_tokens for r in records for w in r.scheduled.values())
    assert drafts > 0 and any(r.bitmask_s > 0 for r in records if any(
        w.draft_tokens for w in r.scheduled.values()))


def test_constrained_outputs_of_the_offline_llm_match(llm):
    schema = {"type": "object", "properties": {
        "size": {"enum": ["s", "l"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "t": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
        "required": ["size", "n", "t"], "additionalProperties": False}
    cases = [(StructuredOutputsParams(json=schema, disable_any_whitespace=True),
              lambda t: jsonschema.validate(json.loads(t), schema)),
             (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"),
              lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t) or pytest.fail(t)),
             (StructuredOutputsParams(choice=["yes", "no"]),
              lambda t: t in ("yes", "no") or pytest.fail(t)),
             (StructuredOutputsParams(grammar='root ::= "n=" [1-9] [0-9]?'),
              lambda t: re.fullmatch(r"n=[1-9][0-9]?", t) or pytest.fail(t))]
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=so)
              for so, _ in cases]
    outs = llm.generate(["one", "two", "three", "four"], params, use_tqdm=False)
    for out, (_, check) in zip(outs, cases, strict=True):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0]
        check(out.outputs[0].text)


def test_the_offline_llm_refuses_a_spec_that_does_not_compile(llm):
    with pytest.raises(ValueError, match="Invalid regex for structured output"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=2),
                                  SamplingParams(structured_outputs=StructuredOutputsParams(
                                      regex="[a-"))], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()     # nothing was added


def test_a_grammar_that_does_not_compile_in_the_engine_is_an_error_output(llm):
    engine = llm.engine
    bad = engine.make_request("bad", [5, 6], SamplingParams(
        structured_outputs=StructuredOutputsParams(grammar="root ::= ")))
    ok = engine.make_request("ok", [5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request(bad)
    engine.add_request(ok)
    outputs, _ = run_to_end(engine)
    (err,) = outputs["bad"]
    assert (err.finish_reason, err.new_token_ids) == ("error", [])
    assert err.error.startswith("Invalid grammar for structured output: ")
    assert len(tokens_of(outputs["ok"])) == 3
    assert engine.block_pool.get_num_free_blocks() == engine.block_pool.num_usable_blocks


def test_the_step_records_say_how_much_bitmask_time_the_forward_hid(llm):
    engine = llm.engine
    engine.add_request(engine.make_request("j", [5, 6, 7], SamplingParams(
        temperature=0.0, max_tokens=6,
        structured_outputs=StructuredOutputsParams(regex="[a-z ]+"))))
    engine.add_request(engine.make_request("f", [9, 9], SamplingParams(max_tokens=6)))
    _, records = run_to_end(engine)
    masked = [r for r in records if r.bitmask_s > 0]
    assert masked and all(r.forward_s > 0 for r in records)
    # how much overlapped is the machine's business (a forward that ends before the bitmask
    # starts hides none of it, as on a loaded machine); the overlap rule is tested exactly on
    # given windows above (StepTiming.of)
    assert all(0 <= r.bitmask_hidden_s <= r.bitmask_s for r in masked)
    assert {"forward_s", "bitmask_s", "bitmask_hidden_s"} <= set(masked[0].to_json())


@pytest.mark.slow   # runs the benchmark
def test_the_benchmark_runs(llm, tmp_path, capsys):
    from kvloop.bench import structured

    path = write_tiny_gguf(tiny_hf_model(seed=3), tmp_path / "b.gguf")
    assert structured.main(["--model", str(path), "--dtype", "float32", "--threads", "1",
                            "--num-requests", "2", "--output-len", "4", "--repeats", "1"]) == 0
    text = capsys.readouterr().out
    assert "json_schema / unconstrained" in text and "hidden behind the forward" in text
