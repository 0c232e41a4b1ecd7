"""OpenTelemetry traces, one trace per request across router, API server, engine core and the
P/D peer (docs/tracing.md).

Flags (vLLM's names and meanings): `--otlp-traces-endpoint URL` turns tracing on and sends
spans over OTLP, gRPC unless `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` (or
`OTEL_EXPORTER_OTLP_PROTOCOL`) says `http/protobuf`; `--collect-detailed-traces
{all,model,worker}` adds the per-step spans (each prefill chunk's step, decode steps) that
cost a span per step. The other standard OTEL_* variables are read by the SDK itself
(service name, resource attributes, headers, TLS, timeouts, sampler, batch processor).

Cost when off: nothing. This module imports no OpenTelemetry package at import time; a process
without `--otlp-traces-endpoint` holds `None` for its tracer and every hook is one `is None`
test. The SDK and the OTLP exporters are the optional `tracing` extra.

Context crosses processes as W3C `traceparent`/`tracestate` strings only (`TraceHeaders`):
HTTP headers router -> worker, a field of `EngineCoreRequest` API server -> engine core, a
field of the KV pull D -> P. A header that is not a valid trace context is ignored (a new
trace starts); nothing else a client sends is read.

Privacy: spans carry ids, counts, times, worker names and digests, never prompt or output
text or token ids.
"""

from __future__ import annotations

import argparse
import contextvars
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

TRACE_HEADERS = ("traceparent", "tracestate")
MAX_TRACE_HEADER_LEN = 512      # W3C: traceparent is 55 chars; tracestate at most 512
DETAIL_CHOICES = ("all", "model", "worker")
GRPC, HTTP = "grpc", "http/protobuf"
PROTOCOL_ENV = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")

TraceHeaders = dict[str, str]   # {"traceparent": ..., "tracestate": ...} (W3C)


class Attr:
    """Span attribute names: vLLM's (`gen_ai.*`) where vLLM has one, else `kvloop.*`."""

    REQUEST_ID = "gen_ai.request.id"
    MAX_TOKENS = "gen_ai.request.max_tokens"
    TEMPERATURE = "gen_ai.request.temperature"
    TOP_P = "gen_ai.request.top_p"
    N = "gen_ai.request.n"
    PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    CACHED_TOKENS = "gen_ai.usage.cached_tokens"
    TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    TTFT = "gen_ai.latency.time_to_first_token"
    E2E = "gen_ai.latency.e2e"
    PREFILL = "gen_ai.latency.time_in_model_prefill"
    DECODE = "gen_ai.latency.time_in_model_decode"


def add_tracing_args(p: argparse.ArgumentParser | Any) -> None:
    """The two tracing flags, on `serve`, `router` and `fleet`."""
    g = p.add_argument_group("tracing (docs/tracing.md)")
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send OpenTelemetry traces to this OTLP endpoint (gRPC; "
                        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf for HTTP); needs "
                        "the `tracing` extra")
    g.add_argument("--collect-detailed-traces", default=None, metavar="all|model|worker",
                   help="also trace every engine step of a request (prefill chunks, decode); "
                        "comma-separated; needs --otlp-traces-endpoint")


@dataclass(frozen=True)
class TracingConfig:
    """Where spans go (None: tracing off) and which detailed spans are collected."""

    endpoint: str | None = None
    detailed: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        bad = [d for d in self.detailed if d not in DETAIL_CHOICES]
        if bad:
            raise ValueError(f"--collect-detailed-traces: {bad[0]!r} is not one of "
                             f"{', '.join(DETAIL_CHOICES)}")
        if self.detailed and self.endpoint is None:
            raise ValueError("--collect-detailed-traces needs --otlp-traces-endpoint")

    @property
    def steps(self) -> bool:
        """Whether each engine step of a request gets its own span."""
        return bool(self.detailed)

    def to_args(self) -> list[str]:
        """The flags that give a child process (a fleet's worker) this config."""
        out = [] if self.endpoint is None else ["--otlp-traces-endpoint", self.endpoint]
        return out + (["--collect-detailed-traces", ",".join(self.detailed)]
                      if self.detailed else [])


def tracing_config(args: argparse.Namespace) -> TracingConfig:
    detailed = args.collect_detailed_traces or ""
    return TracingConfig(args.otlp_traces_endpoint,
                         tuple(d.strip() for d in detailed.split(",") if d.strip()))


def trace_headers(headers: Mapping[str, str] | None) -> TraceHeaders | None:
    """The W3C trace headers of `headers` (lower-case names), length-bounded; None: none."""
    if not headers:
        return None
    out = {k: v for k in TRACE_HEADERS
           if isinstance(v := headers.get(k), str) and len(v) <= MAX_TRACE_HEADER_LEN}
    return out if "traceparent" in out else None


