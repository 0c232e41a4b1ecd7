"""Real OTLP trace receivers for tests: the gRPC `TraceService` of opentelemetry-proto served
by grpcio, and the HTTP/protobuf form (`POST /v1/traces`) on a stdlib HTTP server. Both
decode every `ExportTraceServiceRequest` into `ReceivedSpan`s."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_id: str          # "" for a root
    service: str
    pid: int
    attributes: dict[str, Any]
    start_ns: int
    end_ns: int


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Received:
    """Every span received so far (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.spans: list[ReceivedSpan] = []
        self.exports = 0

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        out = []
        for rs in request.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    out.append(ReceivedSpan(
                        s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                        res.get("service.name", ""), int(res.get("process.pid", 0)),
                        {a.key: _value(a.value) for a in s.attributes},
                        s.start_time_unix_nano, s.end_time_unix_nano))
        with self._lock:
            self.spans.extend(out)
            self.exports += 1

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, pred: Callable[[list[ReceivedSpan]], bool], timeout: float = 30.0
                 ) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = list(self.spans)
            if pred(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"spans never satisfied the condition: "
                                     f"{sorted((s.service, s.name) for s in spans)}")
            time.sleep(0.1)


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, received: Received):
        self.received = received

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 (the proto's name)
        self.received.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@contextmanager
def grpc_receiver() -> Iterator[tuple[str, Received]]:
    """An OTLP/gRPC receiver on 127.0.0.1: (its endpoint URL, what it received)."""
    import grpc

    received = Received()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(received), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}", received
    finally:
        server.stop(grace=None)


@contextmanager
def http_receiver() -> Iterator[tuple[str, Received]]:
    """An OTLP/HTTP (protobuf) receiver on 127.0.0.1: (its base URL, what it received)."""
    received = Received()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            ok = (self.path == "/v1/traces"
                  and self.headers.get("content-type") == "application/x-protobuf")
            if ok:
                received.add(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200 if ok else 400)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
