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

Owner: `RouterApp` owns the HTTP client and the background poller (worker load from
/metrics, worker identity from /kvloop/worker, liveness alarms).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar
from urllib.parse import quote

import anyio
import httpx
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvloop.config import DEFAULT_ROLE, ROLES
from kvloop.front.anthropic import (
    COUNT_TOKENS_PATH,
    MESSAGES_PATH,
    MESSAGES_PATHS,
    MessagesRequest,
    anthropic_error_body,
    event,
    validate_messages,
)
from kvloop.front.auth import (
    PUBLIC_PATHS,
    WORKER_INFO_PATH,
    Caller,
    RouteRules,
    presented_authorization,
)
from kvloop.front.drain import DRAINING_METRIC, refused_by_drain
from kvloop.front.embeddings import EMBEDDINGS_PATH, EmbeddingRequest, validate_embedding_body
from kvloop.front.guard import install
from kvloop.front.openai import (
    MaxTokens,
    SamplingRequest,
    error_body,
    http_error_body,
    validate_body,
    validation_error_body,
)
from kvloop.front.prometheus_text import metric_value, samples
from kvloop.front.responses import RESPONSES_PATH, ResponsesRequest
from kvloop.front.tokenizer_files import MAX_TOKENIZER_FILES_BYTES, tokenizer_from_files
from kvloop.router import tracing
from kvloop.router.batch import attach_batch
from kvloop.router.config import RouterConfig
from kvloop.router.flow import FlowControl, Permit, Rejection, rejection_response
from kvloop.router.migration import Migration
from kvloop.router.pd_proxy import PDFlow
from kvloop.router.prompts import Fetch, PromptTokenizer
from kvloop.router.registry import (
    LoadSnapshot,
    WorkerDescription,
    WorkerSpec,
    WorkerState,
    event_source,
)
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
from kvloop.router.responses import ResponseAffinity, completed_response
from kvloop.router.router import NoWorkerError, PDRouted, Routed, Router
from kvloop.router.sessions import session_key
from kvloop.trust import INTERNAL_TOKEN_HEADER, PURPOSE_INTERNAL_HTTP
from kvloop.wire import TOKENIZER_FILES_PATH, TokenizerFiles

log = logging.getLogger("kvloop.router")

ROUTER_RULES = RouteRules(public=PUBLIC_PATHS,
                          admin=frozenset({("POST", "/workers"), ("DELETE", "/workers")}))
