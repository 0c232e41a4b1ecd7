"""FastAPI routes of the API server: OpenAI endpoints, health, metrics, tokenizer, worker info.

With --api-key every route needs a key except the public ones (`SERVER_RULES`); the admin
route (POST /reset_prefix_cache) needs --admin-api-key (`kvloop.front.auth`). /kvloop/worker
is public for routers, but process ids and file paths appear in it (and in /v1/models'
`root`) only for a caller `AuthConfig.sees_private` admits, and the worker's internal
addresses (the KV-event PUB and replay endpoints, which carry prompts' token ids, and the
KV side channel) only for a caller the api routes admit (with --api-key: a key holder).

Every error, including request-validation errors, is answered with vLLM's shape
`{"error": {"message", "type", "param", "code"}}`; validation errors are 400 (not FastAPI's
422). An unexpected exception is logged and answered 500 in the same shape; bad input never
gets there.

The published schema (`/openapi.json`) says what each route really answers: its body types
(the TypedDicts of `openai.py`, event by event for a stream; for `WIRE_BODIES`, encoded by
msgspec, the schema of their Structs in `kvloop/wire.py`), its status codes and content
types (`_answers`). `tests/test_serve_schema.py` holds a live server to it with schemathesis.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import TypeAdapter
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from kvloop.batch.inproc import InProcessSender
from kvloop.batch.routes import BatchService
from kvloop.front.advertise import advertised_endpoint
from kvloop.front.anthropic import (
    COUNT_TOKENS_PATH,
    MESSAGES_PATH,
    MESSAGES_PATHS,
    AnthropicErrorResponse,
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
    MessagesResponse,
    MessagesStreamEvent,
)
from kvloop.front.auth import (
    PUBLIC_PATHS,
    WORKER_INFO_PATH,
    Caller,
    RouteRules,
    presented_authorization,
)
from kvloop.front.embeddings import EMBEDDINGS_PATH, EmbeddingRequest, EmbeddingResponse
from kvloop.front.guard import install
from kvloop.front.openai import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EngineStats,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    GenerateStreamResponse,
    LoadResponse,
    ModelCard,
    ModelList,
    ResetPrefixCacheResponse,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
    error_body,
    http_error_body,
    validation_error_body,
)
from kvloop.front.prompts import PromptError, encode, render_chat
from kvloop.front.responses import (
    RESPONSES_PATH,
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
)
from kvloop.front.tokenizer_files import tokenizer_files
from kvloop.server.embeddings import create_embedding
from kvloop.server.lora_routes import ROUTES as LORA_ROUTES
from kvloop.server.lora_routes import add_lora_routes
from kvloop.server.messages import count_tokens, create_messages
from kvloop.server.responses import create_response, retrieve_response
from kvloop.server.responses_store import ResponseStore
from kvloop.server.serving import (
    APIError,
    ServerContext,
    create_chat_completion,
    create_completion,
    create_generate,
)
from kvloop.server.tracing import TraceMiddleware
from kvloop.version import __version__
from kvloop.wire import (
    TOKENIZER_FILES_PATH,
    EngineFacts,
    KVEventsInfo,
    KVTransferInfo,
    TokenizerFiles,
    WorkerInfo,
)

logger = logging.getLogger("kvloop.server")

SERVER_RULES = RouteRules(public=(*PUBLIC_PATHS, WORKER_INFO_PATH),
                          admin=frozenset({("POST", "/reset_prefix_cache"), *LORA_ROUTES}))
KVEventSources = dict[str, KVEventsInfo | None]   # GET /kv_event_sources: engine index -> events
# bodies encoded by msgspec: their schema is msgspec's (`msgspec.json.schema_components`)
WIRE_BODIES: tuple[Any, ...] = (WorkerInfo, KVEventSources, TokenizerFiles)

def _validation_response(exc: RequestValidationError) -> JSONResponse:
    return JSONResponse(validation_error_body(list(exc.errors())), status_code=400)


def _allowed_methods(request: Request) -> str:
    """The `Allow` of a 405: every method the path is served with (`/ping` has one route per
    method, and Starlette's 405 names only the first route's)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if route.matches(request.scope)[0] != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_response(exc)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(PromptError)
    async def on_prompt_error(request: Request, exc: PromptError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), 400, exc.param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = _allowed_methods(request)
        return JSONResponse(http_error_body(exc.status_code, exc.detail),
                            status_code=exc.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error serving %s", request.url.path)
        return JSONResponse(error_body(f"{type(exc).__name__}: {exc}", 500),
                            status_code=500)


# --- the published schema ----------------------------------------------------------------------
_REF = "#/components/schemas/{model}"
_ERRORS = {
    400: "Invalid request: the body fails validation, or a value is out of range or not "
         "supported.",
    401: "Missing or wrong API key (only on a server started with one; the admin routes need "
         "the admin key).",
    403: "An admin route without --admin-api-key, or called with an API key, not the admin "
         "key; on the generation routes, `kv_transfer_params` asking to hold or load KV "
         "blocks without the fleet token or the admin key.",
    404: "No such model (the body's `model`, or the id in the path).",
    413: "Request body over the server's limit.",
    500: "The engine died, or a KV transfer the request needed failed.",
    503: "Shutting down, the engine did not answer, or too many requests waiting (then with "
         "Retry-After).",
}
_GENERATION_ERRORS = (400, 403, 404, 413, 500, 503)
_STREAMED = (CompletionStreamResponse, ChatCompletionStreamResponse, GenerateStreamResponse,
             ResponseStreamEvent, MessagesStreamEvent)
GENERATE_PATH = "/inference/v1/generate"   # vLLM's token-in route
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.",
                                "schema": {"type": "string"}}}


