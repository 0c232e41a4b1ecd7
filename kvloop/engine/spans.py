"""The engine core's spans of one request (docs/tracing.md), children of the API server's
`llm_request` span whose W3C context came with the request (`EngineCoreRequest.trace_headers`).

    engine_core.queue          arrival -> first admission (queue time, local prefix hit)
    engine_core.kv_load        waiting for its KV from outside the pool: a tier or P (tokens;
                               for a P/D pull also bytes, transport, ms: `on_transfer`)
    engine_core.prefill        first admission -> first token (cached and external tokens)
    engine_core.prefill_chunk  each step that computed part of its prompt (detailed traces)
    engine_core.decode         first token -> finished (output tokens)
    engine_core.decode_step    each decode step (detailed traces)

Owner: `EngineSpans` is called by the engine process's busy loop only (after `add_request`
and after each step) and by the connector's `on_transfer` from that same loop; it reads the
scheduler's requests and mutates nothing of the engine. Requests without trace headers (no
tracer in the API server) are never tracked.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvloop.core.engine import EngineCore, StepResult
from kvloop.core.request import RequestStatus
from kvloop.tracing import (
    Attr,
    TraceHeaders,
    Tracer,
    TracingConfig,
    epoch_ns,
    make_tracer,
    trace_headers,
)
from kvloop.wire import EngineCoreRequest


@dataclass
class _Live:
    parent: TraceHeaders
    arrival: float
    admitted: float | None = None
    first_token: float | None = None
    load_started: float | None = None
    transfer: dict[str, Any] = field(default_factory=dict)
    prefill_steps: int = 0
    decode_steps: int = 0


class EngineSpans:
    """Per-request spans of one engine core (module docstring)."""

    def __init__(self, tracer: Tracer):
        self.tracer = tracer
        self.detailed = tracer.config.steps
        self._live: dict[str, _Live] = {}

    def on_add(self, msg: EngineCoreRequest) -> None:
        if msg.trace_headers:
            self._live[msg.request_id] = _Live(msg.trace_headers, time.monotonic())

    def on_transfer(self, request_id: str, attributes: dict[str, Any]) -> None:
        """The P/D connector finished a pull for `request_id` (bytes, transport, ms)."""
        live = self._live.get(request_id)
        if live is not None:
            live.transfer = attributes

    def on_read(self, read: Any, nbytes: int, t0: float, t1: float) -> None:
        """P's side channel served a Read (its own thread): a span of D's request's trace,
        if the Read carries a valid context (a peer's field: checked, bounded)."""
        parent = trace_headers(read.trace_headers)
        if parent is None:
            return
        self.tracer.record("kv_transfer.send", parent, epoch_ns(t0), epoch_ns(t1), {
            "kvloop.kv_transfer.bytes": nbytes, "kvloop.kv_transfer.transport": read.transport,
            "kvloop.kv_transfer.ms": round((t1 - t0) * 1000, 3),
            "kvloop.kv_transfer.blocks": len(read.block_ids)})

    def on_step(self, engine: EngineCore, result: StepResult, t0: float, t1: float) -> None:
        """One step ran from `t0` to `t1` (monotonic seconds)."""
        if not self._live:
            return
        for a in result.admissions:
            live = self._live.get(a.request_id)
            if live is not None and live.admitted is None:
                live.admitted = t0
                self._span("engine_core.queue", live, live.arrival, t0, {
                    Attr.TIME_IN_QUEUE: t0 - live.arrival,
                    "kvloop.prefix_hit_tokens": a.prefix_hit_tokens})
        out = result.scheduler_output
        scheduled = out.num_scheduled_tokens if out is not None else {}
        if self.detailed:
            self._steps(scheduled, result, t0, t1)
        for o in result.outputs:
            live = self._live.get(o.request_id)
            if live is None:
                continue
            if o.new_token_ids and live.first_token is None:
                self._first_token(live, o.num_cached_tokens, o.num_external_computed_tokens, t1)
            if o.finished:
                self._finished(o.request_id, o.finish_reason, t1)
        self._loads_and_aborts(engine, t1)

    def _steps(self, scheduled: dict[str, int], result: StepResult, t0: float,
               t1: float) -> None:
        step = result.stats.step_index if result.stats is not None else None
        for rid, n in scheduled.items():
            live = self._live.get(rid)
            if live is None:
                continue
            if live.first_token is None:
                live.prefill_steps += 1
                name = "engine_core.prefill_chunk"
            else:
                live.decode_steps += 1
                name = "engine_core.decode_step"
            self._span(name, live, t0, t1, {"kvloop.step_index": step,
                                            "kvloop.scheduled_tokens": n})

    def _first_token(self, live: _Live, cached: int, external: int, t: float) -> None:
        live.first_token = t
        start = live.admitted if live.admitted is not None else live.arrival
        self._span("engine_core.prefill", live, start, t, {
            Attr.PREFILL: t - start, Attr.CACHED_TOKENS: cached,
            "kvloop.external_cached_tokens": external,
            "kvloop.prefill_steps": live.prefill_steps if self.detailed else None})

    def _finished(self, request_id: str, reason: str | None, t: float) -> None:
        live = self._live.pop(request_id)
        if live.first_token is not None:
            self._span("engine_core.decode", live, live.first_token, t, {
                Attr.DECODE: t - live.first_token, "kvloop.finish_reason": reason,
                "kvloop.decode_steps": live.decode_steps if self.detailed else None})

    def _loads_and_aborts(self, engine: EngineCore, t: float) -> None:
        """A tracked request that started or ended a wait for outside KV, or that is gone
        (aborted: no output tells)."""
        requests = engine.scheduler.requests
        for rid in list(self._live):
            live = self._live[rid]
            req = requests.get(rid)
            if req is None:
                del self._live[rid]
                continue
            loading = req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            if loading and live.load_started is None:
                live.load_started = t
            elif not loading and live.load_started is not None:
                self._span("engine_core.kv_load", live, live.load_started, t, {
                    "kvloop.external_tokens": req.num_external_computed_tokens,
                    **live.transfer})
                live.load_started = None

    def _span(self, name: str, live: _Live, start: float, end: float,
              attributes: dict[str, Any]) -> None:
        self.tracer.record(name, live.parent, epoch_ns(start), epoch_ns(end), attributes)


def make_engine_spans(config: TracingConfig | None, connector: Any) -> EngineSpans | None:
    """The engine's spans when tracing is on (None: off, nothing imported); a P/D
    connector reports each pull's bytes, transport and time to them."""
    tracer = make_tracer(config, "kvloop-engine-core")
    if tracer is None:
        return None
    spans = EngineSpans(tracer)
    for c in getattr(connector, "connectors", [connector]):   # a MultiConnector's, or it
        if hasattr(c, "on_transfer"):
            c.on_transfer = spans.on_transfer
        server = getattr(c, "server", None)   # P's side channel
        if server is not None:
            server.on_read = spans.on_read
    return spans