MAX_POLL_FAILURES = 3
_FORWARD_HEADERS = ("content-type", "accept", "x-request-id")   # and a key: _worker_headers
_TRANSPORT_ERRORS = (httpx.TransportError,)
# a connection a stopping server closed before answering (nothing of the request ran)
_UNANSWERED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
_ROUTER_KEYS = (Caller.API, Caller.ADMIN)
D = TypeVar("D", Routed, PDRouted)


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
        self.describe_every = describe_every
        self.client: httpx.AsyncClient | None = None
        self._decider: ThreadPoolExecutor | None = None
        self._poller: asyncio.Task[None] | None = None
        self._polls = 0
        self._poll_failures: dict[str, int] = {}
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
        install(self.app, cfg.auth, ROUTER_RULES, cfg.http_limits)
        self.tracer = tracing.install_tracing(self.app, cfg.tracing)
        self.pd = PDFlow(self)
        self.worker_headers = ({"authorization": f"Bearer {cfg.worker_api_key}"}
                               if cfg.worker_api_key else {})
        self.fleet_headers = fleet_headers(cfg)
        self.affinity = ResponseAffinity()
        self.flow = FlowControl(cfg.flow, router.serving_pool, router.clock,
                                router.metrics.prom)
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
        if self.router.index.remote:
            self._decider = ThreadPoolExecutor(1, thread_name_prefix="kvloop-router-decide")
        for spec in self.initial_workers:
            await self.register(spec)
        self._poller = asyncio.create_task(self._poll_loop())
        if self.batch is not None:
            await self.batch.start()

    async def stop(self) -> None:
        if self.batch is not None:
            await self.batch.stop()
        await self.flow.stop()
        if self._poller is not None:
            self._poller.cancel()
            try:
                await self._poller
            except asyncio.CancelledError:
                pass
        if self.client is not None:
            await self.client.aclose()
        if self._decider is not None:
            self._decider.shutdown(wait=False)
        if self.tracer is not None:
            self.tracer.shutdown()
        self.router.shutdown()

    # --- workers --------------------------------------------------------------------------
    async def register(self, spec: WorkerSpec) -> dict[str, Any]:
        """Probe `spec` and register it (down, and retried by the poller, if unreachable)."""
        if self.router.registry.get(spec.name) is None:
            self.router.registry.add(spec)
        try:
            desc = await self._describe(spec)
        except (httpx.HTTPError, BadWorkerAnswer) as e:
            reason = _describe_failure(spec, e)
            log.warning("worker %s registered but down: %s", spec.name, reason)
            self.router.registry.note_unreachable(spec.name, reason)
            return {"worker": spec.name, "up": False, "warnings": [reason]}
        key_warnings = _key_problems(spec, desc, bool(self.worker_headers))
        for w in key_warnings:
            log.warning("%s", w)
        warnings = self.router.register(spec, desc) + key_warnings
        source = event_source(spec, desc)
        log.info("worker %s registered: role %s, model %r, %s blocks, events %s, epoch %s",
                 spec.name, spec.role, desc.model if desc else None,
                 desc.kv_capacity_blocks if desc else None,
                 source.endpoint if source else None, desc.epoch if desc else None)
        return {"worker": spec.name, "up": True, "warnings": warnings}

    async def _describe(self, spec: WorkerSpec) -> WorkerDescription | None:
        """The worker's `GET /kvloop/worker` answer; None when it has no such route (no
        kvloop worker: no hashing facts, no advertised events). Raises httpx.HTTPError when
        it cannot be asked, BadWorkerAnswer when its answer does not decode."""
        assert self.client is not None
        lv = self.router.config.liveness
        r = await self.client.get(spec.url + WORKER_INFO_PATH,
                                  timeout=lv.connect_timeout_s)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        try:
            return _DESCRIPTION.decode(r.content)
        except msgspec.DecodeError as e:   # malformed JSON, or a missing or mistyped field
            raise BadWorkerAnswer(f"{spec.url}{WORKER_INFO_PATH} answered what this router "
                                  f"cannot read: {e}") from e

    async def _poll_loop(self) -> None:
        interval = self.router.config.liveness.poll_interval_s
        while True:
            try:
                await self.poll_once()
            except Exception:  # the poller must survive any single bad answer
                log.exception("router poll failed")
            await asyncio.sleep(interval)

    async def poll_once(self) -> None:
        """Load of live workers, identity (epoch) checks, re-probes, alarms."""
        self._polls += 1
        describe = self._polls % self.describe_every == 0
        await asyncio.gather(*(self._poll_worker(w, describe)
                               for w in self.router.registry.all()))
        self.router.check_liveness()

    async def _poll_worker(self, w: WorkerState, describe: bool) -> None:
        if not w.up or describe:
            try:
                desc = await self._describe(w.spec)
            except (httpx.HTTPError, BadWorkerAnswer) as e:
                reason = _describe_failure(w.spec, e)
                self.router.worker_down(w.name, reason)
                self.router.registry.note_unreachable(w.name, reason)   # if never up
                return
            epoch = desc.epoch if desc else None
            known = w.description.epoch if w.description else None
            if not w.up or epoch != known:
                if w.up:
                    log.warning("worker %s restarted (epoch %s -> %s): re-indexing", w.name,
                                known, epoch)
                else:
                    log.warning("worker %s is back (epoch %s)", w.name, epoch)
                self.router.register(w.spec, desc)
            elif desc is not None:
                self.router.registry.refresh_adapters(w.name, desc)
        await self._poll_load(w)

    async def _poll_load(self, w: WorkerState) -> None:
        """Read the worker's load. Refused connections mark it down at once; slow or bad
        answers only after `MAX_POLL_FAILURES` in a row (a busy worker is not a dead one)."""
        assert self.client is not None
        try:
            r = await self.client.get(w.spec.url + "/metrics",
                                      timeout=self.router.config.liveness.connect_timeout_s)
            r.raise_for_status()
        except httpx.HTTPError as e:
            failures = self._poll_failures.get(w.name, 0) + 1
            self._poll_failures[w.name] = failures
            if isinstance(e, httpx.ConnectError) or failures >= MAX_POLL_FAILURES:
                self.router.worker_down(w.name, f"/metrics failed: {e!r}")
            return
        self._poll_failures.pop(w.name, None)
        self.router.registry.set_load(w.name, parse_load(r.text, self.router.clock()))

    # --- OpenAI routes --------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self.forward(request, "/v1/completions")

    async def chat(self, request: Request) -> Response:
        return await self.forward(request, "/v1/chat/completions")

    async def embeddings(self, request: Request) -> Response:
        """An embeddings request goes where its first input's prefix is cached (or by load),
        as is; it produces no token (`expected_output_tokens` 0) and never streams."""
        raw = await request.body()
        read = read_embedding_body(raw)
        if isinstance(read, Response):
            return read
        body, req = read
        tokens = self.prompts.embedding_ids(req, await self._tokenizing_model())
        return await self._send(request, EMBEDDINGS_PATH, raw, body, tokens or [],
                                self._worker_headers(request), False, False,
                                output_tokens=0)

    async def _tokenizing_model(self) -> str | None:
        """The fleet's model, its tokenizer made ready first (local, the flag's, or fetched
        from a worker: `RouterPrompts.ensure`)."""
        model = self._fleet_model()
        await self.prompts.ensure(model, self._tokenizer_fetch(model))
        return model

    async def messages(self, request: Request) -> Response:
        return await self.forward(request, MESSAGES_PATH)

    async def count_tokens(self, request: Request) -> Response:
        return await self._ask_any_worker(COUNT_TOKENS_PATH, await request.body(),
                                          self._worker_headers(request))

    async def forward(self, request: Request, path: str) -> Response:
        raw = await request.body()
        read = read_body(raw, path, self._fleet_member(request))
        if isinstance(read, Response):
            return read
        body, stream, strip_usage = read
        tokens = self.prompts.token_ids(path, body, await self._tokenizing_model())
        if stream and strip_usage:
            body = {**body, "stream_options": {**(body.get("stream_options") or {}),
                                               "include_usage": True}}
        headers = self._worker_headers(request)
        if self.router.pd_mode():
            return await self.pd.send(request, path, json.dumps(body).encode(), body,
                                      tokens or [], headers, stream, strip_usage)
        migration = Migration.of(path, body, headers, self.router.config.migration_limit,
                                 request, tokens or []) if stream else None
        return await self._send(request, path, json.dumps(body).encode(), body, tokens or [],
                                headers, stream, strip_usage, migration=migration)

    async def responses(self, request: Request) -> Response:
        """POST /v1/responses: a continuation goes to the worker holding its previous
        response, tokenized with that conversation; every stored answer is remembered
        (kvloop/router/responses.py). One worker serves it (no prefill/decode split)."""
        raw = await request.body()
        read = read_responses_body(raw)
        if isinstance(read, Response):
            return read
        body, req = read
        held = self.affinity.holder(req.previous_response_id)
        tokens = self.prompts.token_ids(RESPONSES_PATH, body, await self._tokenizing_model(),
                                        held.conversation if held else None)
        others = [w.name for w in self.router.registry.all()
                  if held is not None and w.name != held.worker]
        routed: list[str] = []
        answer = await self._send(request, RESPONSES_PATH, raw, body, tokens or [],
                                  self._worker_headers(request), bool(req.stream), False,
                                  exclude=others, on_routed=routed.append)
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

    def _fleet_model(self) -> str | None:
        """The model whose tokenizer the workers use (its path when they report one)."""
        for w in self.router.registry.all():
            d = w.description
            if w.up and d is not None and (d.model_path or d.model):
                return d.model_path or d.model
        return None

    def _tokenizer_fetch(self, model: str | None) -> Fetch | None:
        """Fetches `model`'s tokenizer from a live worker serving it (None: none is up)."""
        for w in self.router.registry.all():
            d = w.description
            if w.up and d is not None and model in (d.model_path, d.model):
                return functools.partial(self._fetch_tokenizer, w.spec.url)
        return None

    async def _fetch_tokenizer(self, url: str) -> Any:
        """`GET {url}/kvloop/tokenizer` with the router's worker key, bounded in size."""
        assert self.client is not None
        async with self.client.stream("GET", url + TOKENIZER_FILES_PATH) as r:
            if r.status_code != 200:
                await r.aread()
                raise BadWorkerAnswer(f"{url}{TOKENIZER_FILES_PATH} answered "
                                      f"{r.status_code}: {r.text[:200]}")
            body = bytearray()
            async for chunk in r.aiter_bytes():
                body += chunk
                if len(body) > MAX_TOKENIZER_FILES_BYTES:
                    raise BadWorkerAnswer(f"{url}{TOKENIZER_FILES_PATH} answered more than "
                                          f"{MAX_TOKENIZER_FILES_BYTES} bytes")
        try:
            files = msgspec.json.decode(bytes(body), type=TokenizerFiles)
        except msgspec.DecodeError as e:
            raise BadWorkerAnswer(f"{url}{TOKENIZER_FILES_PATH}: {e}") from e
        log.info("tokenizer of model %r fetched from %s", files.model, url)
        return await asyncio.to_thread(tokenizer_from_files, files)

    async def _send(self, request: Request, path: str, raw: bytes, body: dict[str, Any],
                    tokens: list[int], headers: dict[str, str], stream: bool,
                    strip_usage: bool, output_tokens: int | None = None,
                    exclude: Sequence[str] = (),
                    on_routed: Callable[[str], None] | None = None,
                    migration: Migration | None = None) -> Response:
        """Wait for room (flow control), route (never to a worker of `exclude`), forward,
        answer; `on_routed` hears the name of the worker that got the request;
        `output_tokens`: what the request will produce (None: what its body asks for);
        `migration`: a stream's, if it may move."""
        assert self.client is not None
        tried: list[str] = list(exclude)
        unanswered: Unanswered | None = None   # one retry after a connection closed so
        if output_tokens is None:
            output_tokens = MaxTokens.of_body(path, body).tokens(None)
        permit = await self.admission(request, body)
        if isinstance(permit, Response):
            return permit
        session = session_key(request.headers, body)
        while True:
            try:
                routed = await self.decide(self.router.route, tokens, tried,
                                           body.get("cache_salt"), output_tokens, session,
                                           self.router.adapter_of(body.get("model")))
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
                tried.append(name)
                continue
            if isinstance(upstream, Response):
                return upstream
            assert isinstance(upstream, httpx.Response)
            return await self.answer(request, upstream, routed, stream, strip_usage,
                                     migration)

    async def admission(self, request: Request, body: dict[str, Any]) -> Permit | Response:
        """Flow control's answer (kvloop/router/flow.py): a permit, to close once the request
        is routed, or the refusal to answer (499: the client left while queued)."""
        key, t0 = self.flow.key_of(request.headers, body), time.monotonic()
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
        relay = _SseRelay(strip_usage, migration)
        outcome = "disconnected"
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
        except httpx.TransportError as e:
            outcome, failure = "worker_error", e
            self.router.worker_down(routed.worker.name, f"failed mid-stream: {e!r}")
        finally:
            with anyio.CancelScope(shield=True):
                await upstream.aclose()
                self.router.finish(routed.ticket, relay.cached_tokens, outcome)
        interrupted = migration.interrupted if migration is not None else None
        if failure is None and interrupted is None:
            return
        msg = (f"worker {routed.worker.name} failed mid-stream: {failure!r}"
               if failure is not None else
               f"worker {routed.worker.name} ended the stream early: {interrupted}")
        if migration is not None:
            async for out in self._migrate(migration, routed.worker.name, strip_usage, msg):
                yield out
            return
        yield (event(anthropic_error_body(msg, 502)) if messages
               else _sse(error_body(msg, 502)) + b"data: [DONE]\n\n")

    async def _migrate(self, m: Migration, failed: str, strip_usage: bool, msg: str
                       ) -> AsyncIterator[bytes]:
        """The rest of a stream whose worker `failed`, from another worker
        (kvloop/router/migration.py); `msg`'s error event when none takes it."""
        if m.finished:   # its last chunk was relayed: only the end was lost
            yield b"data: [DONE]\n\n"
            return
        leg = m.next_leg(failed)
        while not isinstance(leg, str):
            try:
                routed = await self.decide(self.router.route, leg.tokens or m.tokens, m.failed,
                                           m.body.get("cache_salt"), leg.max_tokens)
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
        yield _sse(error_body(f"{msg}; not migrated: {leg}", 502)) + b"data: [DONE]\n\n"

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
            spec = _spec_from_body(await request.json())
        except (ValueError, TypeError) as e:
            return error_response(f"bad worker registration: {e}", 400)
        if self.router.registry.get(spec.name) is not None:
            return error_response(f"worker {spec.name} is already registered", 409)
        try:
            desc = await self._describe(spec)
        except (httpx.HTTPError, BadWorkerAnswer) as e:
            return error_response(f"worker {spec.name} not registered: "
                                  f"{_describe_failure(spec, e)}", 422)
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
        key_problems = _key_problems(spec, desc, bool(self.worker_headers))
        for w in key_problems:
            log.warning("%s", w)
        warnings = self.router.register(spec, desc) + key_problems
        log.info("worker %s registered at run time: role %s, model %r, epoch %s", spec.name,
                 spec.role, desc.model, desc.epoch)
        return JSONResponse({"worker": spec.name, "up": True, "warnings": warnings},
                            status_code=201)

    def _refusal(self, spec: WorkerSpec, desc: WorkerDescription) -> tuple[int, str] | None:
        """(status, reason) when a worker answering `desc` must not join, else None."""
        key_problems = _key_problems(spec, desc, bool(self.worker_headers))
        if key_problems and self.worker_headers:  # without a key, clients' keys may do
            return 422, key_problems[0]
        mismatches = self.router.hashing_mismatches(desc)
        if mismatches:
            return 409, "; ".join(mismatches)
        return None

    async def remove_worker(self, request: Request) -> Response:
        try:
            data = await request.json()
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


