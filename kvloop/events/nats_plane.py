"""The NATS event plane: subjects, headers and payloads, written once for publishers,
consumers, announcers and the router's bus watch.

Subjects (Dynamo's data subject; kvloop's extensions beside it, where no Dynamo consumer of
the data subject ever sees them):

    namespace.{ns}.component.{c}.kv-events            the events (Dynamo's subject)
    namespace.{ns}.component.{c}.kvloop.heartbeat     PublisherInfo (msgpack) every second
    namespace.{ns}.component.{c}.kvloop.recency       Touches (msgpack): cache-hit hashes
    namespace.{ns}.component.{c}.kvloop.query.{id}    request/reply: info, replay, snapshot
    namespace.{ns}.kvloop.workers                     WorkerAnnouncement (JSON, kvloop.wire)

`{c}` is the worker's component: `backend` when aggregated, `prefill` / `decode` when
disaggregated (`COMPONENT_OF_ROLE`). `{id}` is the worker id: a 64-bit number that names one
worker incarnation (`worker_id_of(epoch)`), as Dynamo's worker ids do.

Every kvloop message carries headers `Kvloop-Worker` (the id), `Kvloop-Epoch` and, on data,
`Kvloop-Seq` (0, 1, 2... per worker: a batch in vLLM's format, an event in Dynamo's).

Payloads on the data subject (`NatsPlaneConfig.payload_format`):
- `vllm` (default): vLLM's msgpack `KVEventBatch`, byte for byte what its ZMQ publisher sends;
- `dynamo`: one Dynamo `RouterEvent` per event, JSON as its serde layout writes it:
  `{"worker_id", "storage_tier", "event": {"event_id", "data", "dp_rank"}}` with `data` one of
  `{"stored": {"parent_hash", "blocks": [{"block_hash", "tokens_hash"}]}}`,
  `{"removed": {"block_hashes"}}` or `"cleared"`; `event_id` is the message's sequence number
  and `tokens_hash` Dynamo's local block hash (`tokens_hash`), so a Dynamo router reads
  kvloop workers.

Query replies go to the request's reply inbox: a `header` message (PublisherInfo), the data
messages (`Kvloop-Seq`: replay, their own numbers; snapshot, all the snapshot's `next_seq`),
then an `end` message. A replay whose start is no longer buffered gets the header and the end.

Identity (docs/security.md): a member holding the fleet secret signs every message it sends
(announcements, withdrawals, data, heartbeats, recency notices, queries and their replies:
`kvloop.trust.sign_message` headers, `signed_headers`); a consumer holding it admits only
messages a `MessageGate` passes: signed by a member, fresh, never seen before. Messages
refused are counted by reason (`Refusals`), never delivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import xxhash

from kvloop.events.config import (
    PAYLOAD_DYNAMO,
    NatsPlaneConfig,
)
from kvloop.events.types import (
    LOCALITY_OF_TIER,
    MEDIUM_OF_TIER,
    TIER_DEVICE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    tier_of,
)
from kvloop.trust import FleetSecret, MessageVerifier, sign_message

logger = logging.getLogger(__name__)

DATA_TOKEN = "kv-events"
H_WORKER = "Kvloop-Worker"
H_EPOCH = "Kvloop-Epoch"
H_SEQ = "Kvloop-Seq"
H_KIND = "Kvloop-Kind"        # on query replies: header | data | end
H_CMD = "Kvloop-Cmd"          # on query requests: info | replay | snapshot
H_START = "Kvloop-Start"      # replay's first sequence number
KIND_HEADER, KIND_DATA, KIND_END = "header", "data", "end"
CMD_INFO, CMD_REPLAY, CMD_SNAPSHOT = "info", "replay", "snapshot"

# Dynamo's local block hash: XXH3-64 of the block's token ids (u32 little-endian), seed 1337,
# salted by the LoRA name (wrapping add of XXH3-64(name, seed 0)).
DYNAMO_HASH_SEED = 1337
_U64 = (1 << 64) - 1


# --- subjects ---------------------------------------------------------------------------------
class Subjects:
    """The subjects of one namespace and component (`component` "*" for a consumer that
    listens to every component)."""

    def __init__(self, namespace: str, component: str):
        self.namespace = namespace
        self.component = component
        self.prefix = f"namespace.{namespace}.component.{component}"

    @classmethod
    def of(cls, cfg: NatsPlaneConfig) -> Subjects:
        return cls(cfg.namespace, cfg.component)

    @property
    def data(self) -> str:
        return f"{self.prefix}.{DATA_TOKEN}"

    @property
    def heartbeat(self) -> str:
        return f"{self.prefix}.kvloop.heartbeat"

    @property
    def recency(self) -> str:
        return f"{self.prefix}.kvloop.recency"

    def query(self, worker_id: int) -> str:
        return f"{self.prefix}.kvloop.query.{worker_id}"

    @property
    def namespace_wildcard(self) -> str:
        """Everything published in the namespace (the bus watch's probe)."""
        return f"namespace.{self.namespace}.>"


def discovery_subject(namespace: str) -> str:
    return f"namespace.{namespace}.kvloop.workers"


def router_load_subject(namespace: str) -> str:
    """Where router replicas share their in-flight requests (kvloop/router/replicas.py)."""
    return f"namespace.{namespace}.kvloop.router-load"


# Every namespace's data and heartbeat subjects: what the bus watch also looks at, so a
# worker in another namespace is found too.
ANY_NAMESPACE_DATA = f"namespace.*.component.*.{DATA_TOKEN}"
ANY_NAMESPACE_HEARTBEAT = "namespace.*.component.*.kvloop.heartbeat"


def component_of(subject: str) -> str | None:
    """The component token of a `namespace.{ns}.component.{c}...` subject (None otherwise)."""
    parts = subject.split(".")
    return parts[3] if len(parts) > 4 and parts[0] == "namespace" and parts[2] == "component" \
        else None


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS's rule: `*` matches one token, a final `>` one or more."""
    pt, st = pattern.split("."), subject.split(".")
    for i, p in enumerate(pt):
        if p == ">":
            return len(st) > i
        if i >= len(st) or (p != "*" and p != st[i]):
            return False
    return len(st) == len(pt)


def worker_id_of(epoch: str) -> int:
    """The 64-bit worker id of one worker incarnation (its epoch)."""
    return int.from_bytes(hashlib.blake2b(epoch.encode(), digest_size=8).digest(), "big")


def connect_options(cfg: NatsPlaneConfig, name: str) -> dict[str, Any]:
    """Keyword arguments of `nats.connect` for `cfg` (credentials included, never logged)."""
    opts: dict[str, Any] = {"servers": [cfg.url], "name": name,
                            "connect_timeout": cfg.connect_timeout_s,
                            "allow_reconnect": True, "max_reconnect_attempts": -1,
                            "reconnect_time_wait": 0.25, "ping_interval": 5,
                            "max_outstanding_pings": 2}
    if cfg.user is not None:
        opts.update(user=cfg.user, password=cfg.password)
    if cfg.token is not None:
        opts["token"] = cfg.token
    if cfg.tls:
        # TLS before the server's first word: nats-py otherwise follows the server's INFO,
        # and a man in the middle saying "no TLS" would get the password in the clear.
        opts.update(tls=tls_context(cfg), tls_handshake_first=True)
    return opts


def tls_context(cfg: NatsPlaneConfig) -> ssl.SSLContext:
    """The client side of a TLS connection to `cfg`'s server: its certificate verified
    against `tls_ca` (else the system's roots) and its host name checked."""
    return ssl.create_default_context(cafile=cfg.tls_ca)


CONNECT_STOP_S = 5.0    # how long an abandoned first connection may take to end
TLS_FIRST_HINT = (" (kvloop starts TLS before the server speaks: the server must have TLS "
                  "with handshake_first in its tls block, as deploy/nats/nats-server.conf "
                  "has)")


async def first_connect(options: dict[str, Any], timeout_s: float, **callbacks: Any) -> Any:
    """A connected nats-py client for `options`, or OSError after `timeout_s` (nats-py
    retries a refused or unauthorized first connection for ever); the server's last complaint
    is in the error. Once connected, the client reconnects for ever."""
    from nats.aio.client import Client

    errors: list[BaseException] = []

    async def on_error(e: Exception) -> None:
        errors.append(e)

    nc = Client()
    attempt = asyncio.ensure_future(nc.connect(**options, error_cb=on_error, **callbacks))
    try:
        await asyncio.wait({attempt}, timeout=timeout_s)
    finally:
        timed_out = not attempt.done()
        if timed_out:
            await _stop_connecting(nc, attempt)
    failure = TimeoutError(f"no connection within {timeout_s:g} s") if timed_out \
        else attempt.exception()
    if failure is None:
        return nc
    # The server's refusal says more than the reset that follows it, whichever came last.
    refusals = [x for x in errors if "authorization" in str(x).lower()]
    cause = (refusals or errors or [failure])[-1]
    hint = TLS_FIRST_HINT if options.get("tls_handshake_first") and isinstance(
        cause, ssl.SSLError) and "WRONG_VERSION_NUMBER" in str(cause) else ""
    raise OSError(f"{type(cause).__name__}: {cause}".rstrip(": ") + hint)


async def _stop_connecting(nc: Any, attempt: asyncio.Future[Any]) -> None:
    """End a first connection still retrying, without waiting for ever: nats-py can swallow
    a cancellation mid-retry (then it is told to stop retrying, and ends at its next
    failure); its sockets are closed."""
    nc.options["allow_reconnect"] = False
    attempt.cancel()
    await asyncio.wait({attempt}, timeout=CONNECT_STOP_S)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.close(), CONNECT_STOP_S)


