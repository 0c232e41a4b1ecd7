"""`POST /v1/responses` and `GET /v1/responses/{id}`: OpenAI's Responses API, served as a
chat completion (`kvloop.front.responses.chat_request`: one conversion, then the chat
route's tools, constraint, prompt, sampling and generation).

A request continues a stored response with `previous_response_id` (unknown or evicted: 404,
vLLM's message) and is stored when `store` is true (`ResponseStore`, bounded). Output items:
one `message` with one `output_text` part when there is text, then one `function_call` per
tool call; status `incomplete` (`incomplete_details.reason` "max_output_tokens") when the
output hit its length limit, else `completed`.

Streaming (`stream: true`) sends `event: TYPE` / `data: JSON` pairs, each event with its
`sequence_number`: response.created, response.in_progress; per output item
response.output_item.added, then for a message response.content_part.added,
response.output_text.delta..., response.output_text.done, response.content_part.done, for a
function call response.function_call_arguments.delta..., .done; then
response.output_item.done; and last response.completed (as vLLM, also for an incomplete
response: its `status` says so). A failure after the stream started ends it with an `error`
event. Nothing follows the last event (no `[DONE]`, as vLLM's route).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pydantic
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvloop.front.auth import presented_authorization
from kvloop.front.openai import DeltaToolCall, MaxTokens, ToolCall, Usage
from kvloop.front.prompts import chat_prompt
from kvloop.front.responses import (
    RESPONSE_ID_PREFIX,
    Message,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    chat_request,
    conversation_after,
)
from kvloop.sampling_params import SamplingParams
from kvloop.server.responses_store import ResponseStore
from kvloop.server.serving import (
    APIError,
    Generation,
    GenerationStream,
    ServerContext,
    build_sampling_params,
    chat_tools,
    collect,
    log_received,
    make_children,
    request_constraint,
    usage,
)
from kvloop.server.tools import ToolCallStream, ToolPlan, answer


def not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param="response_id")


def retrieve_response(store: ResponseStore, response_id: str,
                      owner: str | None) -> ResponseObject:
    """`owner`'s stored response (another key's: 404, as an unknown id)."""
    entry = store.get(response_id, owner)
    if entry is None:
        raise not_found(response_id)
    return entry.response  # type: ignore[return-value]


def _check_request(req: ResponsesRequest) -> None:
    if req.background:
        raise APIError(400, "background is not supported by kvloop", param="background")
    if req.include:
        raise APIError(400, f"include {req.include[0]!r} is not supported by kvloop",
                       param="include")
    if req.truncation == "auto":
        raise APIError(400, "truncation 'auto' is not supported by kvloop (a prompt over the "
                            "context is a 400)", param="truncation")


@dataclass
class Turn:
    """One Responses request on its way: its ids, its chat form, what it stores."""

    req: ResponsesRequest
    response_id: str
    created: int
    history: list[Message]
    prompt: list[int]
    params: SamplingParams
    tools: ToolPlan
    owner: str | None = None       # the caller's key (`AuthConfig.owner`): what it may read


def prepare(ctx: ServerContext, store: ResponseStore, req: ResponsesRequest,
            owner: str | None = None) -> tuple[Turn, Generation]:
    """The request checked, converted and submitted (APIError for what cannot run);
    `previous_response_id` must name one of `owner`'s stored responses."""
    ctx.check_model(req.model)
    _check_request(req)
    history: list[Message] = []
    if req.previous_response_id is not None:
        prev = store.get(req.previous_response_id, owner)
        if prev is None:
            raise not_found(req.previous_response_id)
        history = prev.conversation
    try:
        chat = chat_request(req, history)
    except pydantic.ValidationError as e:   # a chat request cannot hold it
        raise APIError(400, f"the input is no chat: {e}", param="input") from e
    tools = chat_tools(ctx, chat)
    if tools.choice == "auto":   # a parser may need the special tokens of its format
        chat = chat.model_copy(update={"skip_special_tokens": False})
    constraint = request_constraint(ctx, chat, tools)
    prompt = chat_prompt(ctx.tokenizer, chat)
    params = build_sampling_params(ctx, chat, len(prompt), MaxTokens.of(chat), None,
                                   constraint=constraint)
    rid = f"{RESPONSE_ID_PREFIX}{uuid.uuid4().hex}"
    gen = Generation(ctx, make_children(ctx, rid, [prompt], [params], req.model), constraint,
                     owner)
    gen.submit()
    log_received(ctx, rid, [prompt], [params])
    turn = Turn(req, rid, int(time.time()), history, prompt, params, tools, owner)
    return turn, gen


async def create_response(ctx: ServerContext, store: ResponseStore, req: ResponsesRequest,
                          request: Request) -> Response:
    owner = ctx.config.auth.owner(presented_authorization(request.headers))
    turn, gen = prepare(ctx, store, req, owner)
    if req.stream:
        if gen.error_param is not None:
            await gen.verdict()
        return GenerationStream(_stream(ctx, store, turn, gen), gen)
    await collect(request, gen)
    c = gen.children[0]
    done = answer(turn.tools, c.state.text, c.state.finish_reason)
    output = [*_message_items(done.content), *(_call_item(call) for call in done.tool_calls)]
    body = response_object(ctx, turn, _status(done.finish_reason), output,
                           usage(gen.children, [turn.prompt]))
    _store(store, turn, body)
    return JSONResponse(body)


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _store(store: ResponseStore, turn: Turn, body: ResponseObject) -> None:
    if turn.req.store:
        store.put(dict(body), conversation_after(turn.history, turn.req, body["output"]),
                  turn.owner)


