"""Anthropic's Messages API on the API server: `POST /v1/messages` and
`POST /v1/messages/count_tokens` (docs/serving.md#anthropic-messages).

A Messages request is converted into its chat equivalent (`kvloop.front.anthropic.chat_request`)
and started by the chat route's own code (`kvloop.server.serving.start_chat`: checks, prompt,
tool plan, constraint, engine requests); only the answer differs: content blocks, Anthropic's
stop reason and usage, or the stream's events (`kvloop.front.anthropic.MessageEvents`).
A stream's `message_start` goes out with the first output, when the prompt's cached tokens are
known; an error after it ends the stream with an `error` event (Anthropic's). Error answers
before a stream are the chat route's, reshaped by `AnthropicErrorMiddleware`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvloop.front.anthropic import (
    ConversionError,
    CountTokensRequest,
    CountTokensResponse,
    MessageEvents,
    MessagesRequest,
    MessagesResponse,
    anthropic_error_body,
    chat_request,
    content_blocks,
    event,
    stop_reason,
    usage,
)
from kvloop.front.openai import ChatCompletionRequest
from kvloop.front.prompts import chat_prompt
from kvloop.server.serving import (
    APIError,
    ChatStart,
    GenerationStream,
    ServerContext,
    collect,
    handed_on,
    start_chat,
)
from kvloop.server.tools import ToolCallStream, answer


def _chat(req: CountTokensRequest) -> ChatCompletionRequest:
    try:
        return chat_request(req)
    except ConversionError as e:
        raise APIError(400, str(e), param=e.param) from e


async def create_messages(ctx: ServerContext, req: MessagesRequest,
                          request: Request) -> Response:
    started = start_chat(ctx, _chat(req), request, prefix="msg_")
    gen = started.gen
    if req.stream:
        if started.constraint is not None:
            await gen.verdict()
        return GenerationStream(_stream(ctx, req, started), gen)
    await collect(request, gen)
    c = gen.children[0]
    done = answer(started.tools, c.state.text, c.state.finish_reason)
    blocks = content_blocks(done.content, done.tool_calls)
    reason, sequence = stop_reason(done.finish_reason, c.state.stop_reason, req.stop_sequences,
                                   any(b["type"] == "tool_use" for b in blocks))
    body: MessagesResponse = {
        "id": started.base, "type": "message", "role": "assistant",
        "model": ctx.served_name(req.model), "content": blocks, "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(len(started.prompt), c.state.num_cached_tokens, len(c.state.token_ids))}
    params = handed_on(gen.children)
    if params is not None:
        body["kv_transfer_params"] = params
    return JSONResponse(body)


async def _stream(ctx: ServerContext, req: MessagesRequest, started: ChatStart
                  ) -> AsyncIterator[bytes]:
    gen, prompt_len = started.gen, len(started.prompt)
    events = MessageEvents(started.base, ctx.served_name(req.model))
    calls = ToolCallStream(started.tools)
    tool_use = False
    async for c, d in gen.stream_deltas():
        if not events.started:
            for b in events.start(usage(prompt_len, c.state.num_cached_tokens, 0)):
                yield b
        text, deltas = calls.push(d.text)
        tool_use |= bool(deltas)
        if d.finish_reason is None:
            for b in events.push(text, deltas):
                yield b
            continue
        rest, more, finish_reason = calls.finish(d.finish_reason)
        tool_use |= bool(more)
        for b in events.push(text + rest, deltas + more):
            yield b
        reason, sequence = stop_reason(finish_reason, d.stop_reason, req.stop_sequences,
                                       tool_use)
        final = usage(prompt_len, c.state.num_cached_tokens, len(c.state.token_ids))
        for b in events.finish(reason, sequence, final):
            yield b
    end = gen.end
    if end.error is not None:
        yield event(anthropic_error_body(end.error.message, end.error.status))
    elif end.aborted:
        yield event(anthropic_error_body("the server is shutting down", 503))


async def count_tokens(ctx: ServerContext, req: CountTokensRequest) -> CountTokensResponse:
    """The prompt's length, as `/v1/messages` would render it (tools included)."""
    ctx.check_model(req.model)
    n = len(chat_prompt(ctx.tokenizer, _chat(req)))
    return {"input_tokens": n, "context_management": {"original_input_tokens": n}}
