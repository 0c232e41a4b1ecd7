"""Completions and chat completions: request -> engine requests -> JSON or SSE.

One HTTP request becomes `len(prompts) * n` engine requests ("children"). A `Generation`
submits them (after admission control), merges their outputs from one queue, runs each
through its `OutputState` (detokenizer, stop strings) and makes sure every child is either
finished or aborted in the engine when the handler ends, however it ends (done, client gone,
server stopping, engine dead).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvloop.core.request import (
    KV_TRANSFER_PARAMS_KEY,
    NO_GRAMMAR_BACKEND,
    ContextLengthError,
    StructuredOutputsParams,
    TokenIdError,
    check_context_length,
    check_token_ids,
)
from kvloop.front.auth import Caller, presented_authorization
from kvloop.front.drain import DRAINING_HEADERS
from kvloop.front.openai import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatDelta,
    ChatLogprobs,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    GenerateChoice,
    GenerateRequest,
    GenerateResponse,
    GenerateSamplingParams,
    GenerateStreamResponse,
    MaxTokens,
    ResponseMetrics,
    SamplingRequest,
    SpecDecodingSummary,
    TopLogprob,
    Usage,
    error_body,
)
from kvloop.front.processor import (
    Delta,
    OutputOptions,
    OutputState,
    TokenLogprob,
    fan_out,
    merge_outputs,
    model_stops,
)
from kvloop.front.prompts import chat_prompt, completion_prompts
from kvloop.kv_transfer.params import asks_for_kv, bounds_refusal
from kvloop.pooling_params import PoolingParams
from kvloop.sampling_params import SamplingParams
from kvloop.server.client import (
    EngineClient,
    EngineDeadError,
    QueueItem,
    ServerShuttingDown,
)
from kvloop.server.config import ServeConfig
from kvloop.server.logs import log_request
from kvloop.server.lora import LoRANames
from kvloop.server.metrics import ServerMetrics
from kvloop.server.sampling_extras import (
    LOGPROB_FLOOR,
    check_prompt_logprobs,
    extra_kwargs,
    prompt_logprobs_body,
)
from kvloop.server.structured import ConstraintError, check_size, requested_constraint
from kvloop.server.tools import Answer, ToolCallStream, ToolPlan, answer, plan_tools
from kvloop.trust import INTERNAL_TOKEN_HEADER, PURPOSE_INTERNAL_HTTP
from kvloop.wire import (
    KV_LOAD_FAILED,
    LORA_UNAVAILABLE,
    EngineCoreOutput,
    EngineCoreRequest,
    EngineReady,
    RequestSpecDecodingStats,
)

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1


class APIError(Exception):
    """An error answered with vLLM's JSON error shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.status, self.param),
                            status_code=self.status, headers=self.headers)


class ClientDisconnected(Exception):
    pass


@dataclass
class StreamEnd:
    """How a stream ended early (read by the stream's tail)."""

    error: APIError | None = None
    aborted: bool = False


@dataclass
class ServerContext:
    """What every handler needs; built once the engine is ready."""

    config: ServeConfig
    client: EngineClient
    tokenizer: Any
    ready: EngineReady
    metrics: ServerMetrics
    created: int
    loras: LoRANames = field(init=False)

    def __post_init__(self) -> None:
        self.loras = LoRANames(self.config.lora)

    def lora_name(self, model: str | None) -> str | None:
        """The adapter a request's `model` selects (None: the base model)."""
        return model if model is not None and model in self.loras else None

    @property
    def vocab_size(self) -> int:
        return int(self.ready.vocab_size or self.tokenizer.vocab_size)

    def served_name(self, requested: str | None) -> str:
        """The model an answer names: the one the client sent (an alias of
        `--served-model-name`, checked by `check_model`), else the first served name."""
        return self.config.model_name if requested is None else requested

    def check_model(self, name: str | None) -> None:
        """404 unless `name` (if given) is a served name or a loaded LoRA adapter's."""
        if name is not None and name not in self.config.served_model_names \
                and name not in self.loras:
            raise APIError(404, f"The model `{name}` does not exist. Valid aliases: "
                                f"{', '.join(self.config.served_model_names)}",
                           param="model")

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        try:
            check_token_ids(ids, self.vocab_size, param)
        except TokenIdError as e:
            raise APIError(400, str(e), param=e.param) from None

    def token_str(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))


# --- sampling parameters -----------------------------------------------------------------------
def _check_supported(req: SamplingRequest) -> None:
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported by kvloop (use n)", param="best_of")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "Stream options can only be defined when `stream=True`.",
                       param="stream_options")


_MSGPACK_INTS = (-(2 ** 63), 2 ** 64 - 1)     # what msgpack can carry to the engine


def authorize_kv_transfer(ctx: ServerContext, request: Request,
                          params: dict[str, Any] | None) -> None:
    """APIError(403) when `params` ask this worker (one with a KV connector: without one
    they do nothing) to hold or load KV blocks and the caller presents neither the fleet
    token (`INTERNAL_TOKEN_HEADER`: a router of this fleet) nor the admin key. Checked
    before any other work for the request (docs/security.md)."""
    if ctx.ready.kv_transfer is None or not asks_for_kv(params):
        return
    secret = ctx.config.fleet_secret
    token = request.headers.get(INTERNAL_TOKEN_HEADER)
    if secret is not None and secret.check_token(PURPOSE_INTERNAL_HTTP, token):
        return
    if ctx.config.auth.identify(presented_authorization(request.headers)) is Caller.ADMIN:
        return
    why = ("this worker has no fleet secret" if secret is None else
           f"the {INTERNAL_TOKEN_HEADER} header is " + ("missing" if token is None
                                                        else "not this fleet's token"))
    raise APIError(403, f"kv_transfer_params that ask a worker to hold or load KV blocks "
                        f"(do_remote_decode, do_remote_prefill) are accepted only from this "
                        f"fleet's router or with the admin key: {why}",
                   param=KV_TRANSFER_PARAMS_KEY)


