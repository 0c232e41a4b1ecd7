"""What stands in front of a front's app (the API server's FastAPI app, the router's Starlette
app): API keys (`kvloop.front.auth`), the body limit and the read timeouts
(`kvloop.front.http_limits`), and Anthropic's error shape on its routes.

    uvicorn ─ TimedH11Protocol ─▶ AnthropicErrorMiddleware ─▶ AuthMiddleware ─▶ BodyLimit ─▶ app
              read timeouts (408)  /v1/messages* errors          401 / 403        413

`install(app, ...)` adds the three middlewares; `http_protocol(limits)` is uvicorn's `http=`.
Keys are checked before any byte of the body is read. A key is presented as `Authorization:
Bearer KEY` or, as Anthropic's clients send it, `x-api-key: KEY` (`presented_authorization`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from typing import Any, cast

import h11
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvloop.front.anthropic import AnthropicErrorMiddleware
from kvloop.front.auth import (
    INTERNAL_CALLER_SCOPE,
    AuthConfig,
    Caller,
    RouteRules,
    presented_authorization,
)
from kvloop.front.http_limits import HttpLimits
from kvloop.front.openai import error_body

logger = logging.getLogger("kvloop.front")

_REALM = 'Bearer realm="kvloop"'


def install(app: Starlette, auth: AuthConfig, rules: RouteRules, limits: HttpLimits) -> None:
    """Put the Messages routes' error shape (outermost), the key check and the body limit in
    front of `app`'s routes."""
    app.add_middleware(BodyLimitMiddleware, max_bytes=limits.max_request_body_bytes)
    app.add_middleware(AuthMiddleware, config=auth, rules=rules)
    app.add_middleware(AnthropicErrorMiddleware)


# --- keys ----------------------------------------------------------------------------------------
class AuthMiddleware:
    """Lets a request through or refuses it (401/403), by `RouteRules`."""

    def __init__(self, app: ASGIApp, config: AuthConfig, rules: RouteRules):
        self.app = app
        self.config = config
        self.rules = rules

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or \
                scope.get(INTERNAL_CALLER_SCOPE) is True:
            await self.app(scope, receive, send)
            return
        caller = self.config.identify(presented_authorization(Headers(scope=scope)))
        refusal = self.refusal(scope["method"], scope["path"], caller)
        if refusal is None:
            await self.app(scope, receive, send)
        else:
            await refusal(scope, receive, send)

    def refusal(self, method: str, path: str, caller: Caller) -> JSONResponse | None:
        """The answer refusing this call, or None to let it through."""
        if (method, path) in self.rules.admin:
            return self._admin_refusal(method, path, caller)
        if not self.config.api_keys or self.rules.is_public(path):
            return None
        if caller in (Caller.API, Caller.ADMIN):
            return None
        if caller is Caller.NONE:
            return _refuse(401, "no API key: send 'Authorization: Bearer KEY' with one of the "
                                "server's --api-key keys", _REALM)
        return _refuse(401, "invalid API key", _REALM + ', error="invalid_token"')

    def _admin_refusal(self, method: str, path: str, caller: Caller) -> JSONResponse | None:
        route = f"{method} {path}"
        if self.config.admin_api_key is None:
            return _refuse(403, f"{route} changes state and is disabled: start with "
                                "--admin-api-key KEY and send 'Authorization: Bearer KEY'")
        if caller is Caller.ADMIN:
            return None
        if caller is Caller.API:
            return _refuse(403, f"{route} needs the admin key (--admin-api-key), not an API key")
        return _refuse(401, f"{route} needs the admin key: send 'Authorization: Bearer KEY' "
                            "with the --admin-api-key", _REALM)


def _refuse(code: int, message: str, challenge: str | None = None) -> JSONResponse:
    """A refusal; the connection closes after it (a body the caller may still be sending is
    not drained for it)."""
    headers = {"connection": "close"}
    if challenge is not None:
        headers["www-authenticate"] = challenge
    return JSONResponse(error_body(message, code), status_code=code, headers=headers)


