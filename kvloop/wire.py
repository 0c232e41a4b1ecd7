"""Messages between processes: msgspec Structs, defined here and nowhere else (except
`SamplingParams`, `kvloop.sampling_params`', which requests carry as is).

Version: bump `WIRE_VERSION` on any incompatible change; the API server checks the engine
core's handshake (`EngineReady.wire_version`) against its own. `WorkerInfo` (the body of
`GET /kvloop/worker`) crosses from the API server to a router, as JSON.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from kvloop.config import EngineConfig, Role, RunnerConfig
from kvloop.events.config import KVEventsConfig
from kvloop.pooling_params import PoolingParams
from kvloop.sampling_params import SamplingParams
from kvloop.tracing import TracingConfig
from kvloop.trust import FleetSecret

WIRE_VERSION = 4


class PrefixCacheStats(msgspec.Struct, omit_defaults=True):
    """Prefix-cache lookups at admission, in tokens (vLLM's counting)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    reset: bool = False


class SpecDecodingStats(msgspec.Struct, omit_defaults=True):
    """Speculative decoding in one step (vLLM's counting): one draft per request that had
    drafts scheduled and sampled; `num_accepted_tokens_per_pos[i]` counts the drafts whose
    position i was accepted (so it never grows with i)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_accepted_tokens - len(per_pos)))
        for i in range(num_accepted_tokens):
            per_pos[i] += 1

    def add(self, other: SpecDecodingStats) -> None:
        """Accumulate another step's counts into this one."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (len(other.num_accepted_tokens_per_pos) - len(per_pos)))
        for i, n in enumerate(other.num_accepted_tokens_per_pos):
            per_pos[i] += n


# Why a KV load failed (`KVTransferStats.failures`, `kvloop:kv_transfer_failures_total{reason}`)
KV_FAILURE_UNREACHABLE = "unreachable"   # no answer from P within transfer_timeout
KV_FAILURE_MISMATCH = "mismatch"         # P's fingerprint or block size differs from D's
KV_FAILURE_REFUSED = "refused"           # P refused the Read (unknown or expired request)
KV_FAILURE_TRUNCATED = "truncated"       # P answered fewer blocks or bytes than asked for
KV_FAILURE_ERROR = "error"               # anything else (a bad reply, a failed write)
KV_FAILURE_CORRUPT = "corrupt"           # a tier record failed its MAC, hash or size check
KV_FAILURE_REASONS = (KV_FAILURE_UNREACHABLE, KV_FAILURE_MISMATCH, KV_FAILURE_REFUSED,
                      KV_FAILURE_TRUNCATED, KV_FAILURE_ERROR, KV_FAILURE_CORRUPT)
# How the `EngineCoreOutput.error` of a request failed by its KV load (policy "fail") begins:
# the API server answers it as vLLM answers finish_reason "error", 500, where an error the
# engine refused a request with at admission is the client's (400).
KV_LOAD_FAILED = "KV transfer failed"
# How the error of a request whose LoRA adapter could not be read (its folder gone, a file
# unreadable) begins: the engine unloads the adapter, the API server stops listing it and
# answers 404 naming `model`, as for an adapter never loaded.
LORA_UNAVAILABLE = "LoRA adapter unavailable"

# `kv_transfer_params` (vLLM's keys, docs/disaggregation.md section 2): what a router's
# prefill leg sends P (vLLM's proxy sends exactly these), and what D must find in P's answer,
# besides `do_remote_prefill`, to pull (`missing_remote_keys`: the router checks P's answer
# with it before a decode leg, D's connector before a pull).
PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None}
REQUIRED_REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port",
                        "remote_block_ids")


def missing_remote_keys(params: dict[str, Any]) -> list[str]:
    """The `REQUIRED_REMOTE_KEYS` that `params` lack, in that order: absent, null or empty
    (vLLM's rule). [] when D has what it needs to pull (whether each value is well formed is
    `kvloop.kv_transfer.params`' to check)."""
    return [k for k in REQUIRED_REMOTE_KEYS if params.get(k) in (None, "", [])]


