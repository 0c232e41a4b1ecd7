"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), as vLLM
serves it: the request schemas, the one conversion of a Messages request into the equivalent
chat completion request, the answer's pieces (content blocks, stop reason, usage), the stream's
events and Anthropic's error object.

A Messages request *is* a chat request once converted (`chat_request`): the API server renders,
samples and parses tool calls with the chat code, and the router tokenizes it with the same
function (`kvloop.front.prompts.body_prompts`), so its block hashes are the worker's. The
conversion (vLLM's rules, docs/serving.md#anthropic-messages):

- `system` (a text, or text blocks joined) and any `system`-role message become one leading
  system message;
- a message's text blocks are its content; an assistant's `tool_use` blocks its `tool_calls`
  (`input` as JSON text); a user's `tool_result` blocks become `tool` messages (their text,
  text blocks joined by newlines) ahead of the rest of that user message; `thinking` and
  `redacted_thinking` blocks are dropped (kvloop has no reasoning parser); images are refused;
- `tools` become functions (`input_schema` is the parameters); `tool_choice` auto -> "auto",
  any -> "required", tool -> the named function, none -> "none" (no choice with tools: "auto");
- `max_tokens`, `stop_sequences` (-> `stop`), `temperature`, `top_p`, `top_k`, `stream` and
  vLLM's `kv_transfer_params` carry over; `metadata` is accepted and unused.

Errors on these routes are Anthropic's object, `{"type": "error", "error": {"type",
"message"}}`, with the status's type (`anthropic_error_type`); `AnthropicErrorMiddleware`
rewrites every error answer of these paths (the key check's, the body limit's, validation's,
the handlers') from the OpenAI shape the rest of kvloop speaks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal, NotRequired

import pydantic
from pydantic import Field
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from typing_extensions import TypedDict

from kvloop.front.openai import (
    ChatCompletionRequest,
    DeltaToolCall,
    ErrorResponse,
    OpenAIModel,
    ToolCall,
    validation_error_body,
)

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
MESSAGES_PATHS = (MESSAGES_PATH, COUNT_TOKENS_PATH)


# --- requests ------------------------------------------------------------------------------------
class TextBlockParam(OpenAIModel):
    type: Literal["text"]
    text: str


class ContentBlockParam(OpenAIModel):
    """One block of a message's content; the fields each type uses (others are ignored)."""

    type: Literal["text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking"]
    text: str | None = None
    id: str | None = None                   # tool_use
    name: str | None = None                 # tool_use
    input: dict[str, Any] | None = None     # tool_use
    tool_use_id: str | None = None          # tool_result
    content: str | list[dict[str, Any]] | None = None   # tool_result
    is_error: bool | None = None            # tool_result


class MessageParam(OpenAIModel):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlockParam]


class ToolParam(OpenAIModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoiceParam(OpenAIModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(OpenAIModel):
    """`POST /v1/messages/count_tokens`: the prompt part of a Messages request."""

    model_config = pydantic.ConfigDict(extra="ignore", json_schema_extra={"examples": [
        {"model": "sim", "messages": [{"role": "user", "content": "Hello!"}]}]})

    model: str | None = None
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages` (Anthropic's fields, and vLLM's `kv_transfer_params`)."""

    model_config = pydantic.ConfigDict(extra="ignore", json_schema_extra={"examples": [
        {"model": "sim", "max_tokens": 8, "messages": [{"role": "user", "content": "Hello!"}]},
        {"model": "sim", "max_tokens": 4, "stream": True, "system": "Be brief.",
         "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}]})

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None


class ConversionError(ValueError):
    """A Messages request with no chat equivalent: a 400 naming `param`."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


