"""The router's single-worker flow (beside `pd_proxy.PDFlow`): wait for room (flow
control), route, forward to one worker, answer.

    admission -> decide (Router.pick, off the loop with a network index) -> open_upstream
    -> answer (relayed as it streams, or read whole) -> the ticket closed on every path

A worker that refuses the connection is marked down and the request is routed again
(nothing reached it), and so is a draining worker's refusal; one that closes the connection
unanswered is retried once; one that fails before its headers answers a JSON 502; one that
fails mid-stream ends the stream with an error event, unless the stream migrates
(`kvloop.router.migration`). The proxy's docstring (`kvloop.router.proxy`) has the whole
contract.

Owner: `SingleFlow` owns the decision thread (with an index that does network I/O) and
nothing else; its HTTP client is its front's, handed over at `start`. `PDFlow` reuses its
admission, decision, upstream and answer steps for the decode leg.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kvloop.front.anthropic import MESSAGES_PATHS, anthropic_error_body, event
from kvloop.front.drain import refused_by_drain
from kvloop.front.openai import error_body
from kvloop.router import tracing
from kvloop.router.flow import FlowControl, FlowKey, Permit, Rejection, rejection_response
from kvloop.router.migration import Migration
from kvloop.router.relay import (
    RETRY,
    Disconnected,
    Retry,
    Unanswered,
    cached_tokens,
    error_response,
    json_or_none,
    response_headers,
    unless_disconnected,
)
from kvloop.router.request import RoutingRequest
from kvloop.router.router import NoWorkerError, PDRouted, Routed, Router
from kvloop.router.sse import SseRelay, sse_event

log = logging.getLogger("kvloop.router")

# a connection a stopping server closed before answering (nothing of the request ran)
_UNANSWERED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
D = TypeVar("D", Routed, PDRouted)


class SingleFlow:
    """One request, one worker (module docstring)."""

    def __init__(self, router: Router, flow: FlowControl):
        self.router = router
        self.flow = flow
        self.client: httpx.AsyncClient | None = None
        self._decider: ThreadPoolExecutor | None = None

    def start(self, client: httpx.AsyncClient) -> None:
        self.client = client
        if self.router.index.remote:
            self._decider = ThreadPoolExecutor(1, thread_name_prefix="kvloop-router-decide")

    def stop(self) -> None:
        if self._decider is not None:
            self._decider.shutdown(wait=False)

    async def send(self, request: Request, rr: RoutingRequest, raw: bytes,
                   headers: dict[str, str], stream: bool, strip_usage: bool,
                   on_routed: Callable[[str], None] | None = None,
                   migration: Migration | None = None) -> Response:
        """Wait for room (flow control), pick (`Router.pick_one`: never a worker of
        `rr.exclude`), forward `raw` to `rr.path`, answer; `on_routed` hears the name of the
        worker that got the request; `migration`: a stream's, if it may move."""
        assert self.client is not None
        unanswered: Unanswered | None = None   # one retry after a connection closed so
        permit = await self.admission(request, rr.flow_key)
        if isinstance(permit, Response):
            return permit
        path = rr.path
        while True:
            try:
                routed = await self.decide(self.router.pick_one, rr)
            except NoWorkerError as e:
                return unanswered.answer if unanswered else error_response(str(e), 503)
            finally:
                permit.close()   # routed: its ticket counts it from now on
            name = routed.worker.name
            if on_routed is not None:
                on_routed(name)
            upstream = await self.open_upstream(request, routed, path, raw, headers,
                                                retry_unanswered=unanswered is None)
            if isinstance(upstream, Retry):
                if isinstance(upstream, Unanswered):
                    unanswered = upstream
                rr = rr.continued(exclude=[name])
                continue
            if isinstance(upstream, Response):
                return upstream
            assert isinstance(upstream, httpx.Response)
            return await self.answer(request, upstream, routed, stream, strip_usage,
                                     migration)

    async def admission(self, request: Request, key: FlowKey | None) -> Permit | Response:
        """Flow control's answer (kvloop/router/flow.py) for a request of flow `key` (None:
        the default band and tenant): a permit, to close once the request is routed, or the
        refusal to answer (499: the client left while queued)."""
        key, t0 = key or FlowKey(), time.monotonic()
        permit = await unless_disconnected(request, self.flow.admit(key))
        tracing.admitted(key, t0, permit)
        if isinstance(permit, Disconnected):
            return Response(status_code=499)
        if isinstance(permit, Rejection):
            return rejection_response(permit, self.flow.cfg)
        return permit

    async def decide(self, route: Callable[..., D], *args: Any) -> D:
        """`route(*args)`: on the event loop, or, with an index that does network I/O (Redis),
        on the router's one decision thread, so decisions stay serial and a frozen Redis
        stalls that thread, never the loop. A request cancelled meanwhile closes the tickets
        its decision opens."""
        t0 = time.monotonic()
        if self._decider is None:
            result = route(*args)
            tracing.decided(result, t0)
            return result
        loop = asyncio.get_running_loop()
        decision = loop.run_in_executor(self._decider, functools.partial(route, *args))
        try:
            result = await asyncio.shield(decision)
        except asyncio.CancelledError:
            decision.add_done_callback(self._abandon)
            raise
        tracing.decided(result, t0)
        return result

    def _abandon(self, decision: asyncio.Future[Any]) -> None:
        if not decision.cancelled() and decision.exception() is None:
            self.router.abandon(decision.result())

    async def open_upstream(self, request: Request, routed: Routed, path: str, raw: bytes,
                            headers: dict[str, str], retry_unanswered: bool = False
                            ) -> httpx.Response | Response | Retry:
        """Send the request to the routed worker and wait for its headers (a client that
        leaves meanwhile closes the connection: 499). A worker that refuses the connection is
        marked down (`RETRY`: nothing reached it); any other failure before the headers
        closes the ticket and answers the documented JSON 502. A draining worker's refusal,
        or its connection closed unanswered, is also `RETRY` (`kvloop.front.drain`); with
        `retry_unanswered`, any worker's connection closed unanswered is `Unanswered` (it is
        marked down: route again, once)."""
        assert self.client is not None
        w = routed.worker
        headers = tracing.leg_headers(headers, routed, routed.worker.spec.role)
        req = self.client.build_request("POST", w.spec.url + path, content=raw,
                                        headers=headers)
        sent = False
        try:
            upstream = await unless_disconnected(request, self.client.send(req, stream=True))
            if isinstance(upstream, Disconnected):
                return Response(status_code=499)
            sent = True
            if refused_by_drain(upstream.status_code, upstream.headers):
                await upstream.aclose()
                self._refused_by_drain(routed, "refused: draining")
                return RETRY
            return upstream
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            self.router.finish(routed.ticket, None, "worker_error")
            self.router.worker_down(w.name, f"connection failed: {e!r}")
            return RETRY
        except httpx.TransportError as e:
            if w.load.draining and isinstance(e, _UNANSWERED):   # it stopped meanwhile
                self._refused_by_drain(routed, f"closed unanswered while draining: {e!r}")
                return RETRY
            self.router.finish(routed.ticket, None, "worker_error")
            if not isinstance(e, httpx.TimeoutException):   # slow is not dead
                self.router.worker_down(w.name, f"failed before answering: {e!r}")
            failed = error_response(f"worker {w.name} failed before answering: {e!r}", 502)
            if retry_unanswered and isinstance(e, _UNANSWERED):
                return Unanswered(failed)
            return failed
        finally:   # cancelled (the client left) or a bug: the ticket never stays open
            if not sent:
                self.router.finish(routed.ticket, None, "disconnected")

    def _refused_by_drain(self, routed: Routed, why: str) -> None:
        """The routed worker drains and did not run the request: close its ticket, send
        nothing more there."""
        self.router.finish(routed.ticket, None, "draining")
        self.router.registry.mark_draining(routed.worker.name)
        log.info("worker %s %s: routing the request again", routed.worker.name, why)

    async def answer(self, request: Request, upstream: httpx.Response, routed: Routed,
                     stream: bool, strip_usage: bool, migration: Migration | None = None
                     ) -> Response:
        """The worker's answer to the client: relayed as it streams, or read whole (a client
        that leaves meanwhile closes the upstream connection). The ticket is closed on every
        path (`_RelayResponse` closes it even when the stream never starts)."""
        if stream and upstream.status_code == 200:
            messages = request.url.path in MESSAGES_PATHS
            return _RelayResponse(self._relay(upstream, routed, strip_usage, messages,
                                              migration),
                                  on_close=lambda: self._close(upstream, routed),
                                  status_code=200, headers=response_headers(upstream))
        try:
            whole = await unless_disconnected(request, self._whole(upstream, routed))
        finally:
            await self._close(upstream, routed)
        return whole if isinstance(whole, Response) else Response(status_code=499)

    async def _close(self, upstream: httpx.Response, routed: Routed) -> None:
        """Close the upstream connection and the ticket, if still open (idempotent)."""
        with anyio.CancelScope(shield=True):
            await upstream.aclose()
        self.router.finish(routed.ticket, None, "disconnected")

    async def _whole(self, upstream: httpx.Response, routed: Routed) -> Response:
        """A non-streamed answer (or an error status): read it, account, pass it on."""
        name = routed.worker.name
        try:
            content = await upstream.aread()
        except httpx.TransportError as e:
            self.router.finish(routed.ticket, None, "worker_error")
            if not isinstance(e, httpx.TimeoutException):
                self.router.worker_down(name, f"failed mid-request: {e!r}")
            return error_response(f"worker {name} failed while serving the request: {e!r}", 502)
        finally:
            with anyio.CancelScope(shield=True):
                await upstream.aclose()
        cached = None
        outcome = "ok" if upstream.status_code < 400 else (
            "client_error" if upstream.status_code < 500 else "worker_error")
        if upstream.status_code == 200:
            cached = cached_tokens(json_or_none(content))
        self.router.first_token(routed.ticket)
        self.router.finish(routed.ticket, cached, outcome)
        return Response(content, status_code=upstream.status_code,
                        headers=response_headers(upstream))

    async def _relay(self, upstream: httpx.Response, routed: Routed, strip_usage: bool,
                     messages: bool = False, migration: Migration | None = None
                     ) -> AsyncIterator[bytes]:
        """Relay SSE events as they arrive; note the first token and the reported hit. A
        worker that fails mid-stream ends it with an error event (Anthropic's on a
        `messages` stream), unless the stream's `migration` goes on elsewhere."""
        relay = SseRelay(strip_usage, migration)
        outcome = "disconnected"
        cut = False   # the worker closed the stream before its answer's end
        failure: httpx.TransportError | None = None
        try:
            async for chunk in upstream.aiter_raw():
                out = relay.feed(chunk)
                if relay.started:
                    self.router.first_token(routed.ticket)
                if out:
                    yield out
            tail = relay.flush()
            if tail:
                yield tail
            outcome = "ok"
            if migration is not None and migration.interrupted is not None:
                outcome = "worker_error"
            elif not relay.end.ended and not relay.end.finished:
                outcome, cut = "worker_error", True
        except httpx.TransportError as e:
            outcome, failure = "worker_error", e
            self.router.worker_down(routed.worker.name, f"failed mid-stream: {e!r}")
        finally:
            with anyio.CancelScope(shield=True):
                await upstream.aclose()
                self.router.finish(routed.ticket, relay.cached_tokens, outcome)
        interrupted = migration.interrupted if migration is not None else None
        if failure is None and interrupted is None and not cut:
            if outcome == "ok" and not relay.end.ended:   # finished; only its end was lost
                yield event({"type": "message_stop"}) if messages else b"data: [DONE]\n\n"
            return
        if cut:
            interrupted = "it closed the stream before the answer's end (no [DONE], no " \
                          "finish reason)"
            log.warning("worker %s %s", routed.worker.name, interrupted)
        msg = (f"worker {routed.worker.name} failed mid-stream: {failure!r}"
               if failure is not None else
               f"worker {routed.worker.name} ended the stream early: {interrupted}")
        if migration is not None:
            async for out in self._migrate(migration, routed, strip_usage, msg):
                yield out
            return
        yield (event(anthropic_error_body(msg, 502)) if messages
               else sse_event(error_body(msg, 502)) + b"data: [DONE]\n\n")

    async def _migrate(self, m: Migration, left: Routed, strip_usage: bool, msg: str
                       ) -> AsyncIterator[bytes]:
        """The rest of a stream whose worker (`left`'s) failed, from another worker
        (kvloop/router/migration.py), picked with `left`'s routing request continued (its
        adapter, session and salt kept); `msg`'s error event when none takes it."""
        if m.finished:   # its last chunk was relayed: only the end was lost
            yield b"data: [DONE]\n\n"
            return
        failed = left.worker.name
        assert left.request is not None
        rr = left.request
        leg = m.next_leg(failed)
        while not isinstance(leg, str):
            try:
                routed = await self.decide(self.router.pick_one, rr.continued(
                    leg.tokens, m.failed, leg.max_tokens))
            except NoWorkerError as e:
                leg = str(e)
                break
            upstream = await self.open_upstream(m.request, routed, leg.path, leg.raw,
                                                m.headers)
            if isinstance(upstream, Retry):
                m.failed.append(routed.worker.name)
                continue
            if isinstance(upstream, httpx.Response) and upstream.status_code != 200:
                await self._close(upstream, routed)
                leg = f"{routed.worker.name} answered {upstream.status_code}"
                break
            if not isinstance(upstream, httpx.Response):   # its failure, or the client left
                leg = f"{routed.worker.name} did not answer"
                break
            self.router.metrics.migrations.labels(failed, "migrated").inc()
            tracing.migrated(failed, routed, m.moves, len(m.output_ids))
            log.warning("stream migrated from worker %s to worker %s after %d tokens (move "
                        "%d of at most %d)", failed, routed.worker.name, len(m.output_ids),
                        m.moves, m.limit)
            async for out in self._relay(upstream, routed, strip_usage, False, m):
                yield out
            return
        self.router.metrics.migrations.labels(failed, "failed").inc()
        log.warning("stream from worker %s not migrated: %s", failed, leg)
        yield sse_event(error_body(f"{msg}; not migrated: {leg}", 502)) + b"data: [DONE]\n\n"

class _RelayResponse(StreamingResponse):
    """A relayed stream whose `on_close` runs however the response ends, even when the
    client leaves before the first chunk (an async generator that never started runs no
    `finally`)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]],
                 status_code: int, headers: dict[str, str]):
        super().__init__(content, status_code=status_code, headers=headers)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()
