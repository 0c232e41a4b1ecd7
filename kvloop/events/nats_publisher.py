"""NatsEventPublisher: the engine core's KV events on a NATS server (Dynamo's subjects).

The same surface as `ZmqEventPublisher` (`start`, `publish`, `publish_touches`, `shutdown`,
`info`, `stats`), so the engine process starts either one from its `KVEventsConfig`.

Threads and ownership:
- The engine loop calls `publish(batch)` once per step (non-blocking: `BatchQueue.put`).
- One publisher thread (`kvloop-nats-events`) runs an asyncio loop holding the NATS client,
  the `BatchLog` (sequence numbers, replay buffer, mirror), the heartbeats, recency notices
  and the query service (info, replay, snapshot on `...kvloop.query.{worker_id}`), so a
  snapshot is exact at a sequence number, as on ZMQ.

Subjects, headers and payloads: `kvloop.events.nats_plane`. With a fleet secret every message
is signed, and queries are answered only when a fleet member signed them (a stranger on the
bus gets no snapshot of this worker's cache). A message the client cannot send
(the server is down, the reconnect buffer is full) is still numbered and kept: consumers see
the gap and replay it once the client has reconnected.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import msgspec

from kvloop.events import protocol as proto
from kvloop.events.batch_log import BatchLog
from kvloop.events.config import KVEventsConfig, NatsPlaneConfig
from kvloop.events.nats_plane import (
    CMD_INFO,
    CMD_REPLAY,
    CMD_SNAPSHOT,
    H_CMD,
    H_START,
    KIND_DATA,
    KIND_END,
    KIND_HEADER,
    MessageGate,
    Refusals,
    Subjects,
    connect_options,
    encode_messages,
    first_connect,
    header_int,
    headers,
    signed_headers,
    worker_id_of,
)
from kvloop.events.publisher import QueuedPublisher, new_epoch, touch_notices
from kvloop.events.types import KVEventBatch
from kvloop.trust import FleetSecret

logger = logging.getLogger(__name__)


class NatsEventPublisher(QueuedPublisher):
    """Publishes one engine step's events on NATS; see the module docstring."""

    NAME = "NatsEventPublisher"

    def __init__(self, config: KVEventsConfig, epoch: str | None = None,
                 secret: FleetSecret | None = None):
        if config.nats is None:
            raise ValueError("NatsEventPublisher needs KVEventsConfig(nats=...)")
        super().__init__(config)
        self.plane: NatsPlaneConfig = config.nats
        self._epoch = epoch or new_epoch()
        self.worker_id = worker_id_of(self._epoch)
        self.subjects = Subjects.of(self.plane)
        self._log = BatchLog(config.buffer_steps, keep_mirror=config.snapshot)
        self._encoder = msgspec.msgpack.Encoder()
        self._stopping = False
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake_event: asyncio.Event | None = None
        self._nc: Any = None
        self.secret = secret
        self.refusals = Refusals()
        self._query_gate = MessageGate(secret, self.refusals)

    # --- public surface -------------------------------------------------------------------
    @property
    def epoch(self) -> str:
        return self._epoch

    @property
    def endpoint(self) -> str:
        """The NATS server, credentials left out."""
        return self.plane.safe_url

    @property
    def replay_endpoint(self) -> str:
        """The query subject (replay, snapshot, info) of this worker."""
        return self.subjects.query(self.worker_id)

    @property
    def next_seq(self) -> int:
        return self._log.next_seq

    def start(self) -> NatsEventPublisher:
        """Connect and start the publisher thread. Raises RuntimeError when called twice,
        OSError when the server cannot be reached within `connect_timeout_s`."""
        if self._started:
            raise RuntimeError("NatsEventPublisher.start() called twice")
        self._started = True
        self._thread = threading.Thread(target=self._run, name="kvloop-nats-events",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(self.plane.connect_timeout_s + 5.0) or self._failure:
            self._closed = True
            self._stop_thread(2.0)
            raise OSError(f"KV events: cannot reach the NATS server {self.endpoint}: "
                          f"{self._failure or 'timed out'}")
        return self

    def shutdown(self, timeout: float = 5.0) -> None:
        """Send what is queued, close the connection, stop the thread. Idempotent."""
        if not self._started or self._closed:
            self._closed = True
            return
        self._closed = True
        self._stop_thread(timeout)

    def info(self) -> proto.PublisherInfo:
        cfg = self.config
        return proto.PublisherInfo(
            epoch=self._epoch, next_seq=self._log.next_seq, oldest_seq=self._log.oldest_seq,
            ts=time.time(), topic=self.subjects.data,
            data_parallel_rank=cfg.data_parallel_rank, buffer_steps=cfg.buffer_steps,
            snapshot=self._log.mirror is not None,
            heartbeat_interval_s=cfg.heartbeat_interval_s, recency=cfg.recency)

    def mirror_hashes(self) -> set[int | bytes] | None:
        mirror = self._log.mirror
        return None if mirror is None else mirror.hashes()

    # --- the thread -----------------------------------------------------------------------
    def _stop_thread(self, timeout: float) -> None:
        self._stopping = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("KV events: NATS publisher thread did not stop in %.1fs",
                               timeout)

    def _wake(self) -> None:
        loop, event = self._loop, self._wake_event
        if loop is not None and event is not None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:   # the loop has closed: the thread is done
                pass

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception as e:  # anything escaping the loop ends publishing, loudly
            self._failure = self._failure or e
            logger.exception("KV events: NATS publisher thread failed")
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake_event = asyncio.Event()
        try:
            self._nc = await first_connect(
                connect_options(self.plane, f"kvloop-worker-{self.worker_id}"),
                self.plane.connect_timeout_s, disconnected_cb=self._on_disconnected,
                reconnected_cb=self._on_reconnected)
            await self._nc.subscribe(self.subjects.query(self.worker_id), cb=self._on_query)
            await self._nc.flush()
        except Exception as e:  # no server, bad credentials: start() reports it
            self._failure = e
            return
        self._ready.set()
        try:
            await self._serve()
        finally:
            await self._close()

    async def _serve(self) -> None:
        cfg = self.config
        now = time.monotonic()
        next_hb = now
        next_touch = now + cfg.recency_interval_s if cfg.recency else float("inf")
        while True:
            sent = await self._send_queued(1024)
            now = time.monotonic()
            if now >= next_hb:
                await self._send_heartbeat()
                next_hb = now + cfg.heartbeat_interval_s
            if now >= next_touch:
                await self._send_touches()
                next_touch = now + cfg.recency_interval_s
            if sent == 0:
                if self._stopping:
                    return
                await self._sleep(min(next_hb, next_touch) - now)

    async def _sleep(self, timeout_s: float) -> None:
        event = self._wake_event
        assert event is not None
        self._sleeping = True
        try:
            if len(self._queue) or self._stopping:
                return
            try:
                await asyncio.wait_for(event.wait(), max(0.0, timeout_s))
            except TimeoutError:
                pass
        finally:
            event.clear()
            self._sleeping = False

    async def _close(self) -> None:
        try:
            await self._send_queued(None)
            await self._nc.flush(timeout=2)
        except Exception as e:  # a server gone at shutdown: nothing more to deliver
            logger.debug("KV events: final flush failed: %s", e)
        try:
            await self._nc.close()
        except Exception:
            pass

    async def _send_queued(self, limit: int | None) -> int:
        n = 0
        while limit is None or n < limit:
            batch = self._queue.pop()
            if batch is None:
                break
            await self._send_batch(batch)
            n += 1
        return n

    async def _send_batch(self, batch: KVEventBatch) -> None:
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.config.data_parallel_rank
        if not batch.events:   # nothing to number: a consumer sees no message
            self.stats.published += 1
            return
        first = self._log.next_seq
        payloads = encode_messages(batch, self.plane, self.worker_id, first, self._encoder)
        self._log.record(batch.events, payloads)
        for i, payload in enumerate(payloads):
            await self._publish(self.subjects.data, payload,
                                headers(self.worker_id, self._epoch, first + i))
        self.stats.published += 1

    async def _publish(self, subject: str, payload: bytes, hdrs: dict[str, str],
                       reply: str = "") -> bool:
        try:
            await self._nc.publish(subject, payload, reply=reply,
                                   headers=signed_headers(self.secret, subject, payload, hdrs))
            return True
        except Exception as e:  # disconnected with a full buffer: consumers replay the gap
            logger.debug("KV events: publish on %s failed: %s", subject, e)
            return False

    async def _send_heartbeat(self) -> None:
        if await self._publish(self.subjects.heartbeat, proto.encode_info(self.info()),
                               headers(self.worker_id, self._epoch, self._log.next_seq)):
            self.stats.heartbeats += 1

    async def _send_touches(self) -> None:
        with self._touch_lock:
            touched, self._touches = self._touches, []
        for notice in touch_notices(touched, self.config, self._epoch):
            await self._publish(self.subjects.recency, msgspec.msgpack.encode(notice),
                                headers(self.worker_id, self._epoch))
            self.stats.touch_notices += 1

    # --- queries --------------------------------------------------------------------------
    async def _on_query(self, msg: Any) -> None:
        """Answer info / replay / snapshot. What the answer holds is taken at once, before
        the first send, so it is exact at one sequence number."""
        if not msg.reply or not self._query_gate.admits(msg.subject, msg.data, msg.headers,
                                                        reply=msg.reply):
            self.stats.bad_requests += 1
            return
        cmd = (msg.headers or {}).get(H_CMD)
        info = self.info()
        items: list[tuple[int, bytes]] = []
        if cmd == CMD_REPLAY:
            start = header_int(msg.headers, H_START) or 0
            if not self._log.history_lost(start):
                items = self._log.since(start)
            self.stats.replays_served += 1
        elif cmd == CMD_SNAPSHOT:
            items = self._snapshot_items()
            self.stats.snapshots_served += 1
        elif cmd == CMD_INFO:
            self.stats.infos_served += 1
        else:
            self.stats.bad_requests += 1
            return
        await self._reply(msg.reply, info, items)

    def _snapshot_items(self) -> list[tuple[int, bytes]]:
        seq = self._log.next_seq
        out: list[tuple[int, bytes]] = []
        for batch in self._log.snapshot(self.config.snapshot_blocks_per_message,
                                        self.config.data_parallel_rank):
            for payload in encode_messages(batch, self.plane, self.worker_id, seq,
                                           self._encoder):
                out.append((seq, payload))
        return out

    async def _reply(self, inbox: str, info: proto.PublisherInfo,
                     items: list[tuple[int, bytes]]) -> None:
        wid, epoch = self.worker_id, self._epoch
        await self._publish(inbox, proto.encode_info(info),
                            headers(wid, epoch, info.next_seq, KIND_HEADER))
        for seq, payload in items:
            await self._publish(inbox, payload, headers(wid, epoch, seq, KIND_DATA))
        await self._publish(inbox, b"", headers(wid, epoch, kind=KIND_END))

    # --- connection callbacks -------------------------------------------------------------
    async def _on_disconnected(self) -> None:
        if not self._stopping:
            logger.warning("KV events: disconnected from %s; reconnecting", self.endpoint)

    async def _on_reconnected(self) -> None:
        logger.warning("KV events: reconnected to %s", self.endpoint)