def _event_stream(event: type) -> dict[str, Any]:
    """The `text/event-stream` content of a stream of `event`s: each event's data is one JSON
    `event`, or the error object that ends a failed stream, or the final `[DONE]`; a Messages
    stream's events are named (their `type`) and end with `message_stop` or an error."""
    if event is MessagesStreamEvent:
        return _messages_stream()
    chunk = {"anyOf": [{"$ref": _REF.format(model=event.__name__)},
                       {"$ref": _REF.format(model=ErrorResponse.__name__)}]}
    data = {"anyOf": [{"const": "[DONE]"},
                      {"type": "string", "contentMediaType": "application/json",
                       "contentSchema": chunk}]}
    return {"itemSchema": {"type": "object", "required": ["data"],
                           "properties": {"data": data}}}


def _messages_stream() -> dict[str, Any]:
    data = {"type": "string", "contentMediaType": "application/json", "contentSchema": {
        "anyOf": [{"$ref": _REF.format(model=MessagesStreamEvent.__name__)},
                  {"$ref": _REF.format(model=AnthropicErrorResponse.__name__)}]}}
    return {"itemSchema": {"type": "object", "required": ["event", "data"],
                           "properties": {"event": {"type": "string"}, "data": data}}}


def _error_model(path: str) -> type:
    """The error object a path answers with: Anthropic's on the Messages routes."""
    return AnthropicErrorResponse if path in MESSAGES_PATHS else ErrorResponse


def _answers(ok: Any, *errors: int, stream: type | None = None,
             error_model: type = ErrorResponse) -> dict[str, Any]:
    """Route arguments that publish what a route answers: 200 with a JSON body of type `ok`
    (None: the response class's own content), or an event stream of `stream`s when the
    request asks for one (a type of `_STREAMED`); each status of `errors` with the error
    object (`error_model`)."""
    assert stream is None or stream in _STREAMED, stream
    ok_response: dict[str, Any] = {} if ok is None else {"model": ok}
    if ok in WIRE_BODIES:
        ok_response = {"content": {"application/json": {"schema": _wire_schema(ok)}}}
    if stream is not None:
        ok_response["content"] = {"text/event-stream": _event_stream(stream)}
    responses: dict[int | str, dict[str, Any]] = {200: ok_response}
    for code in errors:
        responses[code] = {"model": error_model, "description": _ERRORS[code]}
        if code == 503:
            responses[code]["headers"] = _RETRY_AFTER
    return {"response_model": None, "responses": responses}


@functools.cache
def _wire_schemas() -> tuple[tuple[dict[str, Any], ...], dict[str, Any]]:
    """msgspec's JSON schemas of `WIRE_BODIES` (in order) and of the types they refer to."""
    return msgspec.json.schema_components(WIRE_BODIES, ref_template=_REF.format(model="{name}"))


def _wire_schema(body: Any) -> dict[str, Any]:
    return _wire_schemas()[0][WIRE_BODIES.index(body)]