# --- the one conversion --------------------------------------------------------------------------
def chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat completion request equivalent to `req` (see the module docstring); raises
    ConversionError for content kvloop cannot take (images)."""
    messages = _system_messages(req) + [m for msg in req.messages if msg.role != "system"
                                        for m in _chat_messages(msg)]
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema}}
            for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stop=req.stop_sequences, stream=req.stream,
                    temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                    kv_transfer_params=req.kv_transfer_params)
    try:
        return ChatCompletionRequest.model_validate(body)
    except pydantic.ValidationError as e:   # nothing valid converts to this; still a 400
        raise ConversionError(f"no chat equivalent: {e}", "messages") from e


def _system_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    parts = [req.system] if isinstance(req.system, str) else [b.text for b in req.system or ()]
    for msg in req.messages:
        if msg.role == "system":
            parts += [msg.content] if isinstance(msg.content, str) else [
                b.text or "" for b in msg.content if b.type == "text"]
    text = "".join(parts)
    return [{"role": "system", "content": text}] if text else []


def _chat_messages(msg: MessageParam) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user's tool results first (one `tool`
    message each), then the message itself unless nothing of it is left."""
    if isinstance(msg.content, str):
        return [{"role": msg.role, "content": msg.content}]
    if not msg.content:
        raise ConversionError("message content must not be empty", "messages")
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in msg.content:
        if block.type == "image":
            raise ConversionError("image content is not supported by kvloop (text-only "
                                  "models)", "messages")
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "tool_use":
            calls.append({"id": block.id or "", "type": "function", "function": {
                "name": block.name or "", "arguments": json.dumps(block.input or {})}})
        elif block.type == "tool_result":
            out.append({"role": "tool", "tool_call_id": block.tool_use_id or "",
                        "content": _tool_result_text(block.content)})
    message: dict[str, Any] = {"role": msg.role, "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if texts or calls or not out:
        out.append(message)
    return out


def _tool_result_text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(str(b.get("text", "")) for b in content if b.get("type") == "text")


def _tool_choice(choice: ToolChoiceParam) -> Any:
    if choice.type == "any":
        return "required"
    if choice.type == "tool":
        if not choice.name:
            raise ConversionError("tool_choice.name is required when tool_choice.type is "
                                  "'tool'", "tool_choice")
        return {"type": "function", "function": {"name": choice.name}}
    return choice.type


def validate_messages(path: str, body: Any) -> CountTokensRequest | ErrorResponse:
    """`body` read with the schema of `path` (`MESSAGES_PATHS`), or its 400 body, worded as the
    API server words it (see `kvloop.front.openai.validate_body`)."""
    schema = CountTokensRequest if path == COUNT_TOKENS_PATH else MessagesRequest
    try:
        return schema.model_validate(body, from_attributes=True)
    except pydantic.ValidationError as e:
        return validation_error_body([{**err, "loc": ("body", *err.get("loc", ()))}
                                      for err in e.errors()])


# --- answers -------------------------------------------------------------------------------------
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class TextBlock(TypedDict):
    type: Literal["text"]
    text: str


class ToolUseBlock(TypedDict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ToolUseBlock


class AnthropicUsage(TypedDict):
    """Anthropic's split of the prompt: `input_tokens` computed, `cache_read_input_tokens`
    served from the prefix cache (kvloop's `cached_tokens`), `cache_creation_input_tokens`
    always 0 (kvloop caches every prompt, at no extra cost)."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int


class MessagesResponse(TypedDict):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: AnthropicUsage
    kv_transfer_params: NotRequired[dict[str, Any]]   # a prefill worker's, for the decode one


class ContextManagement(TypedDict):
    original_input_tokens: int


class CountTokensResponse(TypedDict):
    input_tokens: int
    context_management: ContextManagement


class StreamDelta(TypedDict, total=False):
    """A content_block_delta's `delta` (text_delta: text; input_json_delta: partial_json) or a
    message_delta's (stop_reason, stop_sequence)."""

    type: Literal["text_delta", "input_json_delta"]
    text: str
    partial_json: str
    stop_reason: StopReason | None
    stop_sequence: str | None


class AnthropicErrorInfo(TypedDict):
    type: str
    message: str


class MessagesStreamEvent(TypedDict):
    """The `data` of one event of a Messages stream; its `type` is also the SSE event name."""

    type: Literal["message_start", "ping", "content_block_start", "content_block_delta",
                  "content_block_stop", "message_delta", "message_stop", "error"]
    message: NotRequired[MessagesResponse]
    index: NotRequired[int]
    content_block: NotRequired[ContentBlock]
    delta: NotRequired[StreamDelta]
    usage: NotRequired[AnthropicUsage]
    error: NotRequired[AnthropicErrorInfo]


class AnthropicErrorResponse(TypedDict):
    type: Literal["error"]
    error: AnthropicErrorInfo


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> AnthropicUsage:
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}


def stop_reason(finish_reason: str | None, stopped_by: int | str | None,
                stop_sequences: list[str] | None, tool_use: bool
                ) -> tuple[StopReason | None, str | None]:
    """(stop_reason, stop_sequence) of a finished choice: tool_use when the answer holds a
    tool call, stop_sequence when one of the request's `stop_sequences` ended it, max_tokens
    for "length", else end_turn (an end-of-turn token)."""
    if tool_use:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stopped_by, str) and stopped_by in (stop_sequences or ()):
        return "stop_sequence", stopped_by
    return ("end_turn", None) if finish_reason is not None else (None, None)


def content_blocks(text: str | None, calls: list[ToolCall]) -> list[ContentBlock]:
    """The answer's blocks: its text (if any), then one tool_use block per call. A call whose
    arguments are not a JSON object (cut short by max_tokens) stays text."""
    blocks: list[ContentBlock] = [{"type": "text", "text": text}] if text else []
    for call in calls:
        arguments = call["function"]["arguments"]
        parsed = _json_object(arguments)
        if parsed is None:
            blocks.append({"type": "text", "text": arguments})
        else:
            blocks.append({"type": "tool_use", "id": call["id"],
                           "name": call["function"]["name"], "input": parsed})
    return blocks


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