def check_kv_transfer_params(ctx: ServerContext, req: SamplingRequest,
                             prompts: list[list[int]]) -> None:
    """APIError(400) unless the request's `kv_transfer_params` (a JSON object, checked by
    the schema) can reach the engine: one engine request (n=1, one prompt), since the
    params name one request's blocks on one worker; within the bounds of
    `kvloop.kv_transfer.params.bounds_refusal` (sizes first, before any element is read);
    integers msgpack carries."""
    params = req.kv_transfer_params
    if params is None:
        return
    if req.n != 1 or len(prompts) != 1:
        raise APIError(400, f"kv_transfer_params needs one prompt and n=1 (they name one "
                            f"request's KV blocks), got {len(prompts)} prompt(s) and "
                            f"n={req.n}", param=KV_TRANSFER_PARAMS_KEY)
    refusal = bounds_refusal(params, len(prompts[0]), ctx.ready.block_size)
    if refusal is not None:
        raise APIError(400, f"kv_transfer_params: {refusal}", param=KV_TRANSFER_PARAMS_KEY)
    pending: list[Any] = [params]
    while pending:
        v = pending.pop()
        if isinstance(v, dict):
            pending.extend(v.values())
        elif isinstance(v, list):
            pending.extend(v)
        elif isinstance(v, int) and not _MSGPACK_INTS[0] <= v <= _MSGPACK_INTS[1]:
            raise APIError(400, f"kv_transfer_params: the integer {v} is out of the "
                                f"int64/uint64 range", param=KV_TRANSFER_PARAMS_KEY)


@dataclass(frozen=True)
class Constraint:
    """A request's structured-output constraint and the field it came from."""

    params: StructuredOutputsParams
    param: str


def request_constraint(ctx: ServerContext, req: SamplingRequest,
                       tools: ToolPlan | None = None) -> Constraint | None:
    """The constraint `req` asks for (response_format, structured_outputs, guided_*, or its
    tools); APIError(400) for a malformed one, two of them, one over the size limit, or an
    engine without a grammar backend."""
    extra = None
    if tools is not None and tools.constraint is not None:
        extra = ("tool_choice", tools.constraint)
    try:
        found = requested_constraint(req, extra)
        if found is not None:
            check_size(*found, ctx.config.max_structured_output_bytes)
    except ConstraintError as e:
        raise APIError(400, str(e), param=e.param) from e
    if found is None:
        return None
    if ctx.ready.structured_output_backend is None:
        raise APIError(400, NO_GRAMMAR_BACKEND, param=found[1])
    return Constraint(*found)


def _param_of(message: str) -> str | None:
    word = message.split(" ", 1)[0]
    return word if word.isidentifier() else None


def build_sampling_params(ctx: ServerContext, req: SamplingRequest, prompt_len: int,
                          asked: MaxTokens, logprobs: int | None,
                          constraint: Constraint | None = None,
                          echo_logprobs: int | None = None) -> SamplingParams:
    """The engine's SamplingParams for one prompt; APIError(400) for invalid input.
    `echo_logprobs`: a completion echoing its prompt asks for its logprobs at that count.

    `asked` is the output length the request asks for (`MaxTokens`): a number the context
    cannot hold after the prompt is a 400, as in vLLM; a default is clamped to the room left.
    """
    max_len = ctx.ready.max_model_len
    try:
        check_context_length(max_len, prompt_len, asked.asked)
    except ContextLengthError as e:
        raise APIError(400, str(e), param=e.param) from e
    defaults = ctx.config.default_sampling   # --generation-config: fields the request left out
    max_tokens = defaults.cap(asked.tokens(max_len - prompt_len))
    if logprobs is not None and logprobs > ctx.config.max_logprobs:
        raise APIError(400, f"Requested sample logprobs of {logprobs}, which is greater than "
                            f"max allowed: {ctx.config.max_logprobs}", param="logprobs")
    seed = None if req.seed == -1 else req.seed
    if seed is not None and not INT64_MIN <= seed <= INT64_MAX:
        raise APIError(400, "seed must be in the int64 range", param="seed")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(s == "" for s in stop):
        raise APIError(400, "stop cannot contain an empty string.", param="stop")
    check_priority(ctx, req.priority)
    ctx.check_token_ids(req.stop_token_ids or [], "stop_token_ids")
    _check_finite(req)
    temperature = defaults.pick("temperature", req.temperature, 1.0)
    if 0.0 < temperature < 0.01:
        temperature = 0.01
    try:
        check_prompt_logprobs(req, ctx.config.max_logprobs)
    except ValueError as e:
        raise APIError(400, str(e), param="prompt_logprobs") from e
    try:
        params = SamplingParams(
            n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens, temperature=temperature,
            top_p=defaults.pick("top_p", req.top_p, 1.0),
            top_k=_top_k(ctx, defaults.pick("top_k", req.top_k, None)),
            min_p=defaults.pick("min_p", req.min_p, 0.0),
            repetition_penalty=defaults.pick("repetition_penalty", req.repetition_penalty, 1.0),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0, seed=seed, stop=tuple(stop),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
            priority=req.priority, cache_salt=req.cache_salt or None,
            extra_args=(None if req.kv_transfer_params is None
                        else {KV_TRANSFER_PARAMS_KEY: req.kv_transfer_params}),
            structured_outputs=constraint.params if constraint else None,
            **extra_kwargs(req, echo_logprobs))
    except ValueError as e:
        raise APIError(400, str(e), param=_param_of(str(e))) from e
    if req.n > ctx.config.max_n:
        raise APIError(400, f"n must be at most {ctx.config.max_n}, got {req.n}.", param="n")
    if params.greedy:
        params = msgspec.structs.replace(params, top_p=1.0, top_k=0, min_p=0.0)
    params = model_stops(params, ctx.tokenizer)
    try:
        params.check_vocab(ctx.vocab_size)
    except ValueError as e:
        raise APIError(400, str(e), param=_param_of(str(e))) from e
    return params


