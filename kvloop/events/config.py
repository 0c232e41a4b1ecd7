"""`KVEventsConfig`: where and how a worker publishes its KV events.

The `--kv-events-*` flags (`kvloop.events.cli_args`) build one; `kvloop serve` sends it to the
engine process inside `EngineStartConfig` (msgspec encodes and decodes this dataclass, running
`__post_init__`), where `kvloop.events.publisher.ZmqEventPublisher` takes it. Importing this
module loads no zmq.

`NatsPlaneConfig` (its `nats` field) moves the stream onto a NATS server instead: Dynamo's
subjects, kvloop's extensions beside them (`kvloop.events.nats_plane`). Its credentials (in
the URL or the user/password/token fields) are never logged: `redact_url` is what logs show.
Its `tls_ca` is a file's path, never its contents.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from kvloop.events import protocol as proto

DEFAULT_ENDPOINT = "tcp://127.0.0.1:0"
_SCHEMES = ("tcp://", "ipc://", "inproc://")

# --- the NATS event plane: Dynamo's names (DYN_NAMESPACE, DYN_COMPONENT) -----------------------
DEFAULT_NAMESPACE = "dynamo"
NAMESPACE_ENV = "DYN_NAMESPACE"
COMPONENT_ENV = "DYN_COMPONENT"
# Dynamo's component per serving role: aggregated workers are `backend`; disaggregated ones
# publish as their role. (kvloop's roles are kvloop.config.ROLES.)
COMPONENT_OF_ROLE = {"both": "backend", "prefill": "prefill", "decode": "decode"}
PAYLOAD_VLLM = "vllm"         # vLLM's msgpack KVEventBatch, one message per engine step
PAYLOAD_DYNAMO = "dynamo"     # Dynamo's RouterEvent JSON, one message per event
PAYLOAD_FORMATS = (PAYLOAD_VLLM, PAYLOAD_DYNAMO)
_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


def redact_url(url: str) -> str:
    """`url` with any user, password or token replaced by `***` (what logs may show)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc="***@" + host))


def check_subject_token(name: str, value: str) -> None:
    """ValueError unless `value` can be one token of a NATS subject (no dots, no wildcards)."""
    if not _TOKEN.match(value):
        raise ValueError(f"{name} must be letters, digits, '-' or '_' (one NATS subject "
                         f"token), got {value!r}")


@dataclass(frozen=True)
class NatsPlaneConfig:
    """Where a worker's KV events go on NATS, or where a consumer reads them.

    `url`: `nats://[USER:PASSWORD@|TOKEN@]HOST:PORT` (`tls://...`: TLS, verified against the
    system's roots unless `tls_ca`); `user`/`password`/`token` add credentials the URL does not
    carry. `tls_ca`: a PEM CA bundle that the server's certificate must chain to (TLS on,
    the host name checked). Subjects: `namespace.{namespace}.component.{component}
    .kv-events` (Dynamo's) and kvloop's extensions beside it. A consumer may give `component`
    "*": every component of the namespace. `payload_format`: vLLM's batches or Dynamo's
    events. `announce_interval_s`: how often a worker repeats its announcement (discovery).
    `connect_timeout_s`: how long a start waits for the server.
    """

    url: str
    namespace: str = DEFAULT_NAMESPACE
    component: str = COMPONENT_OF_ROLE["both"]
    payload_format: str = PAYLOAD_VLLM
    user: str | None = None
    password: str | None = None
    token: str | None = None
    tls_ca: str | None = None
    announce_interval_s: float = 1.0
    connect_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("nats", "tls") or not parts.hostname:
            raise ValueError(f"the event plane must look like nats://HOST:PORT, got "
                             f"{redact_url(self.url)!r}")
        check_subject_token("the namespace", self.namespace)
        if self.component != "*":
            check_subject_token("the component", self.component)
        if self.payload_format not in PAYLOAD_FORMATS:
            raise ValueError(f"payload_format must be one of {PAYLOAD_FORMATS}, got "
                             f"{self.payload_format!r}")
        if (self.password is None) != (self.user is None):
            raise ValueError("a NATS user needs a password, and a password a user")
        if self.announce_interval_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("announce_interval_s and connect_timeout_s must be > 0")
        if self.tls_ca is not None and not os.path.isfile(self.tls_ca):
            raise ValueError(f"--nats-tls-ca {self.tls_ca}: no such file")

    @property
    def tls(self) -> bool:
        """Whether the connection is TLS (a `tls://` URL or a CA)."""
        return urlsplit(self.url).scheme == "tls" or self.tls_ca is not None

    @property
    def safe_url(self) -> str:
        return redact_url(self.url)

    @property
    def authenticated(self) -> bool:
        """Whether the server is asked for credentials (in the URL or the fields): only
        holders of them can subscribe, as far as the server enforces it."""
        parts = urlsplit(self.url)
        return bool(self.user or self.token or parts.username)

    def __repr__(self) -> str:   # dataclass's would print the password and the token
        return (f"NatsPlaneConfig(url={self.safe_url!r}, namespace={self.namespace!r}, "
                f"component={self.component!r}, payload_format={self.payload_format!r}, "
                f"tls={self.tls})")


