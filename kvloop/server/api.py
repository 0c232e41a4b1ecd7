"""FastAPI routes of the API server: OpenAI endpoints, health, metrics, tokenizer, worker info.

With --api-key every route needs a key except the public ones (`SERVER_RULES`); the admin
route (POST /reset_prefix_cache) needs --admin-api-key (`kvloop.server.auth`). /kvloop/worker
is public for routers, but process ids and file paths appear in it (and in /v1/models'
`root`) only for a caller `AuthConfig.sees_private` admits.

Every error, including request-validation errors, is answered with vLLM's shape
`{"error": {"message", "type", "param", "code"}}`; validation errors are 400 (not FastAPI's
422). An unexpected exception is logged and answered 500 in the same shape; bad input never
gets there.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvloop
from kvloop.server.auth import PUBLIC_PATHS, WORKER_INFO_PATH, Caller, RouteRules
from kvloop.server.guard import install
from kvloop.server.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    http_error_body,
)
from kvloop.server.serving import (
    APIError,
    ServerContext,
    create_chat_completion,
    create_completion,
    encode,
)

logger = logging.getLogger("kvloop.server")

SERVER_RULES = RouteRules(public=(*PUBLIC_PATHS, WORKER_INFO_PATH),
                          admin=frozenset({("POST", "/reset_prefix_cache")}))
PRIVATE_FIELDS = ("model_path", "api_pid", "engine_pid")

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after",
              "function-before", "list[int]", "list[str]", "list[list[int]]"}


def _clean_loc(loc: tuple[Any, ...]) -> str:
    """Dotted location of a validation error, without pydantic's union-member tags."""
    parts = [str(p) for p in loc if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p))]
    return ".".join(parts)


def _validation_response(exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    lines = [f"  {_clean_loc(tuple(e.get('loc', ())))}: {e.get('msg', '')}" for e in errors[:10]]
    noun = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {noun}:\n" + "\n".join(lines)
    param = _clean_loc(tuple(errors[0].get("loc", ()))) if errors else None
    return JSONResponse(error_body(message, 400, param), status_code=400)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_response(exc)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(http_error_body(exc.status_code, exc.detail),
                            status_code=exc.status_code, headers=dict(exc.headers or {}))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error serving %s", request.url.path)
        return JSONResponse(error_body(f"{type(exc).__name__}: {exc}", 500),
                            status_code=500)


def build_app(ctx: ServerContext) -> FastAPI:
    """The FastAPI application of one server (all state in `ctx`)."""
    app = FastAPI(title="kvloop", version=kvloop.__version__, docs_url=None, redoc_url=None)
    _add_error_handlers(app)
    install(app, ctx.config.auth, SERVER_RULES, ctx.config.http_limits)
    _add_openai_routes(app, ctx)
    _add_tokenizer_routes(app, ctx)
    _add_operator_routes(app, ctx)
    return app


def _add_openai_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(ctx, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(ctx, body, request)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        path = ctx.config.model_path if sees_private(ctx, request) else None
        data: list[dict[str, Any]] = [{"id": name, "object": "model", "created": ctx.created, "owned_by": "kvloop",
                 "root": path or name, "parent": None,
                 "max_model_len": ctx.ready.max_model_len, "permission": []}
                for name in ctx.config.served_model_names]
        return {"object": "list", "data": data}


def _add_tokenizer_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        if body.messages is not None:
            msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
            try:
                text = ctx.tokenizer.apply_chat_template(
                    msgs, add_generation_prompt=body.add_generation_prompt)
            except Exception as e:  # the request's fault (roles, order...)
                raise APIError(400, f"cannot apply the chat template: {e}",
                               param="messages") from e
        elif body.prompt is not None:
            text = body.prompt
        else:
            raise APIError(400, "either prompt or messages is required", param="prompt")
        ids = encode(ctx, text, body.add_special_tokens, "prompt")
        strs = [ctx.token_str(i) for i in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": ctx.ready.max_model_len, "tokens": ids,
                "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        ctx.check_token_ids(body.tokens, "tokens")
        return {"prompt": ctx.tokenizer.decode(body.tokens)}


def _add_operator_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.get("/health")
    async def health() -> Response:
        if ctx.client.dead or ctx.client.shutting_down:   # dead, draining or stopping
            return Response(status_code=503)
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": kvloop.__version__}

    @app.get("/load")
    async def load() -> dict[str, int]:
        return {"server_load": ctx.client.num_in_flight}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get(WORKER_INFO_PATH)
    async def worker(request: Request) -> dict[str, Any]:
        info = worker_description(ctx, private=sees_private(ctx, request))
        accepted = ctx.config.auth.identify(request.headers.get("authorization"))
        info["api_key_required"] = bool(ctx.config.auth.api_keys)
        info["api_key_accepted"] = accepted in (Caller.API, Caller.ADMIN)
        return info

    @app.get("/kv_event_sources")
    async def kv_event_sources(request: Request) -> dict[str, Any]:
        return {"0": worker_description(ctx, private=sees_private(ctx, request))["kv_events"]}

    @app.get("/kvloop/stats")
    async def stats() -> Any:
        return await _utility(ctx, "get_stats")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Any:
        return {"success": await _utility(ctx, "reset_prefix_cache")}


async def _utility(ctx: ServerContext, method: str) -> Any:
    try:
        return await ctx.client.call_utility(method)
    except Exception as e:
        raise APIError(503, f"engine call {method} failed: {e}") from e


def sees_private(ctx: ServerContext, request: Request) -> bool:
    return ctx.config.auth.sees_private(request.headers.get("authorization"),
                                        request.client.host if request.client else None)


def _endpoint(address: str | None, private: bool) -> str | None:
    """An event endpoint; an ipc:// one names a file, shown only with private facts."""
    return address if private or not (address or "").startswith("ipc://") else None


def worker_description(ctx: ServerContext, private: bool = True) -> dict[str, Any]:
    """What a router reads when this worker registers; without `private`, no process ids
    and no file paths (`PRIVATE_FIELDS`, ipc:// event endpoints)."""
    r = ctx.ready
    events = None
    if r.kv_events_endpoint is not None:
        events = {"endpoint": _endpoint(r.kv_events_endpoint, private),
                  "replay_endpoint": _endpoint(r.kv_events_replay_endpoint, private),
                  "topic": r.kv_events_topic or "", "recency": r.kv_events_recency}
    info = {
        "model": ctx.config.model_name,
        "served_model_names": list(ctx.config.served_model_names),
        "model_path": ctx.config.model_path,
        "role": ctx.config.role,
        "epoch": r.epoch,
        "block_size": r.block_size,
        "hash_algo": r.hash_algo,
        "hash_seed": r.hash_seed,
        "enable_prefix_caching": r.enable_prefix_caching,
        "num_gpu_blocks": r.num_gpu_blocks,
        "kv_capacity_blocks": r.num_gpu_blocks - 1,
        "max_model_len": r.max_model_len,
        "max_num_batched_tokens": r.max_num_batched_tokens,
        "max_num_seqs": r.max_num_seqs,
        "kv_events": events,
        "api_pid": os.getpid(),
        "engine_pid": r.pid,
        "version": kvloop.__version__,
    }
    return info if private else {k: v for k, v in info.items() if k not in PRIVATE_FIELDS}