def check_priority(ctx: ServerContext, priority: int) -> None:
    """APIError(400) for a priority the server cannot schedule by."""
    if priority != 0 and ctx.config.scheduling_policy != "priority":
        raise APIError(400, "priority is only supported with --scheduling-policy priority",
                       param="priority")
    if not INT64_MIN <= priority <= INT64_MAX:
        raise APIError(400, "priority must be in the int64 range", param="priority")


_FLOAT_PARAMS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")


def _check_finite(req: SamplingRequest) -> None:
    for name in _FLOAT_PARAMS:
        v = getattr(req, name)
        if v is not None and not math.isfinite(v):
            raise APIError(400, f"{name} must be a finite number, got {v}.", param=name)


def _top_k(ctx: ServerContext, top_k: int | None) -> int:
    """0 (disabled) for None, and for a k beyond the vocabulary (it keeps every token)."""
    if top_k is None or top_k >= ctx.vocab_size:
        return 0
    return top_k


# --- generation --------------------------------------------------------------------------------
@dataclass
class Child:
    """One engine request of an HTTP request: choice `index` of prompt `prompt_index`."""

    index: int
    prompt_index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    state: OutputState
    pooling_params: PoolingParams | None = None   # a pooling request (POST /v1/embeddings)
    lora_name: str | None = None                  # its LoRA adapter (`model` named one)


def log_received(ctx: ServerContext, base_id: str, prompts: list[list[int]],
                 params: list[SamplingParams]) -> None:
    """One "Received request" line per prompt, with the id its children's ids start with."""
    for p, (ids, sp) in enumerate(zip(prompts, params, strict=True)):
        log_request(ctx.config, ctx.tokenizer, f"{base_id}-{p}", ids, sp)


def make_children(ctx: ServerContext, base_id: str, prompts: list[list[int]],
                  params: list[SamplingParams], model: str | None = None) -> list[Child]:
    """The engine requests of an HTTP request; `model`: the name it sent (an adapter's
    selects that adapter)."""
    children = []
    lora_name = ctx.lora_name(model)
    for p, (ids, sp) in enumerate(zip(prompts, params, strict=True)):
        for i, child_sp in enumerate(fan_out(sp)):
            children.append(Child(p * sp.n + i, p, f"{base_id}-{p}-{i}", ids, child_sp,
                                  OutputState(ctx.tokenizer, ids, OutputOptions.of(sp)),
                                  lora_name=lora_name))
    return children


def request_tenant(ctx: ServerContext, request: Request) -> str | None:
    """The tenant of a request: a digest of the configured API key it presents (None for a
    caller without one: all keyless callers are one tenant), as its stored responses'
    owner."""
    return ctx.config.auth.owner(presented_authorization(request.headers))