def headers(worker_id: int, epoch: str, seq: int | None = None,
            kind: str | None = None) -> dict[str, str]:
    h = {H_WORKER: str(worker_id), H_EPOCH: epoch}
    if seq is not None:
        h[H_SEQ] = str(seq)
    if kind is not None:
        h[H_KIND] = kind
    return h


# --- identity: signed messages ---------------------------------------------------------------
def signed_headers(secret: FleetSecret | None, subject: str, payload: bytes,
                   hdrs: Mapping[str, str] | None = None, reply: str = "") -> dict[str, str]:
    """`hdrs` plus, with `secret`, the signature of `payload`, `hdrs` and `reply` on
    `subject` (kvloop.trust): the message must be published with exactly these headers."""
    out = dict(hdrs or {})
    if secret is not None:
        out.update(sign_message(secret, subject, payload, headers=out, reply=reply))
    return out


REFUSAL_LOG_EVERY_S = 10.0


@dataclass
class Refusals:
    """Messages a consumer refused for want of a valid signature: counts by reason, the last
    one, and a warning at most once per `log_every_s` (an attacker cannot flood the log)."""

    counts: dict[str, int] = field(default_factory=dict)
    last: str | None = None
    log_every_s: float = REFUSAL_LOG_EVERY_S
    _logged_at: float = float("-inf")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def note(self, subject: str, reason: str) -> None:
        key = reason.split(" (")[0]          # "stale (+75.0s old)" counts as "stale"
        self.counts[key] = self.counts.get(key, 0) + 1
        self.last = f"{reason} on {subject}"
        now = time.monotonic()
        if now - self._logged_at >= self.log_every_s:
            self._logged_at = now
            logger.warning("NATS: refused a message on %s: %s (%d refused so far; only "
                           "messages signed with the fleet secret are admitted)", subject,
                           reason, self.total)

    def describe(self) -> dict[str, Any]:
        return {"refused": self.total, "by_reason": dict(self.counts), "last": self.last}


