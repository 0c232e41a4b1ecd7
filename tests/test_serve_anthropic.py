"""Anthropic's Messages API through the official `anthropic` SDK (unchanged) against real
`kvloop serve --model sim` workers, with and without `--api-key`, and through the router:
create, stream (the event sequence), stop sequences, count_tokens, the prompt a Messages
request renders (its chat equivalent's, to the token), prefix-cache reads in the usage, errors
in Anthropic's shape, and the router predicting the hits the worker reports. Tool calls need a
grammar backend or a real model's output: tests/test_serve_anthropic_model.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from kvloop.front.auth import AuthConfig
from kvloop.front.launcher import ServeProcess
from kvloop.front.prometheus_text import metric_value
from kvloop.router.config import RouterConfig
from kvloop.router.registry import WorkerSpec
from kvloop.server.tools import AUTO_NEEDS_PARSER

from .conftest import RouterThread, post, sdk, serving
from .test_router_fleet import router_config

pytestmark = pytest.mark.processes   # real `kvloop serve` workers; routers on threads

BS = 16
KEY = "anthropic-key"
ROUTER_KEY = "anthropic-router-key"
SIM = ("--model", "sim", "--sim-speedup", "50", "--max-model-len", "1024",
       "--served-model-name", "sim")
USER = [{"role": "user", "content": "tell me a long story about a router and its cache " * 3}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with serving(tmp_path_factory, "serve_anthropic", SIM) as srv:
        yield srv


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with serving(tmp_path_factory, "serve_anthropic_key", [*SIM, "--api-key", KEY]) as srv:
        yield srv


def client(url: str, **auth: str) -> anthropic.Anthropic:
    """The anthropic SDK against `url` (no retries); `api_key` goes out as `x-api-key`,
    `auth_token` as a Bearer token."""
    auth = auth or {"api_key": "none"}
    return anthropic.Anthropic(base_url=url, max_retries=0, timeout=60, **auth)


def prompt_len(u: anthropic.types.Usage) -> int:
    return u.input_tokens + (u.cache_read_input_tokens or 0)


def error_of(r: httpx.Response) -> dict[str, Any]:
    """An Anthropic error answer's `error` (and nothing else in the body)."""
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"}, body
    return body["error"]  # type: ignore[no-any-return]


# --- one worker ----------------------------------------------------------------------------------
def test_create_answers_text_and_reports_the_prefix_cache(server):
    c = client(server.url)
    first = c.messages.create(model="sim", max_tokens=6, system="Be brief.", messages=USER)
    assert first.id.startswith("msg_") and first.model == "sim" and first.role == "assistant"
    (block,) = first.content
    assert block.type == "text" and len(block.text.split()) == 6
    assert first.stop_reason == "max_tokens" and first.stop_sequence is None
    assert first.usage.output_tokens == 6 and first.usage.cache_read_input_tokens == 0
    again = c.messages.create(model="sim", max_tokens=2, system="Be brief.", messages=USER)
    n = prompt_len(again.usage)
    assert n == prompt_len(first.usage)
    assert again.usage.cache_read_input_tokens == (n - 1) // BS * BS > 0
    assert again.usage.input_tokens == n - again.usage.cache_read_input_tokens
    assert again.usage.cache_creation_input_tokens == 0


def test_a_stop_sequence_ends_the_answer_and_is_named(server):
    c = client(server.url)
    m = c.messages.create(model="sim", max_tokens=64, messages=USER, stop_sequences=["e"])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "e")
    assert "e" not in m.content[0].text
    with c.messages.stream(model="sim", max_tokens=64, messages=USER,
                           stop_sequences=["zzz", "e"]) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "e")