def _error_answer(code: int, path: str) -> dict[str, Any]:
    return {"description": _ERRORS[code], "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=_error_model(path).__name__)}}}}


class KvloopAPI(FastAPI):
    """FastAPI whose `/openapi.json` matches the server: no 422 answers (a validation error is
    a 400, which each route declares), the key checks of `rules` (401 on every route that is
    not public, 401 and 403 on the admin routes) and the event types of streams among the
    components."""

    def __init__(self, rules: RouteRules, **kwargs: Any):
        super().__init__(**kwargs)
        self.rules = rules

    def openapi(self) -> dict[str, Any]:
        schema = super().openapi()  # cached by FastAPI; the edits below are idempotent
        for path, operations in schema.get("paths", {}).items():
            for method, operation in operations.items():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                guarded = [401, 403] if (method.upper(), path) in self.rules.admin else [401]
                for code in guarded if not self.rules.is_public(path) else []:
                    responses.setdefault(str(code), _error_answer(code, path))
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        for event in _STREAMED:
            event_schema = TypeAdapter(event).json_schema(ref_template=_REF,
                                                          mode="serialization")
            for name, definition in event_schema.pop("$defs", {}).items():
                components.setdefault(name, definition)
            components.setdefault(event.__name__, event_schema)
        for name, definition in _wire_schemas()[1].items():
            components.setdefault(name, definition)
        return schema


def build_app(ctx: ServerContext) -> FastAPI:
    """The FastAPI application of one server (all state in `ctx`)."""
    batch: list[BatchService] = []
    app = KvloopAPI(SERVER_RULES, title="kvloop", version=__version__, docs_url=None,
                    redoc_url=None, lifespan=functools.partial(_batch_lifespan, batch))
    _add_error_handlers(app)
    install(app, ctx.config.auth, SERVER_RULES, ctx.config.http_limits)
    _add_openai_routes(app, ctx)
    _add_responses_routes(app, ctx, ResponseStore(ctx.config.responses_store))
    _add_messages_routes(app, ctx)
    _add_tokenizer_routes(app, ctx)
    _add_operator_routes(app, ctx)
    if ctx.loras.enabled:
        add_lora_routes(app, ctx.loras, ctx.config.served_model_names, ctx.client.call_utility,
                        APIError)
    if ctx.config.batch is not None:   # the Batch API (kvloop/batch): its lines run here
        batch.append(BatchService(ctx.config.batch, InProcessSender(app, lambda owner: {})))
        app.router.routes.extend(batch[0].routes())
    tracer = getattr(ctx.client, "tracer", None)
    if tracer is not None:   # outermost: its span covers the whole request
        app.add_middleware(TraceMiddleware, tracer=tracer)
    return app


@contextlib.asynccontextmanager
async def _batch_lifespan(batch: list[BatchService], app: FastAPI) -> AsyncIterator[None]:
    for service in batch:
        await service.start()
    try:
        yield
    finally:
        for service in batch:
            await service.stop()


def _add_openai_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/completions", **_answers(CompletionResponse, *_GENERATION_ERRORS,
                                            stream=CompletionStreamResponse))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(ctx, body, request)

    @app.post("/v1/chat/completions", **_answers(ChatCompletionResponse, *_GENERATION_ERRORS,
                                                 stream=ChatCompletionStreamResponse))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(ctx, body, request)

    @app.post(GENERATE_PATH, **_answers(GenerateResponse, *_GENERATION_ERRORS,
                                        stream=GenerateStreamResponse))
    async def generate(body: GenerateRequest, request: Request) -> Response:
        return await create_generate(ctx, body, request)

    @app.post(EMBEDDINGS_PATH, **_answers(EmbeddingResponse, *_GENERATION_ERRORS))
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await create_embedding(ctx, body, request)

    @app.get("/v1/models", **_answers(ModelList))
    async def models(request: Request) -> ModelList:
        private = sees_private(ctx, request)
        return {"object": "list", "data": [_model_card(ctx, name, private)
                                           for name in ctx.config.served_model_names]
                + [_adapter_card(ctx, name, private) for name in ctx.loras.paths]}

    served = list(ctx.config.served_model_names)

    @app.get("/v1/models/{model_id:path}", **_answers(ModelCard, 404))
    async def model(request: Request, model_id: str = Path(examples=served)) -> ModelCard:
        ctx.check_model(model_id)
        if model_id in ctx.loras:
            return _adapter_card(ctx, model_id, sees_private(ctx, request))
        return _model_card(ctx, model_id, sees_private(ctx, request))


def _add_responses_routes(app: FastAPI, ctx: ServerContext, store: ResponseStore) -> None:
    @app.post(RESPONSES_PATH, **_answers(ResponseObject, *_GENERATION_ERRORS,
                                         stream=ResponseStreamEvent))
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await create_response(ctx, store, body, request)

    @app.get(RESPONSES_PATH + "/{response_id}", **_answers(ResponseObject, 404))
    async def response(response_id: str, request: Request) -> ResponseObject:
        owner = ctx.config.auth.owner(presented_authorization(request.headers))
        return retrieve_response(store, response_id, owner)
