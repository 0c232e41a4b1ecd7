"""Request and its status (its sampling parameters are `kvloop.sampling_params`', re-exported
here).

Owner: the scheduler alone changes `Request.status`, `num_computed_tokens` and the token
lists; the KV cache manager owns which blocks a request holds (a request holds no blocks).

A request's block hashes grow as tokens arrive: every time a block of `block_size` tokens
fills up (prompt or output), its chained hash is appended, so the prefix cache can store
generated tokens too.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from kvloop.core.hashing import BlockHasher, block_extra_keys
from kvloop.pooling_params import PoolingParams as PoolingParams
from kvloop.sampling_params import KV_TRANSFER_PARAMS_KEY as KV_TRANSFER_PARAMS_KEY
from kvloop.sampling_params import NO_GRAMMAR_BACKEND as NO_GRAMMAR_BACKEND
from kvloop.sampling_params import SamplingParams as SamplingParams
from kvloop.sampling_params import StructuredOutputKind as StructuredOutputKind
from kvloop.sampling_params import StructuredOutputsParams as StructuredOutputsParams
from kvloop.wire import RequestSpecDecodingStats


class RequestGrammar(Protocol):
    """A request's grammar as the scheduler sees it (kvloop.core.structured_output's
    `StructuredOutputRequest` implements it; the request module imports none of it).

    `poll()`: ready yet (a failed compile sets `error`); `release()`: the request no longer
    waits for its compile; `accept_token` / `is_terminated` / `valid_prefix`: the grammar's
    state as tokens are appended (`valid_prefix` leaves it as is)."""

    error: str | None

    def poll(self) -> bool: ...
    def release(self) -> None: ...
    def accept_token(self, token_id: int) -> bool: ...
    def is_terminated(self) -> bool: ...
    def valid_prefix(self, tokens: Sequence[int]) -> list[int]: ...


class RequestStatus(enum.IntEnum):
    """vLLM's statuses, in vLLM's order (WAITING_FOR_LORA added, vLLM skips such a request
    without a status); everything after PREEMPTED is finished."""

    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    WAITING_FOR_LORA = enum.auto()     # kvloop's: its adapter has no slot yet (`AdapterSlots`)
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REPETITION = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_REPETITION: "repetition",
}


def finish_reason(status: RequestStatus) -> str | None:
    """The OpenAI-style finish reason of a finished status ("stop", "length", "abort"...)."""
    return _FINISH_REASONS.get(status)


class ContextLengthError(ValueError):
    """A request that can never fit the model's context; `param` names the field at fault."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class TokenIdError(ValueError):
    """A token id outside the model's vocabulary; `param` names the field at fault."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_token_ids(ids: Iterable[int], vocab_size: int, param: str = "prompt") -> None:
    """Raise TokenIdError for the first id outside [0, vocab_size): the model's embedding
    has no row for it, so the step that read it would fail for every request in it."""
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise TokenIdError(f"Token id {bad} is out of vocabulary [0, {vocab_size})", param)


def check_context_length(max_model_len: int, prompt_len: int,
                         max_tokens: int | None = None) -> None:
    """Raise ContextLengthError unless the request can fit the context, with vLLM's words
    (its serving layer's input validation): the prompt must leave room for at least one
    output token, and `max_tokens`, when the caller asked for a number, must fit in that room
    (prompt + max_tokens <= max_model_len). `max_tokens` None: nothing asked, no check."""
    if prompt_len >= max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {prompt_len} input tokens. Please reduce the length of the input "
            f"messages.", "prompt")
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise ContextLengthError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
            f"model's maximum context length is {max_model_len} tokens and your request has "
            f"{prompt_len} input tokens ({max_tokens} > {max_model_len} - {prompt_len}).",
            "max_tokens")


class Request:
    """One generation request as the engine core sees it.

    Token regions (`num_tokens_with_spec` is what `num_computed_tokens` chases):

        | prompt ............ | outputs ...... | drafts |
        |<-- num_computed -->|
        |<------------- num_tokens ---------->|
        |<------------- num_tokens_with_spec ----------->|
    """

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int],
                 sampling_params: SamplingParams, arrival_time: float = 0.0,
                 hasher: BlockHasher | None = None, lora_name: str | None = None,
                 client_index: int = 0, pooling_params: PoolingParams | None = None,
                 lora_path: str | None = None):
        """`pooling_params`: a pooling request (kvloop.pooling_params): it finishes with a
        vector when its prompt is computed and never samples; its `sampling_params` still
        carry its priority and cache salt. `lora_path`: the second field of the LoRA extra
        key beside `lora_name` (kvloop: None, or a reload marker, `AdapterSlots.hash_key`)."""
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.request_id = request_id
        self.client_index = client_index
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        self.priority = sampling_params.priority
        self.arrival_time = arrival_time
        self.lora_name = lora_name
        self.lora_path = lora_path
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.max_tokens = sampling_params.max_tokens
        self.eos_token_id = sampling_params.effective_eos
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.num_cached_tokens: int | None = None  # prefix hit at the first admission
        self.spec_token_ids: list[int] = []
        # its drafts' verifications so far (None: none yet), for the per-request figure
        self.spec_decoding_stats: RequestSpecDecodingStats | None = None
        # its grammar, attached by the engine's StructuredOutputManager (None: unconstrained)
        self.structured_output_request: RequestGrammar | None = None
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        extra = sampling_params.extra_args or {}
        params = extra.get(KV_TRANSFER_PARAMS_KEY)   # a copy: the connector edits it
        self.kv_transfer_params: dict[str, Any] | None = (
            dict(params) if params is not None else None)
        self.num_external_computed_tokens = 0   # tokens loaded from a remote prefill (vLLM)
        self.num_local_cached_tokens: int | None = None   # the pool's hit of a loaded request
        # the W3C context of its trace (kvloop.tracing): the KV connector passes it to P
        self.trace_headers: dict[str, str] | None = None
        # who sent it (a digest of its API key; None: a keyless caller): its grammar's
        # compile counts against this tenant's share (kvloop.core.compile_queue)
        self.tenant: str | None = None
        self._hasher = hasher
        self.block_hashes: list[bytes] = []
        self._update_block_hashes()

    # --- derived sizes -------------------------------------------------------------------
    @property
    def num_external_cached_tokens(self) -> int:
        """The part of `num_cached_tokens` loaded from outside the pool (a tier's blocks, the
        prefill worker's own hit): `vllm:prompt_tokens_by_source{source="external_kv_transfer"}`."""
        if self.num_local_cached_tokens is None:
            return 0
        return max(0, (self.num_cached_tokens or 0) - self.num_local_cached_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    @property
    def use_structured_output(self) -> bool:
        return self.sampling_params.structured_outputs is not None

    def __lt__(self, other: Request) -> bool:
        """Priority-queue order: (priority, arrival_time, request_id)."""
        return ((self.priority, self.arrival_time, self.request_id)
                < (other.priority, other.arrival_time, other.request_id))

    # --- mutation (scheduler only) --------------------------------------------------------
    def append_output_token_ids(self, token_id: int) -> None:
        """Append one sampled token and hash any block it completes."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self._hasher is not None and len(self.all_token_ids) % self._hasher.block_size == 0:
            self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        hasher = self._hasher
        if hasher is None:
            return
        start = len(self.block_hashes)
        if (start + 1) * hasher.block_size > len(self.all_token_ids):
            return
        parent = self.block_hashes[-1] if self.block_hashes else None
        extra = self._extra_keys_upto(len(self.all_token_ids) // hasher.block_size)
        self.block_hashes.extend(hasher.hash_range(self.all_token_ids, parent, start, extra))

    def _extra_keys_upto(self, num_blocks: int) -> list[tuple[Any, ...] | None] | None:
        salt = self.sampling_params.cache_salt
        if salt is None and self.lora_name is None:
            return None
        return [block_extra_keys(i, lora_name=self.lora_name, lora_path=self.lora_path,
                                 cache_salt=salt)
                for i in range(num_blocks)]

    def block_extra_keys(self, block_index: int) -> tuple[Any, ...] | None:
        return block_extra_keys(block_index, lora_name=self.lora_name,
                                lora_path=self.lora_path,
                                cache_salt=self.sampling_params.cache_salt)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"computed={self.num_computed_tokens}, tokens={self.num_tokens})")
