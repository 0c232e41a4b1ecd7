"""Frozen configuration of the router: index bounds, cost model, liveness windows, addresses.

Values learned at run time (each worker's block size, hash algorithm and seed, KV capacity)
are never written here; they live in the registry's worker descriptions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvloop.batch.config import BatchConfig
from kvloop.config import DEFAULT_BLOCK_SIZE, DEFAULT_HASH_ALGO, DEFAULT_SIM_BANDWIDTH
from kvloop.core.hashing import DEFAULT_CRYPTO_SEED
from kvloop.events.config import NatsPlaneConfig, redact_url
from kvloop.events.types import TIER_DISK, TIER_HOST, TIER_SHARED
from kvloop.front.auth import AuthConfig, check_key
from kvloop.front.http_limits import HttpLimits
from kvloop.front.tls import TlsConfig, WorkerTls
from kvloop.router.flow_config import FlowConfig
from kvloop.router.limits import RouterLimits
from kvloop.tracing import TracingConfig
from kvloop.trust import FleetSecret

POLICIES = ("kv-aware", "round-robin", "least-loaded", "random")
DEFAULT_ROUTER_POLICY = "kv-aware"
PD_POLICIES = ("cost", "always", "never")   # --pd-policy: the remote-prefill decision
DEFAULT_PD_POLICY = "cost"
# K and V bytes per token of the embedded model (SmolLM2-135M: 30 layers x 3 KV heads x
# head_dim 64 x 2, in fp32 as the CPU runner holds them); the router uses what a prefill
# worker's `kv_fingerprint` says once it answered.
DEFAULT_KV_BYTES_PER_TOKEN = 46080.0


@dataclass(frozen=True)
class IndexConfig:
    """Bounds of the global prefix index.

    `max_blocks` caps the (block, worker) entries held in total; `max_blocks_per_worker`
    caps one worker (None: the worker's own KV capacity, times `capacity_slack`).
    `provisional_ttl_s` is how long a routing decision's provisional entries live unless a
    BlockStored event confirms them.
    """

    num_shards: int = 16
    max_blocks: int = 4_000_000
    max_blocks_per_worker: int | None = None
    capacity_slack: float = 1.25
    provisional_ttl_s: float = 2.0
    url: str | None = None            # redis://... : block -> workers shared in Redis
    password: str | None = None       # Redis password, unless the URL carries one
    read_timeout_s: float = 0.25      # a decision's Redis read; then this router's own view
    max_lower_blocks: int = 1_000_000 # per worker and tier below the device, per shared store

    def __post_init__(self) -> None:
        if self.url is not None and urlsplit(self.url).scheme not in ("redis", "rediss",
                                                                      "valkey", "valkeys"):
            raise ValueError(f"the index must be redis://HOST:PORT (or valkey://), got "
                             f"{redact_url(self.url)!r}")
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        if self.max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {self.max_blocks}")
        if self.max_blocks_per_worker is not None and self.max_blocks_per_worker < 1:
            raise ValueError("max_blocks_per_worker must be >= 1 or None")
        if self.capacity_slack < 1.0:
            raise ValueError(f"capacity_slack must be >= 1, got {self.capacity_slack}")
        if self.provisional_ttl_s < 0:
            raise ValueError("provisional_ttl_s must be >= 0")
        if self.read_timeout_s <= 0:
            raise ValueError(f"read_timeout_s must be > 0, got {self.read_timeout_s}")
        if self.max_lower_blocks < 1:
            raise ValueError(f"max_lower_blocks must be >= 1, got {self.max_lower_blocks}")


@dataclass(frozen=True)
class CostConfig:
    """The cost model: every candidate's estimated work before its first token, in tokens.

        cost = queued_prefill_tokens
             + (1 + marginal_work_weight) * (prompt_tokens - predicted_cached_tokens)
             + decode_token_cost * active_decodes + recompute_penalty(KV shortage)
             + eviction_weight * block_size * (cached blocks it would have to evict)

`marginal_work_weight` counts the request's own prefill a second time, as work it adds to
the fleet that every later request pays for: without it, a sibling of a prompt still
prefilling on one worker looks as cheap on an idle worker that must recompute it all.
`load_bound` is the bounded-load factor for hot prefixes (below); `saturation_floor` is the
fewest in-flight requests that can make a worker saturated at all: a continuous-batching
engine runs several requests per step, so a handful is never a hot spot.
`eviction_weight` is the share of an evicted cached block's tokens expected to be needed
again: it steers new prefixes to workers with room, so prefixes spread by cache footprint.
A request for a LoRA adapter adds nothing where the adapter is active (llm-d's affinity
order: resident > room to load > must evict), `lora_load_tokens` where it must be loaded
into a free slot, and `lora_evict_tokens` more where every slot holds an active adapter
(the request waits for one to go idle, and evicts it).

    `load_bound` is the bounded-load factor for hot prefixes: a worker whose in-flight
    requests exceed `load_bound` times the fleet's mean (plus one) is saturated, and a hot
    prefix it holds is deliberately replicated to another worker.
    """

    decode_token_cost: float = 16.0
    marginal_work_weight: float = 1.0
    cache_credit: float = 1.0
    eviction_weight: float = 0.5
    load_bound: float = 2.0
    saturation_floor: int = 8
    kv_shortage_weight: float = 1.0
    session_weight: float = 0.5   # session affinity: share of the last turn's prompt credited

    # Credit of a cached block by the tier it is loaded from (device: 1), Dynamo's
    # `--router-{host,disk}-cache-hit-weight`. A weight is 1 - load time / recompute time of
    # one block, so `(1 - w) * block_size` is the load time in prefill tokens. Defaults
    # measured on the reference CPU (docs/router.md "Tiers"): a 16-token block of the
    # embedded model (737 KB fp32) is recomputed in ~11.5 ms; copied from host memory in
    # ~0.01 ms, read from a file and checksummed in ~0.9 ms, fetched from a shared store
    # at 10 Gb/s and checksummed in ~1.5 ms.
    host_cache_hit_weight: float = 0.99
    disk_cache_hit_weight: float = 0.9
    shared_cache_hit_weight: float = 0.85

    def tier_weight(self, tier: str) -> float:
        """The credit of one block used from `tier` (device: 1)."""
        return {TIER_HOST: self.host_cache_hit_weight, TIER_DISK: self.disk_cache_hit_weight,
                TIER_SHARED: self.shared_cache_hit_weight}.get(tier, 1.0)

    lora_load_tokens: float = 256.0
    lora_evict_tokens: float = 256.0

    def __post_init__(self) -> None:
        if self.lora_load_tokens < 0 or self.lora_evict_tokens < 0:
            raise ValueError("lora_load_tokens and lora_evict_tokens must be >= 0")
        for name in ("host_cache_hit_weight", "disk_cache_hit_weight",
                     "shared_cache_hit_weight"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.decode_token_cost < 0:
            raise ValueError("decode_token_cost must be >= 0")
        if self.marginal_work_weight < 0:
            raise ValueError("marginal_work_weight must be >= 0")
        if not 0.0 <= self.cache_credit <= 1.0:
            raise ValueError(f"cache_credit must be in [0, 1], got {self.cache_credit}")
        if self.eviction_weight < 0:
            raise ValueError("eviction_weight must be >= 0")
        if self.load_bound < 1.0:
            raise ValueError(f"load_bound must be >= 1, got {self.load_bound}")
        if self.saturation_floor < 1:
            raise ValueError("saturation_floor must be >= 1")
        if self.kv_shortage_weight < 0:
            raise ValueError("kv_shortage_weight must be >= 0")
        if not 0.0 <= self.session_weight <= 1.0:
            raise ValueError(f"session_weight must be in [0, 1], got {self.session_weight}")


@dataclass(frozen=True)
class LivenessConfig:
    """When the router raises an alarm about a worker.

    A worker that served traffic but sent no event and no heartbeat within `window_s` is
    silent. Self-verification looks at the last `verify_window` requests with a predicted
    or an actual hit; when at least `verify_min_samples` of them exist and the share that
    missed (predicted but not found, or found but not predicted) reaches `verify_miss_ratio`,
    the worker's predictions are declared broken. `poll_interval_s` is how often the router
    reads each worker's /metrics (load) and re-probes dead workers.
    """

    window_s: float = 30.0
    verify_window: int = 16
    verify_min_samples: int = 6
    verify_miss_ratio: float = 0.75
    poll_interval_s: float = 0.5
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")
        if self.verify_window < 1 or self.verify_min_samples < 1:
            raise ValueError("verify_window and verify_min_samples must be >= 1")
        if self.verify_min_samples > self.verify_window:
            raise ValueError("verify_min_samples must be <= verify_window")
        if not 0.0 < self.verify_miss_ratio <= 1.0:
            raise ValueError("verify_miss_ratio must be in (0, 1]")
        if self.poll_interval_s <= 0:
            raise ValueError("poll_interval_s must be > 0")


@dataclass(frozen=True)
class BusConfig:
    """The router on a NATS event plane (kvloop.router.bus).

    `plane`: the server and what to listen to (`component` "*": every component of the
    namespace). `discover`: register the workers that announce themselves there and drop
    those that withdraw, or whose announcements stop for `discovery_ttl_s` and whose /health
    does not answer within `health_timeout_s`. `probe_s`: how long the bus watch listens to
    the namespace when a worker serving traffic sends nothing. `allow_unsigned`: admit
    messages nobody signed with the fleet secret (insecure: anyone who can publish on the
    bus adds workers and writes the index; RouterConfig refuses a bus without the secret
    unless this is set).
    """

    plane: NatsPlaneConfig
    discover: bool = False
    discovery_ttl_s: float = 5.0
    probe_s: float = 3.0
    health_timeout_s: float = 2.0
    allow_unsigned: bool = False

    def __post_init__(self) -> None:
        if self.discovery_ttl_s <= 0 or self.probe_s <= 0 or self.health_timeout_s <= 0:
            raise ValueError("discovery_ttl_s, probe_s and health_timeout_s must be > 0")


@dataclass(frozen=True)
class HashSpec:
    """How the fleet hashes blocks: must equal every worker's, or its events are refused."""

    block_size: int = DEFAULT_BLOCK_SIZE
    algo: str = DEFAULT_HASH_ALGO
    seed: str = DEFAULT_CRYPTO_SEED

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    def describe(self) -> str:
        return f"block_size={self.block_size} hash={self.algo} seed={self.seed!r}"


@dataclass(frozen=True)
class PDConfig:
    """Prefill/decode disaggregation: whether a request's prompt is prefilled on a prefill
    worker and pulled by its decode worker (remote), or prefilled by the decode worker
    (local). `kvloop/router/pd.py` has the cost model.

    `policy`: `cost` (the estimated-TTFT cost model), `always` (remote whenever a prefill
    worker is up), `never` (every request decode-only). The cost model evaluates the
    simulator's step-time model (`kvloop/sim/latency.py`) with the coefficients of
    `latency_file` (None: `kvloop/sim/latency_smollm2_cpu.json`, fitted on the embedded model
    on this machine's CPU), every time divided by `speedup` (a fleet of `--sim-speedup S`
    workers: S). `transfer_bandwidth` (bytes/s; default: what a simulated worker's transfers
    take, its `sim_bandwidth`) and `kv_bytes_per_token` (until a prefill worker's answer
    tells) price the transfer of the blocks the decode worker lacks.
    `failures_to_skip`: consecutive failed prefill legs after which a prefill worker is left
    out of remote prefills (alarm `prefill_failing`) until the liveness window passes.
    `prefill_timeout_s`: how long a prefill leg may go unanswered; then the request falls
    back to decode-only and the prefill worker is left out at once (a frozen worker).
    """

    policy: str = DEFAULT_PD_POLICY
    latency_file: str | None = None
    speedup: float = 1.0
    transfer_bandwidth: float = DEFAULT_SIM_BANDWIDTH
    kv_bytes_per_token: float = DEFAULT_KV_BYTES_PER_TOKEN
    failures_to_skip: int = 3
    prefill_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.policy not in PD_POLICIES:
            raise ValueError(f"pd policy must be one of {PD_POLICIES}, got {self.policy!r}")
        for name in ("speedup", "transfer_bandwidth", "kv_bytes_per_token",
                     "prefill_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.failures_to_skip < 1:
            raise ValueError("failures_to_skip must be >= 1")


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router needs. `port` 0 binds an ephemeral port.

    `auth`: the keys clients (and admins) present to the router; `worker_api_key`: the key
    the router presents to every worker (polls and forwarded requests; without it a client's
    Authorization header is passed through); `http_limits`: body size and read timeouts of
    the router's HTTP front; `tls`: HTTPS on that front, and `worker_tls` how the router
    checks https:// workers (kvloop/front/tls.py); `bus`: the workers' events (and, with
    discovery, the workers themselves) on a NATS event plane; `fleet_secret`: the fleet's shared key
    (kvloop/trust.py), which the router's bus and P/D legs prove membership with;
    `tokenizer`: a .gguf file or Hugging Face folder whose tokenizer the router uses for every
    model (vLLM's --tokenizer; None: its own copy of the workers' model, else the workers'
    `GET /kvloop/tokenizer`, kvloop/router/prompts.py).
    `migration_limit`: how many times one stream may move to another worker when its worker
    fails mid-stream (Dynamo's --migration-limit; 0: never, kvloop/router/migration.py).
    `limits`: the bytes of request bodies held at once and the prompt threads
    (kvloop/router/limits.py).
    `ext_proc_port`: also serve Envoy's external processing gRPC service there, on `host`, as
    the Gateway API Inference Extension's endpoint picker (None: not; 0: an ephemeral port;
    kvloop/router/ext_proc.py). `discovery_file`: a YAML file of workers, watched for changes
    (kvloop/router/discovery_file.py).
    `batch`: the Batch API's storage and bounds (kvloop/batch; None: no /v1/files and
    /v1/batches routes).
    """

    host: str = "127.0.0.1"
    port: int = 0
    policy: str = DEFAULT_ROUTER_POLICY
    index: IndexConfig = field(default_factory=IndexConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    liveness: LivenessConfig = field(default_factory=LivenessConfig)
    hash_spec: HashSpec | None = None
    random_seed: int | None = None
    auth: AuthConfig = field(default_factory=AuthConfig)
    worker_api_key: str | None = None
    http_limits: HttpLimits = field(default_factory=HttpLimits)
    tls: TlsConfig | None = None
    worker_tls: WorkerTls = field(default_factory=WorkerTls)
    bus: BusConfig | None = None
    pd: PDConfig = field(default_factory=PDConfig)
    fleet_secret: FleetSecret | None = None
    tokenizer: str | None = None
    flow: FlowConfig = field(default_factory=FlowConfig)
    migration_limit: int = 0
    limits: RouterLimits = field(default_factory=RouterLimits)
    ext_proc_port: int | None = None
    discovery_file: str | None = None
    batch: BatchConfig | None = None
    tracing: TracingConfig = field(default_factory=TracingConfig)   # kvloop.tracing

    def __post_init__(self) -> None:
        if self.ext_proc_port is not None and not 0 <= self.ext_proc_port < 65536:
            raise ValueError(f"ext_proc_port must be in [0, 65535], got {self.ext_proc_port}")
        if self.migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0, got {self.migration_limit}")
        if self.worker_api_key is not None:
            check_key(self.worker_api_key)
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.flow.enabled and self.flow.staleness_s <= self.liveness.poll_interval_s:
            raise ValueError(f"--flow-staleness ({self.flow.staleness_s:g} s) must exceed "
                             f"--poll-interval ({self.liveness.poll_interval_s:g} s): every "
                             "worker's figures would be stale, the fleet always saturated")
        if self.bus is not None and self.fleet_secret is None and not self.bus.allow_unsigned:
            raise ValueError(
                "a router on a NATS bus (--discover, --event-plane) needs the fleet secret "
                "(--fleet-secret-file, $KVLOOP_FLEET_SECRET_FILE or $KVLOOP_FLEET_SECRET) to "
                "admit only the workers' signed messages; --allow-unsigned-bus admits unsigned "
                "ones (insecure: anyone who can publish on the bus then adds workers, withdraws "
                "them and writes the index; docs/security.md)")


@dataclass(frozen=True)
class RestartPolicy:
    """How `kvloop fleet` restarts a worker whose process ended without being asked to: with
    the same arguments on the port it had, `backoff_s` after the exit, doubling per
    consecutive restart up to `max_backoff_s`; after `max_restarts` restarts in a row it is
    left dead. A restarted worker that has served for `reset_after_s` starts the count
    again. A restarted worker that announces no URL within the fleet's start timeout is
    killed (and counts as another exit)."""

    max_restarts: int = 5
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    reset_after_s: float = 300.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"--max-worker-restarts must be >= 0, got {self.max_restarts}")
        if not 0 < self.backoff_s <= self.max_backoff_s:
            raise ValueError(f"--worker-restart-backoff must be in (0, {self.max_backoff_s:g}]"
                             f", got {self.backoff_s:g}")

    def delay_s(self, restarts: int) -> float:
        """The wait before restart number `restarts + 1` in a row."""
        return min(self.max_backoff_s, self.backoff_s * 2.0 ** restarts)
