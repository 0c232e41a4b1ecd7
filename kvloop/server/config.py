"""The API server's own frozen configuration (the engine's is `kvloop.config.EngineConfig`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvloop.batch.config import BatchConfig
from kvloop.config import DEFAULT_POLICY, DEFAULT_ROLE, ROLES, Role
from kvloop.front.auth import AuthConfig
from kvloop.front.http_limits import HttpLimits
from kvloop.front.tls import TlsConfig
from kvloop.server.generation_config import DefaultSampling
from kvloop.server.lora import LoRAServe
from kvloop.server.responses_store import ResponseStoreConfig
from kvloop.trust import FleetSecret

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
TOOL_CALL_PARSERS = ("hermes",)   # the formats kvloop/server/tools.py reads
DEFAULT_LOG_STATS_INTERVAL_S = 10.0
LOG_STATS_INTERVAL_ENV = "VLLM_LOG_STATS_INTERVAL"
DEFAULT_MAX_SPEC_BYTES = 64 * 1024   # the largest structured-output constraint compiled
MAX_SPEC_FLAG = "--structured-outputs-max-spec-bytes"


def log_stats_interval(environ: Mapping[str, str] | None = None) -> float:
    """Seconds between stats lines, read as vLLM reads `VLLM_LOG_STATS_INTERVAL`: a float;
    unset or <= 0 means 10. ValueError for text that is not a number."""
    text = (os.environ if environ is None else environ).get(LOG_STATS_INTERVAL_ENV)
    if text is None:
        return DEFAULT_LOG_STATS_INTERVAL_S
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{LOG_STATS_INTERVAL_ENV} must be a number of seconds, "
                         f"got {text!r}") from None
    return value if value > 0 else DEFAULT_LOG_STATS_INTERVAL_S


@dataclass(frozen=True)
class ServeConfig:
    """HTTP side of `kvloop serve`.

    `port` 0 binds an ephemeral port (the actual URL is printed). `max_waiting_requests`
    bounds the requests sent to the engine and not yet scheduled: beyond it a request gets 503
    with Retry-After, one that alone needs more sequences gets 400 (None: unbounded).
    `served_model_names` are the names clients may send in `model`; an answer names the one
    sent, or the first when the request named none. `log_requests` (off unless
    `--enable-log-requests`): one INFO line per request received, its prompt cut to
    `max_log_len` characters and ids (None: whole); `log_stats`: a stats line every
    `log_stats_interval_s` while busy (kvloop/server/logs.py). `auth`: API keys;
    `http_limits`: body size and read timeouts of the HTTP front; `tls`: HTTPS and client
    certificates (kvloop/front/tls.py; None: plain HTTP). `shutdown_timeout_s`: how
    long a SIGTERM lets requests in flight finish (0: they end at once).
    `enable_auto_tool_choice` with `tool_call_parser` (one of `TOOL_CALL_PARSERS`) serves
    `tool_choice: "auto"` (kvloop/server/tools.py); without them it is a 400.
    `advertise_host`: the address other hosts reach this worker at (None: `host`), and
    `advertise_how` how it was chosen (kvloop.front.advertise), said at start-up.
    `fleet_secret`: the fleet's shared key (kvloop/trust.py; None: this worker trusts no
    peer). `max_structured_output_bytes`: the largest constraint (schema, regex, grammar,
    choices, a tool's schema) a request may ask for; larger is a 400 before the engine sees
    it (kvloop/server/structured.py). `responses_store`: the bounds of the stored Responses
    API responses (kvloop/server/responses_store.py). `default_sampling`: what a request that
    leaves a sampling field out gets (`--generation-config`;
    kvloop/server/generation_config.py). `kv_shared_store`: the shared KV store this worker
    reads (`--kv-shared-store`, a URL without credentials), named to routers so they credit
    its blocks to every worker reading it. `lora`: the LoRA
    adapters served (kvloop/server/lora.py; None: no --enable-lora). `batch`: the Batch
    API (kvloop/batch; None: no /v1/files and /v1/batches routes).
    `spec_decode_metrics_k`: the engine's `num_speculative_tokens` when completions and chat
    completions carry each request's acceptance summary (`--per-request-spec-decode-metrics
    summary` with speculative decoding on; kvloop/server/serving.py); None: they carry none.
    """

    served_model_names: tuple[str, ...]
    model_path: str | None = None
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    advertise_how: str = ""
    kv_shared_store: str | None = None
    port: int = 0
    role: Role = DEFAULT_ROLE
    max_waiting_requests: int | None = 1024
    max_logprobs: int = 20
    max_n: int = 128
    retry_after_s: int = 1
    scheduling_policy: str = DEFAULT_POLICY
    log_level: str = "info"
    uvicorn_log_level: str = "info"
    log_requests: bool = False
    max_log_len: int | None = None
    engine_start_timeout_s: float = 900.0
    graceful_shutdown_s: float = 10.0
    shutdown_timeout_s: float = 0.0
    log_stats: bool = True
    log_stats_interval_s: float = DEFAULT_LOG_STATS_INTERVAL_S
    auth: AuthConfig = field(default_factory=AuthConfig)
    http_limits: HttpLimits = field(default_factory=HttpLimits)
    tls: TlsConfig | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    fleet_secret: FleetSecret | None = None
    max_structured_output_bytes: int = DEFAULT_MAX_SPEC_BYTES
    responses_store: ResponseStoreConfig = field(default_factory=ResponseStoreConfig)
    default_sampling: DefaultSampling = field(default_factory=DefaultSampling)
    lora: LoRAServe | None = None
    batch: BatchConfig | None = None
    spec_decode_metrics_k: int | None = None

    def __post_init__(self) -> None:
        if self.max_structured_output_bytes < 1:
            raise ValueError(f"{MAX_SPEC_FLAG} must be >= 1")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if not self.served_model_names:
            raise ValueError("served_model_names must name at least one model")
        if self.lora is not None and any(m.name in self.served_model_names
                                         for m in self.lora.modules):
            raise ValueError("a --lora-modules name may not be a --served-model-name")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError("max_waiting_requests must be >= 0")
        if self.max_logprobs < 0:
            raise ValueError("max_logprobs must be >= 0")
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(f"uvicorn_log_level must be one of {UVICORN_LOG_LEVELS}, got "
                             f"{self.uvicorn_log_level!r}")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"max_log_len must be >= 0, got {self.max_log_len}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
        if self.log_stats_interval_s <= 0:
            raise ValueError("log_stats_interval_s must be > 0")

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]
