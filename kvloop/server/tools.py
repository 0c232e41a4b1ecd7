"""Tool calling on /v1/chat/completions, vLLM's way (docs/vllm-facts.md#tool-calling).

`tool_choice`, given `tools`:

- "none" (and no `tools`): the tools are ignored (still shown to the chat template);
- a named function (`{"type": "function", "function": {"name": ...}}`): the output is
  constrained to that function's `parameters` schema; the answer is one tool call whose
  `arguments` are the text, `content` "" and the finish reason unchanged;
- "required": the output is constrained to a JSON array of `{"name", "parameters"}` objects
  (at least one, each naming one of the tools with its arguments); the answer's `tool_calls`
  are its items, the finish reason "tool_calls" where the engine's was "stop";
- "auto" (the default when `tools` are given): no constraint; the text is parsed for calls by
  the server's tool-call parser, which must be configured (`--enable-auto-tool-choice
  --tool-call-parser hermes`), else a 400. The hermes format is `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`; the text before the first call is the `content` (None
  when empty), the finish reason "tool_calls" when any call was found; output that does not
  parse is plain content.

Streaming: a named call streams its arguments as they come (the first chunk carries the call's
id, type and name); "required" and "auto" calls are sent whole when the choice finishes, and
"auto" streams the content before the first `<tool_call>` as it comes. Tool call ids are
`chatcmpl-tool-<32 hex digits>`.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from kvloop.front.openai import ChatCompletionRequest, ChatTool, DeltaToolCall, ToolCall
from kvloop.server.structured import ConstraintError

AUTO_NEEDS_PARSER = ('"auto" tool choice requires --enable-auto-tool-choice and '
                     '--tool-call-parser to be set')
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

ToolChoice = Literal["none", "auto", "required", "named"]


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools do to its generation and its answer."""

    choice: ToolChoice = "none"
    tools: tuple[ChatTool, ...] = ()
    name: str | None = None          # the named function

    @property
    def constraint(self) -> dict[str, Any] | None:
        """The `StructuredOutputsParams` fields this choice constrains the output with."""
        if self.choice == "required":
            return {"json": required_schema(self.tools)}
        if self.choice == "named":
            tool = next(t for t in self.tools if t.function.name == self.name)
            return {"json": tool.function.parameters or {"type": "object", "properties": {}}}
        return None

    @property
    def parses(self) -> bool:
        """Whether the answer is read for tool calls."""
        return self.choice != "none"


def plan_tools(req: ChatCompletionRequest, parser: str | None) -> ToolPlan:
    """The request's tool plan, checked as vLLM checks it (ConstraintError: a 400)."""
    tools, choice = req.tools, req.tool_choice
    if tools is not None and not tools:
        raise ConstraintError("`tools` must not be an empty array. Either provide at least "
                              "one tool or omit the field entirely.", "tools")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolPlan()
    if not tools:
        raise ConstraintError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice == "auto":
        if parser is None:
            raise ConstraintError(AUTO_NEEDS_PARSER, "tool_choice")
        return ToolPlan("auto", tuple(tools))
    if choice == "required":
        return ToolPlan("required", tuple(tools))
    name = choice.function.name
    if name not in {t.function.name for t in tools}:
        raise ConstraintError("The tool specified in `tool_choice` does not match any of the "
                              "specified `tools`", "tool_choice")
    return ToolPlan("named", tuple(tools), name)


def required_schema(tools: tuple[ChatTool, ...]) -> dict[str, Any]:
    """vLLM's schema of "required": an array (min 1) of {name: one tool's, parameters: its
    schema}; the tools' `$defs` hoisted to the top (a name defined twice, differently, is a
    400)."""
    defs: dict[str, Any] = {}
    items = []
    for tool in tools:
        params = copy.deepcopy(tool.function.parameters) or {"type": "object",
                                                              "properties": {}}
        for def_name, definition in params.pop("$defs", {}).items():
            if defs.setdefault(def_name, definition) != definition:
                raise ConstraintError(f"Tool definition '{def_name}' has multiple schemas, "
                                      f"which is not supported.", "tools")
        items.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                     "parameters": params},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": items}}
    if defs:
        schema["$defs"] = defs
    return schema


