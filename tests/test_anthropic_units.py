"""Anthropic's Messages API as functions: the one conversion to a chat request (and so the
prompt the worker and the router tokenize), stop reasons, content blocks, the stream's event
sequence, the error shape and its middleware, `x-api-key` as a key, and what the router reads
of a Messages body and answer (the HTTP side: tests/test_serve_anthropic.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from kvloop.front.anthropic import (
    ConversionError,
    CountTokensRequest,
    MessageEvents,
    MessagesRequest,
    anthropic_error,
    chat_request,
    content_blocks,
    stop_reason,
    usage,
    validate_messages,
)
from kvloop.front.auth import AuthConfig, RouteRules, presented_authorization
from kvloop.front.guard import install
from kvloop.front.http_limits import HttpLimits
from kvloop.front.openai import ChatCompletionRequest, error_body, http_error_body
from kvloop.front.prompts import PromptError, body_prompts, chat_prompt
from kvloop.front.tokenizer import Tokenizer
from kvloop.router.proxy import read_body
from kvloop.router.relay import cached_tokens

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def messages(**body: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 5, **body})


def chat_dump(req: ChatCompletionRequest) -> dict[str, Any]:
    return req.model_dump(exclude_none=True)


# --- the conversion ------------------------------------------------------------------------------
def test_system_text_blocks_and_turns_become_chat_messages():
    req = messages(system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
                   messages=[{"role": "user", "content": "Hi"},
                             {"role": "assistant", "content": [{"type": "text", "text": "Hel"},
                                                               {"type": "text", "text": "lo"}]},
                             {"role": "user", "content": [{"type": "text", "text": "Bye"}]}],
                   stop_sequences=["x"], temperature=0.5, top_p=0.9, top_k=3, stream=True,
                   metadata={"user_id": "u1"})
    chat = chat_dump(chat_request(req))
    assert chat["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": "Hello"},
                                {"role": "user", "content": "Bye"}]
    assert {k: chat[k] for k in ("max_tokens", "stop", "temperature", "top_p", "top_k",
                                 "stream")} == {"max_tokens": 5, "stop": ["x"],
                                                "temperature": 0.5, "top_p": 0.9, "top_k": 3,
                                                "stream": True}


def test_tool_use_and_tool_results_become_calls_and_tool_messages():
    req = messages(messages=[
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "s"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "sunny"}, {"type": "text", "text": "20C"}]},
            {"type": "text", "text": "And tomorrow?"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2",
                                      "content": "rain"}]}],
        tools=[{"name": "get_weather", "description": "d", "input_schema": WEATHER}])
    chat = chat_dump(chat_request(req))
    assert chat["messages"] == [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny\n20C", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "tool", "content": "rain", "tool_call_id": "toolu_2"}]
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "d", "parameters": WEATHER}}]
    assert "tool_choice" not in chat     # none given: the chat default ("auto" with tools)


@pytest.mark.parametrize("choice, expected", [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "get_weather"},
     {"type": "function", "function": {"name": "get_weather"}})])
def test_tool_choice(choice, expected):
    req = messages(messages=[{"role": "user", "content": "x"}], tool_choice=choice,
                   tools=[{"name": "get_weather", "input_schema": WEATHER}])
    got = chat_request(req).tool_choice
    assert (got if isinstance(got, str) else got.model_dump()) == expected


@pytest.mark.parametrize("body, message", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "image content is not supported"),
    ({"messages": [{"role": "user", "content": []}]}, "must not be empty"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}},
     "tool_choice.name is required")])
def test_what_has_no_chat_equivalent_is_a_conversion_error(body, message):
    with pytest.raises(ConversionError, match=message):
        chat_request(messages(**body))


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return Tokenizer.from_model(None)


def test_a_messages_prompt_is_its_chat_equivalents_prompt_for_server_and_router(smol):
    body = {"model": "m", "max_tokens": 3, "system": "You are terse.",
            "messages": [{"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Hello"},
                         {"role": "user", "content": [{"type": "text", "text": "Again"}]}]}
    chat = {"messages": [{"role": "system", "content": "You are terse."},
                         {"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Hello"},
                         {"role": "user", "content": "Again"}]}
    expected = chat_prompt(smol, ChatCompletionRequest.model_validate(chat))
    assert body_prompts(smol, "/v1/messages", body) == [expected]
    assert body_prompts(smol, "/v1/messages/count_tokens", body) == [expected]
    assert smol.decode(expected, skip_special_tokens=False).startswith(
        "<|im_start|>system\nYou are terse.<|im_end|>")
    with pytest.raises(PromptError) as e:
        body_prompts(smol, "/v1/messages", {**body, "messages": [
            {"role": "user", "content": [{"type": "image", "source": {}}]}]})
    assert e.value.param == "messages"


def test_validation_reads_each_routes_schema():
    ok = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert isinstance(validate_messages("/v1/messages/count_tokens", ok), CountTokensRequest)
    refused = validate_messages("/v1/messages", ok)       # no max_tokens
    assert isinstance(refused, dict) and "max_tokens" in refused["error"]["message"]
    refused = validate_messages("/v1/messages", {**ok, "max_tokens": 1, "messages": []})
    assert isinstance(refused, dict) and refused["error"]["param"] == "body.messages"


# --- answers -------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, expected", [
    (("length", None, None, False), ("max_tokens", None)),
    (("stop", 2, None, False), ("end_turn", None)),           # an end-of-turn token
    (("stop", "END", ["x", "END"], False), ("stop_sequence", "END")),
    (("stop", "END", None, False), ("end_turn", None)),       # not one of the request's
    (("tool_calls", None, None, True), ("tool_use", None)),
    (("stop", None, None, True), ("tool_use", None)),         # a named (forced) call
    ((None, None, None, False), (None, None))])
def test_stop_reason(args, expected):
    assert stop_reason(*args) == expected


def test_content_blocks_text_then_tool_uses_and_a_cut_call_stays_text():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    cut = {"id": "c2", "type": "function", "function": {"name": "f", "arguments": '{"a": '}}
    assert content_blocks("hi", [call]) == [
        {"type": "text", "text": "hi"},
        {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}}]
    assert content_blocks("", [cut]) == [{"type": "text", "text": '{"a": '}]
    assert content_blocks(None, []) == []


def test_usage_splits_the_prompt_into_computed_and_cached():
    assert usage(40, 32, 3) == {"input_tokens": 8, "output_tokens": 3,
                                "cache_read_input_tokens": 32, "cache_creation_input_tokens": 0}


def parse_events(raw: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for b in raw:
        name, data = b.decode().rstrip("\n").split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        body = json.loads(data[len("data: "):])
        assert body["type"] == name[len("event: "):]
        out.append((body["type"], body))
    return out


def test_the_event_sequence_of_text_then_two_tool_calls():
    ev = MessageEvents("msg_1", "m")
    raw = ev.start(usage(10, 0, 0))
    raw += ev.push("Hel", []) + ev.push("lo", [])
    raw += ev.push("", [{"index": 0, "id": "c1", "type": "function",
                         "function": {"name": "f", "arguments": '{"a"'}}])
    raw += ev.push("", [{"index": 0, "function": {"arguments": ": 1}"}}])
    raw += ev.push("", [{"index": 1, "id": "c2", "type": "function",
                         "function": {"name": "g", "arguments": "{}"}}])
    raw += ev.finish("tool_use", None, usage(10, 0, 7))
    events = parse_events(raw)
    assert [(t, b.get("index")) for t, b in events] == [
        ("message_start", None), ("ping", None),
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_stop", 2),
        ("message_delta", None), ("message_stop", None)]
    start = events[0][1]["message"]
    assert (start["id"], start["content"], start["usage"]["input_tokens"]) == ("msg_1", [], 10)
    assert events[3][1]["delta"] == {"type": "text_delta", "text": "Hel"}
    assert events[6][1]["content_block"] == {"type": "tool_use", "id": "c1", "name": "f",
                                             "input": {}}
    assert [b["delta"]["partial_json"] for _, b in events[7:9]] == ['{"a"', ": 1}"]
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == 7


def test_a_stream_with_no_content_has_no_block():
    ev = MessageEvents("msg_2", "m")
    raw = ev.start(usage(3, 0, 0)) + ev.push("", []) + ev.finish("max_tokens", None,
                                                                 usage(3, 0, 1))
    assert [t for t, _ in parse_events(raw)] == ["message_start", "ping", "message_delta",
                                                 "message_stop"]


# --- errors, keys and the middleware ------------------------------------------------------------
@pytest.mark.parametrize("status, kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (405, "invalid_request_error"), (413, "request_too_large"),
    (500, "api_error"), (502, "api_error"), (503, "overloaded_error")])
def test_an_openai_error_in_anthropics_shape(status, kind):
    assert anthropic_error(error_body("boom", status, "p"), status) == {
        "type": "error", "error": {"type": kind, "message": "boom"}}


def test_what_is_not_an_openai_error_is_left_alone():
    already = {"type": "error", "error": {"type": "api_error", "message": "x"}}
    for body in (already, {"error": "text"}, [1], {"detail": "x"}):
        assert anthropic_error(body, 400) is None


def test_x_api_key_is_a_key_and_authorization_wins():
    assert presented_authorization({"x-api-key": "k"}) == "Bearer k"
    assert presented_authorization({"authorization": "Bearer a", "x-api-key": "k"}) == "Bearer a"
    assert presented_authorization({"x-api-key": " "}) is None
    assert presented_authorization({}) is None


@pytest.fixture
def guarded() -> TestClient:
    async def fail(request: Request) -> Response:
        await request.body()
        return JSONResponse(error_body("bad field", 400, "x"), status_code=400)

    async def ok(request: Request) -> Response:
        return JSONResponse({"ok": True})

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return JSONResponse(http_error_body(exc.status_code, exc.detail), exc.status_code)

    app = Starlette(routes=[Route("/v1/messages", fail, methods=["POST"]),
                            Route("/v1/messages/count_tokens", ok, methods=["POST"]),
                            Route("/v1/chat/completions", fail, methods=["POST"])],
                    exception_handlers={HTTPException: http_error})
    install(app, AuthConfig(api_keys=("key",)), RouteRules(),
            HttpLimits(max_request_body_bytes=100))
    return TestClient(app)


def test_the_middleware_reshapes_every_error_of_the_messages_routes(guarded):
    key = {"x-api-key": "key"}
    r = guarded.post("/v1/messages", json={}, headers=key)
    assert (r.status_code, r.json()) == (400, {"type": "error", "error": {
        "type": "invalid_request_error", "message": "bad field"}})
    assert int(r.headers["content-length"]) == len(r.content)
    r = guarded.post("/v1/messages", json={}, headers={"x-api-key": "nope"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = guarded.post("/v1/messages", content=b"x" * 200, headers=key)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = guarded.get("/v1/messages", headers=key)
    assert r.status_code == 405 and r.json()["type"] == "error"
    assert guarded.post("/v1/messages/count_tokens", json={}, headers=key).json() == {"ok": True}
    # other routes keep OpenAI's shape, and take the same key as a Bearer token
    r = guarded.post("/v1/chat/completions", json={}, headers={"authorization": "Bearer key"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x"


# --- what the router reads -----------------------------------------------------------------------
def test_the_router_passes_a_messages_body_on_as_sent():
    body = {"model": "m", "max_tokens": 4, "stream": True, "extra": 1,
            "messages": [{"role": "user", "content": "x"}]}
    assert read_body(json.dumps(body).encode(), "/v1/messages") == (body, True, False)
    refused = read_body(json.dumps({**body, "kv_transfer_params": {}}).encode(), "/v1/messages")
    assert isinstance(refused, Response) and refused.status_code == 400
    refused = read_body(json.dumps({"model": "m"}).encode(), "/v1/messages")
    assert isinstance(refused, Response) and refused.status_code == 400
    assert json.loads(bytes(refused.body))["error"]["param"] == "body.messages"


def test_the_router_reads_anthropics_cache_reads():
    assert cached_tokens({"usage": {"input_tokens": 8, "cache_read_input_tokens": 32}}) == 32
    assert cached_tokens({"type": "message_delta", "usage": {
        "output_tokens": 1, "cache_read_input_tokens": 0}}) == 0
    assert cached_tokens({"usage": {"prompt_tokens_details": {"cached_tokens": 5}}}) == 5


TOOLS_TEMPLATE = (   # a template that shows tools (Qwen's and Llama 3's do; SmolLM2's does not)
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}: "
    "{{ t.function.description }} {{ t.function.parameters | tojson }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_count_tokens_counts_the_tools_as_the_template_renders_them(smol):
    """Issue 37, low: `count_tokens` with `tools` is the prompt `/v1/messages` runs, the
    tools' definitions included where the model's template shows them (and, as there, not
    where it does not: SmolLM2's template has no tools, so neither has its prompt)."""
    shows = Tokenizer(smol._tok, model_name="t", chat_template=TOOLS_TEMPLATE,
                      bos_token_id=smol.bos_token_id, eos_token_id=smol.eos_token_id)
    base = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}
    tools = [{"name": "get_weather", "description": "The weather of a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    for tok, grows in ((shows, True), (smol, False)):
        bare = body_prompts(tok, "/v1/messages/count_tokens", base)[0]
        counted = body_prompts(tok, "/v1/messages/count_tokens", {**base, "tools": tools})[0]
        served = body_prompts(tok, "/v1/messages", {**base, "tools": tools,
                                                    "tool_choice": {"type": "none"}})[0]
        assert counted == served
        assert (len(counted) > len(bare) + 10) is grows
        if grows:
            assert "get_weather: The weather of a city" in tok.decode(counted)