def _add_messages_routes(app: FastAPI, ctx: ServerContext) -> None:
    """Anthropic's Messages API (`kvloop.server.messages`); errors in Anthropic's shape."""
    anthropic = {"error_model": AnthropicErrorResponse}

    @app.post(MESSAGES_PATH, **_answers(MessagesResponse, *_GENERATION_ERRORS,
                                        stream=MessagesStreamEvent, **anthropic))
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await create_messages(ctx, body, request)

    @app.post(COUNT_TOKENS_PATH, **_answers(CountTokensResponse, 400, 404, 413, **anthropic))
    async def messages_count_tokens(body: CountTokensRequest) -> CountTokensResponse:
        return await count_tokens(ctx, body)


def _model_card(ctx: ServerContext, name: str, private: bool) -> ModelCard:
    """One served model name in vLLM's shape of a model object; `root` is the model's path
    only for a caller who may see file paths."""
    path = ctx.config.model_path if private else None
    return {"id": name, "object": "model", "created": ctx.created, "owned_by": "kvloop",
            "root": path or name, "parent": None,
            "max_model_len": ctx.ready.max_model_len, "permission": []}


def _adapter_card(ctx: ServerContext, name: str, private: bool) -> ModelCard:
    """A loaded LoRA adapter, as vLLM lists one: `parent` the base model's name, `root` its
    folder (for a caller who may see file paths, else its name)."""
    card = _model_card(ctx, name, private)
    card["root"] = ctx.loras.paths[name] if private else name
    card["parent"] = ctx.config.model_name
    return card


def _add_tokenizer_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/tokenize", **_answers(TokenizeResponse, 400, 404, 413))
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        ctx.check_model(body.model)
        if body.messages is not None:
            text = render_chat(ctx.tokenizer, body.messages, body.add_generation_prompt)
        elif body.prompt is not None:
            text = body.prompt
        else:
            raise APIError(400, "either prompt or messages is required", param="prompt")
        ids = encode(ctx.tokenizer, text, body.add_special_tokens, "prompt")
        strs = [ctx.token_str(i) for i in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": ctx.ready.max_model_len, "tokens": ids,
                "token_strs": strs}

    files: list[bytes] = []   # encoded once, on the first call

    @app.get(TOKENIZER_FILES_PATH, **_answers(TokenizerFiles))
    async def tokenizer_files_route() -> Response:
        """The tokenizer as data, for a router on another host (kvloop.front.tokenizer_files)."""
        if not files:
            files.append(msgspec.json.encode(tokenizer_files(ctx.tokenizer)))
        return Response(files[0], media_type="application/json")

    @app.post("/detokenize", **_answers(DetokenizeResponse, 400, 404, 413))
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        ctx.check_model(body.model)
        ctx.check_token_ids(body.tokens, "tokens")
        return {"prompt": ctx.tokenizer.decode(body.tokens)}


_HEALTH: dict[str, Any] = {
    "response_class": Response, "response_model": None,
    "responses": {200: {"description": "The engine is alive (empty body)."},
                  503: {"description": "The engine died, or the server is stopping (empty "
                                       "body); or an internal thread died (a JSON body, "
                                       "`{\"status\": \"unhealthy\", \"reasons\": [...]}`)."}}}