def malformed_remote_field(params: dict[str, Any]) -> str | None:
    """Why a field of P's `kv_transfer_params` (a fleet member's) has the wrong type or an
    impossible value, else None: cheap checks of each field present, before any element of
    `remote_block_ids` is looked at. D refuses such params with a 400 before any work; the
    router serves the request decode-only rather than pass them on (issue 37, low: a
    malformed `remote_port` gave a 500)."""
    for key in ("remote_engine_id", "remote_request_id", "remote_host"):
        if key in params and not isinstance(params[key], str | None):
            return f"{key} must be a string"
    if not isinstance(params.get("remote_block_ids", []), list | None):
        return "remote_block_ids must be a list of block ids"
    for key, low, high in _INT_FIELDS:
        value = params.get(key)
        if value is not None and not (_is_int(value) and low <= value <= high):
            return f"{key} must be a whole number from {low} to {high}, got {_short(value)}"
    lease = params.get("lease_expires_in_s")
    if lease is not None and not (isinstance(lease, int | float) and not isinstance(lease, bool)
                                  and 0 <= lease <= MAX_LEASE_FIELD_S):
        return f"lease_expires_in_s must be seconds from 0 to {MAX_LEASE_FIELD_S:g}"
    for key in ("do_remote_prefill", "do_remote_decode"):
        if not isinstance(params.get(key, False), bool | None):
            return f"{key} must be true or false"
    if not isinstance(params.get("kv_fingerprint", {}), dict | None):
        return "kv_fingerprint must be an object"
    return None


MAX_LEASE_FIELD_S = 86_400.0
_INT_FIELDS = (("remote_port", 1, 65_535), ("block_size", 1, 1 << 16),
               ("remote_num_tokens", 1, 1 << 31), ("remote_prefill_cached_tokens", 0, 1 << 31))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class KVTransferStats(msgspec.Struct, omit_defaults=True):
    """One step's KV-connector counters (docs/disaggregation.md section 5), and two gauges.

    Send side (P): `transfers_sent` counts Reads served, `bytes_sent` their payload;
    `expired_requests` leases released without a `Done` (vLLM's `nixl_num_kv_expired_reqs`);
    `held_requests` (gauge) the leases open now. Receive side (D): `transfers_received` counts
    loads finished with their blocks, `bytes_received` their payload, `transfer_seconds` one
    duration per load (admission to completion: the histogram), `failures` failed loads by
    reason (`KV_FAILURE_REASONS`); `loading_requests` (gauge) requests in
    WAITING_FOR_REMOTE_KVS now. `external_prefix_cache_queries` / `_hits` are vLLM's connector
    prefix stats, in tokens: queries = prompt tokens less the local hit, hits = tokens loaded.
    """

    transfers_sent: int = 0
    transfers_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    transfer_seconds: list[float] = msgspec.field(default_factory=list)
    failures: dict[str, int] = msgspec.field(default_factory=dict)
    expired_requests: int = 0
    held_requests: int = 0
    loading_requests: int = 0
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0

    @property
    def has_counts(self) -> bool:
        """Whether any counter (not gauge) is non-zero: news for the API server."""
        return bool(self.transfers_sent or self.transfers_received or self.transfer_seconds
                    or self.failures or self.expired_requests
                    or self.external_prefix_cache_queries)


class LoRAStats(msgspec.Struct, omit_defaults=True):
    """The adapters of the running and the waiting requests (names, sorted) and
    --max-loras: what vLLM's `vllm:lora_requests_info` gauge labels carry."""

    max_lora: int = 0
    running_lora_adapters: list[str] = msgspec.field(default_factory=list)
    waiting_lora_adapters: list[str] = msgspec.field(default_factory=list)


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_stats: PrefixCacheStats = msgspec.field(default_factory=PrefixCacheStats)
    num_preemptions: int = 0
    step_index: int = 0
    spec_decoding_stats: SpecDecodingStats | None = None   # None: no drafts this step
    kv_transfer: KVTransferStats | None = None     # None: the engine has no KV connector
    lora: LoRAStats | None = None                  # None: LoRA is off
    # vllm:num_requests_waiting_by_reason: capacity, deferred, each reason (core/waiting.py)
    num_waiting_by_reason: dict[str, int] | None = None


class TopLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of one sampled token: its own, its rank, and the top-n alternatives."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


class PromptLogprobsChunk(msgspec.Struct, array_like=True):
    """Prompt logprobs of one prefill chunk: `entries[i]` scores prompt token
    `first_position + i` (>= 1: the first prompt token has none); `token_id` is that prompt
    token. A chunk computed again after a preemption repeats positions with equal values."""

    first_position: int
    entries: list[TopLogprobs]


