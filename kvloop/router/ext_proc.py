"""The router behind Envoy: the Gateway API Inference Extension's endpoint picker over Envoy's
external processing service (`envoy.service.ext_proc.v3.ExternalProcessor`).

One gRPC stream per HTTP request, in the standard processing mode (request headers SEND,
request body BUFFERED, response headers SEND, response body STREAMED; the bootstrap is
`kvloop.router.envoy_config`):

    request headers   kept (path, keys, fairness/objective, session); the subset hint read
                      from metadata `envoy.lb.subset_hint` / `x-gateway-destination-endpoint-
                      subset`; answered at once (a body follows), or, without a body, picked
    request body      read as the worker will (400 in the route's own shape otherwise),
                      tokenized; flow control (`kvloop.router.flow`: a sheddable request of a
                      saturated fleet -> 429, a full queue or its timeout -> 503); the pick
                      (the router's decision, `pick_worker`): header
                      `x-gateway-destination-endpoint: ip:port` and dynamic metadata
                      `envoy.lb` / `x-gateway-destination-endpoint` = the pick, then its
                      fallbacks (`ip:port,ip:port,...`); no usable worker -> 503. A stream
                      that did not ask for usage gets `stream_options.include_usage` added
                      (the reported hit), and that usage chunk is cut from its answer again
    response headers  the endpoint that served (`envoy.lb` / `...-served` metadata, else the
                      `x-gateway-destination-endpoint-served` header the bootstrap adds, which
                      the client never sees, else the pick); a draining worker's 503 marks it
                      draining
    response body     each chunk read for the first token and the reported cached tokens;
                      the last one closes the ticket (predicted vs reported: the self-check)

Every stream closes its ticket and its flow-control permit however it ends (the client left:
Envoy ends the stream). The router's keys (`--api-key`) are checked here as its HTTP front
checks them; the router's worker key and fleet token are set on the request to the worker.
The gRPC health service answers `liveness` (always), `readiness` and the ExternalProcessor's
own name (a usable worker is registered), and "" (both).

Not yet through Envoy: prefill/decode disaggregation (a P/D fleet is routed aggregated: the
decode worker prefills locally), stream migration, and `/v1/responses` affinity (routed by
load). See docs/gateway.md.

Owner: `PickerServer` owns the gRPC server, on the router's event loop; each `Exchange`
owns one request's permit, ticket and SSE reader.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import logging
import socket
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from starlette.responses import Response

from kvloop.front.anthropic import MESSAGES_PATH
from kvloop.front.auth import Caller, presented_authorization
from kvloop.front.drain import refused_by_drain
from kvloop.front.openai import MaxTokens, error_body
from kvloop.router.bodies import read_body
from kvloop.router.envoy_config import (
    DESTINATION_HEADER,
    LB_NAMESPACE,
    SERVED_HEADER,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
)
from kvloop.router.flow import Permit, Rejection, rejection_response
from kvloop.router.proxy import RouterApp
from kvloop.router.relay import cached_tokens, json_or_none
from kvloop.router.request import routing_request
from kvloop.router.router import NoWorkerError, Routed
from kvloop.router.sse import SseRelay

log = logging.getLogger("kvloop.router")

PICKER_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "liveness", "readiness", PICKER_SERVICE)
ROUTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", MESSAGES_PATH})
MAX_FALLBACKS = 2            # endpoints after the pick in the metadata's list
MAX_ANSWER_BYTES = 8 << 20   # of a non-streamed answer read for its usage (then: not read)
_ROUTER_KEYS = (Caller.API, Caller.ADMIN)


async def pick_worker(app: RouterApp, path: str, body: Mapping[str, Any],
                      headers: Mapping[str, str], tokens: Sequence[int],
                      exclude: Sequence[str]) -> Routed:
    """The router's decision for one request seen by Envoy: the one adapter between the
    picker and the router's routing code. The same `RoutingRequest` as the HTTP proxy builds,
    decided by the aggregated profile (`Router.pick_one`: Envoy carries one leg, so no P/D)
    through the proxy's one decision path. Raises NoWorkerError."""
    output_tokens = MaxTokens.of_body(path, body).tokens(None) if path in ROUTED_PATHS else 0
    rr = routing_request(app.router, path, body, headers, tokens, exclude=exclude,
                         output_tokens=output_tokens)
    return await app.single.decide(app.router.pick_one, rr)


