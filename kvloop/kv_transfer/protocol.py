"""The side channel's messages (docs/disaggregation.md section 3): msgspec Structs, tagged,
one msgpack frame each; P's ROUTER answers D's DEALER.

    D -> P                                   P -> D
    Meta                                     MetaReply (engine id, fingerprint, block size,
                                                        version, host id)
    Read{remote_request_id, block_ids,       ReadReply{status, error, block_ids, nbytes,
         transport, shm_name}                          shm_name, checksums}, then for TCP one
                                                       raw frame per layer (the blocks in order)
    Done{remote_request_id}                  (no answer: P frees the request's blocks)
    Heartbeat{engine_id, remote_request_ids} (no answer: P extends the leases)

Only Meta and Read are answered, in order, so a D that keeps one DEALER per P matches replies
to its requests first in, first out. `PROTOCOL_VERSION` changes with any incompatible change;
D refuses a P of another version.

Only fleet members talk: P's ROUTER is a CURVE server, D's DEALERs CURVE clients, with keys
derived from the fleet secret (`kvloop.trust`, purpose "kv-side-channel"), so every message
is encrypted and a peer without the secret completes no handshake in either direction. Each
frame carries its xxh3-64 checksum (`frame_checksum`), computed by P, checked by D.
"""

from __future__ import annotations

import functools
import os
import socket
from typing import Any

import msgspec
import xxhash

from kvloop.core.kv_connector import KVFingerprint

PROTOCOL_VERSION = 2
READ_OK = "ok"
READ_REFUSED = "refused"      # unknown or expired request, or blocks it does not hold
READ_ERROR = "error"          # P failed while reading its blocks


class Meta(msgspec.Struct, tag=True, frozen=True):
    """Ask P for its identity and block geometry (the handshake)."""


class MetaReply(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    engine_id: str
    kv_fingerprint: KVFingerprint
    block_size: int
    block_nbytes: int
    version: int
    host_id: str        # equal on two engines of one host: shared memory works between them


class Read(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Send these of the request's blocks (a subset of the `remote_block_ids` P gave out)."""

    remote_request_id: str
    block_ids: list[int]
    transport: str = "tcp"      # "tcp": raw frames after the reply; "shm": a /dev/shm file
    shm_name: str | None = None  # shm: the file D named (kvloop.kv_transfer.shm.new_name)
    trace_headers: dict[str, str] | None = None   # W3C context of D's request (tracing)


class ReadReply(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    status: str
    error: str | None = None
    block_ids: list[int] = msgspec.field(default_factory=list)
    nbytes: int = 0             # payload bytes (modelled ones for a simulated runner)
    num_frames: int = 0         # raw frames following (TCP) or in the file (shm)
    shm_name: str | None = None  # the file written (D's name), None: the frames follow (TCP)
    checksums: list[int] = msgspec.field(default_factory=list)   # frame_checksum per frame


class Done(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """D has what it needs, or gives up: P frees the request's blocks now."""

    remote_request_id: str


class Heartbeat(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """D still wants these requests' blocks: P extends their leases. `engine_id` is the P
    the heartbeat is for (one at another address is ignored)."""

    engine_id: str
    remote_request_ids: list[str]


Request = Meta | Read | Done | Heartbeat
Reply = MetaReply | ReadReply

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)


def decode_request(data: Any) -> Request:
    """Raises msgspec.DecodeError (a ValidationError among them) for a bad message."""
    return _request_decoder.decode(data)


def decode_reply(data: Any) -> Reply:
    return _reply_decoder.decode(data)


def frame_checksum(frame: Any) -> int:
    """The xxh3-64 of a frame's bytes (P computes it, D checks it before writing a block)."""
    return int(xxhash.xxh3_64_intdigest(memoryview(frame).cast("B")))


@functools.cache
def host_id() -> str:
    """This host's identity for choosing shared memory: the hostname and the kernel's boot
    id (two containers on one kernel share /dev/shm only if they share the boot id and the
    mount; the hostname tells containers apart)."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    shm_ok = os.path.isdir("/dev/shm")
    return f"{socket.gethostname()}/{boot}/{'shm' if shm_ok else 'no-shm'}"
