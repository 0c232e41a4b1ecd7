"""The router's spans of one request (docs/tracing.md):

    router POST {path}     SERVER span, continuing the client's W3C `traceparent`
      router.admission     flow control: queue wait, band, tenant digest (never the key)
      router.route         the decision: candidates and their costs in prompt tokens, the
                           chosen worker, its predicted cached tokens, the P/D decision
      router.proxy         CLIENT span per leg sent to a worker (prefill, decode or the
                           one worker); its context goes on in the leg's `traceparent`
      router.migrate       a stream moved to another worker (both workers named)

`TraceMiddleware` (installed only with --otlp-traces-endpoint) opens the request's
`RequestTrace` and puts it in a context variable; the proxy's seams call this module's
functions, which do nothing when no trace is open (one context-variable read).
"""

from __future__ import annotations

import contextvars
import time
from typing import Any

from kvloop.router.flow import FlowKey, Permit
from kvloop.router.router import PDRouted, Routed
from kvloop.tracing import (
    PostSpanMiddleware,
    Span,
    Tracer,
    TracingConfig,
    epoch_ns,
    make_tracer,
)


class RequestTrace:
    """The open spans of one request in the router."""

    def __init__(self, tracer: Tracer, root: Span):
        self.tracer = tracer
        self.root = root
        self.legs: dict[int, Span] = {}   # id(ticket) -> its open proxy span

    def end(self) -> None:
        for span in self.legs.values():
            span.end()
        self.legs.clear()
        self.root.end()


CURRENT: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar(
    "kvloop_router_trace", default=None)


class TraceMiddleware(PostSpanMiddleware[RequestTrace]):
    """Opens a `RequestTrace` around every POST (module docstring)."""

    name = "router"
    current = CURRENT

    def opened(self, span: Span, start_ns: int) -> RequestTrace:
        return RequestTrace(self.tracer, span)

    def closed(self, state: RequestTrace) -> None:
        state.end()


def install_tracing(app: Any, config: TracingConfig) -> Tracer | None:
    """The router's tracer and its middleware (outermost), when tracing is on."""
    tracer = make_tracer(config, "kvloop-router")
    if tracer is not None:
        app.add_middleware(TraceMiddleware, tracer=tracer)
    return tracer


def admitted(key: FlowKey, since: float, outcome: Any) -> None:
    """Flow control answered (`outcome`: a Permit, a Rejection or the client's leaving)
    after waiting since `since` (monotonic)."""
    trace = CURRENT.get()
    if trace is None:
        return
    now = time.monotonic()
    trace.tracer.record("router.admission", trace.root, epoch_ns(since), epoch_ns(now), {
        "kvloop.flow.queue_wait_s": now - since, "kvloop.flow.band": key.priority,
        "kvloop.flow.tenant_digest": f"{key.tenant:016x}",
        "kvloop.flow.outcome": "admitted" if isinstance(outcome, Permit)
        else getattr(outcome, "reason", "disconnected")})


def decided(result: Any, since: float) -> None:
    """A routing decision (`Routed` or `PDRouted`) taken since `since` (monotonic)."""
    trace = CURRENT.get()
    if trace is None:
        return
    attrs: dict[str, Any] = {}
    if isinstance(result, PDRouted):
        d = result.decision
        attrs.update({"kvloop.pd.remote_prefill": d.remote, "kvloop.pd.reason": d.reason})
        if result.prefill is not None:
            attrs.update(_routed(result.prefill, "kvloop.pd.prefill."))
        attrs.update(_routed(result.decode, "kvloop.route."))
    elif isinstance(result, Routed):
        attrs.update(_routed(result, "kvloop.route."))
    trace.tracer.record("router.route", trace.root, epoch_ns(since),
                        epoch_ns(time.monotonic()), attrs)


def _routed(r: Routed, prefix: str) -> dict[str, Any]:
    costs = r.decision.costs
    return {prefix + "worker": r.worker.name, prefix + "reason": r.decision.reason,
            prefix + "candidates": list(costs), prefix + "costs_tokens": list(costs.values()),
            prefix + "cost_tokens": r.decision.cost,
            prefix + "predicted_cached_tokens": r.predicted_tokens,
            prefix + "prompt_tokens": r.ticket.prompt_tokens}


def leg_headers(headers: dict[str, str], routed: Routed, leg: str) -> dict[str, str]:
    """`headers` with the `traceparent` of a new proxy span for this leg (unchanged when
    no trace is open)."""
    trace = CURRENT.get()
    if trace is None:
        return headers
    old = trace.legs.pop(id(routed.ticket), None)
    if old is not None:
        old.end()
    span = trace.tracer.start("router.proxy", trace.root, {
        "kvloop.leg": leg, "kvloop.worker": routed.worker.name,
        "server.address": routed.worker.spec.url}, kind="CLIENT")
    trace.legs[id(routed.ticket)] = span
    return {**headers, **span.headers}


def leg_done(routed: Routed, status: int | None = None) -> None:
    trace = CURRENT.get()
    span = trace.legs.pop(id(routed.ticket), None) if trace is not None else None
    if span is not None:
        span.set({"http.response.status_code": status})
        span.end()


def migrated(failed: str, routed: Routed, moves: int, output_tokens: int) -> None:
    """A stream moved from worker `failed` to `routed`'s."""
    trace = CURRENT.get()
    if trace is None:
        return
    now = epoch_ns(time.monotonic())
    trace.tracer.record("router.migrate", trace.root, now, now, {
        "kvloop.migration.from": failed, "kvloop.migration.to": routed.worker.name,
        "kvloop.migration.move": moves, "kvloop.migration.output_tokens": output_tokens})