# --- body size -----------------------------------------------------------------------------------
def too_large_message(limit: int) -> str:
    return f"the request body exceeds {limit} bytes (--max-request-body-bytes)"


class BodyTooLarge(HTTPException):
    """Raised from `receive()` once the body read so far passes the limit; the app's
    HTTPException handler answers it (413, then the connection closes)."""

    def __init__(self, limit: int):
        super().__init__(413, too_large_message(limit), headers={"connection": "close"})


class BodyLimitMiddleware:
    """Request bodies of at most `max_bytes`. A Content-Length over it is refused before the
    app runs; any other body is counted as the app reads it, so no more than the limit is
    ever held and the 413 goes out while the client is still sending."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            response = JSONResponse(error_body(too_large_message(self.max_bytes), 413),
                                    status_code=413, headers={"connection": "close"})
            await response(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counting_receive, send)


def _content_length(scope: Scope) -> int | None:
    value = Headers(scope=scope).get("content-length")
    try:
        return None if value is None else int(value)
    except ValueError:
        return None  # h11 refuses such a request before it gets here


# --- read timeouts -------------------------------------------------------------------------------
HEADERS = "headers"
BODY = "body"
_TIMEOUT_FLAGS = {HEADERS: "--http-header-timeout", BODY: "--http-body-timeout"}


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol (whose only timer is keep-alive, between requests) plus the
    read timeouts of `HttpLimits`, at the transport level.

    One timer per connection follows what the connection waits for, read from h11's state
    of the client after every read and every response: the headers of a request (a deadline
    from its first byte, or from the connection opening), more of its body (restarted by
    every read; time the server itself stopped reading under flow control does not count),
    or nothing (the app has the request; or keep-alive, which uvicorn times). A connection
    past its deadline gets 408 (unless a response was begun) and is closed.
    """

    def __init__(self, *args: Any, limits: HttpLimits, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._limits = limits
        self._waiting_for: str | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._wait_for(HEADERS)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_request(progress=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_request(progress=False)

    def connection_lost(self, exc: Exception | None) -> None:
        self._wait_for(None)
        super().connection_lost(exc)

    def _follow_request(self, progress: bool) -> None:
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._wait_for(BODY, restart=progress)
        elif state is h11.IDLE and self.conn.trailing_data[0]:
            self._wait_for(HEADERS)   # a request has begun: its deadline is not moved
        else:
            self._wait_for(None)

    def _timeout_s(self, what: str) -> float:
        return self._limits.header_timeout_s if what == HEADERS else self._limits.body_timeout_s

    def _wait_for(self, what: str | None, restart: bool = False) -> None:
        if what == self._waiting_for and not restart:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._waiting_for = what
        if what is not None:
            self._timer = self.loop.call_later(self._timeout_s(what), self._timed_out)

    def _timed_out(self) -> None:
        self._timer = None
        what, self._waiting_for = self._waiting_for, None
        if what is None or self.transport.is_closing():
            return
        if what == BODY and self.flow.read_paused:
            self._wait_for(BODY, restart=True)
            return
        message = (f"request {what} not received within {self._timeout_s(what):g} s "
                   f"({_TIMEOUT_FLAGS[what]})")
        logger.debug("closing the connection of %s: %s", self.client, message)
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # nothing sent for it yet
            self.transport.write(_timeout_response(message))
        self.transport.close()


def _timeout_response(message: str) -> bytes:
    body = json.dumps(error_body(message, 408), separators=(",", ":")).encode()
    head = ("HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


def http_protocol(limits: HttpLimits) -> type[asyncio.Protocol]:
    """uvicorn's `http=`: the timed protocol bound to `limits`."""
    return cast(type[asyncio.Protocol], functools.partial(TimedH11Protocol, limits=limits))