# --- reading the answer --------------------------------------------------------------------------
def make_call(name: str, arguments: str) -> ToolCall:
    return {"id": tool_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_required(text: str) -> list[ToolCall] | None:
    """The calls of a "required" answer (a JSON array of {name, parameters}); None when the
    text is not one (cut short by max_tokens)."""
    try:
        items = json.loads(text)
        return [make_call(str(i["name"]), json.dumps(i["parameters"], ensure_ascii=False))
                for i in items]
    except (ValueError, TypeError, KeyError):
        return None


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of text in the hermes format; text without a well-formed call is all
    content."""
    if HERMES_START not in text:
        return text, []
    try:
        calls = []
        for closed, open_ended in _HERMES.findall(text):
            call = json.loads(closed or open_ended)
            calls.append(make_call(str(call["name"]),
                                   json.dumps(call["arguments"], ensure_ascii=False)))
    except (ValueError, TypeError, KeyError):
        return text, []
    content = text[:text.find(HERMES_START)]
    return content or None, calls


@dataclass
class Answer:
    """A finished choice's message parts and finish reason."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None


def answer(plan: ToolPlan, text: str, finish_reason: str | None) -> Answer:
    """The message of a finished choice under `plan`."""
    if plan.choice == "named":
        assert plan.name is not None
        return Answer("", [make_call(plan.name, text)], finish_reason)
    if plan.choice == "required":
        calls = parse_required(text)
        if calls is None:
            return Answer(text, [], finish_reason)
        return Answer("", calls, "tool_calls" if finish_reason == "stop" else finish_reason)
    if plan.choice == "auto":
        content, calls = parse_hermes(text)
        return Answer(content, calls, "tool_calls" if calls else finish_reason)
    return Answer(text, [], finish_reason)


class ToolCallStream:
    """One streamed choice's text -> (content delta, tool-call deltas), per the plan."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self._sent = 0             # characters of `text` sent as content
        self._named_id: str | None = None

    def push(self, delta: str) -> tuple[str, list[DeltaToolCall]]:
        self.text += delta
        if self.plan.choice == "named":
            return "", self._named_delta(delta) if delta else []
        if self.plan.choice == "auto":
            return self._auto_content(), []
        if self.plan.choice == "required":
            return "", []
        return delta, []

    def finish(self, finish_reason: str | None) -> tuple[str, list[DeltaToolCall], str | None]:
        """What is left to send when the choice finishes, and its finish reason."""
        if self.plan.choice in ("none", "named"):
            return "", [], finish_reason
        done = answer(self.plan, self.text, finish_reason)
        if not done.tool_calls:
            rest, self._sent = self.text[self._sent:], len(self.text)
            return rest, [], done.finish_reason
        deltas: list[DeltaToolCall] = [
            {"index": i, "id": c["id"], "type": "function",
             "function": {"name": c["function"]["name"],
                          "arguments": c["function"]["arguments"]}}
            for i, c in enumerate(done.tool_calls)]
        return "", deltas, done.finish_reason

    def _named_delta(self, delta: str) -> list[DeltaToolCall]:
        if self._named_id is None:
            assert self.plan.name is not None
            self._named_id = tool_call_id()
            return [{"index": 0, "id": self._named_id, "type": "function",
                     "function": {"name": self.plan.name, "arguments": delta}}]
        return [{"index": 0, "function": {"arguments": delta}}]

    def _auto_content(self) -> str:
        """Content before the first `<tool_call>`, holding back what may start one."""
        start = self.text.find(HERMES_START)
        end = start if start >= 0 else len(self.text) - _partial_tag(self.text)
        if end <= self._sent:
            return ""
        chunk, self._sent = self.text[self._sent:end], end
        return chunk


def _partial_tag(text: str) -> int:
    """The length of the longest suffix of `text` that begins `<tool_call>`."""
    for n in range(min(len(text), len(HERMES_START) - 1), 0, -1):
        if HERMES_START.startswith(text[-n:]):
            return n
    return 0
