"""NatsEventPlane: one NATS connection through which a consumer (a router) reads many
workers' KV events, in order and complete, across gaps, late joins and server restarts.

Owner: one thread (`kvloop-nats-plane`) runs an asyncio loop that owns the connection, the
wildcard subscriptions and one `WorkerStream` per attached worker; every callback runs on
that thread. Other threads call `attach`, `detach`, `subscribe`, `probe` and `stop`, which
hand their work to the loop.

How a worker's stream stays whole (`WorkerStream`):
- The consumer subscribes to the data, heartbeat and recency subjects of its component (or of
  every component, "*") once; each message names its worker (`Kvloop-Worker`, or a Dynamo
  payload's `worker_id`) and goes to that worker's queue; messages of workers nobody
  attached are counted and dropped.
- Attach: the stream asks the worker for a snapshot over request/reply first (live messages
  wait in its queue meanwhile), then applies the queued ones numbered from the snapshot's
  `next_seq` on: no window is lost (Dynamo's "subscribe first, then dump" order).
- Gap (a number above the expected one, or a heartbeat whose `next_seq` is ahead): replay
  from the first missing number; if the worker no longer holds it, a snapshot.
- Server restart: on reconnection every stream takes a fresh snapshot (messages published
  while the connection was down are gone for core NATS).
- The order rules are `sequencer.EventSequencer`'s, as in the ZMQ subscriber; this module
  fetches what it asks for. Deliveries are `sequencer.WorkerBatch`es, as the ZMQ one's: a
  reset (`[AllBlocksCleared()]`, reason join / gap / epoch / reconnect) before each snapshot.

Identity: a plane given the fleet secret admits only messages signed by a fleet member, fresh
and never seen before (one `MessageGate` per subscription; refused ones are counted in
`stats.refusals`, never delivered), and signs its own queries (workers answer no others).

The bus watch (`probe`): for a few seconds, listen to everything published in the namespace
(`namespace.{ns}.>`) and to every namespace's data and heartbeat subjects, and report on which
subjects one worker's messages actually travel.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvloop.events import protocol as proto
from kvloop.events.config import PAYLOAD_DYNAMO, NatsPlaneConfig
from kvloop.events.nats_plane import (
    ANY_NAMESPACE_DATA,
    ANY_NAMESPACE_HEARTBEAT,
    CMD_REPLAY,
    CMD_SNAPSHOT,
    H_CMD,
    H_EPOCH,
    H_KIND,
    H_SEQ,
    H_START,
    H_WORKER,
    KIND_DATA,
    KIND_END,
    KIND_HEADER,
    MessageGate,
    Refusals,
    Subjects,
    connect_options,
    decode_dynamo,
    first_connect,
    header_int,
    payload_worker_id,
    signed_headers,
)
from kvloop.events.sequencer import (
    LIVE,
    REPLAY,
    RESET,
    SNAPSHOT,
    BatchCallback,
    EventSequencer,
    SubscriberStats,
    Verdict,
    WorkerBatch,
    count_delivery,
)
from kvloop.events.types import AllBlocksCleared, KVEventBatch
from kvloop.trust import FleetSecret

NATS_STATUS_HEADER, NO_RESPONDERS = "Status", "503"   # nats-server's no-responders reply
logger = logging.getLogger(__name__)

JOIN, GAP, EPOCH, RECONNECT = "join", "gap", "epoch", "reconnect"
_DATA, _HEARTBEAT, _TOUCH, _RESYNC, _STOP = "data", "heartbeat", "touch", "resync", "stop"

HeartbeatCallback = Callable[[str, proto.PublisherInfo], None]
TouchCallback = Callable[[str, list[int | bytes]], None]
MessageCallback = Callable[[str, bytes, dict[str, str]], None]


@dataclass
class PlaneStats:
    """Counters of the connection (not of one worker)."""

    messages: int = 0
    unattached: int = 0          # messages of workers nobody attached
    malformed: int = 0
    reconnects: int = 0
    disconnects: int = 0
    connected: bool = False
    unattached_workers: dict[int, str] = field(default_factory=dict)   # id -> last subject
    refusals: Refusals = field(default_factory=Refusals)   # unsigned, forged, stale, replayed


class NatsEventPlane:
    """A consumer's connection to the event plane; see the module docstring."""

    def __init__(self, config: NatsPlaneConfig, name: str = "kvloop-router",
                 request_timeout_s: float = 2.0, secret: FleetSecret | None = None):
        self.config = config
        self.secret = secret
        self.subjects = Subjects.of(config)
        self.name = name
        self.request_timeout_s = request_timeout_s
        self.stats = PlaneStats()
        self._streams: dict[int, WorkerStream] = {}
        self._extra: list[tuple[str, MessageCallback]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._done: asyncio.Event | None = None
        self._failure: BaseException | None = None
        self.nc: Any = None
        self._data_gate, self._heartbeat_gate, self._touch_gate, self._reply_gate = (
            self.gate() for _ in range(4))

    def gate(self) -> MessageGate:
        """A new subscription's gate (its own verifier; refusals counted in `stats`)."""
        return MessageGate(self.secret, self.stats.refusals)

    # --- lifecycle ------------------------------------------------------------------------
    @property
    def listening(self) -> str:
        """The data subject this consumer listens on (a wildcard for component "*")."""
        return self.subjects.data

    def start(self) -> NatsEventPlane:
        """Connect and subscribe; OSError when the server cannot be reached."""
        self._thread = threading.Thread(target=self._run, name="kvloop-nats-plane",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(self.config.connect_timeout_s + 5.0) or self._failure:
            self.stop()
            raise OSError(f"cannot reach the NATS server {self.config.safe_url}: "
                          f"{self._failure or 'timed out'}")
        return self

    def stop(self, timeout: float = 5.0) -> None:
        loop, done = self._loop, self._done
        if loop is not None and done is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(done.set)
            except RuntimeError:
                pass
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception as e:
            self._failure = self._failure or e
            logger.exception("NATS event plane failed")
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._done = asyncio.Event()
        try:
            self.nc = await first_connect(
                connect_options(self.config, self.name), self.config.connect_timeout_s,
                disconnected_cb=self._on_disconnected, reconnected_cb=self._on_reconnected)
            s = self.subjects
            await self.nc.subscribe(s.data, cb=self._on_data)
            await self.nc.subscribe(s.heartbeat, cb=self._on_heartbeat)
            await self.nc.subscribe(s.recency, cb=self._on_touch)
            await self.nc.flush()
        except Exception as e:   # no server, bad credentials, no permission
            self._failure = e
            return
        self.stats.connected = True
        self._ready.set()
        await self._done.wait()
        for stream in list(self._streams.values()):
            stream.close()
        try:
            await self.nc.close()
        except Exception:
            pass

    def _call(self, coro: Any) -> concurrent.futures.Future[Any]:
        """Run `coro` on the plane's loop (from any other thread)."""
        assert self._loop is not None, "NatsEventPlane.start() first"
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    # --- workers --------------------------------------------------------------------------
    def attach(self, worker_id: int, name: str, component: str, on_batch: BatchCallback,
               on_heartbeat: HeartbeatCallback | None = None,
               on_touch: TouchCallback | None = None, block_size: int = 0,
               payload_format: str | None = None) -> WorkerStream:
        """Start delivering worker `worker_id`'s events (its queries go to `component`'s
        query subject; its payloads are in `payload_format`, by default the plane's);
        returns its stream, already synchronizing."""
        stream = WorkerStream(self, worker_id, name, component, on_batch, on_heartbeat,
                              on_touch, block_size, payload_format)
        self._call(self._attach(stream)).result(timeout=5.0)
        return stream

    async def _attach(self, stream: WorkerStream) -> None:
        old = self._streams.pop(stream.worker_id, None)
        if old is not None:
            old.close()
        self._streams[stream.worker_id] = stream
        self.stats.unattached_workers.pop(stream.worker_id, None)
        stream.start()

    def detach(self, worker_id: int, stream: WorkerStream | None = None) -> None:
        """Stop delivering `worker_id`'s events (only if `stream` is still its stream)."""
        if self._loop is None or self._loop.is_closed():
            return
        try:
            self._call(self._detach(worker_id, stream)).result(timeout=5.0)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass

    async def _detach(self, worker_id: int, stream: WorkerStream | None) -> None:
        current = self._streams.get(worker_id)
        if current is not None and (stream is None or current is stream):
            del self._streams[worker_id]
            current.close()

    def publish(self, subject: str, payload: bytes) -> None:
        """Publish `payload` on `subject`, signed with the plane's secret, from any thread
        (best effort: while disconnected, the client buffers or drops it)."""
        loop = self._loop
        if loop is None or loop.is_closed() or self.nc is None:
            return
        headers = signed_headers(self.secret, subject, payload)
        try:
            self._call(self.nc.publish(subject, payload, headers=headers))
        except RuntimeError:   # the loop is closing
            pass

    def subscribe(self, subject: str, callback: MessageCallback) -> None:
        """Call `callback(subject, payload, headers)` on the plane's thread for every message
        on `subject` (kept across reconnections)."""
        gate = self.gate()

        async def _sub() -> None:
            async def cb(msg: Any) -> None:
                if not gate.admits(msg.subject, msg.data, msg.headers):
                    return
                try:
                    callback(msg.subject, msg.data, dict(msg.headers or {}))
                except Exception:
                    logger.exception("NATS: a callback on %s failed", subject)
            await self.nc.subscribe(subject, cb=cb)
            await self.nc.flush()
        self._call(_sub()).result(timeout=5.0)

    # --- routing messages to streams ------------------------------------------------------
    def _stream_of(self, msg: Any, gate: MessageGate) -> WorkerStream | None:
        self.stats.messages += 1
        if not gate.admits(msg.subject, msg.data, msg.headers):
            return None
        wid = header_int(msg.headers, H_WORKER)
        if wid is None:
            wid = payload_worker_id(msg.data)
        if wid is None:
            self.stats.malformed += 1
            return None
        stream = self._streams.get(wid)
        if stream is None:
            self.stats.unattached += 1
            seen = self.stats.unattached_workers
            if wid in seen or len(seen) < 1024:
                seen[wid] = msg.subject
        return stream

    async def _on_data(self, msg: Any) -> None:
        stream = self._stream_of(msg, self._data_gate)
        if stream is not None:
            stream.put((_DATA, msg.data, dict(msg.headers or {})))

    async def _on_heartbeat(self, msg: Any) -> None:
        stream = self._stream_of(msg, self._heartbeat_gate)
        if stream is not None:
            stream.put((_HEARTBEAT, msg.data, dict(msg.headers or {})))

    async def _on_touch(self, msg: Any) -> None:
        stream = self._stream_of(msg, self._touch_gate)
        if stream is not None:
            stream.put((_TOUCH, msg.data, dict(msg.headers or {})))

    # --- connection callbacks -------------------------------------------------------------
    async def _on_disconnected(self) -> None:
        self.stats.disconnects += 1
        self.stats.connected = False
        if self._done is None or not self._done.is_set():
            logger.warning("NATS: disconnected from %s; reconnecting",
                           self.config.safe_url)

    async def _on_reconnected(self) -> None:
        self.stats.reconnects += 1
        self.stats.connected = True
        logger.warning("NATS: reconnected to %s; resynchronizing %d workers",
                       self.config.safe_url, len(self._streams))
        for stream in self._streams.values():
            stream.put((_RESYNC, RECONNECT, {}))


    # --- requests -------------------------------------------------------------------------
    async def request(self, subject: str, cmd: str, start: int | None = None
                      ) -> tuple[proto.PublisherInfo, list[tuple[int, bytes]]] | None:
        """Ask a worker's query subject; (header, [(seq, payload)...]) or None when nobody
        answers within `request_timeout_s` (between two messages of the answer)."""
        inbox = self.nc.new_inbox()
        replies: asyncio.Queue[Any] = asyncio.Queue()
        sub = await self.nc.subscribe(inbox, cb=replies.put)
        hdrs = {H_CMD: cmd}
        if start is not None:
            hdrs[H_START] = str(start)
        try:
            signed = signed_headers(self.secret, subject, b"", hdrs, reply=inbox)
            await self.nc.publish(subject, b"", reply=inbox, headers=signed)
            return await self._collect(replies)
        except Exception as e:  # disconnected meanwhile: the caller retries on reconnect
            logger.debug("NATS request on %s failed: %s", subject, e)
            return None
        finally:
            try:
                await sub.unsubscribe()
            except Exception:
                pass

    async def _collect(self, replies: asyncio.Queue[Any]
                       ) -> tuple[proto.PublisherInfo, list[tuple[int, bytes]]] | None:
        """The answer's messages until its end; None when nobody answers, or when the
        answer stops for `request_timeout_s`. Every message passes the gate: a stranger's,
        whatever it claims to be, is skipped and does not extend the wait."""
        loop = asyncio.get_running_loop()
        info: proto.PublisherInfo | None = None
        items: list[tuple[int, bytes]] = []
        deadline = loop.time() + self.request_timeout_s
        while True:
            try:
                msg = await asyncio.wait_for(replies.get(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                return None
            hdrs = msg.headers or {}
            if hdrs.get(NATS_STATUS_HEADER) == NO_RESPONDERS:
                return None   # the server says nobody serves the subject
            if not self._reply_gate.admits(msg.subject, msg.data, hdrs):
                continue      # a forged answer: wait for the worker's own
            deadline = loop.time() + self.request_timeout_s
            kind = hdrs.get(H_KIND)
            if kind == KIND_HEADER:
                try:
                    info = proto.decode_info(msg.data)
                except msgspec.DecodeError:
                    return None
            elif kind == KIND_DATA:
                seq = header_int(hdrs, H_SEQ)
                if seq is not None:
                    items.append((seq, msg.data))
            elif kind == KIND_END:
                return (info, items) if info is not None else None
            else:   # admitted, but no part of an answer
                return None

    # --- the bus watch --------------------------------------------------------------------
    def probe(self, worker_id: int, seconds: float) -> concurrent.futures.Future[dict[str, int]]:
        """Where worker `worker_id`'s messages travel: {subject: messages seen} over at most
        `seconds` (ends early once a data or heartbeat subject of it was seen)."""
        return self._call(self._probe(worker_id, seconds))

    async def _probe(self, worker_id: int, seconds: float) -> dict[str, int]:
        seen: dict[str, int] = {}
        found = asyncio.Event()
        gate = self.gate()

        async def cb(msg: Any) -> None:
            if not gate.admits(msg.subject, msg.data, msg.headers):
                return
            wid = header_int(msg.headers, H_WORKER)
            if wid is None:
                wid = payload_worker_id(msg.data)
            if wid == worker_id:
                seen[msg.subject] = seen.get(msg.subject, 0) + 1
                if msg.subject.endswith((".kv-events", ".kvloop.heartbeat")):
                    found.set()

        patterns = (self.subjects.namespace_wildcard, ANY_NAMESPACE_DATA,
                    ANY_NAMESPACE_HEARTBEAT)
        subs = [await self.nc.subscribe(p, cb=cb) for p in patterns]
        try:
            await asyncio.wait_for(found.wait(), seconds)
        except TimeoutError:
            pass
        finally:
            for sub in subs:
                try:
                    await sub.unsubscribe()
                except Exception:
                    pass
        return seen


class WorkerStream:
    """One worker's events through a `NatsEventPlane`: queue, sequencing, resync. All but
    `put` from outside run on the plane's loop."""

    def __init__(self, plane: NatsEventPlane, worker_id: int, name: str, component: str,
                 on_batch: BatchCallback, on_heartbeat: HeartbeatCallback | None,
                 on_touch: TouchCallback | None, block_size: int,
                 payload_format: str | None = None):
        self.plane = plane
        self.worker_id = worker_id
        self.name = name
        self.query_subject = Subjects(plane.config.namespace, component).query(worker_id)
        self._on_batch = on_batch
        self._on_heartbeat = on_heartbeat
        self._on_touch = on_touch
        self.block_size = block_size
        self.dynamo = (payload_format or plane.config.payload_format) == PAYLOAD_DYNAMO
        self._decoder = proto.BatchDecoder()
        self._stats = SubscriberStats(kvloop_publisher=True)
        self._seq = EventSequencer(self._stats)
        self._queue: asyncio.Queue[tuple[str, Any, dict[str, str]]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._last_sync_try = 0.0
        self.closed = False

    @property
    def stats(self) -> SubscriberStats:
        return dataclasses.replace(self._stats)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def put(self, item: tuple[str, Any, dict[str, str]]) -> None:
        if not self.closed:
            self._queue.put_nowait(item)

    def close(self) -> None:
        self.closed = True
        self._queue.put_nowait((_STOP, None, {}))

    async def _run(self) -> None:
        try:
            await self._sync(JOIN)
            while True:
                kind, payload, hdrs = await self._queue.get()
                if kind == _STOP:
                    return
                await self._handle(kind, payload, hdrs)
        except Exception:
            logger.exception("NATS: the event stream of %s failed", self.name)

    async def _handle(self, kind: str, payload: Any, hdrs: dict[str, str]) -> None:
        if kind == _DATA:
            await self._on_data(payload, hdrs)
        elif kind == _HEARTBEAT:
            await self._on_heartbeat_message(payload)
        elif kind == _TOUCH:
            self._on_touches(payload)
        elif kind == _RESYNC:
            await self._sync(payload)

    # --- data -----------------------------------------------------------------------------
    def _decode(self, payload: bytes) -> KVEventBatch | None:
        try:
            if self.dynamo:
                return decode_dynamo(payload, self.block_size)[2]
            return self._decoder.decode(payload)
        except msgspec.DecodeError:
            self._stats.malformed += 1
            return None

    async def _on_data(self, payload: bytes, hdrs: dict[str, str]) -> None:
        seq = header_int(hdrs, H_SEQ)
        epoch = hdrs.get(H_EPOCH)
        if seq is None:
            self._stats.malformed += 1
            return
        if epoch is not None and self._seq.epoch_changed(epoch):
            await self._sync(EPOCH)
            return
        if self._seq.expected is None:
            await self._retry_sync()
        verdict = self._seq.classify(seq)
        if verdict is Verdict.BEHIND:
            self._stats.duplicates += 1
            return
        if verdict is Verdict.GAP:
            self._stats.gaps += 1
            start = self._seq.expected
            assert start is not None   # a gap is counted from a known number
            await self._recover(start)
            if self._seq.classify(seq) is Verdict.BEHIND:
                return   # the replay brought it
        batch = self._decode(payload)
        if batch is not None:
            self._accept(seq, batch, LIVE)

    def _accept(self, seq: int, batch: KVEventBatch, source: str) -> None:
        self._seq.accept(seq)
        self._deliver(batch, seq, source)

    def _deliver(self, batch: KVEventBatch, seq: int | None, source: str,
                 reason: str | None = None) -> None:
        st = self._stats
        count_delivery(st, batch, seq, source)
        try:
            self._on_batch(WorkerBatch(self.name, batch, seq, st.current_epoch, source,
                                       reason))
        except Exception:
            st.callback_errors += 1
            logger.exception("NATS: on_batch failed for %s", self.name)

    # --- heartbeats and touches -----------------------------------------------------------
    async def _on_heartbeat_message(self, payload: bytes) -> None:
        try:
            info = proto.decode_info(payload)
        except msgspec.DecodeError:
            self._stats.malformed += 1
            return
        st = self._stats
        st.heartbeats += 1
        st.last_heartbeat_time = time.time()
        if self._on_heartbeat is not None:
            try:
                self._on_heartbeat(self.name, info)
            except Exception:
                st.callback_errors += 1
        start = self._seq.missing_before(info.next_seq)
        if self._seq.expected is None:
            await self._retry_sync()
        elif self._seq.epoch_changed(info.epoch):
            await self._sync(EPOCH)
        elif start is not None:
            st.gaps += 1      # lost at the tail: nothing later came to show it
            await self._recover(start)

    def _on_touches(self, payload: bytes) -> None:
        try:
            notice = proto.decode_touches(payload)
        except msgspec.DecodeError:
            self._stats.malformed += 1
            return
        if notice.epoch != self._seq.epoch or self._on_touch is None:
            return
        self._stats.touches += len(notice.block_hashes)
        self._on_touch(self.name, notice.block_hashes)

    # --- resynchronization ----------------------------------------------------------------
    async def _recover(self, start: int) -> None:
        """Replay from `start`; a snapshot when the worker no longer holds it."""
        reply = await self.plane.request(self.query_subject, CMD_REPLAY, start)
        if reply is None:
            self._stats.replay_failures += 1
            self._stats.unrecovered_gaps += 1
            return
        info, items = reply
        if self._seq.epoch is None:   # never synced: only a snapshot makes the view whole
            await self._sync(EPOCH)
            return
        verdict = self._seq.replay_verdict(start, info)
        if verdict is not Verdict.REPLAY:
            await self._sync(EPOCH if verdict is Verdict.EPOCH else GAP)
            return
        self._stats.replays += 1
        for seq, payload in items:
            if self._seq.classify(seq) is Verdict.BEHIND:
                continue
            batch = self._decode(payload)
            if batch is not None:
                self._accept(seq, batch, REPLAY)

    async def _retry_sync(self) -> None:
        """Not synchronized yet (the worker did not answer): ask again, at most once a
        second; the message at hand is applied either way."""
        now = time.monotonic()
        if now - self._last_sync_try >= 1.0:
            await self._sync(JOIN)

    async def _sync(self, reason: str) -> bool:
        """Replace this worker's view with a snapshot; the stream continues at its number."""
        self._last_sync_try = time.monotonic()
        reply = await self.plane.request(self.query_subject, CMD_SNAPSHOT)
        st = self._stats
        if reply is None:
            st.replay_failures += 1   # unsynced: the next message or heartbeat retries
            return False
        info, items = reply
        if self._seq.epoch_changed(info.epoch):
            st.restarts += 1
        self._seq.adopt_epoch(info.epoch)
        self._deliver(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]), None, RESET,
                      reason)
        for _, payload in items:
            batch = self._decode(payload)
            if batch is not None:
                self._deliver(batch, info.next_seq, SNAPSHOT)
        self._seq.synced(info)
        return True
