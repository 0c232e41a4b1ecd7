"""What the router's two request flows share: `single.SingleFlow`'s (one worker) and
`pd_proxy.PDFlow`'s (a prefill leg, then a decode leg).

- a leg the client's disconnect cancels (`unless_disconnected` -> `DISCONNECTED`);
- `RETRY`: a worker refused the connection (or, draining, the request), nothing of it ran,
  route again; `Unanswered`: it closed the connection unanswered, route again once;
- a worker's answer read: its JSON (`json_or_none`), its reported prefix hit
  (`cached_tokens`), the headers relayed to the client (`response_headers`);
- the router's own JSON error answer (`error_response`).

Both flows import this module; it imports neither, so the P/D flow builds on the proxy's
pieces without the proxy and the flow importing each other.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable
from typing import Any, TypeVar

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvloop.front.openai import error_body

T = TypeVar("T")
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive",
               "content-encoding", "date", "server"}


def error_response(message: str, code: int) -> JSONResponse:
    return JSONResponse(error_body(message, code), status_code=code)


class Disconnected:
    """The client went away while a leg ran."""


DISCONNECTED = Disconnected()


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, leg: Awaitable[T]) -> T | Disconnected:
    """Await `leg`; if the client disconnects first, cancel it (closing its connection)."""
    task = asyncio.ensure_future(leg)
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:   # this request itself is cancelled: so is its leg
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return DISCONNECTED


class Retry:
    """`SingleFlow.open_upstream`'s answer when the worker refused the connection: route
    again."""


RETRY = Retry()


class Unanswered(Retry):
    """The worker closed the connection without answering (a keep-alive connection it closed
    as it stopped, or it crashed): route again, once per request, never more (a request that
    crashes workers must not walk the fleet); `answer` is the 502 to give when no other
    worker can take it."""

    def __init__(self, answer: Response):
        self.answer = answer


def json_or_none(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None


def cached_tokens(payload: Any) -> int | None:
    """usage.prompt_tokens_details.cached_tokens of a response body (OpenAI's; a Responses
    API answer: usage.input_tokens_details.cached_tokens, of the `response` a stream event
    carries), or usage.cache_read_input_tokens (Anthropic's: a Messages answer or stream
    event), if present."""
    if isinstance(payload, dict) and isinstance(payload.get("response"), dict):
        payload = payload["response"]
    if not isinstance(payload, dict):
        return None
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        return None
    if isinstance(usage.get("cache_read_input_tokens"), int):
        return int(usage["cache_read_input_tokens"])
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    if not isinstance(details, dict) or details.get("cached_tokens") is None:
        return None
    return int(details["cached_tokens"])


def response_headers(r: httpx.Response) -> dict[str, str]:
    """A worker's response headers to relay to the client (hop-by-hop ones dropped)."""
    return {k: v for k, v in r.headers.items() if k.lower() not in HOP_HEADERS}


# the `type` of a streamed event that ends its stream (Anthropic's Messages, Responses)
_END_TYPES = frozenset({"message_stop", "error", "response.completed", "response.failed",
                        "response.incomplete"})
# what an event that ends or finishes a stream contains (one C-speed search per event; only
# an event that matches is parsed: once or twice per stream)
_END_OR_FINISH = re.compile(
    rb'"(?:finish_reason|stop_reason)"\s*:\s*(?!null)|^\{\s*"error"|"type"\s*:\s*"(?:'
    + b"|".join(re.escape(t.encode()) for t in sorted(_END_TYPES)) + rb')"')


class StreamEnd:
    """Did a relayed SSE stream end as a complete answer ends? `ended`: its terminator came
    (`[DONE]`, or an event whose `type` ends the stream, or an error event); `finished`: a
    choice's `finish_reason` (or a message's `stop_reason`) came, so only the terminator
    may be missing. A worker stream that closes with neither was cut: a failure (migrated
    when allowed, else an error event), never relayed as complete."""

    def __init__(self) -> None:
        self.ended = False
        self.finished = False

    def note_events(self, chunk: bytes) -> None:
        """Whole events relayed unparsed: each read only if the chunk may end or finish."""
        if b"[DONE]" not in chunk and b'"error"' not in chunk and \
                _END_OR_FINISH.search(chunk) is None:
            return
        for event in chunk.replace(b"\r\n", b"\n").split(b"\n\n"):
            lines = [ln[5:].strip() for ln in event.splitlines() if ln.startswith(b"data:")]
            if lines:
                self.note(b"\n".join(lines))

    def note(self, data: bytes) -> None:
        """One event's data (SSE `data:` lines joined)."""
        if data == b"[DONE]":
            self.ended = True
            return
        if _END_OR_FINISH.search(data) is None:
            return
        payload = json_or_none(data)
        if not isinstance(payload, dict):
            return
        if payload.get("type") in _END_TYPES or "error" in payload:
            self.ended = True
        delta = payload.get("delta")
        if isinstance(delta, dict) and delta.get("stop_reason") is not None:
            self.finished = True
        choices = payload.get("choices")
        if isinstance(choices, list) and any(
                isinstance(c, dict) and c.get("finish_reason") is not None for c in choices):
            self.finished = True
