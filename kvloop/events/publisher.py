"""ZmqEventPublisher: the engine core's KV events on ZMQ, as vLLM sends them, plus extensions.

Threads and ownership:
- The engine loop calls `publish(batch)` once per step (non-blocking: it appends to a bounded
  queue) and, with recency on, `publish_touches(hashes)`.
- One publisher thread (`kvloop-kv-events`) owns everything else: the PUB and ROUTER sockets
  and the `BatchLog` (`batch_log.py`: the sequence counter, the ring buffer of the last
  `buffer_steps` encoded batches and the mirror of the worker's cache). Replay and snapshot
  requests are served from this thread between publishes, so a snapshot is exact at a
  sequence number and never touches the engine loop.

vLLM compatibility (docs/vllm-facts.md#kv-events): frames, sequence numbers, replay protocol
and end marker, buffer and HWM defaults, `data_parallel_rank` filled in, tcp port + rank for
DP ranks. One deliberate difference: an endpoint is *bound* unless it starts with ">" (CZMQ's
"connect" prefix); vLLM connects whenever the host is a literal address.

Extensions (see `protocol.py`), none of which a vLLM consumer sees unless it asks:
- snapshot, info and epoch-tagged replay on the replay (ROUTER) socket: on whenever a replay
  endpoint is configured (vLLM's publisher ignores such requests; ours answers them);
- heartbeats on `HEARTBEAT_TOPIC`: on by default when `topic` is non-empty (a consumer
  subscribed to its data topic never receives them); with the empty topic every subscriber
  would get them, so they are opt-in (`heartbeat=True`);
- recency on `RECENCY_TOPIC`: opt-in (`recency=True`).

If the queue overflows (the publisher thread cannot keep up), the newest batches are dropped
and, in their place, one `AllBlocksCleared` is published (`batch_log.BatchQueue`).

Events carry the prompt's token ids, so they are as private as the prompts:
- `curve`: both sockets are CURVE servers keyed by the fleet secret
  (`kvloop.trust.PURPOSE_KV_EVENTS`), and a ZAP authenticator on the publisher's context
  admits only the fleet's client key: a subscriber without the secret completes no
  handshake and receives nothing, live or replayed;
- `omit_token_ids`: BlockStored events are published with empty `token_ids` (and no
  `lookahead_token_ids`), in the publisher's log and snapshots too (`without_token_ids`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from kvloop.events import protocol as proto
from kvloop.events.batch_log import OVERFLOWED, QUEUED, BatchLog, BatchQueue
from kvloop.events.config import DEFAULT_ENDPOINT, KVEventsConfig
from kvloop.events.types import BlockStored, KVEventBatch, event_int
from kvloop.events.wakeup import WakeupPipe
from kvloop.trust import CurveKeys, curve_authenticator

logger = logging.getLogger(__name__)

TOUCHES_PER_NOTICE = 8192
_ROUTER_MIN_HWM = 100_000


def endpoint_for_rank(addr: str, rank: int) -> str:
    """vLLM's DP rule: tcp port + rank (unless ephemeral); ipc/inproc get a `_dp<rank>` suffix."""
    if rank == 0:
        return addr
    if addr.startswith("tcp://"):
        host, _, port = addr.rpartition(":")
        if port in ("0", "*"):
            return addr
        return f"{host}:{int(port) + rank}"
    return f"{addr}_dp{rank}"


def without_token_ids(batch: KVEventBatch) -> KVEventBatch:
    """`batch` with every BlockStored's `token_ids` emptied (hashes, parent and the rest
    kept): what a worker started with `omit_token_ids` publishes."""
    events = [msgspec.structs.replace(ev, token_ids=[], lookahead_token_ids=None)
              if isinstance(ev, BlockStored) else ev for ev in batch.events]
    return msgspec.structs.replace(batch, events=events)


def new_epoch() -> str:
    """A fresh process-incarnation id."""
    return uuid.uuid4().hex


@dataclass
class PublisherStats:
    """Counters, written by the publisher thread (and `dropped` by `publish`)."""

    published: int = 0
    dropped: int = 0
    heartbeats: int = 0
    touch_notices: int = 0
    replays_served: int = 0
    snapshots_served: int = 0
    infos_served: int = 0
    bad_requests: int = 0