class Generation:
    """The children of one HTTP request, submitted together, streamed as one."""

    def __init__(self, ctx: ServerContext, children: list[Child],
                 constraint: Constraint | None = None, tenant: str | None = None):
        """`tenant`: who sent it (`request_tenant`), for the engine's compile share."""
        self.ctx = ctx
        self.children = children
        self.tenant = tenant
        self.queue: asyncio.Queue[QueueItem] = asyncio.Queue()
        self.end = StreamEnd()
        self._pending = {c.request_id: c for c in children}
        self._held: list[QueueItem] = []   # taken from the queue, not yet read
        # the field an engine error names (the constraint's: its grammar may not compile)
        self.error_param = constraint.param if constraint else None

    def submit(self) -> None:
        """Admission control, then send every child: APIError(400) for more children than
        the limit admits at all, APIError(503) with Retry-After while the queue is full."""
        client, cfg = self.ctx.client, self.ctx.config
        limit = cfg.max_waiting_requests
        if limit is not None and len(self.children) > limit:
            raise self._never_admitted(limit)
        _raise_unavailable(client)
        if limit is not None and client.num_unscheduled + len(self.children) > limit:
            self.ctx.metrics.reject("max_waiting_requests")
            raise APIError(503, f"Too many requests waiting ({client.num_unscheduled} of at "
                                f"most {limit}); retry later.", "ServiceUnavailableError",
                           headers={"Retry-After": str(cfg.retry_after_s)})
        now = time.monotonic()
        try:
            for c in self.children:
                client.add_request(EngineCoreRequest(c.request_id, c.prompt_ids, c.params,
                                                     arrival_time=now,
                                                     pooling_params=c.pooling_params,
                                                     lora_name=c.lora_name,
                                                     tenant=self.tenant),
                                   self.queue)
        except BaseException:
            client.abort_requests(list(self._pending))
            raise
        per_prompt: dict[int, int] = {}
        for c in self.children:
            per_prompt[c.prompt_index] = per_prompt.get(c.prompt_index, 0) + 1
        for n in per_prompt.values():
            self.ctx.metrics.observe_n(n)

    def _never_admitted(self, limit: int) -> APIError:
        num_prompts = len({c.prompt_index for c in self.children})
        n = len(self.children) // num_prompts
        return APIError(400, f"This request needs {len(self.children)} sequences (n={n} for "
                             f"each of {num_prompts} prompt(s)), more than the "
                             f"{limit} that --max-waiting-requests lets wait at once; it can "
                             f"never be admitted. Reduce n or the number of prompts.",
                        param="n" if n > 1 else "prompt")

    def disconnect(self) -> None:
        self.queue.put_nowait((None, ClientDisconnected()))

    async def deltas(self) -> AsyncGenerator[tuple[Child, Delta], None]:
        """(child, delta) as outputs arrive, until every child has finished.

        Raises ServerShuttingDown, EngineDeadError or ClientDisconnected; on any exit the
        children still running are aborted in the engine.
        """
        client = self.ctx.client
        try:
            while self._pending:
                rid, item = await self._next()
                if isinstance(item, BaseException):
                    raise item
                child = self._pending.get(rid or "")
                if child is None:
                    continue
                delta = child.state.process(item)
                if delta.error is not None and delta.error.startswith(LORA_UNAVAILABLE) \
                        and child.lora_name is not None:
                    self.ctx.loras.forget(child.lora_name)
                if child.state.finished:
                    del self._pending[child.request_id]
                    client.finish_request(child.request_id, child.state.finish_reason or "stop")
                yield child, delta
        finally:
            client.abort_requests(list(self._pending))

    async def _next(self) -> QueueItem:
        """The next item, with what the engine sent for the same request since merged in
        (`merge_held`): a handler that falls behind streams once per wake, not per step."""
        if not self._held:
            self._held.append(await self.queue.get())
        if not self.queue.empty():
            while not self.queue.empty():
                self._held.append(self.queue.get_nowait())
            self._held = merge_held(self._held)
        return self._held.pop(0)

    async def verdict(self) -> None:
        """Wait for the engine's first output on this generation (kept for `deltas`), so a
        stream can still answer a 400: a constrained request gets one when its grammar does
        not compile (APIError(400) naming the constraint's field; the other children are
        aborted). Engine death and shutdown are left for the stream to report."""
        rid, item = await self.queue.get()
        self._held.append((rid, item))
        if not (isinstance(item, EngineCoreOutput) and item.error is not None):
            return
        if item.error.startswith(KV_LOAD_FAILED):
            return    # failed while running: the stream reports it (a 500 when not streaming)
        async with contextlib.aclosing(self.deltas()) as it:
            async for _, delta in it:
                raise engine_error(delta.error or item.error, self.error_param)

    async def stream_deltas(self) -> AsyncGenerator[tuple[Child, Delta], None]:
        """`deltas()` for a stream: shutdown, engine death or a child's error end it quietly,
        recorded in `self.end` for the stream's tail."""
        try:
            async with contextlib.aclosing(self.deltas()) as it:
                async for c, d in it:
                    if d.error is not None:
                        self.end.error = engine_error(d.error, self.error_param)
                        return
                    yield c, d
        except ServerShuttingDown:
            self.end.aborted = True
        except EngineDeadError as e:
            self.end.error = APIError(500, str(e))

    def unfinished(self) -> list[Child]:
        return [c for c in self.children if not c.state.finished]

    def abort_unfinished(self) -> None:
        """Abort in the engine whatever is still running (idempotent)."""
        self.ctx.client.abort_requests(list(self._pending))


def merge_held(held: list[QueueItem]) -> list[QueueItem]:
    """`held` with each output merged into the one of its request before it where they can
    merge (`merge_outputs`), up to the first exception (what follows it is left as it is).
    Each request's outputs keep their order; one pass."""
    merged: list[QueueItem] = []
    last: dict[str | None, int] = {}    # request id -> index of its last output in `merged`
    for k, (rid, item) in enumerate(held):
        if isinstance(item, BaseException):
            return merged + held[k:]
        j = last.get(rid)
        prior = merged[j][1] if j is not None else None
        both = merge_outputs(prior, item) if isinstance(prior, EngineCoreOutput) else None
        if j is not None and both is not None:
            merged[j] = (rid, both)
        else:
            last[rid] = len(merged)
            merged.append((rid, item))
    return merged


class GenerationStream(StreamingResponse):
    """An SSE response that aborts its generation's unfinished requests however it ends,
    even when the client leaves before the body iterator ever starts."""

    def __init__(self, body: AsyncIterator[bytes], gen: Generation):
        super().__init__(body, media_type="text/event-stream")
        self._gen = gen

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._gen.abort_unfinished()


