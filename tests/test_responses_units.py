"""The Responses API's pieces as functions: a body's conversion to a chat request, the
conversation a continuation starts from, the server's bounded store and the router's
affinity, and the event stream's items (the HTTP side: test_serve_responses.py,
test_router_responses.py)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pydantic
import pytest

from kvloop.front.openai import NamedToolChoice
from kvloop.front.responses import ResponsesRequest, chat_request, conversation_after
from kvloop.router.responses import ResponseAffinity, completed_response
from kvloop.server.responses import EventStream
from kvloop.server.responses_store import ResponseStore, ResponseStoreConfig

CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}


def req(**body: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "hi", **body})


def test_items_become_the_chat_messages_the_template_sees() -> None:
    r = req(instructions="Be brief.", input=[
        {"role": "developer", "content": "French."},
        {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                     {"type": "input_text", "text": "b"}]},
        CALL, {**CALL, "call_id": "c2"},
        {"type": "function_call_output", "call_id": "c1", "output": "x"}])
    chat = chat_request(r, [{"role": "user", "content": "before"}])
    got = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert got == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "before"},
        {"role": "system", "content": "French."}, {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "x", "tool_call_id": "c1"}]


def test_tools_choice_sampling_and_format_map_to_the_chat_fields() -> None:
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    chat = chat_request(req(tools=[tool], tool_choice={"type": "function", "name": "f"},
                            max_output_tokens=7, temperature=0.5, top_p=0.9, seed=3,
                            text={"format": {"type": "json_schema", "name": "n",
                                             "schema": {"type": "object"}}}), [])
    assert chat.tools is not None and chat.tools[0].function.name == "f"
    assert isinstance(chat.tool_choice, NamedToolChoice) and chat.tool_choice.function.name == "f"
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p, chat.seed) == (
        7, 0.5, 0.9, 3)
    rf = chat.response_format
    assert rf is not None and rf.json_schema is not None
    assert rf.json_schema.json_schema == {"type": "object"}
    assert chat_request(req(), []).tool_choice is None   # "auto" with no tools: nothing
    assert chat_request(req(tools=[tool], tool_choice="none"), []).tool_choice == "none"


@pytest.mark.parametrize("item", [
    {"role": "user", "content": [{"type": "input_image", "image_url": "u"}]},
    {"type": "reasoning", "summary": []},
    {"role": "tool", "content": "x"},
    {"type": "function_call_output", "output": "x"},
])
def test_items_kvloop_cannot_serve_fail_the_schema(item: dict[str, Any]) -> None:
    with pytest.raises(pydantic.ValidationError):
        req(input=[item])


def test_a_continuation_has_the_history_the_input_and_the_output_not_instructions() -> None:
    output = [{"type": "message", "content": [{"type": "output_text", "text": "Hi!"}]},
              {"type": "function_call", "call_id": "c9", "name": "g", "arguments": "1"}]
    got = conversation_after([{"role": "user", "content": "0"}],
                             req(instructions="ignored", input="q"), output)
    assert got == [{"role": "user", "content": "0"}, {"role": "user", "content": "q"},
                   {"role": "assistant", "content": "Hi!", "tool_calls": [
                       {"id": "c9", "type": "function",
                        "function": {"name": "g", "arguments": "1"}}]}]


def response(rid: str, text: str = "") -> dict[str, Any]:
    return {"id": rid, "status": "completed", "output": [
        {"type": "message", "content": [{"type": "output_text", "text": text}]}]}


def test_the_store_evicts_least_recently_used_within_both_bounds() -> None:
    store = ResponseStore(ResponseStoreConfig(max_entries=2, max_bytes=10_000))
    assert store.put(response("a"), []) and store.put(response("b"), [])
    assert store.get("a") is not None            # a is now the most recent
    store.put(response("c"), [])
    assert [store.get(k) is not None for k in "abc"] == [True, False, True]
    store.check_invariants()
    assert store.put(response("d", "x" * 6000), [])    # the count bound: a goes
    assert [store.get(k) is not None for k in "acd"] == [False, True, True]
    assert store.put(response("f", "y" * 6000), [])    # the byte bound: c and d go
    assert [store.get(k) is not None for k in "cdf"] == [False, False, True]
    store.check_invariants()
    assert not store.put(response("e", "x" * 20_000), [])   # alone over the bound
    assert store.get("e") is None
    store.check_invariants()
    off = ResponseStore(ResponseStoreConfig(max_entries=0))
    assert not off.put(response("a"), []) and len(off) == 0
    with pytest.raises(ValueError):
        ResponseStoreConfig(max_entries=-1)


def test_the_affinity_remembers_stored_answers_and_their_conversation() -> None:
    aff = ResponseAffinity(max_entries=2)
    aff.record("w1", {"input": "q1"}, response("r1", "a1"))
    aff.record("w2", {"input": "q2", "previous_response_id": "r1"}, response("r2", "a2"))
    aff.record("w1", {"input": "x", "store": False}, response("r3"))
    aff.record("w1", {"input": "x"}, {"error": {"code": 500}})
    held = aff.holder("r2")
    assert held is not None and held.worker == "w2"
    assert [m["content"] for m in held.conversation] == ["q1", "a1", "q2", "a2"]
    assert aff.holder("r3") is None
    aff.record("w1", {"input": "q4"}, response("r4"))
    assert aff.holder("r1") is None and aff.holder("r2") is not None   # r1 was least recent


def test_the_event_stream_numbers_events_and_closes_items_in_order() -> None:
    ev = EventStream()
    frames = ev.text("Hel") + ev.text("lo") + ev.call(
        {"index": 0, "id": "c1", "type": "function", "function": {"name": "f",
                                                                  "arguments": "{\"a\""}}) \
        + ev.call({"index": 0, "function": {"arguments": ": 1}"}}) + ev.close()
    events = []
    for frame in frames:
        head, data = frame.split(b"\n", 1)
        event = msgspec.json.decode(data.removeprefix(b"data: ").strip())
        assert head == b"event: " + event["type"].encode()
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.function_call_arguments.done", "response.output_item.done"]
    message, call = ev.output()
    assert message["content"][0]["text"] == "Hello" and message["status"] == "completed"
    assert (call["call_id"], call["arguments"], call["status"]) == ("c1", '{"a": 1}',
                                                                    "completed")
    assert events[-1]["output_index"] == 1 and events[-1]["item"] == call


def test_only_a_completed_event_hands_its_response_on() -> None:
    done = json.dumps({"type": "response.completed", "response": {"id": "r"}}).encode()
    assert completed_response(done) == {"id": "r"}
    assert completed_response(b'{"type": "response.created", "response": {}}') is None
    assert completed_response(b'"response.completed" not json') is None