class MessageGate:
    """What one subscription admits: with a fleet secret, only messages signed by a member,
    fresh and never seen before (its own `MessageVerifier`); without one, everything. Not
    thread-safe: one owner, the thread that receives."""

    def __init__(self, secret: FleetSecret | None, refusals: Refusals):
        self.verifier = None if secret is None else MessageVerifier(secret)
        self.refusals = refusals

    def admits(self, subject: str, payload: bytes, hdrs: Mapping[str, str] | None,
               reply: str = "") -> bool:
        """Whether to act on a message (`reply`: the subject it asks answers on)."""
        if self.verifier is None:
            return True
        reason = self.verifier.refusal(subject, payload, hdrs, reply=reply)
        if reason is None:
            return True
        self.refusals.note(subject, reason)
        return False


def header_int(hdrs: dict[str, str] | None, name: str) -> int | None:
    """An integer header, or None when absent or not a number."""
    value = (hdrs or {}).get(name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


# --- Dynamo's RouterEvent ---------------------------------------------------------------------
class DynamoEvent(msgspec.Struct, kw_only=True):
    event_id: int
    data: Any                     # {"stored": {...}} | {"removed": {...}} | "cleared"
    dp_rank: int = 0


class RouterEvent(msgspec.Struct, kw_only=True):
    """Dynamo's event on its event plane (one per KV event)."""

    worker_id: int
    event: DynamoEvent
    storage_tier: str = "device"


_ROUTER_EVENT = msgspec.json.Decoder(RouterEvent)


def dynamo_tokens_hash(tokens: list[int], lora_name: str | None = None) -> int:
    """Dynamo's local hash of one block's token ids."""
    seed = DYNAMO_HASH_SEED
    if lora_name:
        seed = (seed + xxhash.xxh3_64_intdigest(lora_name.encode())) & _U64
    data = b"".join(t.to_bytes(4, "little") for t in tokens)
    return xxhash.xxh3_64_intdigest(data, seed=seed)


def _u64(h: int | bytes) -> int:
    if isinstance(h, bytes | bytearray):
        return int.from_bytes(bytes(h[-8:]), "big")
    return int(h) & _U64


def _dynamo_data(ev: KVEvent) -> Any:
    if isinstance(ev, BlockStored):
        bs = ev.block_size
        blocks = [{"block_hash": _u64(h), "tokens_hash": dynamo_tokens_hash(
            ev.token_ids[i * bs:(i + 1) * bs], ev.lora_name)}
            for i, h in enumerate(ev.block_hashes)]
        parent = None if ev.parent_block_hash is None else _u64(ev.parent_block_hash)
        return {"stored": {"parent_hash": parent, "blocks": blocks}}
    if isinstance(ev, BlockRemoved):
        return {"removed": {"block_hashes": [_u64(h) for h in ev.block_hashes]}}
    return "cleared"


def _tier(ev: KVEvent) -> str:
    """Dynamo's `storage_tier` of an event (an unknown medium: the device tier)."""
    tier = tier_of(getattr(ev, "medium", None), getattr(ev, "locality", None))
    return tier or TIER_DEVICE


def encode_dynamo(events: list[KVEvent], worker_id: int, first_event_id: int,
                  dp_rank: int) -> list[bytes]:
    """One RouterEvent JSON per event, numbered from `first_event_id`."""
    return [msgspec.json.encode({
        "worker_id": worker_id, "storage_tier": _tier(ev),
        "event": {"event_id": first_event_id + i, "data": _dynamo_data(ev),
                  "dp_rank": dp_rank}})
        for i, ev in enumerate(events)]


def decode_dynamo(payload: bytes, block_size: int) -> tuple[int, int, KVEventBatch]:
    """(worker_id, event_id, a one-event batch) of a RouterEvent. Raises msgspec.DecodeError
    (a ValidationError for a shape that is not Dynamo's). Dynamo's events carry no token ids
    and no block size: the batch's BlockStored get `block_size` and no tokens."""
    rev = _ROUTER_EVENT.decode(payload)
    tier = tier_of(rev.storage_tier) or TIER_DEVICE     # Dynamo's names, or vLLM's mediums
    medium, locality = MEDIUM_OF_TIER[tier], LOCALITY_OF_TIER.get(tier)
    data = rev.event.data
    ev: KVEvent
    if data == "cleared":
        ev = AllBlocksCleared()
    elif isinstance(data, dict) and isinstance(data.get("stored"), dict):
        st = data["stored"]
        hashes = [int(b["block_hash"]) for b in st.get("blocks", [])]
        ev = BlockStored(block_hashes=list(hashes), parent_block_hash=st.get("parent_hash"),
                         token_ids=[], block_size=block_size, lora_id=None, medium=medium,
                         lora_name=None, locality=locality)
    elif isinstance(data, dict) and isinstance(data.get("removed"), dict):
        ev = BlockRemoved(block_hashes=[int(h) for h in data["removed"]["block_hashes"]],
                          medium=medium, locality=locality)
    else:
        raise msgspec.ValidationError(f"not a Dynamo KV event: {data!r}"[:200])
    batch = KVEventBatch(ts=0.0, events=[ev], data_parallel_rank=rev.event.dp_rank)
    return rev.worker_id, rev.event.event_id, batch


def encode_messages(batch: KVEventBatch, cfg: NatsPlaneConfig, worker_id: int,
                    first_seq: int, encoder: msgspec.msgpack.Encoder) -> list[bytes]:
    """The data messages that carry `batch` in `cfg`'s payload format."""
    if cfg.payload_format == PAYLOAD_DYNAMO:
        return encode_dynamo(batch.events, worker_id, first_seq, batch.data_parallel_rank or 0)
    return [encoder.encode(batch)]


def payload_worker_id(payload: bytes) -> int | None:
    """The `worker_id` of a Dynamo RouterEvent payload (None for anything else)."""
    if not payload.startswith(b"{"):
        return None
    try:
        return _ROUTER_EVENT.decode(payload).worker_id
    except msgspec.DecodeError:
        return None