@dataclass(frozen=True)
class KVEventsConfig:
    """Where and how a worker publishes its KV events.

    `endpoint`: PUB address; None = an ephemeral port on 127.0.0.1. Bound, unless prefixed
    with ">" (then connected, e.g. to a consumer's bound SUB). vLLM's default is
    "tcp://*:5557". `replay_endpoint`: ROUTER address for replay, snapshots and info (always
    bound); None = none, as in vLLM. Port 0 means ephemeral; the publisher reports the actual
    addresses. `heartbeat`: None = on iff the topic is non-empty (see `kvloop.events.publisher`).
    `snapshot`: keep a mirror of the cache to serve snapshots (needs a replay endpoint).
    `int_block_hashes`: recency notices carry 64-bit ints (as events do by default) or bytes.
    `nats`: publish on a NATS server instead of ZMQ (then `endpoint` and `replay_endpoint`
    must be None: replay and snapshots go over NATS request/reply, heartbeats are on).
    `curve`: the PUB and replay sockets admit only CURVE clients holding the fleet secret's
    KV-event keys (`kvloop.trust.PURPOSE_KV_EVENTS`); anyone else receives nothing.
    `omit_token_ids`: BlockStored events carry empty `token_ids` (vLLM's format kept): the
    prompt's tokens never leave the worker, only block hashes (docs/events.md).
    """

    endpoint: str | None = None
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    heartbeat_interval_s: float = 1.0
    recency: bool = False
    recency_interval_s: float = 0.5
    data_parallel_rank: int = 0
    heartbeat: bool | None = None
    snapshot: bool = True
    int_block_hashes: bool = True
    snapshot_blocks_per_message: int = 1024
    nats: NatsPlaneConfig | None = None
    curve: bool = False
    omit_token_ids: bool = False

    def __post_init__(self) -> None:
        if self.nats is not None and (self.endpoint or self.replay_endpoint):
            raise ValueError("KV events go either to ZMQ endpoints or to a NATS event plane, "
                             "not both")
        if self.nats is not None and self.curve:
            raise ValueError("CURVE keys protect the ZMQ event sockets; a NATS event plane "
                             "has its own credentials")
        for name in ("endpoint", "replay_endpoint"):
            ep = getattr(self, name)
            if ep is not None:
                _check_endpoint(name, ep)
        if self.replay_endpoint is not None and self.replay_endpoint.startswith(">"):
            raise ValueError("replay_endpoint is always bound; drop the '>' prefix")
        if self.buffer_steps < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {self.buffer_steps}")
        if self.hwm < 0:
            raise ValueError(f"hwm must be >= 0, got {self.hwm}")
        if self.max_queue_size < 1:
            raise ValueError(f"max_queue_size must be >= 1, got {self.max_queue_size}")
        if self.heartbeat_interval_s <= 0 or self.recency_interval_s <= 0:
            raise ValueError("heartbeat_interval_s and recency_interval_s must be > 0")
        if self.data_parallel_rank < 0:
            raise ValueError(f"data_parallel_rank must be >= 0, got {self.data_parallel_rank}")
        if self.snapshot_blocks_per_message < 1:
            raise ValueError("snapshot_blocks_per_message must be >= 1")

    @property
    def heartbeats_enabled(self) -> bool:
        """Explicit `heartbeat`, else on iff no subscriber of `topic` can receive them."""
        if self.heartbeat is not None:
            return self.heartbeat
        topic = self.topic.encode()
        return bool(topic) and not proto.HEARTBEAT_TOPIC.startswith(topic)


def _check_endpoint(name: str, endpoint: str) -> None:
    addr = endpoint.lstrip("@>")
    if len(endpoint) - len(addr) > 1 or not addr.startswith(_SCHEMES):
        raise ValueError(f"{name} must look like tcp://HOST:PORT, ipc://PATH or inproc://NAME "
                         f"(optionally prefixed with '@' bind or '>' connect), got {endpoint!r}")
    if addr.startswith("tcp://") and ":" not in addr[len("tcp://"):]:
        raise ValueError(f"{name} {endpoint!r} has no port (use :0 for an ephemeral one)")
