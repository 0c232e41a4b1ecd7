"""OpenTelemetry traces (docs/tracing.md) at real OTLP receivers started here: one request
through a router and a prefill and a decode worker (`kvloop serve --model sim`) gives one
trace, continuing the client's `traceparent`, with spans from all five processes (router,
two API servers, two engine cores), every parent link inside the trace, and the decision's
and the transfer's attributes equal to what /metrics and the response report (gRPC); the
HTTP/protobuf form carries a one-worker trace the same way."""

from __future__ import annotations

import os
import random
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import replace

import httpx
import pytest

from kvloop.front.prometheus_text import metric_value
from kvloop.router.pd import ALWAYS
from kvloop.router.registry import WorkerSpec
from kvloop.sampling_params import SamplingParams
from kvloop.tracing import TracingConfig, trace_headers

from .conftest import RouterThread, serving
from .otlp_receiver import ReceivedSpan, grpc_receiver, http_receiver
from .test_router_fleet import random_ids
from .test_router_pd_fleet import pd_fleet, pd_router
from .test_tiers_engine import host_rig  # noqa: F401 (a fixture)

FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}   # ms between batch exports (SDK default 5 s)


def _client_context() -> tuple[str, str, dict[str, str]]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, {"traceparent": f"00-{trace_id}-{span_id}-01"}


def _named(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]


def _check_links(spans: list[ReceivedSpan], client_span: str) -> None:
    """Every span's parent is in the trace, except the router's root, whose parent is the
    client's span."""
    ids = {s.span_id for s in spans}
    roots = [s for s in spans if s.parent_id not in ids]
    assert [(s.name, s.parent_id) for s in roots] == [("router POST /v1/completions",
                                                       client_span)]


