"""Sends one batch line through a front's own ASGI app, in this process.

The line takes the same path as a client's request (body checks, tokenizing, flow control,
routing, the worker's answer), marked as the front's own call (`INTERNAL_CALLER_SCOPE`, a
key of the ASGI scope no client can set) so the key check lets it through: the batch's owner
was checked when the batch was created, and no key is kept to present again. `headers` are
added to every line (the router's batch band and the owner as the fairness tenant).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import httpx
from starlette.types import ASGIApp, Receive, Scope, Send

from kvloop.batch.runner import Answer
from kvloop.front.auth import INTERNAL_CALLER_SCOPE
from kvloop.front.openai import error_body

LINE_TIMEOUT_S = 3600.0


class InProcessSender:
    """`send(path, body, owner) -> Answer` over `app` (see the module docstring)."""

    def __init__(self, app: ASGIApp, headers: Callable[[str], Mapping[str, str]]):
        self._app = app
        self._headers = headers
        transport = httpx.ASGITransport(app=self._marked, raise_app_exceptions=False)
        self._client = httpx.AsyncClient(transport=transport,
                                         base_url="http://kvloop-batch",
                                         timeout=LINE_TIMEOUT_S)

    async def _marked(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._app({**scope, INTERNAL_CALLER_SCOPE: True}, receive, send)

    async def __call__(self, path: str, body: dict[str, Any], owner: str) -> Answer:
        try:
            r = await self._client.post(path, content=json.dumps(body).encode(),
                                        headers={"content-type": "application/json",
                                                 **self._headers(owner)})
        except httpx.HTTPError as e:   # the line's own timeout: its answer is this error
            return Answer(504, error_body(f"the request failed: {e!r}", 504),
                          "req_" + secrets.token_hex(12))
        try:
            answer: Any = r.json()
        except ValueError:
            answer = error_body(r.text[:2000], r.status_code)
        rid = r.headers.get("x-request-id") or (answer.get("id") if isinstance(answer, dict)
                                                else None)
        return Answer(r.status_code, answer, str(rid or "req_" + secrets.token_hex(12)))

    async def aclose(self) -> None:
        await self._client.aclose()