def engine_error(message: str, param: str | None = None) -> APIError:
    """The answer to a request the engine ended with an error: 500 when it failed while
    running (its KV load failed: vLLM's finish_reason "error", docs/vllm-facts.md#openai-server),
    else 400 naming `param` (the engine refused it at admission, or its grammar: it can
    never run on this worker); 404 naming `model` when its LoRA adapter could not be read
    (the adapter is unloaded: as for one never loaded)."""
    if message.startswith(KV_LOAD_FAILED):
        return APIError(500, message)
    if message.startswith(LORA_UNAVAILABLE):
        return APIError(404, message, "model")
    return APIError(400, message, param)


def _raise_unavailable(client: EngineClient) -> None:
    try:
        client.check_available()
    except ServerShuttingDown as e:   # refused before anything ran: a router retries it
        raise APIError(503, str(e), headers=DRAINING_HEADERS) from e
    except EngineDeadError as e:
        raise APIError(500, str(e)) from e


async def _watch_disconnect(request: Request, gen: Generation) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            gen.disconnect()
            return


async def collect(request: Request, gen: Generation) -> None:
    """Run a non-streaming generation to the end (aborting it if the client goes away)."""
    watcher = asyncio.create_task(_watch_disconnect(request, gen))
    try:
        async with contextlib.aclosing(gen.deltas()) as it:
            async for _, delta in it:
                if delta.error is not None:
                    raise engine_error(delta.error, gen.error_param)
    except ServerShuttingDown as e:
        raise APIError(503, str(e)) from e
    except EngineDeadError as e:
        raise APIError(500, str(e)) from e
    except ClientDisconnected as e:  # nobody will read it; nginx's "client closed request"
        raise APIError(499, "client disconnected") from e
    finally:
        watcher.cancel()