class QueuedPublisher:
    """What every KV-event publisher shares (ZMQ's and NATS's): the engine loop's side. The
    loop calls `publish(batch)` once per step and `publish_touches(hashes)` for cache hits;
    both only queue (never block) and wake the publisher thread (`_wake`, the subclass's).
    Subclasses set `config` and call `__init__`; `start` sets `_started`, `shutdown`
    `_closed`."""

    NAME = "publisher"
    config: KVEventsConfig

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self.stats = PublisherStats()
        self._queue = BatchQueue(config.max_queue_size)
        self._touches: list[bytes] = []
        self._touch_lock = threading.Lock()
        self._sleeping = False
        self._started = False
        self._closed = False

    def _wake(self) -> None:
        raise NotImplementedError

    def publish(self, batch: KVEventBatch) -> None:
        """Queue one batch (one engine step). Never blocks; after `shutdown()` a no-op.

        Raises RuntimeError before `start()`. When the queue is full the batch is dropped,
        counted in `stats.dropped`, and an AllBlocksCleared takes its place (module docstring).
        """
        if not self._started:
            raise RuntimeError(f"{self.NAME}.publish() before start()")
        if self._closed:
            return
        if self.config.omit_token_ids:
            batch = without_token_ids(batch)
        outcome = self._queue.put(batch)
        if outcome != QUEUED:
            self.stats.dropped += 1
            if outcome == OVERFLOWED:
                logger.warning("KV events: queue full (%d), dropping batches",
                               self.config.max_queue_size)
        if self._sleeping:
            self._wake()

    def publish_touches(self, hashes: Sequence[bytes]) -> None:
        """Record cache-hit block hashes for the next recency notice (no-op unless recency)."""
        if not self.config.recency or not hashes or self._closed:
            return
        with self._touch_lock:
            self._touches.extend(hashes)


