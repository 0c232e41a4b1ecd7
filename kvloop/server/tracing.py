"""The API server's spans (docs/tracing.md):

    api_server {METHOD} {path}   SERVER span of one HTTP request, continuing its W3C
                                 `traceparent` (the router's proxy span, or a client's)
      api_server.preprocess      from the request's arrival to its first engine request
                                 (parsing, validation, chat template, tokenization)
      llm_request                one engine request (vLLM's span name and gen_ai.*
                                 attributes): arrival -> finished; its context goes to the
                                 engine core in `EngineCoreRequest.trace_headers`

`TraceMiddleware` (outermost ASGI middleware, installed only with --otlp-traces-endpoint)
makes the HTTP span and puts it in a context variable that `EngineClient.add_request`, in
the same task, reads. No span carries prompt or output text.
"""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass
from typing import Any

from kvloop.server.metrics import RequestTimes
from kvloop.tracing import Attr, PostSpanMiddleware, Span, Tracer, epoch_ns
from kvloop.wire import EngineCoreRequest


@dataclass
class HttpTrace:
    span: Span
    start_ns: int
    preprocessed: bool = False


CURRENT: contextvars.ContextVar[HttpTrace | None] = contextvars.ContextVar(
    "kvloop_http_trace", default=None)


class TraceMiddleware(PostSpanMiddleware[HttpTrace]):
    """An HTTP SERVER span around every POST (module docstring)."""

    name = "api_server"
    current = CURRENT

    def opened(self, span: Span, start_ns: int) -> HttpTrace:
        return HttpTrace(span, start_ns)

    def closed(self, state: HttpTrace) -> None:
        state.span.end()


def start_llm_request(tracer: Tracer, request: EngineCoreRequest, arrival: float) -> Span:
    """The span of one engine request (vLLM's `llm_request`), under this task's HTTP span."""
    http = CURRENT.get()
    parent = http.span if http is not None else None
    if http is not None and not http.preprocessed:
        http.preprocessed = True
        tracer.record("api_server.preprocess", http.span, http.start_ns, time.time_ns(),
                      {Attr.PROMPT_TOKENS: len(request.prompt_token_ids)})
    sp = request.sampling_params
    return tracer.start("llm_request", parent, {
        Attr.REQUEST_ID: request.request_id, Attr.MAX_TOKENS: sp.max_tokens,
        Attr.TEMPERATURE: sp.temperature, Attr.TOP_P: sp.top_p, Attr.N: sp.n,
        Attr.PROMPT_TOKENS: len(request.prompt_token_ids)}, epoch_ns(arrival), kind="SERVER")


def end_llm_request(span: Span, t: RequestTimes, reason: str, now: float) -> None:
    """vLLM's latency and usage attributes of a finished engine request, then its end."""
    attrs: dict[str, Any] = {
        Attr.COMPLETION_TOKENS: t.num_generation_tokens, Attr.CACHED_TOKENS: t.num_cached_tokens,
        "kvloop.external_cached_tokens": t.num_external_cached_tokens,
        "kvloop.finish_reason": reason, "kvloop.num_preemptions": t.num_preemptions,
        Attr.E2E: now - t.arrival}
    if t.first_scheduled is not None:
        attrs[Attr.TIME_IN_QUEUE] = t.first_scheduled - t.arrival
    if t.first_token is not None:
        attrs[Attr.TTFT] = t.first_token - t.arrival
        if t.first_scheduled is not None:
            attrs[Attr.PREFILL] = t.first_token - t.first_scheduled
    if t.first_token is not None and t.last_token is not None:
        attrs[Attr.DECODE] = t.last_token - t.first_token
    if reason in ("abort", "error"):
        span.error(reason)
    span.set(attrs)
    span.end(epoch_ns(now))