def test_a_stream_is_anthropics_event_sequence(server):
    body = {"model": "sim", "max_tokens": 5, "stream": True, "messages": USER}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = []
    for chunk in raw.strip().split("\n\n"):
        name, data = chunk.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    assert all(name == e["type"] for name, e in events)
    names = [name for name, _ in events]
    # one delta per engine step, or fewer: outputs that queue while the handler is busy are
    # streamed together (kvloop.front.processor.merge_outputs)
    num_deltas = names.count("content_block_delta")
    assert 1 <= num_deltas <= 5
    assert names == ["message_start", "ping", "content_block_start",
                     *["content_block_delta"] * num_deltas,
                     "content_block_stop", "message_delta", "message_stop"]
    start, delta = events[0][1]["message"], events[-2][1]
    assert start["content"] == [] and start["stop_reason"] is None
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 5
    assert prompt_len_of(delta["usage"]) == prompt_len_of(start["usage"])
    # the SDK puts the same events together
    with client(server.url).messages.stream(model="sim", max_tokens=4, messages=USER) as s:
        texts = [e.text for e in s if e.type == "text"]
        final = s.get_final_message()
    assert final.content[0].text == "".join(texts) and 1 <= len(texts) <= 4
    assert final.usage.output_tokens == 4 and final.stop_reason == "max_tokens"


def prompt_len_of(u: dict[str, int]) -> int:
    return u["input_tokens"] + u["cache_read_input_tokens"]


CONVERSATION: dict[str, Any] = {
    "system": [{"type": "text", "text": "You answer "}, {"type": "text", "text": "briefly."}],
    "messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "I will look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 20C"},
            {"type": "text", "text": "And tomorrow?"}]}]}
CHAT_EQUIVALENT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "I will look.", "tool_calls": [
        {"id": "toolu_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 20C"},
    {"role": "user", "content": "And tomorrow?"}]


def test_a_conversation_renders_its_chat_equivalents_prompt(server):
    c = client(server.url)
    counted = c.messages.count_tokens(model="sim", **CONVERSATION)
    created = c.messages.create(model="sim", max_tokens=1, **CONVERSATION)
    chat = sdk(server.url).chat.completions.create(model="sim", messages=CHAT_EQUIVALENT,
                                                   max_tokens=1)
    tokenized = httpx.post(server.url + "/tokenize", json={"messages": CHAT_EQUIVALENT}).json()
    assert counted.input_tokens == prompt_len(created.usage) == chat.usage.prompt_tokens \
        == tokenized["count"] > 20
    assert counted.context_management == {"original_input_tokens": counted.input_tokens}


@pytest.mark.parametrize("body, status, kind, words", [
    ({"messages": USER}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 4, "messages": []}, 400, "invalid_request_error", "at least 1 item"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "data": ""}}]}]}, 400,
     "invalid_request_error", "image content is not supported"),
    ({"max_tokens": 4, "messages": USER, "tools": [{"name": "f", "input_schema": {}}]}, 400,
     "invalid_request_error", AUTO_NEEDS_PARSER),
    ({"max_tokens": 4, "messages": USER, "tools": [{"name": "f", "input_schema": {}}],
      "tool_choice": {"type": "tool", "name": "f"}}, 400, "invalid_request_error",
     "no grammar backend"),
    ({"max_tokens": 4000, "messages": USER}, 400, "invalid_request_error", "context length"),
    ({"model": "nope", "max_tokens": 4, "messages": USER}, 404, "not_found_error", "nope"),
])
def test_errors_are_anthropics(server, body, status, kind, words):
    for stream in (False, True):
        r = post(server, "/v1/messages", {"model": "sim", **body, "stream": stream})
        assert r.status_code == status, r.text
        error = error_of(r)
        assert error["type"] == kind and words.lower() in error["message"].lower(), error
    if "max_tokens" in body:   # (the SDK will not send a request without it)
        with pytest.raises(anthropic.APIStatusError) as e:
            client(server.url).messages.create(**{"model": "sim", **body})
        assert e.value.status_code == status and e.value.body["error"]["type"] == kind


def test_count_tokens_refuses_as_create_does(server):
    r = post(server, "/v1/messages/count_tokens", {"model": "sim", "messages": []})
    assert r.status_code == 400 and error_of(r)["type"] == "invalid_request_error"
    r = post(server, "/v1/messages/count_tokens", {"model": "x", "messages": USER})
    assert r.status_code == 404 and error_of(r)["type"] == "not_found_error"