class EngineCoreOutput(msgspec.Struct, omit_defaults=True):
    """New tokens of one request after one step (only sent when there is news)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    new_logprobs: list[TopLogprobs] | None = None
    # scored prompt tokens of this step's chunk (sent even when no token was sampled)
    new_prompt_logprobs: PromptLogprobsChunk | None = None
    error: str | None = None          # the engine refused or failed this request
    # what a finished request hands on (P -> proxy -> D); sent on the finishing output
    kv_transfer_params: dict[str, Any] | None = None
    # a pooling request's vector (kvloop.pooling_params), on its finishing output
    pooling_output: list[float] | None = None
    # the part of num_cached_tokens loaded from outside the pool (a KV tier, P's hit)
    num_external_computed_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None




# --- API server <-> engine core process -------------------------------------------------------
# Client -> engine: multipart [engine_identity, request_type, msgpack payload] on a ROUTER
# (the engine's DEALER sees [request_type, payload]). Engine -> client: one msgpack
# `EngineCoreOutputs` frame per message on PUSH/PULL, or `ENGINE_CORE_DEAD`.

class RequestType:
    """First frame of a client -> engine message (vLLM's byte values)."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x03"


ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """ADD: one request, already tokenized (the API server owns the tokenizer)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    lora_name: str | None = None
    client_index: int = 0
    pooling_params: PoolingParams | None = None   # a pooling request: no token, a vector
    # W3C traceparent/tracestate of the API server's span (kvloop.tracing; None: untraced)
    trace_headers: dict[str, str] | None = None
    # who sent it: a digest of its API key (None: keyless); its grammar compile's tenant
    tenant: str | None = None


class UtilityRequest(msgspec.Struct, array_like=True):
    """UTILITY: call a whitelisted engine method by name; answered by a `UtilityOutput`."""

    call_id: int
    method: str
    args: list[bool | int | float | str | None] = msgspec.field(default_factory=list)


class UtilityOutput(msgspec.Struct, omit_defaults=True):
    call_id: int
    result: dict[str, bool | int | float | str | None] | bool | None = None
    failure_message: str | None = None


class KVEventsInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Where a worker publishes its KV-cache events: the publisher's actual addresses (port 0
    resolved). In `GET /kvloop/worker` an ipc:// endpoint (a file path) is None for a caller
    who may not see paths.

    On a NATS event plane (`kvloop.events.nats_plane`): `endpoint` is the server's URL without
    credentials, `replay_endpoint` the worker's query subject, `subject` its data subject,
    `worker_id` the id its messages carry, `payload_format` "vllm" or "dynamo".
    `curve`: the ZMQ sockets admit only CURVE clients with the fleet secret's KV-event keys;
    `token_ids`: False when BlockStored events carry no token ids (`omit_token_ids`).
    A caller the worker does not admit (`kvloop.server.api`) sees neither address."""

    endpoint: str | None
    replay_endpoint: str | None
    topic: str
    recency: bool
    subject: str | None = None
    worker_id: int | None = None
    payload_format: str | None = None
    curve: bool = False
    token_ids: bool = True


class KVTransferInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's KV connector, for a router and for the API server's logs: the engine id D
    addresses P by, the role, the side channel's bound address (port 0 resolved) and the
    configured transport ("auto", "tcp", "shm")."""

    engine_id: str
    kv_role: str
    side_channel_host: str
    side_channel_port: int
    transport: str


class EngineFacts(msgspec.Struct, frozen=True, kw_only=True):
    """What an engine reports once its runner is loaded, under the names they keep from the
    handshake (`EngineReady`) through `GET /kvloop/worker` (`WorkerInfo`) to the router's
    registry (`kvloop.router.registry.WorkerDescription`): what nobody knows before the engine
    starts (KV capacity, the resolved hash seed, the bound KV-event addresses)."""

    max_model_len: int
    num_gpu_blocks: int          # including the null block, as vLLM counts
    block_size: int
    enable_prefix_caching: bool
    hash_algo: str
    hash_seed: str
    max_num_batched_tokens: int
    max_num_seqs: int
    epoch: str | None            # this worker incarnation's id (the KV-event epoch)
    kv_events: KVEventsInfo | None    # None: no KV events
    kv_transfer: KVTransferInfo | None = None    # None: no KV connector


class EngineReady(EngineFacts, frozen=True, kw_only=True, tag=True):
    """Handshake: the engine's first message on its input socket, once the runner is loaded:
    its facts, its process id, the runner's model name and vocabulary size, and the grammar
    backend that serves structured output (None: the engine refuses it)."""

    wire_version: int
    pid: int
    model_name: str
    vocab_size: int | None
    structured_output_backend: str | None = None


class EngineStartFailed(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Handshake instead of `EngineReady` when start-up failed (the engine then exits 1)."""

    wire_version: int
    pid: int
    error: str


EngineHandshake = EngineReady | EngineStartFailed


class WorkerInfo(EngineFacts, frozen=True, kw_only=True):
    """`GET /kvloop/worker`, what a router decodes when this worker registers: the engine's
    facts and the API server's. `kv_capacity_blocks` counts the usable blocks
    (`num_gpu_blocks` less the null block). The private fields (process ids, the model's
    path) are left out (`UNSET`) for a caller who may not see them; `api_key_accepted` says
    whether the caller's key was accepted; `lora_adapters` names the LoRA adapters a request's
    `model` may select here."""

    model: str
    served_model_names: list[str]
    model_path: str | None | UnsetType = UNSET
    role: Role
    kv_capacity_blocks: int
    api_pid: int | UnsetType = UNSET
    engine_pid: int | UnsetType = UNSET
    version: str
    api_key_required: bool
    api_key_accepted: bool
    # The shared KV store this worker reads and writes (`--kv-shared-store`), as an id equal
    # on every worker of one store and free of credentials (None: none). A router credits a
    # block one worker put there to every worker naming the same store.
    kv_shared_store: str | None = None

    lora_adapters: list[str] = msgspec.field(default_factory=list)   # LoRA adapters loaded


TOKENIZER_FILES_PATH = "/kvloop/tokenizer"   # a worker's tokenizer, for a router on another host


class TokenizerFiles(msgspec.Struct, frozen=True, kw_only=True):
    """`GET /kvloop/tokenizer`: what a router needs to tokenize prompts exactly as this
    worker does, when it cannot read the model's files itself (another host). `kind` is
    "bpe" (`tokenizer_json` is the `tokenizers` library's JSON) or "byte" (the simulator's
    byte vocabulary: nothing more is needed)."""

    model: str
    kind: str
    tokenizer_json: str | None = None
    chat_template: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    extra_eos_ids: list[int] = msgspec.field(default_factory=list)


class WorkerAnnouncement(msgspec.Struct, frozen=True, kw_only=True):
    """A worker on the NATS event plane says it is there (JSON on
    `namespace.{ns}.kvloop.workers`, every `interval_s`), and that it leaves (`withdrawn`).
    `info` is its `GET /kvloop/worker` answer as a caller without private facts sees it;
    `worker_id` the id its KV-event messages carry."""

    url: str
    info: WorkerInfo
    worker_id: int
    interval_s: float
    withdrawn: bool = False


class RouterLoad(msgspec.Struct, frozen=True, kw_only=True):
    """One router replica's ticket event, for the other replicas of its fleet (JSON on
    `namespace.{ns}.kvloop.router-load`, kvloop/router/replicas.py): `op` "open" (a request
    sent to `worker`, with its prompt's size and the block hashes the worker will cache),
    "first" (its first token came), "close" (it ended)."""

    replica: str
    ticket: int
    op: str
    worker: str = ""
    prompt_tokens: int = 0
    uncached_tokens: int = 0
    hashes: list[int] = []


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    """Everything one engine step (or one utility call) sends to the API server.

    `timestamp` is `time.monotonic()` at the end of the step (one clock per host, so the API
    server compares it with its own arrival times). `scheduled` lists requests admitted for the
    first time this step, `preempted` those preempted; `iteration_tokens` counts the tokens the
    step computed. `faults` (sent when they change, `[]` once cleared; None: unchanged) name
    the engine's internal threads that died (the KV connector's): the worker is unhealthy.
    """

    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    engine_index: int = 0
    scheduled: list[str] | None = None
    preempted: list[str] | None = None
    iteration_tokens: int = 0
    utility_output: UtilityOutput | None = None
    faults: list[str] | None = None


class EngineStartConfig(msgspec.Struct, omit_defaults=True):
    """What the API server tells a new engine core process: one JSON line on its stdin.

    The engine process builds its runner by calling `runner.factory` ("module:function")
    with `runner`; the runner's facts (`kvloop.core.runner.LoadedRunner`: KV blocks, context
    length, vocabulary size, model name) override the template values of `engine`; the two
    configs must agree on the block size. `kv_events` configures the engine's KV-event
    publisher (None: no KV events).
    `shutdown_timeout_s` is how long a SIGTERM lets the engine go on serving (the API server
    drains its requests meanwhile and then closes the pipe); 0 stops it at once.
    `fleet_secret` travels on the stdin pipe only (kvloop/trust.py: never on a command line).
    """

    engine: EngineConfig
    runner: RunnerConfig
    input_address: str
    output_address: str
    trace_file: str | None = None
    kv_events: KVEventsConfig | None = None
    epoch: str | None = None       # this worker incarnation's id (the KV-event epoch)
    engine_index: int = 0
    log_level: str = "INFO"
    shutdown_timeout_s: float = 0.0
    fleet_secret: str | None = None   # the fleet secret's text (kvloop.trust); never printed
    tracing: TracingConfig | None = None   # --otlp-traces-endpoint (kvloop.tracing)

    def __repr__(self) -> str:
        return f"EngineStartConfig(engine_index={self.engine_index}, epoch={self.epoch!r}, ...)"

    def secret(self) -> FleetSecret | None:
        return None if self.fleet_secret is None else FleetSecret.from_text(self.fleet_secret)

    def __post_init__(self) -> None:
        if self.runner.block_size != self.engine.cache.block_size:
            raise ValueError(f"the runner's block_size ({self.runner.block_size}) differs "
                             f"from the engine's ({self.engine.cache.block_size})")