def read_body(raw: bytes, path: str, fleet_member: bool = False
              ) -> tuple[dict[str, Any], bool, bool] | Response:
    """The client's body as the worker will read it, with whether it streams and whether the
    usage chunk the router asks for must be stripped again; or the 400 a worker would answer
    (the API server's own schema, `kvloop.front.openai`). `kv_transfer_params` are the
    router's to set: a client's are refused, unless the caller is a `fleet_member` (it
    presented the fleet's token: a router in front of this one)."""
    try:
        body = json.loads(raw)
    except ValueError as e:
        return error_response(f"invalid JSON body: {e}", 400)
    if path in MESSAGES_PATHS:
        return _read_messages_body(path, body, fleet_member)
    checked = validate_body(path, body)
    if not isinstance(checked, SamplingRequest):
        return JSONResponse(checked, status_code=400)
    if checked.kv_transfer_params is not None and not fleet_member:
        return _client_kv_params_refused()
    assert isinstance(body, dict)
    read = checked.model_dump(include=_READ_FIELDS, exclude_unset=True)
    body = {**body, **read}   # the fields the router reads, as the worker reads them
    opts = checked.stream_options
    stream = bool(checked.stream)
    return body, stream, stream and not (opts is not None and opts.include_usage)


def read_embedding_body(raw: bytes) -> tuple[dict[str, Any], EmbeddingRequest] | Response:
    """An embeddings body and its fields as the worker reads them, or the 400 it answers."""
    try:
        body = json.loads(raw)
    except ValueError as e:
        return error_response(f"invalid JSON body: {e}", 400)
    checked = validate_embedding_body(body)
    if not isinstance(checked, EmbeddingRequest):
        return JSONResponse(checked, status_code=400)
    return body, checked