def _add_operator_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.get("/health", **_HEALTH)
    async def health() -> Response:
        if ctx.client.dead or ctx.client.shutting_down:   # dead, draining or stopping
            return Response(status_code=503)
        if ctx.client.faults:        # alive, but a thread it needs died (the KV transfer's)
            return JSONResponse({"status": "unhealthy", "reasons": ctx.client.faults},
                                status_code=503)
        return Response(status_code=200)

    @app.get("/ping", **_HEALTH)
    @app.post("/ping", **_HEALTH)
    async def ping() -> Response:
        return await health()

    @app.get("/version", **_answers(VersionResponse))
    async def version() -> VersionResponse:
        return {"version": __version__}

    @app.get("/load", **_answers(LoadResponse))
    async def load() -> LoadResponse:
        return {"server_load": ctx.client.num_in_flight}

    @app.get("/metrics", response_class=PlainTextResponse, **_answers(None))
    async def metrics() -> Response:
        return Response(ctx.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get(WORKER_INFO_PATH, **_answers(WorkerInfo))
    async def worker(request: Request) -> Response:
        return _wire_json(worker_description(ctx, request))

    @app.get("/kv_event_sources", **_answers(KVEventSources))
    async def kv_event_sources(request: Request) -> Response:
        events = advertised_events(ctx.ready.kv_events, ctx.config.advertise_host)
        return _wire_json({"0": _kv_events(events, sees_private(ctx, request))})

    @app.get("/kvloop/stats", **_answers(EngineStats, 503))
    async def stats() -> EngineStats:
        return await _utility(ctx, "get_stats")

    @app.post("/reset_prefix_cache", **_answers(ResetPrefixCacheResponse, 503))
    async def reset_prefix_cache() -> ResetPrefixCacheResponse:
        return {"success": await _utility(ctx, "reset_prefix_cache")}


async def _utility(ctx: ServerContext, method: str) -> Any:
    try:
        return await ctx.client.call_utility(method)
    except Exception as e:
        raise APIError(503, f"engine call {method} failed: {e}") from e


def sees_private(ctx: ServerContext, request: Request) -> bool:
    return ctx.config.auth.sees_private(presented_authorization(request.headers),
                                        request.client.host if request.client else None)


def _wire_json(body: Any) -> Response:
    """A body of one of `WIRE_BODIES`, encoded by msgspec."""
    return Response(msgspec.json.encode(body), media_type="application/json")


def advertised_events(events: KVEventsInfo | None, host: str | None) -> KVEventsInfo | None:
    """The event endpoints as others dial them: a wildcard bind names the advertised host."""
    if events is None or host is None:
        return events
    return msgspec.structs.replace(
        events, endpoint=advertised_endpoint(events.endpoint, host),
        replay_endpoint=advertised_endpoint(events.replay_endpoint, host))


def _public(address: str | None) -> str | None:
    """An event endpoint a caller without private facts may see: an ipc:// one names a file."""
    return None if (address or "").startswith("ipc://") else address


def _kv_events(events: KVEventsInfo | None, private: bool,
               admitted: bool = True) -> KVEventsInfo | None:
    """The events' description for a caller: no address at all unless `admitted`, no
    ipc:// (file) address unless `private`."""
    if events is None or private:
        return events
    if not admitted:
        return msgspec.structs.replace(events, endpoint=None, replay_endpoint=None)
    return msgspec.structs.replace(events, endpoint=_public(events.endpoint),
                                   replay_endpoint=_public(events.replay_endpoint))


def _kv_transfer(kv: KVTransferInfo | None, admitted: bool) -> KVTransferInfo | None:
    """The KV connector's description; its side channel's address only if `admitted`."""
    if kv is None or admitted:
        return kv
    return msgspec.structs.replace(kv, side_channel_host="", side_channel_port=0)


def worker_description(ctx: ServerContext, request: Request) -> WorkerInfo:
    """What a router reads when this worker registers: the engine's facts from its handshake
    and the server's. A caller who may not see private facts (`sees_private`) gets no
    process ids, model path or ipc:// event endpoints; one the worker does not admit (with
    --api-key: no key) no event or side-channel address."""
    caller = ctx.config.auth.identify(presented_authorization(request.headers))
    return describe_worker(ctx, sees_private(ctx, request), caller in (Caller.API, Caller.ADMIN))


def describe_worker(ctx: ServerContext, private: bool, key_accepted: bool) -> WorkerInfo:
    """`worker_description` for a caller who may see private facts or not, and whose key
    was accepted or not (what discovery announces: neither)."""
    r, cfg = ctx.ready, ctx.config
    admitted = key_accepted or not cfg.auth.api_keys
    facts = {name: getattr(r, name) for name in EngineFacts.__struct_fields__}
    facts["kv_events"] = _kv_events(advertised_events(r.kv_events, cfg.advertise_host),
                                    private, admitted)
    facts["kv_transfer"] = _kv_transfer(r.kv_transfer, admitted)
    hidden: dict[str, Any] = {"model_path": cfg.model_path, "api_pid": os.getpid(),
                              "engine_pid": r.pid}
    facts["kv_shared_store"] = cfg.kv_shared_store if admitted else None
    return WorkerInfo(**facts, **(hidden if private else {}), model=cfg.model_name,
                      served_model_names=list(cfg.served_model_names), role=cfg.role,
                      kv_capacity_blocks=r.num_gpu_blocks - 1, version=__version__,
                      api_key_required=bool(cfg.auth.api_keys), api_key_accepted=key_accepted,
                      lora_adapters=sorted(ctx.loras.paths))
