"""What the router holds for its clients, bounded in bytes, and where its prompt work runs.

A legal request can be large (a body up to `--max-request-body-bytes`, 32 MiB): a few of
them at once must not take the router down for everyone. So:

- **In-flight bodies** (`BodyBudgetMiddleware`): every POST reserves its `Content-Length`
  (the body limit when it sends none) from one budget of `max_inflight_body_bytes` before a
  byte of its body is read, and gives it back when its answer has ended. A request that finds
  no room within `body_wait_s` gets 503 with `Retry-After` (reason `body_budget`). What a
  request holds is a small multiple of its body (its bytes, the parsed body, the re-encoded
  body the worker gets), so the router's memory stays within a few times the budget.
- **Prompt work** (`PromptWork`): parsing, checking and tokenizing a body larger than
  `INLINE_BODY_BYTES` run on `prompt_threads` threads, never on the event loop, so
  `/health`, `/metrics`, the worker poller and small requests are answered while large
  prompts are read. A client that leaves
  meanwhile keeps its reservation until its work item has finished (the thread still holds
  its body).
- **Prompt length** (`kvloop.front.prompts.BoundedTokenizer`): a prompt is tokenized at most
  up to the fleet's largest `max_model_len` times `CHARS_PER_TOKEN_BOUND` characters; one
  whose prefix already fills every worker's context is refused (400, vLLM's context-length
  message) without tokenizing the rest.
- **Flow control's queue** is bounded in bytes as well as in requests
  (`FlowConfig.max_queue_bytes`, kvloop/router/flow.py).

Owner: `RouterApp` owns one `ByteBudget` (through its middleware) and one `PromptWork`.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.types import ASGIApp, Receive, Scope, Send

from kvloop.front.openai import error_body

T = TypeVar("T")
BODY_BUDGET_REFUSED = "body_budget"   # x-kvloop-flow-rejected of a request with no room
INLINE_BODY_BYTES = 32 * 1024   # smaller bodies are read and tokenized on the event loop


@dataclass(frozen=True)
class RouterLimits:
    """Bytes the router holds for its clients and the threads that read prompts."""

    max_inflight_body_bytes: int = 256 * 1024 * 1024
    body_wait_s: float = 10.0
    prompt_threads: int = 1
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.max_inflight_body_bytes <= 0:
            raise ValueError("--max-inflight-body-bytes must be > 0")
        if not self.body_wait_s > 0:
            raise ValueError("body_wait_s must be > 0")
        if self.prompt_threads < 1:
            raise ValueError("--prompt-threads must be >= 1")


class ByteBudget:
    """A count of bytes that `acquire` waits for and `release` gives back (on one loop)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0
        self._freed: asyncio.Condition | None = None

    async def acquire(self, n: int, timeout_s: float) -> bool:
        """Reserve `n` bytes (at most the capacity), waiting up to `timeout_s` for room."""
        n = min(n, self.capacity)
        if self.used + n <= self.capacity:
            self.used += n
            return True
        if self._freed is None:
            self._freed = asyncio.Condition()
        async with self._freed:
            try:
                await asyncio.wait_for(self._freed.wait_for(
                    lambda: self.used + n <= self.capacity), timeout_s)
            except TimeoutError:
                return False
            self.used += n
            return True

    async def release(self, n: int) -> None:
        self.used -= min(n, self.capacity)
        if self._freed is not None:
            async with self._freed:
                self._freed.notify_all()


class BodyBudgetMiddleware:
    """Reserves each POST's body size from `budget` for as long as the request is served
    (module docstring); 503 when no room comes within `wait_s`."""

    def __init__(self, app: ASGIApp, budget: ByteBudget, max_body_bytes: int,
                 limits: RouterLimits):
        self.app = app
        self.budget = budget
        self.max_body_bytes = max_body_bytes
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        n = self._size(scope)
        if not await self.budget.acquire(n, self.limits.body_wait_s):
            await self._refuse(send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            await self.budget.release(n)

    def _size(self, scope: Scope) -> int:
        """The body's announced length (bounded by the body limit), else the limit."""
        for k, v in scope["headers"]:
            if k == b"content-length":
                try:
                    return max(0, min(int(v), self.max_body_bytes))
                except ValueError:
                    break
        return self.max_body_bytes

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(error_body(
            f"the router holds {self.budget.capacity} bytes of request bodies at most and "
            f"had no room for this one within {self.limits.body_wait_s:g} s; retry later",
            503)).encode()
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(self.limits.retry_after_s).encode()),
            (b"x-kvloop-flow-rejected", BODY_BUDGET_REFUSED.encode())]})
        await send({"type": "http.response.body", "body": body})


class PromptWork:
    """Runs prompt-sized work (parse, check, tokenize) on its own threads."""

    def __init__(self, threads: int):
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvloop-router-prompt")

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, the work for a body of `size` bytes: on a prompt thread, unless the
        body is small (`INLINE_BODY_BYTES`: microseconds of work, not worth two thread hops).
        Cancelled (the client left): a call not started never starts; a running one is
        waited for, so what it holds stays reserved."""
        if size <= INLINE_BODY_BYTES:
            return fn(*args)
        job: Future[T] = self._pool.submit(functools.partial(fn, *args))
        try:
            return await asyncio.shield(asyncio.wrap_future(job))
        except asyncio.CancelledError:
            if not job.cancel():
                await asyncio.wait({asyncio.wrap_future(job)})
            raise

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