# --- the stream ----------------------------------------------------------------------------------
def event(body: MessagesStreamEvent | AnthropicErrorResponse) -> bytes:
    """One server-sent event: its name is the body's `type`."""
    return (f"event: {body['type']}\ndata: ".encode()
            + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n")


class MessageEvents:
    """One streamed answer's events, in Anthropic's order:

        message_start, ping, (content_block_start, content_block_delta*, content_block_stop)*,
        message_delta (stop_reason, usage), message_stop

    Text goes into a text block, each tool call into a tool_use block whose input streams as
    `input_json_delta`s; a block ends when the next begins. The caller feeds what the chat
    code streams (`kvloop.server.tools.ToolCallStream`: content deltas, tool-call deltas)."""

    def __init__(self, message_id: str, model: str):
        self.message_id = message_id
        self.model = model
        self.started = False
        self._index = -1           # the open block's (-1: none yet)
        self._open: str | None = None   # its type, or the id of the tool call it holds
        self._calls: dict[int, str] = {}   # tool-call index -> its id

    def start(self, first: AnthropicUsage) -> list[bytes]:
        self.started = True
        message: MessagesResponse = {
            "id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": first}
        return [event({"type": "message_start", "message": message}), event({"type": "ping"})]

    def push(self, text: str, calls: list[DeltaToolCall]) -> list[bytes]:
        out: list[bytes] = []
        if text:
            if self._open != "text":
                out += self._begin("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": text}))
        for call in calls:
            out += self._push_call(call)
        return out

    def _push_call(self, call: DeltaToolCall) -> list[bytes]:
        out: list[bytes] = []
        if "id" in call:
            self._calls[call["index"]] = call["id"]
            out += self._begin(call["id"], {"type": "tool_use", "id": call["id"],
                                            "name": call["function"].get("name", ""),
                                            "input": {}})
        arguments = call["function"].get("arguments")
        if arguments and self._open == self._calls.get(call["index"]):
            out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return out

    def finish(self, reason: StopReason | None, sequence: str | None,
               final: AnthropicUsage) -> list[bytes]:
        out = self._end()
        out.append(event({"type": "message_delta", "usage": final,
                          "delta": {"stop_reason": reason, "stop_sequence": sequence}}))
        out.append(event({"type": "message_stop"}))
        return out

    def _begin(self, kind: str, block: ContentBlock) -> list[bytes]:
        out = self._end()
        self._index += 1
        self._open = kind
        out.append(event({"type": "content_block_start", "index": self._index,
                          "content_block": block}))
        return out

    def _end(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [event({"type": "content_block_stop", "index": self._index})]

    def _delta(self, delta: StreamDelta) -> bytes:
        return event({"type": "content_block_delta", "index": self._index, "delta": delta})


# --- errors --------------------------------------------------------------------------------------
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error",
                504: "timeout_error"}


def anthropic_error_type(status: int) -> str:
    """Anthropic's error type of an HTTP status (other 4xx: invalid_request_error; 5xx:
    api_error)."""
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error_body(message: str, status: int) -> AnthropicErrorResponse:
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


def anthropic_error(body: Any, status: int) -> AnthropicErrorResponse | None:
    """An OpenAI error object (`{"error": {"message", ...}}`) in Anthropic's shape; None for
    anything else (already Anthropic's, or not an error object)."""
    if not isinstance(body, Mapping) or body.get("type") == "error":
        return None
    inner = body.get("error")
    if not isinstance(inner, Mapping) or not isinstance(inner.get("message"), str):
        return None
    return anthropic_error_body(inner["message"], status)


class AnthropicErrorMiddleware:
    """Answers the errors of `MESSAGES_PATHS` in Anthropic's shape: a JSON error answer
    (status >= 400) is read whole and rewritten (`anthropic_error`); every other answer, and
    every other path, passes untouched."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in MESSAGES_PATHS:
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def rewriting_send(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                if message["status"] >= 400 and "json" in Headers(
                        raw=message.get("headers", [])).get("content-type", ""):
                    start = message
                    return
            elif message["type"] == "http.response.body" and start is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                await _send_rewritten(send, start, b"".join(chunks))
                return
            await send(message)

        await self.app(scope, receive, rewriting_send)


async def _send_rewritten(send: Send, start: Message, body: bytes) -> None:
    try:
        rewritten = anthropic_error(json.loads(body), start["status"])
    except ValueError:
        rewritten = None
    if rewritten is not None:
        body = json.dumps(rewritten).encode()
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    await send({**start, "headers": headers})
    await send({"type": "http.response.body", "body": body})
