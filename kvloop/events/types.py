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

# --- tiers: the one place that names them ------------------------------------------------
# vLLM's `medium` strings: "GPU" (the device pool), "CPU" (the OffloadingConnector's host
# tier), "STORAGE" (current vLLM: file and object stores folded into one medium, with
# `locality` LOCAL for a worker's own disk and REMOTE for a store other workers read).
# SGLang's HiCache says "CPU_PINNED"; older kvloop/Dynamo spellings are accepted too.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
LOCALITY_LOCAL = "LOCAL"
LOCALITY_REMOTE = "REMOTE"

# The router's tier names are Dynamo's (KVBM G1-G4 / `storage_tier` on its event plane).
TIER_DEVICE = "device"
TIER_HOST = "host_pinned"
TIER_DISK = "disk"
TIER_SHARED = "external"
TIERS = (TIER_DEVICE, TIER_HOST, TIER_DISK, TIER_SHARED)   # best (fastest to use) first
TIER_MEDIUMS = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE)   # what kvloop publishes, fastest first

_TIER_OF_MEDIUM = {
    "GPU": TIER_DEVICE, "DEVICE": TIER_DEVICE, "G1": TIER_DEVICE,
    "CPU": TIER_HOST, "CPU_PINNED": TIER_HOST, "CPU_TIER1": TIER_HOST, "HOST": TIER_HOST,
    "HOST_PINNED": TIER_HOST, "G2": TIER_HOST,
    "DISK": TIER_DISK, "NVME": TIER_DISK, "CPU_TIER2": TIER_DISK, "FS": TIER_DISK,
    "G3": TIER_DISK,
    "EXTERNAL": TIER_SHARED, "REMOTE": TIER_SHARED, "SHARED": TIER_SHARED, "OBJ": TIER_SHARED,
    "G4": TIER_SHARED,
}
# What kvloop writes for each tier (vLLM's medium, and its locality where vLLM sets one).
MEDIUM_OF_TIER = {TIER_DEVICE: MEDIUM_GPU, TIER_HOST: MEDIUM_CPU, TIER_DISK: MEDIUM_STORAGE,
                  TIER_SHARED: MEDIUM_STORAGE}
LOCALITY_OF_TIER = {TIER_DISK: LOCALITY_LOCAL, TIER_SHARED: LOCALITY_REMOTE}


def tier_of(medium: str | None, locality: str | None = None) -> str | None:
    """The router tier of an event's `medium` (None: "GPU"), or None for a medium nobody
    names. vLLM's "STORAGE" is the worker's own disk unless `locality` says REMOTE."""
    m = (medium or MEDIUM_GPU).upper()
    if m == MEDIUM_STORAGE:
        return TIER_SHARED if (locality or "").upper() == LOCALITY_REMOTE else TIER_DISK
    return _TIER_OF_MEDIUM.get(m)


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
