"""The router's HTTP front: OpenAI-compatible, forwards each request to one worker.

    POST /v1/completions, /v1/chat/completions   tokenize -> hash -> pick -> forward -> stream
    POST /v1/embeddings                          the same, its first input's prefix, no stream
    POST /v1/responses, GET /v1/responses/{id}   the same, pinned to the worker holding a
                                                 stored response (kvloop/router/responses.py)
    POST /v1/messages                            the same (Anthropic's; tokenized as its chat
                                                 equivalent, `kvloop.front.anthropic`)
    POST /v1/messages/count_tokens               the first usable worker's answer
    GET  /v1/models, /v1/models/{id}             the first usable worker's answer
    GET  /health                                 ok | degraded (200, with reasons) | 503
    GET  /metrics                                Prometheus text
    GET  /workers, POST /workers, DELETE /workers    list, register, deregister at run time
    GET  /router/index                           the index per worker (for checks and tests)

Keys (`kvloop.front.auth`, checked by the same middleware as the API server's): with
--api-key every route but /health and /metrics needs one; POST and DELETE /workers need the
--admin-api-key. The router presents --worker-api-key to every worker, on polls, probes and
forwarded requests, and no key of its own: a client's Authorization header is passed on only
when the router has no worker key and the header holds none of the router's keys (with
--api-key, every key a client may send is the router's: nothing is passed on).
A worker registered at run time is probed first and refused (4xx, with the reason) unless
it answers /kvloop/worker with a body that decodes as `WorkerDescription` (the server's
`WorkerInfo`), with the fleet's hashing (block size, algorithm, seed), and accepts the
router's key.

With decode workers and no `both` worker up, requests take the P/D flow (`pd_proxy.py`):
a prefill leg on a prefill worker when the cost model says it pays, then the decode leg.

Before anything is routed, the body is read with the API server's schema (a malformed field
type gets the worker's own 400) and a client's `kv_transfer_params` are refused (400: they
are the router's to set, unless the caller presents the fleet token). With a fleet secret,
every forwarded request carries the fleet token (`kvloop.trust.INTERNAL_TOKEN_HEADER`).

Passthrough rules: the worker's status, content type and body reach the client untouched
(errors included); SSE events are relayed as they arrive. To see
`usage.prompt_tokens_details.cached_tokens` on a stream, the router asks for
`stream_options.include_usage`, and strips that usage chunk again when the client did not
ask for it. A client that disconnects closes the upstream connection, so the worker aborts
the request. A worker that dies mid-stream ends the stream with an OpenAI-shaped error
event naming the worker; one that fails before its headers answers a JSON 502, unless it
closed the connection unanswered: then the request is routed again, once (a keep-alive
connection closed by a stopping worker). A worker that refuses the connection is marked down
and the request is routed again to another worker (nothing reached the first one), and so is
a draining worker's refusal (503 with `x-kvloop-draining`, `kvloop.front.drain`); a draining
worker (its /metrics gauge, or such a refusal) gets no new request. With
--migration-limit, a stream whose worker fails mid-stream goes on on another worker instead
(`kvloop.router.migration`). Each request's ticket (its worker's in-flight count) is closed
in a `finally` on every path.

Where each part lives: the body read (`bodies.py`), the single-worker flow (`single.py`, beside
`pd_proxy.PDFlow`), the SSE relay (`sse.py`), the worker poller (`poller.py`: load from
/metrics, identity from /kvloop/worker, liveness alarms), the tokenizer fetch
(`tokenizer_fetch.py`).

Owner: `RouterApp` owns the HTTP client, the routes and the run-time worker registration;
its flows and poller get the client at `start`.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any
from urllib.parse import quote

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvloop.config import DEFAULT_ROLE, ROLES
from kvloop.front.anthropic import COUNT_TOKENS_PATH, MESSAGES_PATH
from kvloop.front.auth import (
    PUBLIC_PATHS,
    WORKER_INFO_PATH,
    Caller,
    RouteRules,
    presented_authorization,
)
from kvloop.front.embeddings import EMBEDDINGS_PATH
from kvloop.front.guard import install
from kvloop.front.json_body import load_json
from kvloop.front.openai import error_body, http_error_body
from kvloop.front.prompts import PromptTooLong
from kvloop.front.responses import RESPONSES_PATH
from kvloop.router import tracing
from kvloop.router.batch import attach_batch
from kvloop.router.bodies import read_body, read_embedding_body, read_responses_body
from kvloop.router.config import RouterConfig
from kvloop.router.flow import FlowControl
from kvloop.router.limits import BodyBudgetMiddleware, ByteBudget, PromptWork
from kvloop.router.migration import Migration
from kvloop.router.pd_proxy import PDFlow
from kvloop.router.poller import BadWorkerAnswer, WorkerPoller, describe_failure, key_problems
from kvloop.router.prompts import PromptTokenizer, fleet_context
from kvloop.router.registry import WorkerDescription, WorkerSpec, event_source
from kvloop.router.relay import error_response, json_or_none, response_headers
from kvloop.router.request import RoutingRequest, routing_request
from kvloop.router.responses import ResponseAffinity, completed_response
from kvloop.router.router import Router
from kvloop.router.single import SingleFlow
from kvloop.router.sse import event_data
from kvloop.router.tokenizer_fetch import tokenizing_model
from kvloop.trust import INTERNAL_TOKEN_HEADER, PURPOSE_INTERNAL_HTTP

log = logging.getLogger("kvloop.router")

ROUTER_RULES = RouteRules(public=PUBLIC_PATHS,
                          admin=frozenset({("POST", "/workers"), ("DELETE", "/workers")}))
_FORWARD_HEADERS = ("content-type", "accept", "x-request-id")   # and a key: _worker_headers
_ROUTER_KEYS = (Caller.API, Caller.ADMIN)


def fleet_headers(cfg: RouterConfig) -> dict[str, str]:
    """With a fleet secret, the fleet's internal-HTTP token, sent on every request forwarded
    to a registered worker (workers accept `kv_transfer_params` only with it); never on a
    probe, so a worker not yet verified never sees it."""
    if cfg.fleet_secret is None:
        return {}
    return {INTERNAL_TOKEN_HEADER: cfg.fleet_secret.token(PURPOSE_INTERNAL_HTTP)}


async def _http_error(request: Request, exc: Exception) -> Response:
    """Unknown paths and wrong methods answer with the same error object as the workers."""
    assert isinstance(exc, HTTPException)
    return JSONResponse(http_error_body(exc.status_code, exc.detail),
                        status_code=exc.status_code, headers=dict(exc.headers or {}))


async def _internal_error(request: Request, exc: Exception) -> Response:
    """A bug in the router still answers the documented JSON error; what went wrong (which
    may name workers or internal state) goes to the log, not to the client."""
    log.error("internal error serving %s %s", request.method, request.url.path,
              exc_info=exc)
    return error_response("router internal error (the router's log has the cause)", 500)


async def _client_gone(request: Request, exc: Exception) -> Response:
    """The client left (or timed out) while sending its body: nobody reads an answer."""
    return Response(status_code=499)


class RouterApp:
    """The ASGI app of one router plus its poller; `app` is what uvicorn serves."""

    def __init__(self, router: Router, workers: list[WorkerSpec],
                 prompts: PromptTokenizer | None = None,
                 describe_every: int = 4):
        self.router = router
        self.initial_workers = workers
        self.prompts = prompts or PromptTokenizer(router.config.tokenizer, router.metrics)
        router.problems.append(self.prompts.problems)
        self.client: httpx.AsyncClient | None = None
        self.poller = WorkerPoller(router, describe_every)
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route(EMBEDDINGS_PATH, self.embeddings, methods=["POST"]),
            Route(RESPONSES_PATH, self.responses, methods=["POST"]),
            Route(RESPONSES_PATH + "/{response_id}", self.response, methods=["GET"]),
            Route(MESSAGES_PATH, self.messages, methods=["POST"]),
            Route(COUNT_TOKENS_PATH, self.count_tokens, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/workers", self.list_workers, methods=["GET"]),
            Route("/workers", self.add_worker, methods=["POST"]),
            Route("/workers", self.remove_worker, methods=["DELETE"]),
            Route("/router/index", self.index_dump, methods=["GET"]),
        ], lifespan=self._lifespan, exception_handlers={HTTPException: _http_error,
                                                        ClientDisconnect: _client_gone,
                                                        Exception: _internal_error})
        cfg = router.config
        self.body_budget = ByteBudget(cfg.limits.max_inflight_body_bytes)
        install(self.app, cfg.auth, ROUTER_RULES, cfg.http_limits, [Middleware(
            BodyBudgetMiddleware, budget=self.body_budget,
            max_body_bytes=cfg.http_limits.max_request_body_bytes, limits=cfg.limits)])
        self.work = PromptWork(cfg.limits.prompt_threads)
        self.tracer = tracing.install_tracing(self.app, cfg.tracing)
        self.worker_headers = ({"authorization": f"Bearer {cfg.worker_api_key}"}
                               if cfg.worker_api_key else {})
        self.fleet_headers = fleet_headers(cfg)
        self.affinity = ResponseAffinity()
        self.flow = FlowControl(cfg.flow, router.serving_pool, router.clock,
                                router.metrics.prom)
        self.single = SingleFlow(router, self.flow)
        self.pd = PDFlow(self.single)
        self.batch = attach_batch(self.app, self.flow, cfg.batch) if cfg.batch else None

    # --- lifecycle ------------------------------------------------------------------------
    @asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.start()
        try:
            yield
        finally:
            await self.stop()

    async def start(self) -> None:
        lv = self.router.config.liveness
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(lv.request_timeout_s, connect=lv.connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            headers=self.worker_headers, verify=self.router.config.worker_tls.context())
        self.single.start(self.client)
        self.poller.attach(self.client)
        for spec in self.initial_workers:
            await self.register(spec)
        self.poller.start()
        if self.batch is not None:
            await self.batch.start()

    async def stop(self) -> None:
        if self.batch is not None:
            await self.batch.stop()
        await self.flow.stop()
        await self.poller.stop()
        if self.client is not None:
            await self.client.aclose()
        self.single.stop()
        self.work.shutdown()
        if self.tracer is not None:
            self.tracer.shutdown()
        self.router.shutdown()

    # --- workers --------------------------------------------------------------------------
    async def register(self, spec: WorkerSpec) -> dict[str, Any]:
        """Probe `spec` and register it (down, and retried by the poller, if unreachable)."""
        if self.router.registry.get(spec.name) is None:
            self.router.registry.add(spec)
        try:
            desc = await self.poller.describe(spec)
        except (httpx.HTTPError, BadWorkerAnswer) as e:
            reason = describe_failure(spec, e)
            log.warning("worker %s registered but down: %s", spec.name, reason)
            self.router.registry.note_unreachable(spec.name, reason)
            return {"worker": spec.name, "up": False, "warnings": [reason]}
        key_warnings = key_problems(spec, desc, bool(self.worker_headers))
        for w in key_warnings:
            log.warning("%s", w)
        warnings = self.router.register(spec, desc) + key_warnings
        source = event_source(spec, desc)
        log.info("worker %s registered: role %s, model %r, %s blocks, events %s, epoch %s",
                 spec.name, spec.role, desc.model if desc else None,
                 desc.kv_capacity_blocks if desc else None,
                 source.endpoint if source else None, desc.epoch if desc else None)
        return {"worker": spec.name, "up": True, "warnings": warnings}

    # --- OpenAI routes --------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self.forward(request, "/v1/completions")

    async def chat(self, request: Request) -> Response:
        return await self.forward(request, "/v1/chat/completions")

    async def embeddings(self, request: Request) -> Response:
        """An embeddings request goes where its first input's prefix is cached (or by load),
        as is; it produces no token (`expected_output_tokens` 0) and never streams."""
        raw = await request.body()
        read = await self.work.run(len(raw), read_embedding_body, raw)
        if isinstance(read, Response):
            return read
        body, req = read
        tokens = await self.work.run(len(raw), self.prompts.embedding_ids, req,
                                     await self._tokenizing_model())
        rr = self._routing(request, EMBEDDINGS_PATH, body, tokens, output_tokens=0,
                           size=len(raw))
        return await self.single.send(request, rr, raw, self._worker_headers(request), False,
                                      False)

    def _routing(self, request: Request, path: str, body: dict[str, Any],
                 tokens: list[int] | None, exclude: Sequence[str] = (),
                 output_tokens: int | None = None, size: int = 0) -> RoutingRequest:
        """The request's `RoutingRequest`, built once here (`kvloop.router.request`);
        `size`: its body's bytes (flow control's queue is bounded in bytes too)."""
        key = self.flow.key_of(request.headers, body, self._trusted_front(request.headers))
        return routing_request(self.router, path, body, request.headers, tokens,
                               replace(key, body_bytes=size), exclude,
                               output_tokens, self.router.config.migration_limit)

    async def _token_ids(self, size: int, path: str, body: dict[str, Any],
                         history: list[Any] | None = None) -> list[int] | None | Response:
        """The prompt's ids, tokenized on a prompt thread when the body is large
        (kvloop/router/limits.py); the 400 a worker would answer when it fits no worker's
        context."""
        model = await self._tokenizing_model()
        try:
            return await self.work.run(size, self.prompts.token_ids, path, body, model,
                                       history,
                                       fleet_context(self.router.registry.usable(ROLES)))
        except PromptTooLong as e:
            self.router.metrics.prompts_refused.inc()
            return JSONResponse(error_body(str(e), 400, e.param), status_code=400)

    def _trusted_front(self, headers: Mapping[str, str]) -> bool:
        """May the caller set the fairness and objective headers (kvloop/router/flow.py)? A
        fleet member (the fleet token: a gateway or router of the fleet) or the admin key."""
        presented = presented_authorization(headers)
        secret = self.router.config.fleet_secret
        return (secret is not None and secret.check_token(
            PURPOSE_INTERNAL_HTTP, headers.get(INTERNAL_TOKEN_HEADER))) or (
            presented is not None and self.router.config.auth.identify(presented)
            is Caller.ADMIN)

    async def _tokenizing_model(self) -> str | None:
        """The fleet's model, its tokenizer made ready first (local, the flag's, or fetched
        from a worker: `kvloop.router.tokenizer_fetch`)."""
        return await tokenizing_model(self.router, self.prompts, self.client)

    async def messages(self, request: Request) -> Response:
        return await self.forward(request, MESSAGES_PATH)

    async def count_tokens(self, request: Request) -> Response:
        return await self._ask_any_worker(COUNT_TOKENS_PATH, await request.body(),
                                          self._worker_headers(request))

    async def forward(self, request: Request, path: str) -> Response:
        raw = await request.body()
        read = await self.work.run(len(raw), read_body, raw, path,
                                   self._fleet_member(request))
        if isinstance(read, Response):
            return read
        body, stream, strip_usage = read
        tokens = await self._token_ids(len(raw), path, body)
        if isinstance(tokens, Response):
            return tokens
        if stream and strip_usage:
            body = {**body, "stream_options": {**(body.get("stream_options") or {}),
                                               "include_usage": True}}
        headers = self._worker_headers(request)
        rr = self._routing(request, path, body, tokens, size=len(raw))
        if self.router.pd_mode():
            return await self.pd.send(request, rr, await self.work.run(len(raw), _encoded, body),
                                      body, headers, stream, strip_usage)
        migration = Migration.of(path, body, headers, self.router.config.migration_limit,
                                 request, list(rr.tokens)) if rr.migratable else None
        return await self.single.send(request, rr, await self.work.run(len(raw), _encoded,
                                                                       body),
                                      headers, stream, strip_usage, migration=migration)

    async def responses(self, request: Request) -> Response:
        """POST /v1/responses: a continuation goes to the worker holding its previous
        response, tokenized with that conversation; every stored answer is remembered
        (kvloop/router/responses.py). One worker serves it (no prefill/decode split)."""
        raw = await request.body()
        read = await self.work.run(len(raw), read_responses_body, raw)
        if isinstance(read, Response):
            return read
        body, req = read
        held = self.affinity.holder(req.previous_response_id)
        tokens = await self._token_ids(len(raw), RESPONSES_PATH, body,
                                       held.conversation if held else None)
        if isinstance(tokens, Response):
            return tokens
        others = [w.name for w in self.router.registry.all()
                  if held is not None and w.name != held.worker]
        routed: list[str] = []
        rr = self._routing(request, RESPONSES_PATH, body, tokens, exclude=others,
                           size=len(raw))
        answer = await self.single.send(request, rr, raw, self._worker_headers(request),
                                        bool(req.stream), False, on_routed=routed.append)
        return self._remember(answer, routed, body)

    def _remember(self, answer: Response, routed: list[str], body: dict[str, Any]
                  ) -> Response:
        """`answer` as it is, its stored response (JSON, or the stream's completed event)
        recorded with the worker that gave it."""
        if not routed or answer.status_code != 200:
            return answer
        record = functools.partial(self.affinity.record, routed[0], body)
        if isinstance(answer, StreamingResponse):
            answer.body_iterator = _completed_events(answer.body_iterator, record)
        else:
            record(json_or_none(bytes(answer.body)))
        return answer

    async def response(self, request: Request) -> Response:
        """GET /v1/responses/{id}: from the worker holding it, else the first that has it."""
        assert self.client is not None
        rid = request.path_params["response_id"]
        held = self.affinity.holder(rid)
        workers = sorted(self.router.registry.usable(ROLES),
                         key=lambda w: held is None or w.name != held.worker)
        for w in workers:
            try:
                r = await self.client.get(f"{w.spec.url}{RESPONSES_PATH}/{quote(rid, safe='')}")
            except httpx.HTTPError:
                continue
            if r.status_code != 404:
                return Response(r.content, status_code=r.status_code,
                                headers=response_headers(r))
        return JSONResponse(error_body(f"Response with id '{rid}' not found.", 404,
                                       "response_id"), status_code=404)

    def _worker_headers(self, request: Request) -> dict[str, str]:
        """The headers a request forwarded to a worker carries: the client's of
        `_FORWARD_HEADERS`, its key (Authorization, or an `x-api-key` as one) unless it is
        one of the router's, the router's worker key and fleet token."""
        headers = {k: v for k, v in request.headers.items() if k in _FORWARD_HEADERS}
        presented = presented_authorization(request.headers)
        if presented is not None and \
                self.router.config.auth.identify(presented) not in _ROUTER_KEYS:
            headers["authorization"] = presented   # a key of the router's is none for a worker
        headers.update(self.worker_headers)   # the router's key to the worker, if it has one
        headers.update(self.fleet_headers)
        headers["accept-encoding"] = "identity"
        return headers

    def _fleet_member(self, request: Request) -> bool:
        """Does the caller present this fleet's internal-HTTP token (another router of the
        fleet, in front of this one)?"""
        secret = self.router.config.fleet_secret
        return secret is not None and secret.check_token(
            PURPOSE_INTERNAL_HTTP, request.headers.get(INTERNAL_TOKEN_HEADER))


    async def models(self, request: Request) -> Response:
        return await self._ask_any_worker("/v1/models")

    async def model(self, request: Request) -> Response:
        return await self._ask_any_worker(
            "/v1/models/" + quote(request.path_params["model_id"], safe=""))

    async def _ask_any_worker(self, path: str, content: bytes | None = None,
                              headers: dict[str, str] | None = None) -> Response:
        """GET `path` (POST `content` with `headers`) from the first usable worker that
        answers; its answer as it is."""
        assert self.client is not None
        for w in self.router.registry.usable(ROLES):
            try:
                r = await (self.client.get(w.spec.url + path) if content is None else
                           self.client.post(w.spec.url + path, content=content,
                                            headers=headers))
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code,
                            headers=response_headers(r))
        return error_response("no usable worker", 503)

    # --- router routes --------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        status, body = self.router.health()
        return JSONResponse(body, status_code=status)

    async def metrics(self, request: Request) -> Response:
        return Response(self.router.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def list_workers(self, request: Request) -> Response:
        r = self.router
        return JSONResponse({w.name: r.describe_worker(w) for w in r.registry.all()})

    async def add_worker(self, request: Request) -> Response:
        """Register a worker at run time, only once it answered as a usable kvloop worker."""
        try:
            spec = _spec_from_body(load_json(await request.body()))
        except (ValueError, TypeError) as e:
            return error_response(f"bad worker registration: {e}", 400)
        if self.router.registry.get(spec.name) is not None:
            return error_response(f"worker {spec.name} is already registered", 409)
        try:
            desc = await self.poller.describe(spec)
        except (httpx.HTTPError, BadWorkerAnswer) as e:
            return error_response(f"worker {spec.name} not registered: "
                                  f"{describe_failure(spec, e)}", 422)
        if desc is None:
            return error_response(f"worker {spec.name} not registered: {spec.url}"
                                  f"{WORKER_INFO_PATH} answered 404, so no hashing facts "
                                  "(block_size, hash_algo, hash_seed): not a kvloop worker?",
                                  422)
        refusal = self._refusal(spec, desc)
        if refusal is not None:
            code, reason = refusal
            return error_response(f"worker {spec.name} not registered: {reason}", code)
        if self.router.registry.get(spec.name) is not None:  # registered while we probed
            return error_response(f"worker {spec.name} is already registered", 409)
        problems = key_problems(spec, desc, bool(self.worker_headers))
        for w in problems:
            log.warning("%s", w)
        warnings = self.router.register(spec, desc) + problems
        log.info("worker %s registered at run time: role %s, model %r, epoch %s", spec.name,
                 spec.role, desc.model, desc.epoch)
        return JSONResponse({"worker": spec.name, "up": True, "warnings": warnings},
                            status_code=201)

    def _refusal(self, spec: WorkerSpec, desc: WorkerDescription) -> tuple[int, str] | None:
        """(status, reason) when a worker answering `desc` must not join, else None."""
        problems = key_problems(spec, desc, bool(self.worker_headers))
        if problems and self.worker_headers:  # without a key, clients' keys may do
            return 422, problems[0]
        mismatches = self.router.hashing_mismatches(desc)
        if mismatches:
            return 409, "; ".join(mismatches)
        return None

    async def remove_worker(self, request: Request) -> Response:
        try:
            data = load_json(await request.body())
            name = WorkerSpec(str(data["url"]).rstrip("/")).name
        except (ValueError, TypeError, KeyError) as e:
            return error_response(f"bad deregistration (need {{'url': ...}}): {e}", 400)
        if not self.router.deregister(name):
            return error_response(f"worker {name} is not registered", 404)
        return JSONResponse({"worker": name, "removed": True})

    async def index_dump(self, request: Request) -> Response:
        idx = self.router.index
        return JSONResponse({"num_blocks": idx.num_blocks(),
                             "workers": {n: sorted(idx.hashes_of(n)) for n in idx.workers()}})


def _spec_from_body(data: Any) -> WorkerSpec:
    if not isinstance(data, dict) or "url" not in data:
        raise ValueError("need a JSON object with 'url' (and optional role, events, replay)")
    return WorkerSpec(str(data["url"]).rstrip("/"), str(data.get("role", DEFAULT_ROLE)),
                      data.get("events"), data.get("replay"))

async def _completed_events(chunks: AsyncIterable[Any], record: Callable[[Any], None]
                            ) -> AsyncIterator[Any]:
    """`chunks` of a relayed Responses stream (whole events, `_SseRelay`'s), passed on; the
    response of its `response.completed` event handed to `record`."""
    async for chunk in chunks:
        data = event_data(bytes(chunk))
        done = completed_response(data) if data is not None else None
        if done is not None:
            record(done)
        yield chunk


def _encoded(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()
