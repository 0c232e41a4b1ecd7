"""Request, its status and its sampling parameters.

Owner: the scheduler alone changes `Request.status`, `num_computed_tokens` and the token
lists; the KV cache manager owns which blocks a request holds (a request holds no blocks).

A request's block hashes grow as tokens arrive: every time a block of `block_size` tokens
fills up (prompt or output), its chained hash is appended, so the prefix cache can store
generated tokens too.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec

from kvloop.core.hashing import BlockHasher, block_extra_keys


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
    """vLLM's statuses, in vLLM's order; everything after PREEMPTED is finished."""

    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
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


KV_TRANSFER_PARAMS_KEY = "kv_transfer_params"   # vLLM's key in SamplingParams.extra_args


def _check_extra_args(extra_args: dict[str, Any] | None) -> None:
    if extra_args is None:
        return
    if not isinstance(extra_args, dict) or not all(isinstance(k, str) for k in extra_args):
        raise ValueError("extra_args must be an object with string keys")
    params = extra_args.get(KV_TRANSFER_PARAMS_KEY)
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    try:
        msgspec.msgpack.encode(extra_args)
    except (TypeError, OverflowError) as e:
        raise ValueError(f"extra_args must be msgpack-serialisable: {e}") from e


class StructuredOutputKind(enum.Enum):
    """What a structured-output spec constrains the output to (vLLM's request types)."""

    JSON = "json"                 # a JSON schema
    JSON_OBJECT = "json_object"   # any JSON object
    REGEX = "regex"
    CHOICE = "choice"             # one of a list of strings
    GRAMMAR = "grammar"           # an EBNF (GBNF) grammar


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
NO_GRAMMAR_BACKEND = ("structured output is not supported by this engine: it has no grammar "
                      "backend (the simulator, --model sim, has none; serve a real model)")


class StructuredOutputsParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """vLLM's `StructuredOutputsParams`: exactly one constraint, and its options.

    A msgspec Struct inside `SamplingParams`, so it crosses to the engine as is and is checked
    again on decode (`__post_init__`: shape only; whether a schema, regex or grammar is valid
    is the grammar backend's verdict, `kvloop.core.structured_output`). `json` is a schema
    (a dict, or its JSON text); `choice` a non-empty list of strings; `grammar` EBNF.
    `disable_any_whitespace` allows no whitespace between JSON tokens (the default allows
    any, as vLLM's). `disable_additional_properties` is accepted for vLLM's sake and changes
    nothing: the backend already refuses properties a schema does not name unless it allows
    them. `whitespace_pattern` and `structural_tag` are refused.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINTS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one constraint of "
                             f"{', '.join(_CONSTRAINTS[:-1])}; got "
                             f"{', '.join(given) if given else 'none'}.")
        if self.structural_tag is not None:
            raise ValueError("structured outputs: structural_tag is not supported by kvloop.")
        if self.whitespace_pattern is not None:
            raise ValueError("structured outputs: whitespace_pattern is not supported by "
                             "kvloop's grammar backend (xgrammar).")
        if self.json_object is False:
            raise ValueError("structured outputs: json_object must be true when given.")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) for c in self.choice)):
            raise ValueError("structured outputs: choice must be a non-empty list of strings.")
        if isinstance(self.json, str):
            _check_json_text(self.json)
        for name in ("regex", "grammar"):
            if getattr(self, name) == "":
                raise ValueError(f"structured outputs: {name} must not be empty.")

    @property
    def kind(self) -> StructuredOutputKind:
        for kind in StructuredOutputKind:
            if getattr(self, kind.value) is not None:
                return kind
        raise AssertionError("checked in __post_init__")

    @property
    def spec(self) -> str:
        """The constraint as text: the schema's JSON (as given: the order of its properties is
        the order of the output's), the regex, the grammar, the choices as a JSON list; ""
        for json_object."""
        kind = self.kind
        if kind == StructuredOutputKind.JSON:
            return self.json if isinstance(self.json, str) else json.dumps(self.json)
        if kind == StructuredOutputKind.CHOICE:
            return json.dumps(self.choice)
        if kind == StructuredOutputKind.JSON_OBJECT:
            return ""
        return str(getattr(self, kind.value))

    @property
    def key(self) -> tuple[StructuredOutputKind, str, bool]:
        """What a compiled grammar depends on: (kind, spec, any whitespace); the cache key."""
        return self.kind, self.spec, not self.disable_any_whitespace


def _check_json_text(text: str) -> None:
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise ValueError(f"structured outputs: json is not valid JSON ({e}).") from None
    if not isinstance(schema, dict | bool):
        raise ValueError("structured outputs: json must be a JSON schema (an object).")


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """What to generate and when to stop; vLLM's names and defaults.

    One type for the offline API (`from kvloop import SamplingParams`, keyword arguments as
    vLLM's), the API server, the wire (`kvloop.wire.EngineCoreRequest` carries it as is) and
    the engine. A frozen msgspec Struct, as vLLM's own is a Struct: `__post_init__` runs on
    construction, on `msgspec.structs.replace` and on decode, so the engine process validates
    what it receives (a bad value is a `msgspec.ValidationError` naming the rule) and nobody
    converts field by field. Change with `msgspec.structs.replace`.

    `eos_token_id` is filled from the tokenizer by whoever builds the request; with
    `ignore_eos` it is not checked (it is still masked while `min_tokens` is not reached).
    `stop` (strings) is handled by the detokenizing frontend, not the engine.
    `extra_args` is vLLM's bag of request extensions, msgpack-serialisable (integers within
    int64/uint64); the engine reads `extra_args["kv_transfer_params"]` (a dict) as
    `Request.kv_transfer_params` (docs/disaggregation.md section 2).
    `structured_outputs` constrains what may be sampled (kvloop.core.structured_output).
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    eos_token_id: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = None
    skip_reading_prefix_cache: bool | None = None
    extra_args: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        _check_extra_args(self.extra_args)
        if isinstance(self.stop, str):
            msgspec.structs.force_setattr(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            msgspec.structs.force_setattr(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            msgspec.structs.force_setattr(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, "
                             f"got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens="
                             f"{self.max_tokens}, got {self.min_tokens}.")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable) or at least 1, "
                             f"got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, "
                             f"got {self.repetition_penalty}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], "
                             f"got {self.frequency_penalty}.")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def skips_prefix_cache(self) -> bool:
        """vLLM skips reading the prefix cache when prompt logprobs are asked for."""
        if self.skip_reading_prefix_cache is not None:
            return self.skip_reading_prefix_cache
        return self.prompt_logprobs is not None

    @property
    def effective_eos(self) -> int | None:
        return None if self.ignore_eos else self.eos_token_id


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
                 client_index: int = 0):
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.request_id = request_id
        self.client_index = client_index
        self.sampling_params = sampling_params
        self.priority = sampling_params.priority
        self.arrival_time = arrival_time
        self.lora_name = lora_name
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
        # its grammar, attached by the engine's StructuredOutputManager (None: unconstrained)
        self.structured_output_request: RequestGrammar | None = None
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        extra = sampling_params.extra_args or {}
        params = extra.get(KV_TRANSFER_PARAMS_KEY)   # a copy: the connector edits it
        self.kv_transfer_params: dict[str, Any] | None = (
            dict(params) if params is not None else None)
        self.num_external_computed_tokens = 0   # tokens loaded from a remote prefill (vLLM)
        self._hasher = hasher
        self.block_hashes: list[bytes] = []
        self._update_block_hashes()

    # --- derived sizes -------------------------------------------------------------------
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
        return [block_extra_keys(i, lora_name=self.lora_name, cache_salt=salt)
                for i in range(num_blocks)]

    def block_extra_keys(self, block_index: int) -> tuple[Any, ...] | None:
        return block_extra_keys(block_index, lora_name=self.lora_name,
                                cache_salt=self.sampling_params.cache_salt)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"computed={self.num_computed_tokens}, tokens={self.num_tokens})")