@functools.lru_cache(maxsize=1024)
def endpoint_of(name: str) -> str:
    """A worker's `host:port` as the `ip:port` Envoy's clusters need (a name resolved once)."""
    host, _, port = name.rpartition(":")
    bare = host.strip("[]")
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        ip = ipaddress.ip_address(socket.getaddrinfo(bare, int(port), type=socket.SOCK_STREAM)
                                  [0][4][0])
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def fallbacks(app: RouterApp, routed: Routed, exclude: Sequence[str]) -> list[str]:
    """The workers to try after the pick, least loaded first (the metadata list's tail)."""
    others = [w for w in app.router.serving_pool(exclude) if w.name != routed.worker.name]
    others.sort(key=lambda w: (w.in_flight(), w.load.waiting, w.name))
    return [w.name for w in others[:MAX_FALLBACKS]]


def _headers(m: base_pb2.HeaderMap) -> dict[str, str]:
    """Envoy's header map as lower-case name -> value (the last of repeated names)."""
    return {h.key.lower(): (h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value)
            for h in m.headers}


def _subset(md: base_pb2.Metadata) -> frozenset[str] | None:
    """The proxy's subset hint (ip:port endpoints), or None when it gave none."""
    if SUBSET_NAMESPACE not in md.filter_metadata:
        return None
    value = md.filter_metadata[SUBSET_NAMESPACE].fields.get(SUBSET_KEY)
    if value is None:
        return None
    items = (value.list_value.values if value.HasField("list_value") else [value])
    return frozenset(part.strip() for v in items for part in v.string_value.split(",")
                     if part.strip())


def _served(md: base_pb2.Metadata) -> str | None:
    lb = md.filter_metadata.get(LB_NAMESPACE) if LB_NAMESPACE in md.filter_metadata else None
    value = lb.fields.get(SERVED_HEADER) if lb is not None else None
    return value.string_value or None if value is not None else None


def _set(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def immediate(status: int, body: bytes, headers: Mapping[str, str] | None = None
              ) -> pb.ProcessingResponse:
    """Envoy answers the client at once with this, never reaching a worker."""
    mutation = pb.HeaderMutation(set_headers=[_set(k, v) for k, v in
                                              {"content-type": "application/json",
                                               **(headers or {})}.items()])
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), headers=mutation, body=body))


def immediate_of(r: Response) -> pb.ProcessingResponse:
    """A Starlette answer (the router's JSON error in the route's own shape) as Envoy's."""
    keep = {k: v for k, v in r.headers.items() if k in ("retry-after", "x-kvloop-flow-rejected")}
    return immediate(r.status_code, bytes(r.body), keep)


