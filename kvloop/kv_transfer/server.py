"""P's side channel: a ZMQ ROUTER in a thread, answering D's Meta and Read, taking Done and
Heartbeat (kvloop.kv_transfer.protocol).

Owner: the server thread alone uses its socket. It reads P's blocks through the runner's
`KVBlockStore` while the engine computes other blocks: a lease is pinned for the length of a
Read (`LeaseTable.begin_read`), so its blocks are neither expired nor freed meanwhile; Reads
and Dones of one D arrive in order on one connection, so a Done never overtakes its Read.
"""

from __future__ import annotations

import logging
import threading
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
)
from kvloop.kv_transfer.stats import TransferCounters

logger = logging.getLogger("kvloop.kv_transfer")
_POLL_MS = 100


class SideChannelServer:
    """Bind `host:port` (0: ephemeral) at construction; `start()` runs the thread."""

    def __init__(self, ctx: zmq.Context, host: str, port: int, meta: MetaReply,
                 leases: LeaseTable, store: KVBlockStore, counters: TransferCounters,
                 wakeup: Callable[[], None]):
        self.meta = meta
        self.leases = leases
        self.store = store
        self.counters = counters
        self.wakeup = wakeup
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        host_part = f"[{host}]" if ":" in host else host
        if ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
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
        shm_file = None
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

    def _read(self, read: Read) -> tuple[ReadReply, list[Any], str | None]:
        """The reply, the raw frames to send after it (TCP) and the file written (shm)."""
        store = self.store
        nbytes = len(read.block_ids) * store.block_nbytes
        frames = store.read_blocks(read.block_ids) if store.has_payload else []
        if read.transport == "shm" and frames:
            name = shm.shm_name(self.meta.engine_id)
            path = shm.write_frames(name, frames)
            return (ReadReply(status=READ_OK, block_ids=read.block_ids, nbytes=nbytes,
                              num_frames=len(frames), shm_name=name), [], path)
        return (ReadReply(status=READ_OK, block_ids=read.block_ids, nbytes=nbytes,
                          num_frames=len(frames)), frames, None)
