"""What a pooling request asks for: `PoolingParams`, vLLM's name for the non-generative
counterpart of `SamplingParams`.

A request that carries `PoolingParams` (on the wire `kvloop.wire.EngineCoreRequest`, in the
engine `kvloop.core.request.Request.pooling_params`) is a pooling request: the scheduler
schedules its prompt like any prefill (chunked, prefix hits included) and, in the step that
computes its last prompt token, the runner returns a vector instead of sampling a token; the
request then finishes with that vector and no output token.

kvloop pools as vLLM pools a generative model served as an embedding model (`*ForCausalLM`
with `--convert embed`, vLLM's `as_embedding_model`): the final-norm hidden state of the last
prompt token (pooling type LAST), L2-normalized unless `normalize` is False.
It imports nothing of kvloop, like `kvloop.sampling_params`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

PoolingTask = Literal["embed"]


class PoolingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """`task`: what the vector is for (only "embed"); `normalize`: L2-normalize it (vLLM's
    default for "embed": True)."""

    task: PoolingTask = "embed"
    normalize: bool = True