class Exchange:
    """One HTTP request through Envoy: its messages in, the picker's answers out."""

    def __init__(self, app: RouterApp):
        self.app = app
        self.headers: dict[str, str] = {}
        self.subset: frozenset[str] | None = None
        self.body = bytearray()
        self.routed: Routed | None = None
        self.request: tuple[dict[str, Any], list[int]] = ({}, [])   # parsed body, tokens
        self.permit: Permit | None = None
        self.stream = False
        self.strip_usage = False
        self.relay: SseRelay | None = None
        self.answer = bytearray()
        self.status = 0

    async def on(self, req: pb.ProcessingRequest) -> pb.ProcessingResponse:
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            return await self._request_headers(req)
        if kind == "request_body":
            return await self._request_body(req.request_body)
        if kind == "response_headers":
            return await self._response_headers(req)
        if kind == "response_body":
            return pb.ProcessingResponse(response_body=self._response_body(req.response_body))
        if kind == "request_trailers":
            return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
        return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())

    # --- the request ----------------------------------------------------------------------
    async def _request_headers(self, req: pb.ProcessingRequest) -> pb.ProcessingResponse:
        self.headers = _headers(req.request_headers.headers)
        self.subset = _subset(req.metadata_context)
        refused = self._unauthorized()
        if refused is not None:
            return refused
        if req.request_headers.end_of_stream:   # no body follows: pick now
            return await self._pick(b"", "request_headers")
        return pb.ProcessingResponse(request_headers=pb.HeadersResponse())

    def _unauthorized(self) -> pb.ProcessingResponse | None:
        """With --api-key, the 401 a caller without one of the router's keys gets."""
        auth = self.app.router.config.auth
        if not auth.api_keys:
            return None
        if auth.identify(presented_authorization(self.headers)) in _ROUTER_KEYS:
            return None
        return immediate(401, json.dumps({"error": {
            "message": "missing or invalid API key", "type": "invalid_request_error",
            "param": None, "code": 401}}).encode())

    async def _request_body(self, body: pb.HttpBody) -> pb.ProcessingResponse:
        self.body += body.body
        if not body.end_of_stream:
            return pb.ProcessingResponse(request_body=pb.BodyResponse())
        return await self._pick(bytes(self.body), "request_body")

    @property
    def path(self) -> str:
        return self.headers.get(":path", "").split("?", 1)[0]

    async def _pick(self, raw: bytes, phase: str) -> pb.ProcessingResponse:
        """Read, admit, decide; the pick as Envoy's header and metadata (module docstring)."""
        routed_path = self.headers.get(":method") == "POST" and self.path in ROUTED_PATHS
        body: dict[str, Any] = {}
        tokens: list[int] = []
        if routed_path:
            read = await self.app.work.run(len(raw), read_body, raw, self.path)
            if isinstance(read, Response):
                return immediate_of(read)
            body, self.stream, self.strip_usage = read
            ids = await self.app._token_ids(len(raw), self.path, body)   # off the loop
            if isinstance(ids, Response):   # a prompt no worker's context holds
                return immediate_of(ids)
            tokens = ids or []
        self.request = (body, tokens)
        key = self.app.flow.key_of(self.headers, body, self.app._trusted_front(self.headers))
        admitted = await self.app.flow.admit(key, len(raw))
        if isinstance(admitted, Rejection):
            return immediate_of(rejection_response(admitted, self.app.flow.cfg))
        self.permit = admitted
        exclude = self._outside_subset()
        try:
            self.routed = await pick_worker(self.app, self.path, body, self.headers, tokens,
                                            exclude)
        except NoWorkerError as e:
            return immediate(503, json.dumps(error_body(str(e), 503)).encode())
        finally:
            admitted.close()
        return self._picked(phase, exclude, body)

    def _outside_subset(self) -> list[str]:
        """Workers the subset hint leaves out (none without a hint)."""
        if self.subset is None:
            return []
        return [w.name for w in self.app.router.registry.all()
                if _endpoint_or_none(w.name) not in self.subset]

    def _picked(self, phase: str, exclude: Sequence[str], body: dict[str, Any]
                ) -> pb.ProcessingResponse:
        assert self.routed is not None
        names = [self.routed.worker.name, *fallbacks(self.app, self.routed, exclude)]
        picked = endpoint_of(names[0])
        to_set, to_remove = self._worker_mutation()
        headers = [_set(DESTINATION_HEADER, picked), *(_set(k, v) for k, v in to_set.items())]
        common = pb.CommonResponse(clear_route_cache=True)
        common.header_mutation.remove_headers.extend(to_remove)
        if self.stream and self.strip_usage:   # ask for the usage chunk (cut again later)
            raw = json.dumps({**body, "stream_options": {
                **(body.get("stream_options") or {}), "include_usage": True}}).encode()
            common.body_mutation.body = raw
            headers.append(_set("content-length", str(len(raw))))
        common.header_mutation.set_headers.extend(headers)
        metadata = struct_pb2.Struct()
        metadata.update({LB_NAMESPACE: {
            DESTINATION_HEADER: ",".join(endpoint_of(n) for n in names)}})
        if self.stream:
            self.relay = SseRelay(self.strip_usage)
        if phase == "request_headers":
            return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common),
                                         dynamic_metadata=metadata)
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common),
                                     dynamic_metadata=metadata)

    def _worker_mutation(self) -> tuple[dict[str, str], list[str]]:
        """(headers to set, headers to remove) on the request to the worker: the router's
        worker key and fleet token, as the HTTP proxy sends them; a key of the router's own
        goes no further (a worker must never learn it)."""
        out = {**self.app.fleet_headers, **self.app.worker_headers}
        presented = presented_authorization(self.headers)
        if "authorization" not in out and presented is not None and \
                self.app.router.config.auth.identify(presented) in _ROUTER_KEYS:
            return out, ["authorization", "x-api-key"]
        return out, []

    # --- the answer -----------------------------------------------------------------------
    async def _response_headers(self, req: pb.ProcessingRequest) -> pb.ProcessingResponse:
        headers = _headers(req.response_headers.headers)
        self.status = int(headers.get(":status", "0") or 0)
        mutation = pb.HeaderMutation(remove_headers=[SERVED_HEADER])
        answer = pb.ProcessingResponse(response_headers=pb.HeadersResponse(
            response=pb.CommonResponse(header_mutation=mutation)))
        if self.routed is None:
            return answer
        served = _served(req.metadata_context) or headers.get(SERVED_HEADER)
        await self._account_served(served)
        if refused_by_drain(self.status, headers):
            self._finish(None, "draining")
            self.app.router.registry.mark_draining(self.routed.worker.name)
        if self.status != 200 or "text/event-stream" not in headers.get("content-type", ""):
            self.relay = None
        if req.response_headers.end_of_stream:
            self._done()
        return answer

    async def _account_served(self, served: str | None) -> None:
        """Envoy served the request elsewhere than the pick (it fell back through the list):
        the pick's ticket closes unanswered and the server gets one of its own."""
        assert self.routed is not None
        if not served or served in ("-", endpoint_of(self.routed.worker.name)):
            return
        name = next((w.name for w in self.app.router.registry.all()
                     if _endpoint_or_none(w.name) == served), None)
        first = self.routed
        self._finish(None, "worker_error")
        if name is None:
            return
        others = [w.name for w in self.app.router.registry.all() if w.name != name]
        body, tokens = self.request
        try:   # the same decision, with only the server left to choose
            self.routed = await pick_worker(self.app, self.path, body, self.headers, tokens,
                                            others)
        except NoWorkerError:
            return
        log.info("envoy served the request on %s, not the pick %s", name, first.worker.name)

    def _response_body(self, body: pb.HttpBody) -> pb.BodyResponse:
        chunk, last = body.body, body.end_of_stream
        if self.relay is not None:
            out = self.relay.feed(chunk)
            if self.relay.started and self.routed is not None:
                self.app.router.first_token(self.routed.ticket)
            if last:
                out += self.relay.flush()
                self._done()
            if self.strip_usage:
                return pb.BodyResponse(response=pb.CommonResponse(
                    body_mutation=pb.BodyMutation(body=out)))
            return pb.BodyResponse()
        if len(self.answer) + len(chunk) <= MAX_ANSWER_BYTES:
            self.answer += chunk
        if last:
            self._done()
        return pb.BodyResponse()

    def _done(self) -> None:
        """The answer ended: first token (if no stream said so), the reported hit, the
        ticket closed with the outcome of its status."""
        if self.routed is None:
            return
        if self.relay is not None:
            cached = self.relay.cached_tokens
        else:
            cached = cached_tokens(json_or_none(bytes(self.answer))) if self.status == 200 \
                else None
        self.app.router.first_token(self.routed.ticket)
        outcome = "ok" if self.status < 400 else (
            "client_error" if self.status < 500 else "worker_error")
        self._finish(cached, outcome)

    def _finish(self, cached: int | None, outcome: str) -> None:
        if self.routed is not None:
            self.app.router.finish(self.routed.ticket, cached, outcome)

    def close(self) -> None:
        """However the stream ended: the ticket and the permit close (idempotent). A stream
        whose terminator (`[DONE]`) already passed is an answered request even when Envoy
        closes the exchange before its end-of-stream body reaches us (a client that stops
        reading at `[DONE]` and hangs up): its reported hit counts."""
        if self.permit is not None:
            self.permit.close()
        if self.relay is not None and self.relay.end.ended and self.status == 200:
            self._done()
        self._finish(None, "disconnected")


