"""P's side channel: a ZMQ ROUTER in a thread, answering D's Meta and Read, taking Done and
Heartbeat (kvloop.kv_transfer.protocol).

Owner: the server thread alone uses its socket. It reads P's blocks through the runner's
`KVBlockStore` while the engine computes other blocks: a lease is pinned for the length of a
Read (`LeaseTable.begin_read`), so its blocks are neither expired nor freed meanwhile; Reads
and Dones of one D arrive in order on one connection, so a Done never overtakes its Read.

The ROUTER is a CURVE server (`keys`; the connector runs the ZAP authenticator admitting
only the fleet's client key), so only fleet members get any answer, Meta included. A thread
that dies records why in `fault` (the worker's /health reports it) instead of vanishing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from kvloop.core.kv_connector import KVBlockStore
from kvloop.kv_transfer import shm
from kvloop.kv_transfer.leases import LeaseTable
from kvloop.kv_transfer.protocol import (
    READ_ERROR,
    READ_OK,
    READ_REFUSED,
    Done,
    Heartbeat,
    Meta,
    MetaReply,
    Read,
    ReadReply,
    decode_request,
    encode,
    frame_checksum,
)
from kvloop.kv_transfer.stats import TransferCounters
from kvloop.trust import CurveKeys

logger = logging.getLogger("kvloop.kv_transfer")
_POLL_MS = 100


class SideChannelServer:
    """Bind `host:port` (0: ephemeral) at construction; `start()` runs the thread."""

    def __init__(self, ctx: zmq.Context, host: str, port: int, meta: MetaReply,
                 leases: LeaseTable, store: KVBlockStore, counters: TransferCounters,
                 wakeup: Callable[[], None], keys: CurveKeys | None):
        """`keys`: the side channel's CURVE keys (None: plaintext, the insecure opt-out)."""
        self.meta = meta
        self.fault: str | None = None   # why the thread died (None: alive or stopped)
        self.leases = leases
        self.store = store
        self.counters = counters
        self.wakeup = wakeup
        # hears each Read served: (the Read, bytes, start, end monotonic; engine/spans.py)
        self.on_read: Callable[[Read, int, float, float], None] | None = None
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        host_part = f"[{host}]" if ":" in host else host
        if ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        if keys is not None:
            keys.make_server(self._sock)
        try:
            self._sock.bind(f"tcp://{host_part}:{port}")
        except zmq.ZMQError as e:
            self._sock.close()
            raise OSError(f"cannot bind the KV side channel on {host}:{port}: {e}") from e
        endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.port = int(endpoint.rsplit(":", 1)[1])
        wake = f"inproc://kv-side-channel-{id(self)}"
        self._wake_pull = ctx.socket(zmq.PULL)
        self._wake_pull.bind(wake)
        self._wake_push = ctx.socket(zmq.PUSH)
        self._wake_push.setsockopt(zmq.LINGER, 0)
        self._wake_push.connect(wake)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-side-channel", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._wake_push.send(b"", zmq.NOBLOCK)
            self._thread.join(timeout=5.0)
        self._sock.close()
        self._wake_push.close()
        self._wake_pull.close()

    # --- the thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except Exception as e:  # recorded, logged, reported by /health: never silent
            self.fault = f"the KV side-channel thread died: {type(e).__name__}: {e}"
            logger.exception("KV side channel: %s", self.fault)
            self.wakeup()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_pull, zmq.POLLIN)   # shutdown
        while not self._stop.is_set():
            if self._sock not in dict(poller.poll(_POLL_MS)):
                continue
            frames = self._sock.recv_multipart(copy=False)
            if len(frames) != 2:
                logger.warning("KV side channel: dropping a message of %d frames", len(frames))
                continue
            identity, payload = frames[0].bytes, frames[1].buffer
            try:
                msg = decode_request(payload)
            except msgspec.DecodeError as e:
                logger.warning("KV side channel: dropping an undecodable message: %s", e)
                continue
            self._handle(identity, msg)

    def _handle(self, identity: bytes, msg: Any) -> None:
        if isinstance(msg, Meta):
            self._sock.send_multipart([identity, encode(self.meta)])
        elif isinstance(msg, Read):
            self._serve_read(identity, msg)
        elif isinstance(msg, Done):
            if self.leases.done(msg.remote_request_id):
                self.wakeup()
            else:
                logger.debug("KV side channel: Done for %s, which is not held (freed, expired "
                             "or never held)", msg.remote_request_id)
        elif isinstance(msg, Heartbeat):
            if msg.engine_id == self.meta.engine_id:
                self.leases.heartbeat(msg.remote_request_ids)

    def _serve_read(self, identity: bytes, read: Read) -> None:
        rid = read.remote_request_id
        refusal = self.leases.begin_read(rid, read.block_ids)
        if refusal is not None:
            logger.info("KV side channel: refusing a Read: %s", refusal)
            self._sock.send_multipart([identity, encode(ReadReply(status=READ_REFUSED,
                                                                  error=refusal))])
            return
        shm_file, t0 = None, time.monotonic()
        try:
            reply, frames, shm_file = self._read(read)
        except Exception as e:  # a failed read must answer D, not kill the side channel
            logger.warning("KV side channel: reading blocks of %s failed: %s", rid, e)
            reply, frames = ReadReply(status=READ_ERROR, error=f"{type(e).__name__}: {e}"), []
        finally:
            self.leases.end_read(rid, shm_file)
        self._sock.send_multipart([identity, encode(reply), *frames], copy=False)
        if reply.status == READ_OK:
            self.counters.add_sent(reply.nbytes)
            if self.on_read is not None:
                self.on_read(read, reply.nbytes, t0, time.monotonic())

    def _read(self, read: Read) -> tuple[ReadReply, list[Any], str | None]:
        """The reply, the raw frames to send after it (TCP) and the file written (shm)."""
        store = self.store
        nbytes = len(read.block_ids) * store.block_nbytes
        frames = store.read_blocks(read.block_ids) if store.has_payload else []
        checksums = [frame_checksum(f) for f in frames]
        if read.transport == "shm" and frames and read.shm_name is not None:
            path = _write_shm(read.shm_name, frames)
            if path is not None:
                return (ReadReply(status=READ_OK, block_ids=read.block_ids, nbytes=nbytes,
                                  num_frames=len(frames), shm_name=read.shm_name,
                                  checksums=checksums), [], path)
        return (ReadReply(status=READ_OK, block_ids=read.block_ids, nbytes=nbytes,
                          num_frames=len(frames), checksums=checksums), frames, None)


def _write_shm(name: str, frames: list[Any]) -> str | None:
    """Write the file D named; None (send over TCP instead) when the name is not one D makes
    or a file of that name already exists (a squatter's: never ours to use or remove)."""
    if not shm.is_valid_name(name):
        logger.warning("KV side channel: a Read names the shared-memory file %r, not of "
                       "kvloop's form; sending over TCP", name[:80])
        return None
    try:
        return shm.write_frames(name, frames)
    except FileExistsError:
        logger.warning("KV side channel: the shared-memory file %s already exists (not "
                       "ours); sending over TCP", name)
        return None
