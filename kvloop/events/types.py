"""KV-cache events, wire-compatible with vLLM's `vllm.distributed.kv_events`.

Same class names, fields, field order, defaults, tagging and array/map layout, so a consumer
written for vLLM (llm-d's indexer, Dynamo, vLLM's example subscriber) decodes kvloop's
batches unchanged:

- a batch is a msgpack array `[ts, [events...], data_parallel_rank]`;
- each event is a msgpack map whose first key is `type` (the class name), then the fields in
  declaration order; fields without a default are always present, defaulted fields equal to
  their default are omitted.

Block hashes are 64-bit integers by default (`event_int`: the last 8 bytes of the digest,
big-endian), or raw digest bytes when configured so.
"""

from __future__ import annotations

from typing import Any

import msgspec

ExternalBlockHash = bytes | int
_INT64_MASK = (1 << 64) - 1

# The tiers a block may sit in, as vLLM's events name them (`medium`): the block pool (kvloop
# says "GPU" on every device, as vLLM's pool does), host memory, and storage (vLLM main folds
# file and object stores into one "STORAGE" medium). A storage-tier event also says whether
# the store is this worker's own (`locality` LOCAL: its disk) or shared by the fleet (REMOTE).
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
TIER_MEDIUMS = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE)   # fastest first
LOCALITY_LOCAL = "LOCAL"
LOCALITY_REMOTE = "REMOTE"


def event_int(block_hash: bytes) -> int:
    """The 64-bit integer KV events carry for a block hash: the digest's last 8 bytes,
    big-endian, unsigned (vLLM's default)."""
    return int.from_bytes(block_hash, "big") & _INT64_MASK


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=False, omit_defaults=True, gc=False, tag=True):
    """Base class of every KV-cache event (tagged by class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