def _endpoint_or_none(name: str) -> str | None:
    try:
        return endpoint_of(name)
    except (OSError, ValueError):
        return None


class EndpointPicker(pb_grpc.ExternalProcessorServicer):
    """The ExternalProcessor service: one `Exchange` per stream."""

    def __init__(self, app: RouterApp):
        self.app = app
        self.streams = 0

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[pb.ProcessingResponse]:
        self.streams += 1
        ex = Exchange(self.app)
        try:
            async for req in request_iterator:
                yield await ex.on(req)
        finally:
            ex.close()


class PickerServer:
    """The gRPC server of the picker and its health service, on the router's event loop."""

    def __init__(self, app: RouterApp, host: str, port: int):
        self.app = app
        self.host = host
        self.requested_port = port
        self.port: int | None = None
        self.picker = EndpointPicker(app)
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None

    async def start(self) -> int:
        """Bind and serve; the bound port (an ephemeral one for port 0)."""
        server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(self.picker, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        port = server.add_insecure_port(_grpc_address(self.host, self.requested_port))
        if port == 0:
            raise OSError(f"the endpoint picker cannot listen on {self.host}:"
                          f"{self.requested_port}")
        await server.start()
        self._server, self.port = server, port
        self.app.router.watchers.append(lambda router: self._note_health())
        await self._set_health()
        return port

    def _note_health(self) -> None:
        import asyncio

        asyncio.get_running_loop().create_task(self._set_health())

    async def _set_health(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        ready = serving if self.app.router.serving_pool() else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set("liveness", serving)
        for service in ("", "readiness", PICKER_SERVICE):
            await self.health.set(service, ready)

    async def stop(self, grace_s: float = 2.0) -> None:
        if self._server is not None:
            await self._server.stop(grace_s)

    def describe(self) -> dict[str, Any]:
        """The `ext_proc` part of /health."""
        return {"address": f"{self.host}:{self.port}", "streams": self.picker.streams}


def _grpc_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
