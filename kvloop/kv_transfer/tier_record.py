"""One KV block as stored in a tier below the block pool: self-describing, keyed, checked.

A record is

    MAGIC (8) | header length (u32) | header (msgpack `TierBlockHeader`) | header MAC (32)
        | payload | MAC (32)

where the payload is the block's per-layer frames concatenated (`KV_BLOCK_LAYOUT`, one block),
zlib-compressed when the header says so. The header MAC is HMAC-SHA256 over what precedes
it (a restart announces a block from its first bytes); the MAC, over everything before it;
both under the tier key (`tier_key`: derived from the fleet secret when there is one, else
from the model fingerprint alone, which makes it a checksum, not a secret). `decode_record`
accepts a record only when its MACs, its fingerprint, its block hash and its payload size
all match what the reader expects (a compressed payload is never inflated past that size):
anything else (a torn file, another model's block, flipped bits) is a `RecordError`, which
the tiers count and treat as a miss.

Keys (`record_key`) join the fingerprint's digest and the block hash: the hash chains the
block's tokens, its parents' tokens, its LoRA and its cache salt, so no model's or tenant's
block is found under another's key.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import msgspec

from kvloop.core.kv_connector import KVFingerprint
from kvloop.trust import FleetSecret

MAGIC = b"KVLTIER1"
MAC_BYTES = 32
MAX_HEADER_BYTES = 1 << 20
PURPOSE_KV_TIERS = "kv-tiers"     # the fleet secret's purpose for stored blocks
_HEAD = struct.Struct(">I")


class TierBlockHeader(msgspec.Struct, array_like=True, frozen=True):
    """What a tier keeps beside a block's bytes, enough to announce it after a restart
    (a self-describing `BlockStored`) and to check it on load."""

    fingerprint: bytes            # `fingerprint_digest` of the writer
    block_hash: bytes
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None
    compressed: bool
    raw_nbytes: int               # the payload's size uncompressed (0: a simulated block)


class RecordError(Exception):
    """A stored record that must not be used (the reason is the message)."""


class ShortPrefix(RecordError):
    """The bytes given end inside the header: read more of the record."""


def fingerprint_digest(fingerprint: KVFingerprint, block_size: int) -> bytes:
    """16 bytes naming the model, dtype, layout and block size a block's bytes belong to."""
    raw = msgspec.msgpack.encode([fingerprint.to_dict(), block_size])
    return hashlib.sha256(raw).digest()[:16]


def tier_key(secret: FleetSecret | None, fp_digest: bytes) -> bytes:
    """The MAC key of stored blocks: the fleet's (only fleet members can write blocks others
    accept) or, without a secret, one anybody can compute (a checksum)."""
    if secret is not None:
        return secret.derive(PURPOSE_KV_TIERS)
    return hashlib.sha256(b"kvloop/kv-tiers/unkeyed/" + fp_digest).digest()


def record_key(fp_digest: bytes, block_hash: bytes) -> str:
    """A tier's name for a block (a file name, a redis key suffix): hex only."""
    return f"{fp_digest.hex()}-{block_hash.hex()}"


def encode_record(header: TierBlockHeader, frames: Sequence[Any], key: bytes) -> bytes:
    """The record of one block; `frames` are its per-layer byte frames (none: simulated)."""
    payload = b"".join(bytes(memoryview(f).cast("B")) for f in frames)
    if len(payload) != header.raw_nbytes:
        raise ValueError(f"{len(payload)} payload bytes, header says {header.raw_nbytes}")
    if header.compressed:
        payload = zlib.compress(payload, 1)
    head = MAGIC + _HEAD.pack(len(header_bytes := msgspec.msgpack.encode(header))) + header_bytes
    body = head + hmac.new(key, head, hashlib.sha256).digest() + payload
    return body + hmac.new(key, body, hashlib.sha256).digest()


def decode_record(record: bytes, key: bytes, fp_digest: bytes, block_hash: bytes,
                  num_layers: int, block_nbytes: int) -> tuple[TierBlockHeader, list[bytes]]:
    """The header and per-layer frames of a record of a `block_nbytes` block (0: simulated),
    or RecordError (see the module docstring for what is checked)."""
    if len(record) < MAC_BYTES or not hmac.compare_digest(
            record[-MAC_BYTES:], hmac.new(key, record[:-MAC_BYTES], hashlib.sha256).digest()):
        raise RecordError("MAC mismatch (torn, corrupt, or written without the fleet key)")
    header, end = decode_header(record, key)
    payload = record[end:-MAC_BYTES]
    if header.fingerprint != fp_digest:
        raise RecordError("fingerprint mismatch (another model, dtype or block size)")
    if header.block_hash != block_hash:
        raise RecordError("block hash mismatch")
    if header.raw_nbytes != block_nbytes:
        raise RecordError(f"a block of {header.raw_nbytes} bytes, expected {block_nbytes}")
    if header.compressed:
        payload = _inflate(payload, block_nbytes)
    if len(payload) != block_nbytes or (num_layers and len(payload) % num_layers):
        raise RecordError(f"payload of {len(payload)} bytes, expected {block_nbytes}")
    if not payload:
        return header, []
    step = len(payload) // num_layers
    return header, [payload[i * step:(i + 1) * step] for i in range(num_layers)]


def _inflate(payload: bytes, limit: int) -> bytes:
    """A compressed payload, never inflated past `limit` + 1 bytes (RecordError if bad)."""
    try:
        inflater = zlib.decompressobj()
        out = inflater.decompress(payload, limit + 1)
    except zlib.error as e:
        raise RecordError(f"payload does not decompress: {e}") from None
    if not inflater.eof or inflater.unconsumed_tail:
        raise RecordError("compressed payload is truncated or too large")
    return out


def decode_header(prefix: bytes, key: bytes) -> tuple[TierBlockHeader, int]:
    """The header of a record from its first bytes (at least `header_span` of them), checked
    by the header MAC, and where the payload starts (RecordError: torn or forged)."""
    fixed = len(MAGIC) + _HEAD.size
    if len(prefix) < fixed or not prefix.startswith(MAGIC):
        raise RecordError("not a tier record (torn or foreign)")
    (head_len,) = _HEAD.unpack_from(prefix, len(MAGIC))
    end = fixed + head_len + MAC_BYTES
    if head_len > MAX_HEADER_BYTES:
        raise RecordError("header length out of bounds")
    if len(prefix) < end:
        raise ShortPrefix("the record ends inside its header (torn)")
    mac = hmac.new(key, prefix[:fixed + head_len], hashlib.sha256).digest()
    if not hmac.compare_digest(prefix[fixed + head_len:end], mac):
        raise RecordError("header MAC mismatch (torn, corrupt, or written without the key)")
    try:
        header = msgspec.msgpack.decode(prefix[fixed:fixed + head_len], type=TierBlockHeader)
    except msgspec.DecodeError as e:
        raise RecordError(f"bad header: {e}") from None
    return header, end


def header_span(max_tokens: int) -> int:
    """Bytes enough to hold the header of a block of `max_tokens` tokens (a prefix to read)."""
    return len(MAGIC) + _HEAD.size + 1024 + 9 * max_tokens + MAC_BYTES