@pytest.mark.processes
def test_one_request_through_router_p_and_d_is_one_trace_from_every_process(monkeypatch):
    for k, v in FAST_EXPORT.items():
        monkeypatch.setenv(k, v)
    with grpc_receiver() as (endpoint, received):
        fleet = pd_fleet(1, 1, "--otlp-traces-endpoint", endpoint,
                         "--collect-detailed-traces", "all")
        try:
            p, d = fleet.specs()
            cfg = replace(pd_router(ALWAYS), tracing=TracingConfig(endpoint))
            with RouterThread(cfg, [WorkerSpec(p.url, "prefill"),
                                    WorkerSpec(d.url, "decode")]) as rt:
                trace_id, client_span, headers = _client_context()
                r = httpx.post(rt.url + "/v1/completions", headers=headers, timeout=60, json={
                    "prompt": random_ids(random.Random(7), 100), "max_tokens": 4,
                    "ignore_eos": True})
                assert r.status_code == 200, r.text
                router_metrics = httpx.get(rt.url + "/metrics").text
                d_metrics = httpx.get(d.url + "/metrics").text
                expected = {"router POST /v1/completions", "router.admission", "router.route",
                            "router.proxy", "api_server POST /v1/completions",
                            "api_server.preprocess", "llm_request", "engine_core.queue",
                            "engine_core.kv_load", "engine_core.prefill",
                            "engine_core.prefill_chunk", "engine_core.decode",
                            "engine_core.decode_step", "kv_transfer.send"}
                spans = received.wait_for(lambda got: expected <= {
                    s.name for s in got if s.trace_id == trace_id} and len(
                    _named([s for s in got if s.trace_id == trace_id], "llm_request")) == 2
                    and len(_named([s for s in got if s.trace_id == trace_id],
                                   "engine_core.decode")) == 2, timeout=60)
        finally:
            fleet.stop()
    spans = [s for s in spans if s.trace_id == trace_id]
    _check_links(spans, client_span)
    by_id = {s.span_id: s for s in spans}
    services = {(s.service, s.pid) for s in spans}
    assert {svc for svc, _ in services} == {"kvloop-router", "kvloop-api-server",
                                            "kvloop-engine-core"}
    assert len(services) == 5 and len({pid for _, pid in services}) == 5

    route, = _named(spans, "router.route")
    a = route.attributes
    assert a["kvloop.pd.remote_prefill"] is True and a["kvloop.pd.reason"] == ALWAYS
    p_name, d_name = WorkerSpec(p.url, "prefill").name, WorkerSpec(d.url, "decode").name
    assert a["kvloop.route.worker"] == d_name and a["kvloop.pd.prefill.worker"] == p_name
    assert a["kvloop.pd.prefill.candidates"] == [p_name]
    assert len(a["kvloop.pd.prefill.costs_tokens"]) == 1
    for prefix, name in (("kvloop.route.", d_name), ("kvloop.pd.prefill.", p_name)):
        assert a[prefix + "predicted_cached_tokens"] == metric_value(
            router_metrics, "kvloop_router_predicted_hit_tokens_total", worker=name)
    admission, = _named(spans, "router.admission")
    assert admission.attributes["kvloop.flow.band"] == 0
    assert len(admission.attributes["kvloop.flow.tenant_digest"]) == 16

    # the proxy legs: P's and D's API-server spans are children of the router's legs
    legs = {s.attributes["kvloop.leg"]: s for s in _named(spans, "router.proxy")}
    assert set(legs) == {"prefill", "decode"}
    http_spans = _named(spans, "api_server POST /v1/completions")
    assert sorted(by_id[s.parent_id].attributes["kvloop.leg"] for s in http_spans) == [
        "decode", "prefill"]
    # the engine cores' spans hang under their own API server's llm_request
    for s in spans:
        if s.service == "kvloop-engine-core":
            parent = by_id[s.parent_id]
            assert parent.name == "llm_request" and parent.pid != s.pid

    usage = r.json()["usage"]
    d_req, = [s for s in _named(spans, "llm_request")
              if by_id[by_id[s.parent_id].parent_id].attributes["kvloop.leg"] == "decode"]
    assert d_req.attributes["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 4
    assert d_req.attributes["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"] == 100
    assert d_req.attributes["gen_ai.usage.cached_tokens"] == metric_value(
        router_metrics, "kvloop_router_actual_hit_tokens_total", worker=d_name)
    load, = _named(spans, "engine_core.kv_load")
    assert load.attributes["kvloop.kv_transfer.ok"] is True
    assert load.attributes["kvloop.kv_transfer.transport"] in ("tcp", "shm")
    assert load.attributes["kvloop.kv_transfer.bytes"] == metric_value(
        d_metrics, "kvloop:kv_transfer_bytes_total", side="recv") > 0
    assert load.attributes["kvloop.external_tokens"] == usage["prompt_tokens"]   # from P
    # P's side channel served D's Read under D's llm_request (the context came in the Read)
    send, = _named(spans, "kv_transfer.send")
    assert by_id[send.parent_id] is d_req and send.service == "kvloop-engine-core"
    assert send.pid != load.pid and send.pid != d_req.pid
    assert send.attributes["kvloop.kv_transfer.bytes"] == load.attributes[
        "kvloop.kv_transfer.bytes"]
    assert send.attributes["kvloop.kv_transfer.transport"] == load.attributes[
        "kvloop.kv_transfer.transport"]
    decode_steps = [s for s in _named(spans, "engine_core.decode_step")
                    if by_id[s.parent_id] is d_req]
    assert len(decode_steps) == 3   # 4 tokens: the first from the prefill step
    no_text = str([s.attributes for s in spans])
    assert "prompt" not in no_text.replace("prompt_tokens", "")


@pytest.mark.processes
def test_http_protobuf_receiver_gets_a_one_worker_trace(tmp_path_factory, monkeypatch):
    env = {**FAST_EXPORT, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
           "OTEL_SERVICE_NAME": "custom-name"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with http_receiver() as (endpoint, received):
        with serving(tmp_path_factory, "traced", ["--model", "sim", "--otlp-traces-endpoint",
                                                 endpoint], env=env) as srv:
            cfg = replace(pd_router(), tracing=TracingConfig(endpoint))
            with RouterThread(cfg, [WorkerSpec(srv.url)]) as rt:
                trace_id, client_span, headers = _client_context()
                r = httpx.post(rt.url + "/v1/completions", headers=headers, timeout=60,
                               json={"prompt": "hello there", "max_tokens": 3,
                                     "ignore_eos": True})
                assert r.status_code == 200, r.text
                expected = {"router POST /v1/completions", "router.route", "router.proxy",
                            "api_server POST /v1/completions", "llm_request",
                            "engine_core.queue", "engine_core.prefill",
                            "engine_core.decode"}
                spans = received.wait_for(lambda got: expected <= {
                    s.name for s in got if s.trace_id == trace_id}, timeout=60)
    spans = [s for s in spans if s.trace_id == trace_id]
    _check_links(spans, client_span)
    assert {s.service for s in spans} == {"custom-name"}   # OTEL_SERVICE_NAME honoured
    assert len({s.pid for s in spans}) == 3
    # no detailed traces without --collect-detailed-traces
    assert not _named(spans, "engine_core.decode_step")
    assert "hello" not in str([s.attributes for s in spans])


def test_trace_headers_are_checked_and_bounded():
    good = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    assert trace_headers({"traceparent": good, "x": "y"}) == {"traceparent": good}
    assert trace_headers({"tracestate": "k=v"}) is None
    assert trace_headers({"traceparent": "x" * 600}) is None
    with pytest.raises(ValueError, match="needs --otlp-traces-endpoint"):
        TracingConfig(None, ("all",))
    with pytest.raises(ValueError, match="not one of"):
        TracingConfig("http://x", ("everything",))


@pytest.mark.processes
def test_tracing_off_imports_no_opentelemetry():
    """With the flag off, no process of kvloop loads the OpenTelemetry SDK, an exporter or
    grpc (FastAPI itself imports the light opentelemetry API package: not ours)."""
    code = ("import sys; from kvloop.server import api, client; from kvloop.router import "
            "proxy; import kvloop.engine.proc; from kvloop.tracing import make_tracer, "
            "TracingConfig; assert make_tracer(TracingConfig(), 'x') is None; "
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', "
            "'opentelemetry.exporter', 'opentelemetry.proto', 'grpc'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_tier_load_is_a_kv_load_span_of_the_engine(host_rig):  # noqa: F811
    """In process: a prefix evicted to the host tier comes back through
    WAITING_FOR_REMOTE_KVS; the engine's spans show its queue, the tier load (16 tokens,
    as the output reports), prefill, decode and each step, under the request's context."""
    from kvloop.engine.spans import EngineSpans
    from kvloop.tracing import Tracer
    from kvloop.wire import EngineCoreRequest

    from .test_tiers_engine import A, B

    rig = host_rig
    rig.run("a1", A)
    rig.run("b", B)                                  # A leaves the pool for the host tier
    with grpc_receiver() as (endpoint, received):
        tracer = Tracer(TracingConfig(endpoint, ("all",)), "kvloop-engine-core")
        spans = EngineSpans(tracer)
        trace_id, parent, headers = _client_context()
        sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        rig.engine.add_request(rig.engine.make_request("a2", A, sp))
        spans.on_add(EngineCoreRequest("a2", A, sp, trace_headers=headers))
        outs = []
        for _ in range(2000):
            if outs and outs[-1].finished:
                break
            t0 = time.monotonic()
            result = rig.engine.step()
            spans.on_step(rig.engine, result, t0, time.monotonic())
            outs += [o for o in result.outputs if o.request_id == "a2"]
            rig.engine.wait_for_work(0.01)
        tracer.flush()
        expected = sorted(["engine_core.queue", "engine_core.kv_load", "engine_core.prefill",
                           "engine_core.prefill_chunk", "engine_core.decode",
                           "engine_core.decode_step", "engine_core.decode_step"])
        # all of them: a loaded run's exporter sends them in several batches, in any order
        got = received.wait_for(lambda s: len(s) >= len(expected), timeout=30)
        tracer.shutdown()
    assert outs[0].num_external_computed_tokens == 16
    assert {s.trace_id for s in got} == {trace_id} and {s.parent_id for s in got} == {parent}
    assert sorted(s.name for s in got) == expected
    load, = _named(got, "engine_core.kv_load")
    assert load.attributes == {"kvloop.external_tokens": 16}   # a tier: no P/D pull figures
    prefill, = _named(got, "engine_core.prefill")
    assert prefill.attributes["gen_ai.usage.cached_tokens"] == outs[0].num_cached_tokens == 16
    assert prefill.attributes["kvloop.external_cached_tokens"] == 16
    assert load.end_ns <= prefill.end_ns


def test_fleet_passes_the_tracing_flags_to_its_workers_as_serve_reads_them():
    from kvloop.cli import build_parser
    from kvloop.tracing import tracing_config

    cfg = TracingConfig("http://127.0.0.1:4317", ("model", "worker"))
    args = build_parser().parse_args(["serve", "--model", "sim", *cfg.to_args()])
    assert tracing_config(args) == cfg
    fleet = build_parser().parse_args(["fleet", *cfg.to_args()])
    assert tracing_config(fleet) == cfg
    assert TracingConfig().to_args() == []


def _resumed_on(spans: list[ReceivedSpan], trace_id: str, worker: str) -> bool:
    """The trace has its migration span and `worker`'s API-server span under its leg."""
    mine = {s.span_id: s for s in spans if s.trace_id == trace_id}
    return any(s.name == "router.migrate" for s in mine.values()) and any(
        s.name == "api_server POST /v1/completions" and s.parent_id in mine
        and mine[s.parent_id].attributes.get("kvloop.worker") == worker
        for s in mine.values())


@pytest.mark.processes
def test_a_migrated_stream_stays_one_trace_naming_both_workers(monkeypatch):
    """kill -9 of the worker streaming a request (--migration-limit 1): the stream goes on
    elsewhere in the same trace; `router.migrate` names both workers, a proxy leg goes to
    each, and the new worker's API server continues the trace under its leg."""
    from kvloop.router.fleet import Fleet, FleetConfig

    from .test_router_fleet import SIM_ARGS, router_config

    for k, v in FAST_EXPORT.items():
        monkeypatch.setenv(k, v)
    with grpc_receiver() as (endpoint, received):
        fleet = Fleet(FleetConfig(2, "sim", ("both",), (*SIM_ARGS, "--sim-speedup", "4",
                                                         "--otlp-traces-endpoint", endpoint),
                                  start_timeout_s=120, stop_timeout_s=10, echo_output=False))
        try:
            fleet.start()
            cfg = replace(router_config(), migration_limit=1, tracing=TracingConfig(endpoint))
            with RouterThread(cfg, fleet.specs()) as rt:
                trace_id, client_span, headers = _client_context()
                victim, events = None, []
                with httpx.stream("POST", rt.url + "/v1/completions", headers=headers,
                                  timeout=60, json={"prompt": "Once upon a time",
                                                    "max_tokens": 60, "ignore_eos": True,
                                                    "stream": True}) as r:
                    for line in r.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        events.append(line)
                        if len(events) == 3:
                            victim = next(w for w in rt.router.registry.all() if w.in_flight())
                            proc = next(p for p in fleet.workers if p.url == victim.spec.url)
                            os.kill(proc.pid, signal.SIGKILL)
                assert victim is not None and events[-1] == "data: [DONE]"
                assert not any('"error"' in e for e in events)
                other = next(w.name for w in rt.router.registry.all()
                             if w.name != victim.name)
                spans = received.wait_for(lambda got: _resumed_on(got, trace_id, other),
                                          timeout=60)
        finally:
            fleet.stop()
    spans = [s for s in spans if s.trace_id == trace_id]
    by_id = {s.span_id: s for s in spans}
    move, = _named(spans, "router.migrate")
    assert (move.attributes["kvloop.migration.from"], move.attributes["kvloop.migration.to"],
            move.attributes["kvloop.migration.move"]) == (victim.name, other, 1)
    assert sorted(s.attributes["kvloop.worker"] for s in _named(spans, "router.proxy")) == \
        sorted([victim.name, other])
    resumed = [s for s in _named(spans, "api_server POST /v1/completions")
               if by_id[s.parent_id].attributes["kvloop.worker"] == other]
    assert len(resumed) == 1