def epoch_ns(monotonic_s: float) -> int:
    """A `time.monotonic()` reading of this host as Unix-epoch nanoseconds (span times)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class Span:
    """One open span: set attributes, hand its context on (`headers`), end it once."""

    def __init__(self, otel_span: Any, propagator: Any):
        self._span = otel_span
        self._propagator = propagator

    def set(self, attributes: Mapping[str, Any]) -> None:
        self._span.set_attributes({k: v for k, v in attributes.items() if v is not None})

    def error(self, description: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self._span.set_status(Status(StatusCode.ERROR, description))

    @property
    def headers(self) -> TraceHeaders:
        """This span's W3C context, as the headers a child in another process continues."""
        from opentelemetry.trace import set_span_in_context

        carrier: TraceHeaders = {}
        self._propagator.inject(carrier, context=set_span_in_context(self._span))
        return carrier

    @property
    def trace_id(self) -> str:
        return f"{self._span.get_span_context().trace_id:032x}"

    def end(self, end_ns: int | None = None) -> None:
        self._span.end(end_time=end_ns)


Parent = Span | Mapping[str, str] | None   # a span of this process, W3C headers, or a root


class Tracer:
    """One process's tracer: an SDK `TracerProvider` with a batching OTLP exporter.

    Built only when `--otlp-traces-endpoint` is given (`make_tracer`); its constructor is
    the only place the OpenTelemetry SDK is imported."""

    def __init__(self, config: TracingConfig, service_name: str):
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        assert config.endpoint is not None
        self.config = config
        attrs: dict[str, Any] = {"process.pid": os.getpid()}
        if not os.environ.get("OTEL_SERVICE_NAME"):
            attrs[SERVICE_NAME] = service_name
        self._provider = TracerProvider(resource=Resource.create(attrs))
        self._provider.add_span_processor(BatchSpanProcessor(_exporter(config.endpoint)))
        self._tracer = self._provider.get_tracer("kvloop")
        self._propagator = TraceContextTextMapPropagator()

    def start(self, name: str, parent: Parent = None,
              attributes: Mapping[str, Any] | None = None, start_ns: int | None = None,
              kind: str = "INTERNAL") -> Span:
        """Start a span under `parent` (kind: INTERNAL, SERVER or CLIENT)."""
        from opentelemetry.trace import SpanKind, set_span_in_context

        if isinstance(parent, Span):
            ctx = set_span_in_context(parent._span)
        else:
            ctx = self._propagator.extract(dict(parent or {}))
        span = self._tracer.start_span(
            name, context=ctx, kind=SpanKind[kind], start_time=start_ns,
            attributes={k: v for k, v in (attributes or {}).items() if v is not None})
        return Span(span, self._propagator)

    def record(self, name: str, parent: Parent, start_ns: int, end_ns: int,
               attributes: Mapping[str, Any] | None = None) -> Span:
        """A span whose times are known already (engine timestamps)."""
        span = self.start(name, parent, attributes, start_ns)
        span.end(max(end_ns, start_ns))
        return span

    def flush(self, timeout_ms: int = 5000) -> None:
        self._provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        self._provider.shutdown()


S = TypeVar("S")   # a front's per-request trace state


class PostSpanMiddleware(Generic[S]):
    """ASGI middleware: a SERVER span named `{name} POST {path}` around every POST,
    continuing the request's `traceparent`, its status code set when the answer starts. A
    front subclasses it with `name`, `current` (the context variable its hooks read) and
    `opened(span, start_ns)` / `closed(state)` (the per-request state kept there while the
    request runs, and how it ends)."""

    name = ""
    current: contextvars.ContextVar[S | None]

    def __init__(self, app: Any, tracer: Tracer):
        self.app = app
        self.tracer = tracer

    def opened(self, span: Span, start_ns: int) -> S:
        raise NotImplementedError

    def closed(self, state: S) -> None:
        raise NotImplementedError

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", ())}
        start_ns = time.time_ns()
        span = self.tracer.start(f"{self.name} POST {scope['path']}", trace_headers(headers),
                                 {"http.request.method": "POST", "url.path": scope["path"]},
                                 start_ns, kind="SERVER")
        state = self.opened(span, start_ns)
        token = self.current.set(state)

        async def traced_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                span.set({"http.response.status_code": message["status"]})
            await send(message)

        try:
            await self.app(scope, receive, traced_send)
        finally:
            self.current.reset(token)
            self.closed(state)


def make_tracer(config: TracingConfig | None, service_name: str) -> Tracer | None:
    """The process's tracer, or None when tracing is off (no OpenTelemetry import)."""
    if config is None or config.endpoint is None:
        return None
    try:
        return Tracer(config, service_name)
    except ImportError as e:
        raise ValueError(f"--otlp-traces-endpoint needs OpenTelemetry: pip install "
                         f"'kvloop[tracing]' ({e})") from None


def protocol() -> str:
    """The OTLP protocol for traces: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else
    OTEL_EXPORTER_OTLP_PROTOCOL, else gRPC."""
    value = next((os.environ[k] for k in PROTOCOL_ENV if os.environ.get(k)), GRPC)
    if value not in (GRPC, HTTP):
        raise ValueError(f"OTLP traces protocol {value!r}: kvloop supports {GRPC} and {HTTP}")
    return value


def _exporter(endpoint: str) -> Any:
    """The OTLP span exporter for `endpoint`: over HTTP a URL without a path gets the
    standard /v1/traces."""
    if protocol() == HTTP:
        from urllib.parse import urlsplit

        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        if urlsplit(endpoint).path in ("", "/"):
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        return OTLPSpanExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter as GrpcSpanExporter,
    )

    return GrpcSpanExporter(endpoint=endpoint)