# --- response pieces ---------------------------------------------------------------------------
def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def usage(children: list[Child], prompts: list[list[int]]) -> Usage:
    """OpenAI usage; cached tokens of each prompt are those of its first choice."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(len(c.state.token_ids) for c in children)
    first: dict[int, Child] = {}
    for c in children:
        first.setdefault(c.prompt_index, c)
    cached = sum(c.state.num_cached_tokens for c in first.values())
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion,
            "completion_tokens": completion, "prompt_tokens_details": {"cached_tokens": cached}}


def response_metrics(ctx: ServerContext, children: list[Child]) -> ResponseMetrics | None:
    """vLLM's per-request `metrics` (`--per-request-spec-decode-metrics summary` with
    speculative decoding on; None otherwise): the acceptance summary of the request's one
    sequence (null for n > 1, all zeros when it drafted nothing)."""
    k = ctx.config.spec_decode_metrics_k
    if k is None:
        return None
    if len(children) != 1:
        return {"speculative_decoding": None}
    return {"speculative_decoding": spec_summary(children[0].state.spec_decoding_stats, k)}


def spec_summary(stats: RequestSpecDecodingStats | None, k: int) -> SpecDecodingSummary:
    """vLLM's summary of one request's drafts (all zeros for None: it drafted nothing)."""
    stats = stats or RequestSpecDecodingStats()
    steps, drafted, accepted = (stats.num_spec_steps, stats.num_draft_tokens,
                                stats.num_accepted_tokens)
    return {"mean_acceptance_length": 1 + accepted / steps if steps else 1.0,
            "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
            "acceptance_histogram": stats.histogram(k),
            "acceptance_histogram_by_draft_length": {
                str(n): row for n, row in sorted(stats.by_draft_length.items())},
            "num_spec_steps": steps, "num_accepted_draft_tokens": accepted,
            "num_draft_tokens": drafted, "num_spec_tokens": k}


def handed_on(children: list[Child]) -> dict[str, Any] | None:
    """The `kv_transfer_params` a worker hands on (a prefill worker's, for the decode
    worker), from the finishing output of the request's one engine request; None when it has
    nothing to hand on."""
    return children[0].state.kv_transfer_params if len(children) == 1 else None


def echoed(c: Child, echo: list[str] | None) -> list[tuple[int, TokenLogprob | None]]:
    """The echoed prompt tokens of a choice and their prompt logprobs ([] without echo)."""
    if echo is None:
        return []
    lps = c.state.prompt_logprobs or [None] * len(c.prompt_ids)
    return list(zip(c.prompt_ids, lps, strict=True))


def completion_logprobs(ctx: ServerContext, entries: list[TokenLogprob], offset: int,
                        prompt: Sequence[tuple[int, TokenLogprob | None]] = (),
                        num_top: int = 0) -> CompletionLogprobs:
    """Legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset.

    Echoed prompt tokens (`prompt`: each with its prompt logprobs) come first, the first one
    with null logprobs; a position's `top_logprobs` holds its token and the top `num_top`
    (vLLM's); -inf is -9999.0.
    """
    out: CompletionLogprobs = {"text_offset": [], "token_logprobs": [], "tokens": [],
                               "top_logprobs": []}
    for tid, e in [*prompt, *((e.token_id, e) for e in entries)]:
        s = ctx.token_str(tid)
        out["text_offset"].append(offset)
        out["tokens"].append(s)
        offset += len(s)
        if e is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        top = {ctx.token_str(t): max(lp, LOGPROB_FLOOR) for t, lp in e.top[:num_top]}
        top.setdefault(s, max(e.logprob, LOGPROB_FLOOR))
        out["token_logprobs"].append(max(e.logprob, LOGPROB_FLOOR))
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(ctx: ServerContext, entries: list[TokenLogprob], num_top: int
                  ) -> ChatLogprobs:
    content: list[ChatTokenLogprob] = []
    for e in entries:
        s = ctx.token_str(e.token_id)
        top: list[TopLogprob] = [{"token": ctx.token_str(t), "logprob": lp,
                                  "bytes": list(ctx.token_str(t).encode())}
                                 for t, lp in e.top[:num_top]]
        content.append({"token": s, "logprob": e.logprob, "bytes": list(s.encode()),
                        "top_logprobs": top})
    return {"content": content}


# --- completions -------------------------------------------------------------------------------
async def create_completion(ctx: ServerContext, req: CompletionRequest,
                            request: Request) -> Response:
    ctx.check_model(req.model)
    authorize_kv_transfer(ctx, request, req.kv_transfer_params)
    _check_supported(req)
    if req.suffix:
        raise APIError(400, "suffix is not supported by kvloop", param="suffix")
    prompts = completion_prompts(ctx.tokenizer, req, ctx.ready.max_model_len)
    for ids in prompts:
        ctx.check_token_ids(ids, "prompt")
    check_kv_transfer_params(ctx, req, prompts)
    asked = MaxTokens.of(req)
    constraint = request_constraint(ctx, req)
    params = [build_sampling_params(ctx, req, len(ids), asked, req.logprobs, constraint,
                                    req.logprobs if req.echo else None) for ids in prompts]
    base = f"cmpl-{uuid.uuid4().hex}"
    gen = Generation(ctx, make_children(ctx, base, prompts, params, req.model), constraint,
                     request_tenant(ctx, request))
    gen.submit()
    log_received(ctx, base, prompts, params)
    echo = ([ctx.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens)
             for ids in prompts] if req.echo else None)
    if req.stream:
        if constraint is not None:
            await gen.verdict()
        return GenerationStream(_stream_completion(ctx, req, gen, base, prompts, echo), gen)
    await collect(request, gen)
    choices = [_completion_choice(ctx, req, c, echo) for c in gen.children]
    body: CompletionResponse = {
        "id": base, "object": "text_completion", "created": int(time.time()),
        "model": ctx.served_name(req.model), "choices": choices,
        "usage": usage(gen.children, prompts), "system_fingerprint": None,
        "kv_transfer_params": handed_on(gen.children)}
    metrics = response_metrics(ctx, gen.children)
    if metrics is not None:
        body["metrics"] = metrics
    return JSONResponse(body)


def _completion_choice(ctx: ServerContext, req: CompletionRequest, c: Child,
                       echo: list[str] | None) -> CompletionChoice:
    prefix = echo[c.prompt_index] if echo else ""
    lp = None
    if req.logprobs is not None:
        lp = completion_logprobs(ctx, c.state.logprobs, 0, echoed(c, echo), req.logprobs)
    choice: CompletionChoice = {
        "index": c.index, "text": prefix + c.state.text, "logprobs": lp,
        "finish_reason": c.state.finish_reason, "stop_reason": c.state.stop_reason}
    if c.state.prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs_body(c.state.prompt_logprobs, ctx.token_str)
    if req.return_token_ids:
        choice["prompt_token_ids"] = c.prompt_ids
        choice["token_ids"] = c.state.token_ids
    return choice


async def _stream_completion(ctx: ServerContext, req: CompletionRequest, gen: Generation,
                             base: str, prompts: list[list[int]], echo: list[str] | None
                             ) -> AsyncIterator[bytes]:
    created = int(time.time())
    offsets: dict[int, int] = {}
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

    def chunk(choice: CompletionChoice) -> bytes:
        body: CompletionStreamResponse = {"id": base, "object": "text_completion",
                                          "created": created,
                                          "model": ctx.served_name(req.model),
                                          "choices": [choice]}
        if continuous:
            body["usage"] = usage(gen.children, prompts)
        return sse(body)

    async for c, d in gen.stream_deltas():
        first = c.index not in offsets
        text = (echo[c.prompt_index] if echo and first else "") + d.text
        if not (text or d.finish_reason or d.token_ids):
            continue
        lp = None
        if req.logprobs is not None:
            lp = completion_logprobs(ctx, d.logprobs, offsets.get(c.index, 0),
                                     echoed(c, echo if first else None), req.logprobs)
        offsets[c.index] = offsets.get(c.index, 0) + len(text)
        choice: CompletionChoice = {"index": c.index, "text": text, "logprobs": lp,
                                    "finish_reason": d.finish_reason,
                                    "stop_reason": d.stop_reason}
        if req.return_token_ids:
            choice["token_ids"] = d.token_ids
            if first:
                choice["prompt_token_ids"] = c.prompt_ids
        yield chunk(choice)
    async for b in _stream_tail(ctx, req, gen, base, created, prompts, "text_completion"):
        yield b


# --- chat --------------------------------------------------------------------------------------
def _chat_logprobs_arg(ctx: ServerContext, req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise APIError(400, "when using `top_logprobs`, `logprobs` must be set to true.",
                           param="top_logprobs")
        if req.top_logprobs < 0:
            raise APIError(400, "`top_logprobs` must be a non-negative value.",
                           param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def chat_tools(ctx: ServerContext, req: ChatCompletionRequest) -> ToolPlan:
    """The request's tool plan (APIError(400) for tools used wrong, as vLLM)."""
    cfg = ctx.config
    try:
        return plan_tools(req, cfg.tool_call_parser if cfg.enable_auto_tool_choice else None)
    except ConstraintError as e:
        raise APIError(400, str(e), param=e.param) from e


@dataclass(frozen=True)
class ChatStart:
    """A chat request submitted to the engine: the request as served (`skip_special_tokens`
    off for an "auto" tool choice), its generation, prompt, tool plan and constraint, and the
    id its engine requests' ids start with."""

    req: ChatCompletionRequest
    gen: Generation
    prompt: list[int]
    tools: ToolPlan
    constraint: Constraint | None
    base: str


def start_chat(ctx: ServerContext, req: ChatCompletionRequest, request: Request,
               prefix: str = "chatcmpl-") -> ChatStart:
    """Check a chat request (APIError and PromptError: its 4xx), render its prompt and submit
    it; what the chat route and the Messages route (`kvloop.server.messages`) share."""
    ctx.check_model(req.model)
    authorize_kv_transfer(ctx, request, req.kv_transfer_params)
    _check_supported(req)
    tools = chat_tools(ctx, req)
    if tools.choice == "auto":   # vLLM: a parser may need the special tokens of its format
        req = req.model_copy(update={"skip_special_tokens": False})
    constraint = request_constraint(ctx, req, tools)
    prompt = chat_prompt(ctx.tokenizer, req, ctx.ready.max_model_len)
    check_kv_transfer_params(ctx, req, [prompt])
    params = build_sampling_params(ctx, req, len(prompt), MaxTokens.of(req),
                                   _chat_logprobs_arg(ctx, req), constraint=constraint)
    base = f"{prefix}{uuid.uuid4().hex}"
    gen = Generation(ctx, make_children(ctx, base, [prompt], [params], req.model),
                     constraint, request_tenant(ctx, request))
    gen.submit()
    log_received(ctx, base, [prompt], [params])
    return ChatStart(req, gen, prompt, tools, constraint, base)


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest,
                                 request: Request) -> Response:
    started = start_chat(ctx, req, request)
    req, gen, prompt, tools = started.req, started.gen, started.prompt, started.tools
    constraint, base = started.constraint, started.base
    if req.stream:
        if constraint is not None:
            await gen.verdict()
        return GenerationStream(_stream_chat(ctx, req, gen, base, prompt, tools), gen)
    await collect(request, gen)
    choices = [_chat_choice(ctx, req, c, answer(tools, c.state.text, c.state.finish_reason))
               for c in gen.children]
    body: ChatCompletionResponse = {
        "id": base, "object": "chat.completion", "created": int(time.time()),
        "model": ctx.served_name(req.model), "choices": choices,
        "usage": usage(gen.children, [prompt]), "system_fingerprint": None,
        "kv_transfer_params": handed_on(gen.children)}
    if req.return_token_ids:
        body["prompt_token_ids"] = prompt
    prompt_lps = gen.children[0].state.prompt_logprobs
    if prompt_lps is not None:
        body["prompt_logprobs"] = prompt_logprobs_body(prompt_lps, ctx.token_str)
    metrics = response_metrics(ctx, gen.children)
    if metrics is not None:
        body["metrics"] = metrics
    return JSONResponse(body)