def read_responses_body(raw: bytes) -> tuple[dict[str, Any], ResponsesRequest] | Response:
    """A Responses body as the worker reads it, or the 400 a worker would answer."""
    try:
        body = json.loads(raw)
        return body, ResponsesRequest.model_validate(body)
    except ValueError as e:   # not JSON, or not the schema (pydantic's is a ValueError)
        errors = getattr(e, "errors", None)     # pydantic's ValidationError
        if errors is not None:
            return JSONResponse(validation_error_body(
                [{**err, "loc": ("body", *err.get("loc", ()))} for err in errors()]),
                status_code=400)
        return error_response(f"invalid JSON body: {e}", 400)


async def _completed_events(chunks: AsyncIterable[Any], record: Callable[[Any], None]
                            ) -> AsyncIterator[Any]:
    """`chunks` of a relayed Responses stream (whole events, `_SseRelay`'s), passed on; the
    response of its `response.completed` event handed to `record`."""
    async for chunk in chunks:
        data = _event_data(bytes(chunk))
        done = completed_response(data) if data is not None else None
        if done is not None:
            record(done)
        yield chunk
def _client_kv_params_refused() -> Response:
    return JSONResponse(error_body(
        "kv_transfer_params are set by the router (prefill/decode disaggregation), never by "
        "a client", 400, "kv_transfer_params"), status_code=400)


