"""OpenAI's Responses API on a real `kvloop serve --model sim` (with --api-key), through the
`openai` SDK (`responses.create`, `.stream`, `.retrieve`) and httpx: the answer and its
usage, the event stream, `previous_response_id` chains, the store's bound, input items,
refusals. The pieces as functions (conversion, store, events): test_responses_units.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvloop.front.launcher import ServeProcess

from .conftest import bearer, sdk, serving

pytestmark = pytest.mark.processes   # a real `kvloop serve` for the module

KEY = "responses-key"
OTHER_KEY = "another-tenants-key"
MAX_ENTRIES = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with serving(tmp_path_factory, "serve_responses", [
            "--model", "sim", "--sim-speedup", "100", "--api-key", KEY, "--api-key", OTHER_KEY,
            "--responses-store-max-entries", str(MAX_ENTRIES)]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return sdk(server.url, KEY)


def post(server: ServeProcess, body: dict[str, Any], key: str | None = KEY) -> httpx.Response:
    headers = bearer(key) if key else {}
    return httpx.post(server.url + "/v1/responses", json=body, headers=headers, timeout=30)


def chat_tokens(server: ServeProcess, messages: list[dict[str, Any]]) -> int:
    """The prompt length of `messages` as the chat route tokenizes them."""
    r = httpx.post(server.url + "/tokenize", json={"messages": messages}, headers=bearer(KEY))
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


def test_create_answers_a_response_with_text_and_usage(client: openai.OpenAI,
                                                       server: ServeProcess) -> None:
    r = client.responses.create(model="sim", input="Tell me a story.", instructions="Be brief.",
                                max_output_tokens=5, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "sim"
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.content[0].type == "output_text" and r.output_text == item.content[0].text
    assert r.output_text
    u = r.usage
    assert u is not None and u.output_tokens == 5
    assert u.input_tokens == chat_tokens(server, [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "Tell me a story."}])
    assert u.total_tokens == u.input_tokens + 5 and u.input_tokens_details.cached_tokens == 0
    again = client.responses.create(model="sim", input="Tell me a story.",
                                    instructions="Be brief.", max_output_tokens=1)
    assert again.usage is not None and again.usage.input_tokens_details.cached_tokens > 0
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()


def test_stream_sends_the_events_in_order_and_the_final_response(client: openai.OpenAI) -> None:
    with client.responses.stream(model="sim", input="Hello", max_output_tokens=6) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    deltas = types.count("response.output_text.delta")
    assert deltas >= 1 and types == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"], types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and final.output_text == text and final.usage is not None
    assert final.usage.output_tokens == 6 and final.status == "incomplete"
    assert events[0].response.status == "in_progress"  # type: ignore[union-attr]
    item_ids = {getattr(e, "item_id", None) for e in events} - {None}
    assert item_ids == {final.output[0].id}
    assert client.responses.retrieve(final.id).output_text == text


def test_stream_true_on_create_is_the_same_stream(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model="sim", input="Hi", max_output_tokens=3,
                                          stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    done = events[-1].response  # type: ignore[union-attr]
    assert done.usage is not None and done.usage.output_tokens == 3


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI,
                                                         server: ServeProcess) -> None:
    first = client.responses.create(model="sim", input="My name is Ada.", instructions="Old.",
                                    max_output_tokens=4)
    second = client.responses.create(model="sim", input="What is my name?",
                                     previous_response_id=first.id, max_output_tokens=4)
    assert second.previous_response_id == first.id
    conversation = [{"role": "user", "content": "My name is Ada."},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "What is my name?"}]
    # the earlier instructions are not carried over; its input and output are
    assert second.usage is not None
    assert second.usage.input_tokens == chat_tokens(server, conversation)
    third = client.responses.create(model="sim", input="And again?", instructions="New.",
                                    previous_response_id=second.id, max_output_tokens=2)
    conversation = [{"role": "system", "content": "New."}, *conversation,
                    {"role": "assistant", "content": second.output_text},
                    {"role": "user", "content": "And again?"}]
    assert third.usage is not None
    assert third.usage.input_tokens == chat_tokens(server, conversation)


def test_unknown_ids_and_unstored_responses_are_404(client: openai.OpenAI,
                                                    server: ServeProcess) -> None:
    unstored = client.responses.create(model="sim", input="x", max_output_tokens=1, store=False)
    for rid in ("resp_nope", unstored.id):
        with pytest.raises(openai.NotFoundError) as e:
            client.responses.retrieve(rid)
        assert e.value.body == {"message": f"Response with id '{rid}' not found.",
                                "type": "NotFoundError", "param": "response_id", "code": 404}
        r = post(server, {"input": "x", "previous_response_id": rid})
        assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"


def test_the_store_keeps_the_most_recently_used(client: openai.OpenAI) -> None:
    ids = [client.responses.create(model="sim", input=f"n{i}", max_output_tokens=1).id
           for i in range(MAX_ENTRIES)]
    client.responses.retrieve(ids[0])            # now the most recently used
    newest = client.responses.create(model="sim", input="more", max_output_tokens=1).id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[1])        # the least recently used went out
    for rid in (ids[0], ids[2], newest):
        assert client.responses.retrieve(rid).id == rid


def test_input_items_with_function_calls_reach_the_chat_template(
        client: openai.OpenAI, server: ServeProcess) -> None:
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city": "Paris"}'}
    items: Any = [
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        call, {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    r = client.responses.create(model="sim", input=items, max_output_tokens=2)
    messages = [{"role": "system", "content": "Answer in French."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {
                        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    assert r.usage is not None and r.usage.input_tokens == chat_tokens(server, messages)


@pytest.mark.parametrize("body, status, param", [
    ({"input": "x", "background": True}, 400, "background"),
    ({"input": []}, 400, "body.input"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, 400, "include"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     400, None),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": "auto"},
     400, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_object"}}}, 400, "response_format"),
    ({"input": "x", "max_output_tokens": 10 ** 9}, 400, None),
    ({"input": "x", "model": "nope"}, 404, "model"),
])
def test_what_cannot_run_is_refused(server: ServeProcess, body: dict[str, Any], status: int,
                                    param: str | None) -> None:
    r = post(server, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and (param is None or err["param"] == param), err


def test_the_routes_need_the_api_key(server: ServeProcess) -> None:
    with pytest.raises(openai.AuthenticationError):
        sdk(server.url, "wrong").responses.create(model="sim", input="x", max_output_tokens=1)
    assert post(server, {"input": "x"}, key=None).status_code == 401
    assert httpx.get(server.url + "/v1/responses/resp_x").status_code == 401
    stats = httpx.get(server.url + "/kvloop/stats", headers=bearer(KEY)).json()
    assert stats["num_running_reqs"] == stats["num_waiting_reqs"] == 0, stats
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats


def test_a_stored_response_belongs_to_the_key_that_created_it(client: openai.OpenAI,
                                                              server: ServeProcess) -> None:
    """issue 37 (9): another API key can neither read nor continue it: 404, as an unknown id
    (so the id's existence is not told either); its own key still can."""
    mine = client.responses.create(model="sim", input="my secret", max_output_tokens=2)
    other = sdk(server.url, OTHER_KEY)
    with pytest.raises(openai.NotFoundError) as e:
        other.responses.retrieve(mine.id)
    assert e.value.body == {"message": f"Response with id '{mine.id}' not found.",
                            "type": "NotFoundError", "param": "response_id", "code": 404}
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model="sim", input="go on", max_output_tokens=1,
                               previous_response_id=mine.id)
    assert client.responses.retrieve(mine.id).id == mine.id
    theirs = other.responses.create(model="sim", input="x", max_output_tokens=1,
                                    previous_response_id=None)
    assert other.responses.retrieve(theirs.id).id == theirs.id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(theirs.id)
    go_on = client.responses.create(model="sim", input="go on", max_output_tokens=1,
                                    previous_response_id=mine.id)
    assert go_on.previous_response_id == mine.id
