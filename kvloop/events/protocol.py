"""Frames of the KV-event stream: vLLM's, byte for byte, and kvloop's opt-in extensions.

vLLM's wire (what every vLLM consumer parses; kvloop sends exactly this):

    live, on the PUB socket     [topic, seq, payload]
                                seq = 8 bytes big-endian unsigned, 0, 1, 2... per publisher
                                payload = msgpack KVEventBatch (see `types.py`)
    replay, on the ROUTER       request  [b"", start_seq]           (DEALER; a REQ adds the b"")
                                replies  [b"", topic, seq, payload]  for each buffered seq >= start
                                end      [b"", b"", END_SEQ, b""]    END_SEQ = -1 as 8 bytes = ff*8

kvloop's extensions never change those frames. They use shapes and topics a vLLM consumer
never asks for or never subscribes to:

    requests on the ROUTER      [b"", b"kvloop", b"info"]
                                [b"", b"kvloop", b"replay", start_seq]
                                [b"", b"kvloop", b"snapshot"]
      (vLLM's publisher ignores them: it only answers 3-frame requests)
    reply header                [b"", b"kvloop", command, PublisherInfo]
      then, for replay and snapshot, vLLM-shaped replies and vLLM's end marker. A snapshot's
      replies all carry seq = PublisherInfo.next_seq: the state they describe includes every
      batch with a smaller sequence number, and the live stream continues at that number.
    PUB side topics             [HEARTBEAT_TOPIC, next_seq, PublisherInfo]
                                [RECENCY_TOPIC, counter, Touches]
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvloop.events.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)

END_SEQ = b"\xff" * 8
KVLOOP = b"kvloop"
CMD_INFO = b"info"
CMD_REPLAY = b"replay"
CMD_SNAPSHOT = b"snapshot"
HEARTBEAT_TOPIC = b"_kvloop.heartbeat"
RECENCY_TOPIC = b"_kvloop.recency"
PROTOCOL_VERSION = 1


def seq_bytes(seq: int) -> bytes:
    """A sequence number as vLLM sends it: 8 bytes, big-endian, unsigned."""
    return seq.to_bytes(8, "big")


def seq_from_bytes(frame: bytes) -> int:
    """Inverse of `seq_bytes`. Raises ValueError unless `frame` is exactly 8 bytes."""
    if len(frame) != 8:
        raise ValueError(f"a sequence frame has 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


class PublisherInfo(msgspec.Struct, omit_defaults=True, kw_only=True):
    """What a kvloop publisher says about itself (heartbeats and reply headers).

    `next_seq` is the sequence number the next batch will get, i.e. how many batches this
    process has published. `oldest_seq` is the oldest batch still in the replay buffer (None
    when empty). `snapshot` tells whether the publisher can serve snapshots.
    """

    epoch: str
    next_seq: int
    oldest_seq: int | None = None
    ts: float = 0.0
    topic: str = ""
    data_parallel_rank: int = 0
    buffer_steps: int = 0
    snapshot: bool = False
    heartbeat_interval_s: float = 0.0
    recency: bool = False
    version: int = PROTOCOL_VERSION


class Touches(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Recency: block hashes that were cache hits since the previous notice (deduplicated)."""

    ts: float
    epoch: str
    block_hashes: list[int | bytes]
    data_parallel_rank: int = 0


# --- the older positional layout of events (vLLM before its map encoding) -----------------
# Each event was a tagged array: ["BlockStored", block_hashes, parent, token_ids, ...]. The
# subscriber accepts it as a fallback so it can consume older vLLM publishers too.


class _LegacyEvent(msgspec.Struct, array_like=True, tag=True, gc=False):
    pass


class _LegacyBlockStored(_LegacyEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None = None
    token_ids: list[int] = msgspec.field(default_factory=list)
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _LegacyBlockRemoved(_LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class _LegacyAllBlocksCleared(_LegacyEvent, tag="AllBlocksCleared"):
    pass


class _LegacyBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_LegacyBlockStored | _LegacyBlockRemoved | _LegacyAllBlocksCleared]
    data_parallel_rank: int | None = None


def _from_legacy(ev: _LegacyEvent) -> KVEvent:
    if isinstance(ev, _LegacyBlockStored):
        extra = list(ev.extra_keys) if ev.extra_keys is not None else None
        return BlockStored(
            block_hashes=ev.block_hashes, parent_block_hash=ev.parent_block_hash,
            token_ids=ev.token_ids, block_size=ev.block_size, lora_id=ev.lora_id,
            medium=ev.medium, lora_name=ev.lora_name, extra_keys=extra,  # type: ignore[arg-type]
            group_idx=ev.group_idx, kv_cache_spec_kind=ev.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=ev.kv_cache_spec_sliding_window)
    if isinstance(ev, _LegacyBlockRemoved):
        return BlockRemoved(block_hashes=ev.block_hashes, medium=ev.medium,
                            group_idx=ev.group_idx)
    return AllBlocksCleared()


class BatchDecoder:
    """Decodes batch payloads: vLLM's map layout first, then the older array layout.

    `decode` raises `msgspec.DecodeError` (or ValidationError, a subclass) for a payload that
    is neither.
    """

    def __init__(self) -> None:
        self._map = msgspec.msgpack.Decoder(KVEventBatch)
        self._legacy = msgspec.msgpack.Decoder(_LegacyBatch)

    def decode(self, payload: bytes) -> KVEventBatch:
        try:
            return self._map.decode(payload)
        except msgspec.DecodeError as first:
            try:
                old = self._legacy.decode(payload)
            except msgspec.DecodeError:
                raise first from None
        return KVEventBatch(ts=old.ts, events=[_from_legacy(e) for e in old.events],
                            data_parallel_rank=old.data_parallel_rank)


def encode_info(info: PublisherInfo) -> bytes:
    return msgspec.msgpack.encode(info)


def decode_info(payload: bytes) -> PublisherInfo:
    """Raises msgspec.DecodeError for anything that is not a PublisherInfo."""
    return msgspec.msgpack.decode(payload, type=PublisherInfo)


def decode_touches(payload: bytes) -> Touches:
    """Raises msgspec.DecodeError for anything that is not a Touches notice."""
    return msgspec.msgpack.decode(payload, type=Touches)