def _read_messages_body(path: str, body: Any, fleet_member: bool
                        ) -> tuple[dict[str, Any], bool, bool] | Response:
    """`read_body` of an Anthropic Messages body: passed on as the client sent it (its usage
    reaches the router on every answer, streamed or not, so nothing is asked or stripped)."""
    checked = validate_messages(path, body)
    if not isinstance(checked, MessagesRequest):   # its 400 (reshaped by the middleware)
        return JSONResponse(checked, status_code=400)
    if checked.kv_transfer_params is not None and not fleet_member:
        return _client_kv_params_refused()
    assert isinstance(body, dict)
    return body, bool(checked.stream), False


_READ_FIELDS = {"stream", "stream_options", "n", "best_of", "max_tokens",
                "max_completion_tokens", "cache_salt"}


class _SseRelay:
    """Splits an SSE byte stream into events; drops the injected usage chunk if asked."""

    def __init__(self, strip_usage: bool, migration: Migration | None = None):
        self.strip_usage = strip_usage
        self.migration = migration   # sees (and may rewrite) each event's data first
        self.buf = b""
        self.started = False
        self.cached_tokens: int | None = None

    def feed(self, chunk: bytes) -> bytes:
        self.buf += chunk
        out: list[bytes] = []
        while (found := _event_end(self.buf)) is not None:
            end, sep = found
            event, self.buf = self.buf[:end + sep], self.buf[end + sep:]
            event = self._migrated(event)
            if event and self._keep(event):
                out.append(event)
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self.buf = self._migrated(self.buf), b""
        return rest if rest and self._keep(rest) else b""

    def _migrated(self, event: bytes) -> bytes:
        """`event` as the migration rewrites it (b"": dropped)."""
        data = _event_data(event) if self.migration is not None else None
        if self.migration is None or data is None:
            return event
        out = self.migration.on_event(data)
        return b"" if out is None else b"data: " + out + b"\n\n"

    def _keep(self, event: bytes) -> bool:
        data = _event_data(event)
        if data is None or data == b"[DONE]":
            return True
        if b'"usage"' not in data:
            self.started = True
            return True
        payload = json_or_none(data)
        if not isinstance(payload, dict):
            self.started = True
            return True
        cached = cached_tokens(payload)
        if cached is not None:
            self.cached_tokens = cached
        usage_only = payload.get("choices") == [] and payload.get("usage") is not None
        if not usage_only:
            self.started = True
        return not (usage_only and self.strip_usage)


