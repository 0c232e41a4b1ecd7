"""`POST /v1/embeddings`: each input becomes one pooling request (kvloop.pooling_params) of the
same engine loop as generation, submitted, collected and aborted by `serving.Generation` like
any other; the answer is OpenAI's list of embeddings (fields: kvloop.front.embeddings).

The vector is vLLM's for a generative model served as an embedding model: the final-norm
hidden state of the input's last token, L2-normalized (`use_activation: false`: not).
"""

from __future__ import annotations

import time
import uuid

import msgspec
from fastapi import Request
from fastapi.responses import Response

from kvloop.core.request import ContextLengthError, check_context_length
from kvloop.front.embeddings import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    embedding_inputs,
    encode_vector,
)
from kvloop.front.processor import OutputOptions, OutputState
from kvloop.pooling_params import PoolingParams
from kvloop.sampling_params import SamplingParams
from kvloop.server.serving import (
    APIError,
    Child,
    Generation,
    ServerContext,
    check_priority,
    collect,
    log_received,
)


def pooling_params(ctx: ServerContext, req: EmbeddingRequest) -> PoolingParams:
    """The request's PoolingParams; APIError(400) for `dimensions` (vLLM refuses them for a
    model without matryoshka representation: every model kvloop serves)."""
    if req.dimensions is not None:
        raise APIError(400, f'Model "{ctx.served_name(req.model)}" does not support matryoshka '
                            f"representation, changing output dimensions will lead to poor "
                            f"results.", param="dimensions")
    return PoolingParams(normalize=req.use_activation is not False)


def check_inputs(ctx: ServerContext, inputs: list[list[int]]) -> None:
    """APIError(400) for a token id outside the vocabulary or an input the context cannot
    hold (a KV cache too small for it is the engine's 400)."""
    for ids in inputs:
        ctx.check_token_ids(ids, "input")
        try:
            check_context_length(ctx.ready.max_model_len, len(ids))
        except ContextLengthError as e:
            raise APIError(400, str(e), param="input") from e


async def create_embedding(ctx: ServerContext, req: EmbeddingRequest,
                           request: Request) -> Response:
    ctx.check_model(req.model)
    pooling = pooling_params(ctx, req)
    check_priority(ctx, req.priority)
    inputs = embedding_inputs(ctx.tokenizer, req, ctx.ready.max_model_len)
    check_inputs(ctx, inputs)
    params = SamplingParams(max_tokens=1, priority=req.priority,
                            cache_salt=req.cache_salt or None)
    base = f"embd-{uuid.uuid4().hex}"
    children = [Child(i, i, f"{base}-{i}", ids, params,
                      OutputState(ctx.tokenizer, ids, OutputOptions()), pooling,
                      lora_name=ctx.lora_name(req.model))
                for i, ids in enumerate(inputs)]
    gen = Generation(ctx, children)
    gen.submit()
    log_received(ctx, base, inputs, [params] * len(inputs))
    await collect(request, gen)
    data: list[EmbeddingData] = [
        {"index": c.index, "object": "embedding",
         "embedding": encode_vector(_vector(c), req.encoding_format)} for c in children]
    num_tokens = sum(len(ids) for ids in inputs)
    body: EmbeddingResponse = {
        "id": base, "object": "list", "created": int(time.time()),
        "model": ctx.served_name(req.model), "data": data,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens,
                  "completion_tokens": 0, "prompt_tokens_details": None}}
    return Response(msgspec.json.encode(body), media_type="application/json")


def _vector(child: Child) -> list[float]:
    vector = child.state.pooling_output
    if vector is None:     # `collect` raised for an engine error; this would be a bug
        raise APIError(500, f"request {child.request_id} finished without a vector")
    return vector