def _chat_choice(ctx: ServerContext, req: ChatCompletionRequest, c: Child,
                 done: Answer) -> ChatChoice:
    lp = chat_logprobs(ctx, c.state.logprobs, req.top_logprobs or 0) if req.logprobs else None
    message: AssistantMessage = {"role": "assistant", "content": done.content}
    if done.tool_calls:
        message["tool_calls"] = done.tool_calls
    choice: ChatChoice = {"index": c.index, "message": message, "logprobs": lp,
                          "finish_reason": done.finish_reason,
                          "stop_reason": c.state.stop_reason}
    if req.return_token_ids:
        choice["token_ids"] = c.state.token_ids
    return choice


async def _stream_chat(ctx: ServerContext, req: ChatCompletionRequest, gen: Generation,
                       base: str, prompt: list[int], tools: ToolPlan) -> AsyncIterator[bytes]:
    created = int(time.time())
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    calls = {c.index: ToolCallStream(tools) for c in gen.children}

    def chunk(choice: ChatStreamChoice, prompt_ids: list[int] | None = None) -> bytes:
        body: ChatCompletionStreamResponse = {"id": base, "object": "chat.completion.chunk",
                                              "created": created,
                                              "model": ctx.served_name(req.model),
                                              "choices": [choice]}
        if prompt_ids is not None:   # vLLM's: the first chunk, with `return_token_ids`
            body["prompt_token_ids"] = prompt_ids
        if continuous:
            body["usage"] = usage(gen.children, [prompt])
        return sse(body)

    for c in gen.children:
        yield chunk({"index": c.index, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None, "stop_reason": None},
                    prompt if req.return_token_ids else None)
    async for c, d in gen.stream_deltas():
        delta, finish_reason = _chat_delta(calls[c.index], d)
        ids_only = d.token_ids and (req.return_token_ids or not tools.parses)
        if not (delta or d.finish_reason or ids_only):
            continue
        lp = chat_logprobs(ctx, d.logprobs, req.top_logprobs or 0) if req.logprobs else None
        choice: ChatStreamChoice = {"index": c.index, "delta": delta, "logprobs": lp,
                                    "finish_reason": finish_reason,
                                    "stop_reason": d.stop_reason}
        if req.return_token_ids:
            choice["token_ids"] = d.token_ids
        yield chunk(choice)
    async for b in _stream_tail(ctx, req, gen, base, created, [prompt], "chat.completion.chunk"):
        yield b