def _event_end(buf: bytes) -> tuple[int, int] | None:
    """Position and length of the first event separator in `buf`, or None."""
    a = buf.find(b"\n\n")
    b = buf.find(b"\r\n\r\n")
    if b >= 0 and (a < 0 or b < a):
        return b, 4
    return (a, 2) if a >= 0 else None


def _event_data(event: bytes) -> bytes | None:
    lines = [ln[5:].strip() for ln in event.splitlines() if ln.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class BadWorkerAnswer(ValueError):
    """A worker's `GET /kvloop/worker` answer that does not decode as a `WorkerDescription`."""


_DESCRIPTION = msgspec.json.Decoder(WorkerDescription)


def _describe_failure(spec: WorkerSpec, e: Exception) -> str:
    """Why asking `spec` for its description failed (the reason a registration names)."""
    if isinstance(e, BadWorkerAnswer):
        return str(e)
    return f"GET {spec.url}{WORKER_INFO_PATH} failed: {e!r}"


def _key_problems(spec: WorkerSpec, desc: WorkerDescription | None,
                  has_key: bool) -> list[str]:
    """Why requests forwarded to the worker would get 401 (empty: they would not, or a worker
    that is no kvloop one does not say)."""
    if desc is None or not desc.api_key_required or desc.api_key_accepted:
        return []
    if has_key:
        return [f"{spec.name} requires an API key and refused the router's "
                "(--worker-api-key): requests forwarded to it would get 401"]
    return [f"{spec.name} requires an API key and the router has none for it "
            "(--worker-api-key): only clients sending the worker's key get through"]


def _spec_from_body(data: Any) -> WorkerSpec:
    if not isinstance(data, dict) or "url" not in data:
        raise ValueError("need a JSON object with 'url' (and optional role, events, replay)")
    return WorkerSpec(str(data["url"]).rstrip("/"), str(data.get("role", DEFAULT_ROLE)),
                      data.get("events"), data.get("replay"))


_LOAD_NAMES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
               "vllm:kv_cache_usage_perc": "kv_usage", DRAINING_METRIC: "draining"}


def parse_load(text: str, now: float) -> LoadSnapshot:
    """Running, waiting, KV usage and drain from a vLLM-style /metrics page (summed over
    engines), and the active LoRA adapters and max_lora of its newest
    `vllm:lora_requests_info`."""
    sums = {key: metric_value(text, name) for name, key in _LOAD_NAMES.items()}
    adapters, max_loras = _lora_info(text)
    return LoadSnapshot(int(sums["running"]), int(sums["waiting"]), sums["kv_usage"], now,
                        adapters, max_loras, sums["draining"] > 0)


def _lora_info(text: str) -> tuple[frozenset[str], int | None]:
    """(running and waiting adapters, max_lora) of the newest sample (its value is a time)."""
    newest = max(samples(text, "vllm:lora_requests_info"), key=lambda s: s[1], default=None)
    if newest is None:
        return frozenset(), None
    labels = newest[0]
    names = {n for key in ("running_lora_adapters", "waiting_lora_adapters")
             for n in labels.get(key, "").split(",") if n}
    try:
        max_loras: int | None = int(labels.get("max_lora", ""))
    except ValueError:
        max_loras = None
    return frozenset(names), max_loras