# --- the response object -----------------------------------------------------------------------
def response_object(ctx: ServerContext, turn: Turn, status: str, output: list[dict[str, Any]],
                    used: Usage | None) -> ResponseObject:
    req, params = turn.req, turn.params
    return {
        "id": turn.response_id, "object": "response", "created_at": turn.created,
        "status": status, "error": None,
        "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                               else None),
        "instructions": req.instructions, "max_output_tokens": params.max_tokens,
        "model": ctx.served_name(req.model), "output": output,
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "temperature": params.temperature, "top_p": params.top_p,
        "tool_choice": (req.tool_choice if isinstance(req.tool_choice, str)
                        else req.tool_choice.model_dump()),
        "tools": [t.model_dump(exclude_none=True) for t in req.tools],
        "text": ({"format": {"type": "text"}} if req.text is None or req.text.format is None
                 else req.text.model_dump(exclude_none=True, by_alias=True)),
        "truncation": req.truncation or "disabled", "store": req.store, "background": False,
        "metadata": req.metadata or {}, "user": req.user,
        "usage": None if used is None else _usage(used)}


def _usage(u: Usage) -> ResponseUsage:
    """Chat usage in the Responses API's names (cached tokens under input_tokens_details)."""
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"][
                "cached_tokens"]},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


def _message_items(content: str | None, item_id: str | None = None) -> list[dict[str, Any]]:
    if not content:
        return []
    return [_message(item_id or f"msg_{uuid.uuid4().hex}", content, "completed")]


def _message(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    parts = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": parts}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call: ToolCall, item_id: str | None = None, status: str = "completed"
               ) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or f"fc_{uuid.uuid4().hex}",
            "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


# --- streaming ---------------------------------------------------------------------------------
@dataclass
class _Item:
    """An output item being streamed: the message (text so far) or one function call."""

    item: dict[str, Any]
    index: int
    text: str = ""


@dataclass
class EventStream:
    """Owns a stream's sequence numbers and its open output items."""

    seq: int = 0
    items: list[_Item] = field(default_factory=list)
    message: _Item | None = None
    calls: dict[int, _Item] = field(default_factory=dict)   # tool-call index -> its item

    def event(self, type_: str, **fields: Any) -> bytes:
        body = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + type_.encode() + b"\ndata: " + msgspec.json.encode(body) + b"\n\n"

    def text(self, delta: str) -> list[bytes]:
        if not delta:
            return []
        out = []
        if self.message is None:
            self.message = self._open(_message(f"msg_{uuid.uuid4().hex}", None, "in_progress"))
            out.append(self._added(self.message))
            out.append(self.event("response.content_part.added", **self._where(self.message),
                                  content_index=0, part=_text_part("")))
        self.message.text += delta
        out.append(self.event("response.output_text.delta", **self._where(self.message),
                              content_index=0, delta=delta, logprobs=[]))
        return out

    def call(self, d: DeltaToolCall) -> list[bytes]:
        out = []
        it = self.calls.get(d["index"])
        if it is None:
            call: ToolCall = {"id": d.get("id", ""), "type": "function",
                              "function": {"name": d["function"].get("name", ""),
                                           "arguments": ""}}
            it = self.calls[d["index"]] = self._open(_call_item(call, status="in_progress"))
            out.append(self._added(it))
        args = d["function"].get("arguments", "")
        if args:
            it.text += args
            out.append(self.event("response.function_call_arguments.delta",
                                  **self._where(it), delta=args))
        return out

    def close(self) -> list[bytes]:
        """The done events of every open item, in output order."""
        out = []
        for it in self.items:
            if it is self.message:
                out.append(self.event("response.output_text.done", **self._where(it),
                                      content_index=0, text=it.text, logprobs=[]))
                out.append(self.event("response.content_part.done", **self._where(it),
                                      content_index=0, part=_text_part(it.text)))
                it.item = _message(it.item["id"], it.text, "completed")
            else:
                it.item = {**it.item, "arguments": it.text, "status": "completed"}
                out.append(self.event("response.function_call_arguments.done",
                                      **self._where(it), name=it.item["name"],
                                      arguments=it.text))
            out.append(self.event("response.output_item.done", output_index=it.index,
                                  item=it.item))
        return out

    def output(self) -> list[dict[str, Any]]:
        return [it.item for it in self.items]

    def _open(self, item: dict[str, Any]) -> _Item:
        it = _Item(item, len(self.items))
        self.items.append(it)
        return it

    def _added(self, it: _Item) -> bytes:
        return self.event("response.output_item.added", output_index=it.index, item=it.item)

    @staticmethod
    def _where(it: _Item) -> dict[str, Any]:
        return {"item_id": it.item["id"], "output_index": it.index}


async def _stream(ctx: ServerContext, store: ResponseStore, turn: Turn,
                  gen: Generation) -> AsyncIterator[bytes]:
    events = EventStream()
    started = response_object(ctx, turn, "in_progress", [], None)
    yield events.event("response.created", response=started)
    yield events.event("response.in_progress", response=started)
    calls = ToolCallStream(turn.tools)
    finish_reason = None
    async for _, d in gen.stream_deltas():
        content, deltas = calls.push(d.text)
        if d.finish_reason is not None:
            rest, more, finish_reason = calls.finish(d.finish_reason)
            content, deltas = content + rest, deltas + more
        for b in events.text(content):
            yield b
        for delta in deltas:
            for b in events.call(delta):
                yield b
    if gen.end.error is not None or gen.end.aborted:
        e = gen.end.error or APIError(503, "the server is shutting down")
        yield events.event("error", code=str(e.status), message=e.message, param=e.param)
        return
    for b in events.close():
        yield b
    body = response_object(ctx, turn, _status(finish_reason), events.output(),
                           usage(gen.children, [turn.prompt]))
    _store(store, turn, body)
    yield events.event("response.completed", response=body)