def test_api_key_as_x_api_key_or_bearer(keyed):
    for auth in ({"api_key": KEY}, {"auth_token": KEY}):
        c = client(keyed.url, **auth)
        assert c.messages.create(model="sim", max_tokens=1, messages=USER).usage.output_tokens == 1
        assert c.messages.count_tokens(model="sim", messages=USER).input_tokens > 0
    for auth in ({"api_key": "wrong"}, {"auth_token": "wrong"}):
        with pytest.raises(anthropic.AuthenticationError) as e:
            client(keyed.url, **auth).messages.create(model="sim", max_tokens=1, messages=USER)
        assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(keyed.url + "/v1/messages/count_tokens", json={"model": "sim",
                                                                  "messages": USER})
    assert r.status_code == 401 and error_of(r)["type"] == "authentication_error"
    # the same key opens the OpenAI routes in either header
    r = httpx.post(keyed.url + "/v1/completions", headers={"x-api-key": KEY},
                   json={"prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200, r.text


# --- through the router ------------------------------------------------------------------------
def hits(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics").text
    return (metric_value(text, "kvloop_router_predicted_hit_tokens_total"),
            metric_value(text, "kvloop_router_actual_hit_tokens_total"))


def keyed_router_config() -> RouterConfig:
    cfg = router_config()
    return RouterConfig(policy=cfg.policy, liveness=cfg.liveness, index=cfg.index,
                        auth=AuthConfig((ROUTER_KEY,)), worker_api_key=KEY)


def test_the_router_predicts_the_hits_the_worker_reports(keyed):
    with RouterThread(keyed_router_config(), [WorkerSpec(keyed.url)]) as rt:
        c = client(rt.url, api_key=ROUTER_KEY)
        conversation = {**CONVERSATION, "system": "A router test. " * 5}
        first = c.messages.create(model="sim", max_tokens=2, **conversation)
        for stream in (False, True):
            before = hits(rt.url)
            if stream:
                with c.messages.stream(model="sim", max_tokens=2, **conversation) as s:
                    again = s.get_final_message()
            else:
                again = c.messages.create(model="sim", max_tokens=2, **conversation)
            predicted, actual = (b - a for a, b in zip(before, hits(rt.url), strict=True))
            hit = again.usage.cache_read_input_tokens
            assert prompt_len(again.usage) == prompt_len(first.usage)
            assert hit == (prompt_len(again.usage) - 1) // BS * BS > 0
            assert predicted == actual == hit, (stream, predicted, actual, hit)
        counted = c.messages.count_tokens(model="sim", **conversation)
        assert counted.input_tokens == prompt_len(first.usage)
        # the router's own refusals are Anthropic's too
        with pytest.raises(anthropic.AuthenticationError):
            client(rt.url, api_key=KEY).messages.create(model="sim", max_tokens=1,
                                                        messages=USER)
        r = httpx.post(rt.url + "/v1/messages", headers={"x-api-key": ROUTER_KEY},
                       json={"model": "sim", "messages": USER})
        direct = post(keyed, "/v1/messages", {"model": "sim", "messages": USER})
        assert r.status_code == 400 and error_of(r)["type"] == "invalid_request_error"
        assert direct.status_code == 401   # (the worker wants its key)


def test_a_router_without_keys_passes_the_clients_x_api_key_on(keyed):
    with RouterThread(router_config(), [WorkerSpec(keyed.url)]) as rt:
        m = client(rt.url, api_key=KEY).messages.create(model="sim", max_tokens=1,
                                                       messages=USER)
        assert m.usage.output_tokens == 1
        assert client(rt.url, api_key=KEY).messages.count_tokens(
            model="sim", messages=USER).input_tokens == prompt_len(m.usage)
        with pytest.raises(anthropic.AuthenticationError):
            client(rt.url, api_key="wrong").messages.create(model="sim", max_tokens=1,
                                                            messages=USER)
