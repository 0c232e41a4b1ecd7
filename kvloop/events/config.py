"""`KVEventsConfig`: where and how a worker publishes its KV events.

The `--kv-events-*` flags (`kvloop.events.cli_args`) build one; `kvloop serve` sends it to the
engine process inside `EngineStartConfig` (msgspec encodes and decodes this dataclass, running
`__post_init__`), where `kvloop.events.publisher.ZmqEventPublisher` takes it. Importing this
module loads no zmq.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvloop.events import protocol as proto

DEFAULT_ENDPOINT = "tcp://127.0.0.1:0"
_SCHEMES = ("tcp://", "ipc://", "inproc://")


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

    def __post_init__(self) -> None:
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