# --- token-in: vLLM's POST /inference/v1/generate ---------------------------------------------
def _generate_sampling(req: GenerateRequest) -> GenerateSamplingParams:
    """The request's sampling parameters with its top-level fields folded in (those win)."""
    sp = req.sampling_params
    return sp.model_copy(update={
        "model": req.model, "stream": req.stream, "stream_options": req.stream_options,
        "cache_salt": req.cache_salt or sp.cache_salt, "priority": req.priority or sp.priority,
        "kv_transfer_params": (sp.kv_transfer_params if req.kv_transfer_params is None
                               else req.kv_transfer_params)})


async def create_generate(ctx: ServerContext, req: GenerateRequest,
                          request: Request) -> Response:
    ctx.check_model(req.model)
    sp = _generate_sampling(req)
    authorize_kv_transfer(ctx, request, sp.kv_transfer_params)
    _check_supported(sp)
    ids = list(req.token_ids)
    if not ids:
        raise APIError(400, "token_ids must not be empty", param="token_ids")
    ctx.check_token_ids(ids, "token_ids")
    check_kv_transfer_params(ctx, sp, [ids])
    params = build_sampling_params(ctx, sp, len(ids), MaxTokens.of(sp), sp.logprobs)
    base = f"gen-{uuid.uuid4().hex}"
    gen = Generation(ctx, make_children(ctx, base, [ids], [params], req.model))
    gen.submit()
    log_received(ctx, base, [ids], [params])
    rid = req.request_id or base
    if sp.stream:
        return GenerationStream(_stream_generate(ctx, sp, gen, rid), gen)
    await collect(request, gen)
    prompt_lps = gen.children[0].state.prompt_logprobs
    body: GenerateResponse = {
        "request_id": rid, "kv_transfer_params": handed_on(gen.children),
        "prompt_logprobs": (None if prompt_lps is None
                            else prompt_logprobs_body(prompt_lps, ctx.token_str)),
        "choices": [_generate_choice(ctx, sp, c.index, c.state.token_ids, c.state.logprobs,
                                     c.state.finish_reason) for c in gen.children]}
    return JSONResponse(body)


def _generate_choice(ctx: ServerContext, sp: GenerateSamplingParams, index: int,
                     token_ids: list[int], logprobs: list[TokenLogprob],
                     finish_reason: str | None) -> GenerateChoice:
    lp = chat_logprobs(ctx, logprobs, sp.logprobs) if sp.logprobs is not None else None
    return {"index": index, "token_ids": token_ids, "logprobs": lp,
            "finish_reason": finish_reason}


async def _stream_generate(ctx: ServerContext, sp: GenerateSamplingParams, gen: Generation,
                           rid: str) -> AsyncIterator[bytes]:
    def chunk(choice: GenerateChoice) -> bytes:
        event: GenerateStreamResponse = {"request_id": rid, "choices": [choice]}
        return sse(event)

    async for c, d in gen.stream_deltas():
        if d.token_ids or d.finish_reason:
            yield chunk(_generate_choice(ctx, sp, c.index, d.token_ids, d.logprobs,
                                         d.finish_reason))
    if gen.end.error is not None:
        e = gen.end.error
        yield sse(error_body(e.message, e.status, e.param))
    elif gen.end.aborted:
        for c in gen.unfinished():
            yield chunk({"index": c.index, "token_ids": [], "logprobs": None,
                         "finish_reason": "abort"})
    yield SSE_DONE


def _chat_delta(calls: ToolCallStream, d: Delta) -> tuple[ChatDelta, str | None]:
    """One delta of a streamed chat choice: its content and tool calls (as `calls` reads the
    text), and its finish reason."""
    content, tool_calls = calls.push(d.text)
    finish_reason = d.finish_reason
    if finish_reason is not None:
        rest, more, finish_reason = calls.finish(finish_reason)
        content, tool_calls = content + rest, tool_calls + more
    delta: ChatDelta = {}
    if content:
        delta["content"] = content
    if tool_calls:
        delta["tool_calls"] = tool_calls
    return delta, finish_reason


# --- streaming common --------------------------------------------------------------------------
async def _stream_tail(ctx: ServerContext, req: SamplingRequest, gen: Generation, base: str,
                       created: int, prompts: list[list[int]], obj: str
                       ) -> AsyncIterator[bytes]:
    end = gen.end
    if end.error is not None:
        e = end.error
        yield sse(error_body(e.message, e.status, e.param))
    elif end.aborted:
        for c in gen.unfinished():
            empty: dict[str, Any] = {"content": ""} if obj.startswith("chat") else {}
            choice: dict[str, Any] = ({"index": c.index, "delta": empty, "logprobs": None,
                                       "finish_reason": "abort", "stop_reason": None}
                                      if obj.startswith("chat") else
                                      {"index": c.index, "text": "", "logprobs": None,
                                       "finish_reason": "abort", "stop_reason": None})
            yield sse({"id": base, "object": obj, "created": created,
                       "model": ctx.served_name(req.model), "choices": [choice]})
    if req.stream_options and req.stream_options.include_usage:
        tail: dict[str, Any] = {"id": base, "object": obj, "created": created,
                                "model": ctx.served_name(req.model), "choices": [],
                                "usage": usage(gen.children, prompts)}
        metrics = response_metrics(ctx, gen.children)   # vLLM's: on the usage chunk
        if metrics is not None:
            tail["metrics"] = metrics
        yield sse(tail)
    yield SSE_DONE