class ZmqEventPublisher(QueuedPublisher):
    """Publishes one KVEventBatch per engine step; see the module docstring."""

    NAME = "ZmqEventPublisher"

    def __init__(self, config: KVEventsConfig, epoch: str | None = None,
                 curve_keys: CurveKeys | None = None):
        """`curve_keys`: the fleet's KV-event keys, required when `config.curve` is set
        (ValueError without them)."""
        super().__init__(config)
        if config.curve and curve_keys is None:
            raise ValueError("KV events with CURVE need the fleet secret (--fleet-secret-file "
                             "or $KVLOOP_FLEET_SECRET)")
        self._curve_keys = curve_keys if config.curve else None
        self._auth: Any = None    # the ZAP authenticator thread (CURVE only)
        self._epoch = epoch or new_epoch()
        self._topic = config.topic.encode("utf-8")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx: zmq.Context | None = None
        self._pub: zmq.Socket | None = None
        self._router: zmq.Socket | None = None
        self._pipe: WakeupPipe | None = None
        self._failed_addr = ""
        self._endpoint: str | None = None
        self._replay_endpoint: str | None = None
        # Publisher-thread state.
        keep = config.snapshot and config.replay_endpoint is not None
        self._log = BatchLog(config.buffer_steps, keep_mirror=keep)
        self._touch_seq = 0
        self._encoder = msgspec.msgpack.Encoder()

    # --- public surface -------------------------------------------------------------------
    @property
    def epoch(self) -> str:
        return self._epoch

    @property
    def endpoint(self) -> str | None:
        """The PUB socket's actual address (bound port resolved), after `start()`."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The ROUTER socket's actual address, or None without a replay endpoint."""
        return self._replay_endpoint

    @property
    def next_seq(self) -> int:
        """Sequence number of the next batch the thread will send (= batches sent)."""
        return self._log.next_seq

    def start(self) -> ZmqEventPublisher:
        """Bind (or connect) the sockets and start the publisher thread.

        Raises RuntimeError when called twice, OSError when an address cannot be bound.
        """
        if self._started:
            raise RuntimeError("ZmqEventPublisher.start() called twice")
        self._ctx = zmq.Context()
        if self._curve_keys is not None:
            self._auth = curve_authenticator(self._ctx, [self._curve_keys])
        try:
            self._open_sockets()
        except zmq.ZMQError as e:
            self._close_sockets(linger=0)
            self._stop_auth()
            self._ctx.term()
            raise OSError(f"KV events: cannot open {self._failed_addr}: {e}") from e
        self._pipe = WakeupPipe()
        self._started = True
        self._thread = threading.Thread(target=self._run, name="kvloop-kv-events", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 5.0) -> None:
        """Send what is queued, close the sockets, stop the thread. Idempotent."""
        if not self._started or self._closed:
            self._closed = True
            return
        self._closed = True
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("KV events: publisher thread did not stop in %.1fs", timeout)
        self._stop_auth()
        if self._thread is not None and self._thread.is_alive():
            if self._ctx is not None:
                self._ctx.destroy(linger=0)
            return  # the stuck thread may still read its pipe: leave it open
        if self._ctx is not None:
            self._ctx.term()
        if self._pipe is not None:
            self._pipe.close()

    def _stop_auth(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def mirror_hashes(self) -> set[int | bytes] | None:
        """The mirror's hashes (for tests; only meaningful when the thread is idle)."""
        mirror = self._log.mirror
        return None if mirror is None else mirror.hashes()

    def info(self) -> proto.PublisherInfo:
        """What heartbeats and reply headers say about this publisher right now."""
        cfg = self.config
        return proto.PublisherInfo(
            epoch=self._epoch, next_seq=self._log.next_seq,
            oldest_seq=self._log.oldest_seq, ts=time.time(),
            topic=cfg.topic, data_parallel_rank=cfg.data_parallel_rank,
            buffer_steps=cfg.buffer_steps, snapshot=self._log.mirror is not None,
            heartbeat_interval_s=cfg.heartbeat_interval_s if cfg.heartbeats_enabled else 0.0,
            recency=cfg.recency)

    # --- sockets --------------------------------------------------------------------------
    def _open_sockets(self) -> None:
        cfg = self.config
        rank = cfg.data_parallel_rank
        ep = cfg.endpoint or DEFAULT_ENDPOINT
        connect = ep.startswith(">")
        addr = endpoint_for_rank(ep.lstrip("@>"), rank)
        self._failed_addr = addr
        self._pub = self._socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, cfg.hwm)
        self._pub.setsockopt(zmq.LINGER, 500)
        if connect:
            self._pub.connect(addr)
            self._endpoint = addr
        else:
            self._pub.bind(addr)
            self._endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        if cfg.replay_endpoint is not None:
            raddr = endpoint_for_rank(cfg.replay_endpoint.lstrip("@"), rank)
            self._failed_addr = raddr
            self._router = self._socket(zmq.ROUTER)
            self._router.setsockopt(zmq.SNDHWM, max(2 * (cfg.buffer_steps + 1), _ROUTER_MIN_HWM))
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(raddr)
            self._replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)

    def _socket(self, kind: int) -> zmq.Socket:
        """A new socket of the context, a CURVE server when `curve` is on."""
        assert self._ctx is not None
        sock = self._ctx.socket(kind)
        if self._curve_keys is not None:
            self._curve_keys.make_server(sock)
        return sock

    def _close_sockets(self, linger: int | None = None) -> None:
        for sock in (self._pub, self._router):
            if sock is not None and not sock.closed:
                sock.close(linger=linger)

    def _wake(self) -> None:
        if self._pipe is not None:
            self._pipe.wake()

    # --- the publisher thread -------------------------------------------------------------
    def _run(self) -> None:
        cfg = self.config
        poller = zmq.Poller()
        assert self._pipe is not None
        poller.register(self._pipe.fd, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        now = time.monotonic()
        next_hb = now if cfg.heartbeats_enabled else float("inf")
        next_touch = now + cfg.recency_interval_s if cfg.recency else float("inf")
        try:
            while True:
                sent = self._send_queued(limit=1024)
                self._serve_requests()
                now = time.monotonic()
                if now >= next_hb:
                    self._send_heartbeat()
                    next_hb = now + cfg.heartbeat_interval_s
                if now >= next_touch:
                    self._send_touches()
                    next_touch = now + cfg.recency_interval_s
                if sent == 0:
                    if self._stop.is_set():
                        break
                    self._sleep(poller, min(next_hb, next_touch) - now)
            self._send_queued(limit=None)
        except Exception:
            logger.exception("KV events: publisher thread failed")
        finally:
            self._close_sockets()

    def _sleep(self, poller: zmq.Poller, timeout_s: float) -> None:
        self._sleeping = True
        try:
            if self._queue or self._stop.is_set():
                return
            ms = 1000 if timeout_s == float("inf") else max(0, int(timeout_s * 1000) + 1)
            poller.poll(ms)
            assert self._pipe is not None    # closed only after this thread stopped
            self._pipe.drain()
        finally:
            self._sleeping = False

    def _send_queued(self, limit: int | None) -> int:
        n = 0
        while limit is None or n < limit:
            batch = self._queue.pop()
            if batch is None:
                break
            self._send_batch(batch)
            n += 1
        return n

    def _send_batch(self, batch: KVEventBatch) -> None:
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.config.data_parallel_rank
        payload = self._encoder.encode(batch)
        assert self._pub is not None
        self._pub.send_multipart((self._topic, proto.seq_bytes(self._log.next_seq), payload),
                                 copy=False)
        self._log.record(batch.events, (payload,))
        self.stats.published += 1

    def _send_heartbeat(self) -> None:
        assert self._pub is not None
        self._pub.send_multipart((proto.HEARTBEAT_TOPIC, proto.seq_bytes(self._log.next_seq),
                                  proto.encode_info(self.info())))
        self.stats.heartbeats += 1

    def _send_touches(self) -> None:
        with self._touch_lock:
            touched, self._touches = self._touches, []
        assert self._pub is not None
        for notice in touch_notices(touched, self.config, self._epoch):
            self._pub.send_multipart((proto.RECENCY_TOPIC, proto.seq_bytes(self._touch_seq),
                                      msgspec.msgpack.encode(notice)))
            self._touch_seq += 1
            self.stats.touch_notices += 1

    # --- replay socket --------------------------------------------------------------------
    def _serve_requests(self, max_requests: int = 16) -> None:
        router = self._router
        for _ in range(max_requests):
            if router is None or not router.poll(0):
                return
            self._handle_request(router.recv_multipart())

    def _handle_request(self, frames: list[bytes]) -> None:
        """vLLM's request is exactly [identity, b"", start_seq]; ours start with b"kvloop"."""
        if len(frames) == 3 and frames[1] == b"" and len(frames[2]) == 8:
            self._send_replay(frames[0], proto.seq_from_bytes(frames[2]))
            self._send_end(frames[0])
            self.stats.replays_served += 1
        elif len(frames) >= 4 and frames[1] == b"" and frames[2] == proto.KVLOOP:
            self._handle_kvloop(frames[0], frames[3], frames[4:])
        else:
            self.stats.bad_requests += 1
            logger.debug("KV events: ignoring a malformed replay request of %d frames",
                         len(frames))

    def _handle_kvloop(self, ident: bytes, cmd: bytes, args: list[bytes]) -> None:
        if cmd == proto.CMD_INFO:
            self._send_header(ident, cmd)
            self.stats.infos_served += 1
        elif cmd == proto.CMD_REPLAY and len(args) == 1 and len(args[0]) == 8:
            start = proto.seq_from_bytes(args[0])
            self._send_header(ident, cmd)
            if not self._log.history_lost(start):
                self._send_replay(ident, start)
            self._send_end(ident)
            self.stats.replays_served += 1
        elif cmd == proto.CMD_SNAPSHOT:
            self._send_header(ident, cmd)
            self._send_snapshot(ident)
            self._send_end(ident)
            self.stats.snapshots_served += 1
        else:
            self.stats.bad_requests += 1

    def _send_header(self, ident: bytes, cmd: bytes) -> None:
        assert self._router is not None
        self._router.send_multipart((ident, b"", proto.KVLOOP, cmd,
                                     proto.encode_info(self.info())))

    def _send_replay(self, ident: bytes, start: int) -> None:
        router = self._router
        assert router is not None
        for seq, payload in self._log.since(start):
            router.send_multipart((ident, b"", self._topic, proto.seq_bytes(seq), payload),
                                  copy=False)

    def _send_snapshot(self, ident: bytes) -> None:
        assert self._router is not None
        seq = proto.seq_bytes(self._log.next_seq)
        for batch in self._log.snapshot(self.config.snapshot_blocks_per_message,
                                        self.config.data_parallel_rank):
            self._router.send_multipart((ident, b"", self._topic, seq,
                                         msgspec.msgpack.encode(batch)))

    def _send_end(self, ident: bytes) -> None:
        assert self._router is not None
        self._router.send_multipart((ident, b"", b"", proto.END_SEQ, b""))



def touch_notices(touched: Sequence[bytes], cfg: KVEventsConfig,
                  epoch: str) -> list[proto.Touches]:
    """The recency notices for `touched` hashes (deduplicated, at most `TOUCHES_PER_NOTICE`
    hashes each, ints or bytes as `cfg.int_block_hashes` says)."""
    unique = list(dict.fromkeys(touched))
    hashes: list[int | bytes] = ([event_int(h) for h in unique]
                                 if cfg.int_block_hashes else list(unique))
    return [proto.Touches(ts=time.time(), epoch=epoch,
                          block_hashes=hashes[i:i + TOUCHES_PER_NOTICE],
                          data_parallel_rank=cfg.data_parallel_rank)
            for i in range(0, len(hashes), TOUCHES_PER_NOTICE)]
