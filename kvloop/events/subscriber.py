"""KVEventSubscriber: one worker's KV events, in order and complete, across gaps and restarts.

Owner: one subscriber thread (`kvloop-kv-sub`) owns the SUB and DEALER sockets, the sequence
state (its `EventSequencer`) and the stats, and calls the callbacks, in order, from that thread.

What it guarantees to `on_batch`: for each worker, batches arrive in publisher order, each
at most once. Whenever what came before can no longer be trusted (a new publisher epoch, a
publisher restart, a snapshot), a *reset* comes first: a `WorkerBatch` with
`source == "reset"` whose batch is `[AllBlocksCleared()]`, so a consumer that simply applies
every batch's events is always right; `reason` tells why.

How (see `protocol.py` for the frames; the order rules are `sequencer.EventSequencer`'s,
shared with the NATS stream; this module fetches what it asks for):
- Sequence numbers: the next batch must carry `expected`. A higher number is a gap: ask the
  replay socket for the missing range; if the publisher no longer has it, ask for a snapshot
  (kvloop publishers). A lower number is a duplicate if its payload equals what that number
  carried before (a recent window of digests), otherwise a new publisher incarnation.
- Epochs: a kvloop publisher names its process incarnation in heartbeats and in every reply
  header. A new epoch means a restart: reset, then snapshot (or replay from 0).
- Liveness: heartbeats on their own topic; when none came for `probe_interval_s`, an
  `info` request on the replay socket (kvloop publishers) serves as one, checks the epoch
  even while batches flow, and reveals batches lost at the tail of the stream.
- A vLLM publisher answers only vLLM's replay request: the subscriber notices that its
  `info` probes go unanswered and then uses vLLM's protocol alone (no snapshots, no epochs).
- Malformed frames and payloads are counted in `stats.malformed` and dropped; exceptions
  from callbacks are logged and counted; nothing stops the thread but `stop()`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from kvloop.events import protocol as proto
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
from kvloop.events.wakeup import WakeupPipe
from kvloop.trust import CurveKeys

logger = logging.getLogger(__name__)

_MAX_UNANSWERED_PROBES = 3


TouchCallback = Callable[[str, list[int | bytes]], None]
InfoCallback = Callable[[str, proto.PublisherInfo], None]


class KVEventSubscriber:
    """Subscribes to one worker's KV events; see the module docstring."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 on_batch: BatchCallback | None = None, *, worker_id: str | None = None,
                 on_touch: TouchCallback | None = None,
                 on_heartbeat: InfoCallback | None = None,
                 probe_interval_s: float = 1.0, request_timeout_s: float = 2.0,
                 rcvhwm: int = 100_000, dedup_window: int = 4096,
                 curve_keys: CurveKeys | None = None):
        if probe_interval_s <= 0 or request_timeout_s <= 0:
            raise ValueError("probe_interval_s and request_timeout_s must be > 0")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.worker_id = worker_id or endpoint
        self._topic = topic.encode("utf-8")
        self._on_batch = on_batch
        self._on_touch = on_touch
        self._on_heartbeat = on_heartbeat
        self._probe_interval = probe_interval_s
        self._timeout_ms = max(1, int(request_timeout_s * 1000))
        self._rcvhwm = rcvhwm
        self._curve_keys = curve_keys   # the fleet's KV-event keys: a CURVE client of both
        self._decoder = proto.BatchDecoder()
        self._stats = SubscriberStats()
        self._seq = EventSequencer(self._stats, dedup_window)
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Subscriber-thread state.
        self._ctx: zmq.Context | None = None
        self._sub: zmq.Socket | None = None
        self._dealer: zmq.Socket | None = None
        self._poller = zmq.Poller()
        self._stop_pipe: WakeupPipe | None = None   # `stop()` wakes the thread's poll with it
        self._resyncing = False
        self._last_heard = 0.0
        self._probe_sent: float | None = None
        self._unanswered = 0
        self._poll_tail: int | None = None
        self._last_probe_time = 0.0
        self._last_info_time = 0.0
        self._last_data_time = 0.0
        self._ignored = 0
        self._last_info: tuple[float, proto.PublisherInfo] | None = None

    # --- public surface -------------------------------------------------------------------
    @property
    def stats(self) -> SubscriberStats:
        """A copy of the counters (safe to read from any thread)."""
        return dataclasses.replace(self._stats)

    @property
    def epoch(self) -> str | None:
        return self._seq.epoch

    def start(self) -> KVEventSubscriber:
        """Connect and start the subscriber thread. Raises RuntimeError if called twice."""
        if self._thread is not None:
            raise RuntimeError("KVEventSubscriber.start() called twice")
        self._ctx = zmq.Context()
        self._open_sockets()
        self._stop_pipe = WakeupPipe()
        self._poller.register(self._stop_pipe.fd, zmq.POLLIN)
        self._thread = threading.Thread(target=self._run, name="kvloop-kv-sub", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread (waking it from its poll) and close the sockets. Idempotent."""
        self._stop.set()
        if self._stop_pipe is not None:
            self._stop_pipe.wake()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            if self._ctx is not None:
                self._ctx.term()
                self._ctx = None
            if self._stop_pipe is not None:
                self._stop_pipe.close()

    def wait_for_seq(self, seq: int, timeout: float) -> bool:
        """Block until the batch numbered `seq` (or later) was delivered; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                last = self._stats.last_seq
                if last is not None and last >= seq:
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cv.wait(remaining)

    def seconds_since_heard(self) -> float | None:
        """Seconds since anything (batch, heartbeat, info reply) came from the publisher."""
        return None if not self._last_heard else time.monotonic() - self._last_heard

    # --- sockets --------------------------------------------------------------------------
    def _open_sockets(self) -> None:
        assert self._ctx is not None
        sub = self._socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, self._rcvhwm)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        sub.setsockopt(zmq.SUBSCRIBE, proto.HEARTBEAT_TOPIC)
        if self._on_touch is not None:
            sub.setsockopt(zmq.SUBSCRIBE, proto.RECENCY_TOPIC)
        sub.connect(self.endpoint)
        self._sub = sub
        self._poller.register(sub, zmq.POLLIN)
        if self.replay_endpoint is not None:
            self._new_dealer()

    def _new_dealer(self) -> None:
        """(Re)create the replay client; a fresh socket never sees a stale reply."""
        assert self._ctx is not None and self.replay_endpoint is not None
        if self._dealer is not None:
            self._poller.unregister(self._dealer)
            self._dealer.close(linger=0)
        dealer = self._socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, self._rcvhwm)
        dealer.connect(self.replay_endpoint)
        self._dealer = dealer
        self._poller.register(dealer, zmq.POLLIN)
        self._probe_sent = None

    def _socket(self, kind: int) -> zmq.Socket:
        """A new socket, a CURVE client of the fleet's publisher when keys were given."""
        assert self._ctx is not None
        sock = self._ctx.socket(kind)
        if self._curve_keys is not None:
            self._curve_keys.make_client(sock)
        return sock

    def _close_sockets(self) -> None:
        for sock in (self._sub, self._dealer):
            if sock is not None:
                sock.close(linger=0)

    # --- the subscriber thread ------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._initial_sync()
            while not self._stop.is_set():
                self._poll_once(100)
        except Exception:
            logger.exception("KV events subscriber %s failed", self.worker_id)
        finally:
            self._close_sockets()

    def _poll_once(self, timeout_ms: int) -> None:
        ready = dict(self._poller.poll(timeout_ms))
        if self._sub in ready:
            self._drain_sub(limit=1024)
        if self._dealer is not None and self._dealer in ready:
            self._drain_dealer()
        self._on_timer(time.monotonic())

    def _drain_sub(self, limit: int) -> None:
        sub = self._sub
        assert sub is not None
        for _ in range(limit):
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_message(frames)

    def _drain_dealer(self) -> None:
        """Replies that arrive outside a request: answers to liveness probes."""
        while self._dealer is not None:
            try:
                msg = self._dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(msg) == 4 and msg[0] == b"" and msg[1] == proto.KVLOOP:
                info = self._decode_info(msg[3])
                if info is not None and msg[2] == proto.CMD_INFO:
                    self._probe_sent = None
                    self._on_info_reply(info)

    def _on_timer(self, now: float) -> None:
        """Liveness and epoch probes on the replay socket, when no heartbeat comes.

        An unanswered probe counts against the publisher being kvloop's only if batches
        arrived meanwhile (a silent publisher may just be down); after a few, it is taken
        for a vLLM publisher and probing stops. Probes back off while unanswered.
        """
        st = self._stats
        if self._dealer is None or st.kvloop_publisher is False:
            return
        if self._probe_sent is not None:
            if now - self._probe_sent > self._timeout_ms / 1000:
                if self._last_data_time > self._probe_sent:
                    self._ignored += 1
                self._probe_sent = None
                self._unanswered += 1
                if self._ignored >= _MAX_UNANSWERED_PROBES and st.kvloop_publisher is None:
                    st.kvloop_publisher = False
            return
        # Probe whenever no heartbeat came for an interval, even while batches flow: only
        # the epoch tells a restarted publisher that happens to continue the numbering.
        backoff = self._probe_interval * (1 << min(self._unanswered, 4))
        if now - max(self._last_info_time, self._last_probe_time) >= backoff:
            self._dealer.send_multipart((b"", proto.KVLOOP, proto.CMD_INFO))
            self._probe_sent = self._last_probe_time = now

    # --- live messages --------------------------------------------------------------------
    def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._stats.malformed += 1
            return
        topic, seq_frame, payload = frames
        if topic == proto.HEARTBEAT_TOPIC:
            self._on_heartbeat_message(payload)
        elif topic == proto.RECENCY_TOPIC:
            self._on_touches(payload)
        elif topic.startswith(self._topic):
            batch = self._decode_batch(payload)
            if batch is not None:
                self._last_heard = self._last_data_time = time.monotonic()
                self._on_data(proto.seq_from_bytes(seq_frame), payload, batch, LIVE)

    def _decode_batch(self, payload: bytes) -> KVEventBatch | None:
        try:
            return self._decoder.decode(payload)
        except msgspec.DecodeError:
            self._stats.malformed += 1
            return None

    def _decode_info(self, payload: bytes) -> proto.PublisherInfo | None:
        try:
            return proto.decode_info(payload)
        except msgspec.DecodeError:
            self._stats.malformed += 1
            return None

    def _on_data(self, seq: int, payload: bytes, batch: KVEventBatch, source: str) -> None:
        """Sequence one data batch: deliver, recover a gap first, or drop a duplicate."""
        digest = hash(payload)
        verdict = self._seq.classify(seq, digest)
        if verdict is Verdict.FIRST:
            if seq == 0 or self._dealer is None or self._resyncing:
                if seq > 0:
                    self._stats.unrecovered_gaps += 1
                self._accept(seq, digest, batch, source)
                return
            self._seq.expect(0)
            verdict = self._seq.classify(seq, digest)
        if verdict is Verdict.APPLY:
            self._accept(seq, digest, batch, source)
        elif verdict is Verdict.GAP:
            self._stats.gaps += 1
            start = self._seq.expected
            assert start is not None   # a gap is counted from a known number
            if not self._resyncing and self._resync_from(start):
                self._recheck(seq, digest, batch, source)
            else:
                self._stats.unrecovered_gaps += 1
                self._accept(seq, digest, batch, source)
        else:
            self._on_regression(verdict, seq, digest, batch, source)

    def _recheck(self, seq: int, digest: int, batch: KVEventBatch, source: str) -> None:
        """A batch seen again after a resync: deliver it if still new, never resync again."""
        verdict = self._seq.classify(seq, digest)
        if verdict in (Verdict.FIRST, Verdict.APPLY):
            self._accept(seq, digest, batch, source)
        elif verdict is Verdict.GAP:
            self._stats.unrecovered_gaps += 1
            self._accept(seq, digest, batch, source)
        else:
            self._stats.duplicates += 1

    def _on_regression(self, verdict: Verdict, seq: int, digest: int, batch: KVEventBatch,
                       source: str) -> None:
        """A number below `expected`: a duplicate, a stale batch, or a restarted publisher."""
        if verdict is Verdict.DUPLICATE:
            self._stats.duplicates += 1
            return
        if verdict is Verdict.BEHIND:
            info = self._current_info()
            if info is not None and info.epoch == self._seq.epoch:
                self._stats.duplicates += 1  # older than what we synced to: already applied
                return
            if info is not None:
                self._restart(info.epoch, "epoch")
            else:
                self._restart(None, "restart")
        else:  # RESTART: same number, other content: another incarnation of the publisher
            self._restart(None, "restart")
        self._recheck(seq, digest, batch, source)

    def _accept(self, seq: int, digest: int, batch: KVEventBatch, source: str) -> None:
        self._seq.accept(seq, digest)
        self._deliver(batch, seq, source)

    # --- delivery -------------------------------------------------------------------------
    def _deliver(self, batch: KVEventBatch, seq: int | None, source: str,
                 reason: str | None = None) -> None:
        st = self._stats
        count_delivery(st, batch, seq, source)
        if self._on_batch is not None:
            item = WorkerBatch(self.worker_id, batch, seq, st.current_epoch, source, reason)
            try:
                self._on_batch(item)
            except Exception:
                st.callback_errors += 1
                logger.exception("KV events: on_batch callback failed for %s", self.worker_id)
        with self._cv:
            self._cv.notify_all()

    def _deliver_reset(self, reason: str) -> None:
        self._seq.reset()
        self._deliver(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]), None, RESET,
                      reason)

    # --- heartbeats, info, touches --------------------------------------------------------
    def _on_heartbeat_message(self, payload: bytes) -> None:
        info = self._decode_info(payload)
        if info is None:
            return
        st = self._stats
        st.heartbeats += 1
        st.last_heartbeat_time = time.time()
        self._last_heard = self._last_info_time = time.monotonic()
        st.kvloop_publisher = True
        self._notify_heartbeat(info)
        if self._on_epoch_news(info):
            return
        start = self._seq.missing_before(info.next_seq, from_start=self._dealer is not None)
        if start is not None:  # lost at the tail of the stream
            self._gap_without_batch(start)

    def _on_info_reply(self, info: proto.PublisherInfo) -> None:
        st = self._stats
        st.heartbeats += 1
        st.last_heartbeat_time = time.time()
        st.kvloop_publisher = True
        self._unanswered = self._ignored = 0
        self._last_heard = self._last_info_time = time.monotonic()
        self._last_info = (self._last_heard, info)
        self._notify_heartbeat(info)
        if self._on_epoch_news(info):
            return
        # The reply overtakes batches still in flight on the PUB socket, so only a number
        # that the previous probe already promised proves a loss at the tail.
        tail, self._poll_tail = self._poll_tail, info.next_seq
        start = None if tail is None else self._seq.missing_before(tail)
        if start is not None:
            self._gap_without_batch(start)

    def _notify_heartbeat(self, info: proto.PublisherInfo) -> None:
        if self._on_heartbeat is not None:
            try:
                self._on_heartbeat(self.worker_id, info)
            except Exception:
                self._stats.callback_errors += 1
                logger.exception("KV events: on_heartbeat callback failed")

    def _on_epoch_news(self, info: proto.PublisherInfo) -> bool:
        """Handle a first or changed epoch; True when that resynchronized the view."""
        seq = self._seq
        if seq.epoch_changed(info.epoch):
            self._restart(info.epoch, "epoch")
            return True
        if seq.adopt_epoch(info.epoch) and seq.expected is None:
            if info.next_seq > 0 and self._dealer is not None:
                self._full_sync("join")
                return True
            if info.next_seq == 0:
                seq.expect(0)
        return False

    def _gap_without_batch(self, exp: int) -> None:
        self._stats.gaps += 1
        if self._resyncing or not self._resync_from(exp):
            self._stats.unrecovered_gaps += 1

    def _on_touches(self, payload: bytes) -> None:
        try:
            notice = proto.decode_touches(payload)
        except msgspec.DecodeError:
            self._stats.malformed += 1
            return
        if self._seq.epoch_changed(notice.epoch):
            return  # from another incarnation: its hashes mean nothing for this view
        self._stats.touches += len(notice.block_hashes)
        if self._on_touch is not None:
            try:
                self._on_touch(self.worker_id, notice.block_hashes)
            except Exception:
                self._stats.callback_errors += 1
                logger.exception("KV events: on_touch callback failed")

    # --- resynchronization ----------------------------------------------------------------
    def _initial_sync(self) -> None:
        """Before live batches: learn the epoch and fetch the current state."""
        if self._dealer is None:
            return
        reply = self._request((b"", proto.KVLOOP, proto.CMD_INFO), proto.CMD_INFO)
        if reply is not None and reply[0] is not None:
            self._on_info_reply(reply[0])
            return
        self._resyncing = True
        try:
            self._replay_vllm(0)
        finally:
            self._resyncing = False

    def _resync_from(self, start: int) -> bool:
        """Recover batches `start`...; True when the view is whole again."""
        if self._dealer is None:
            return False
        self._resyncing = True
        try:
            if self._stats.kvloop_publisher:
                return self._replay_kvloop(start)
            return self._replay_vllm(start)
        finally:
            self._resyncing = False

    def _replay_kvloop(self, start: int) -> bool:
        reply = self._request((b"", proto.KVLOOP, proto.CMD_REPLAY, proto.seq_bytes(start)),
                              proto.CMD_REPLAY)
        if reply is None or reply[0] is None:
            self._stats.replay_failures += 1
            return False
        info, items = reply[0], reply[1]
        verdict = self._seq.replay_verdict(start, info)
        if verdict is Verdict.EPOCH:
            self._restart(info.epoch, "epoch")
            return True
        if verdict is Verdict.SNAPSHOT:
            return info.snapshot and self._full_sync("gap")
        self._stats.replays += 1
        self._apply_replayed(items)
        return True

    def _replay_vllm(self, start: int) -> bool:
        reply = self._request((b"", proto.seq_bytes(start)), None)
        if reply is None:
            self._stats.replay_failures += 1
            return False
        items = reply[1]
        self._stats.replays += 1
        if items and items[0][0] > start:
            self._stats.unrecovered_gaps += 1  # vLLM has no snapshot: that history is gone
            self._seq.expect(items[0][0])
        self._apply_replayed(items)
        return True

    def _apply_replayed(self, items: list[tuple[int, bytes]]) -> None:
        """Sequence replayed batches like live ones, but never start another resync."""
        was, self._resyncing = self._resyncing, True
        try:
            for seq, payload in items:
                batch = self._decode_batch(payload)
                if batch is not None:
                    self._on_data(seq, payload, batch, REPLAY)
        finally:
            self._resyncing = was

    def _full_sync(self, reason: str) -> bool:
        """Replace the view with a snapshot; the live stream then continues at its number."""
        reply = self._request((b"", proto.KVLOOP, proto.CMD_SNAPSHOT), proto.CMD_SNAPSHOT)
        if reply is None or reply[0] is None:
            self._stats.replay_failures += 1
            return False
        info, items = reply[0], reply[1]
        self._seq.adopt_epoch(info.epoch)
        if not info.snapshot:
            self._deliver_reset(reason)
            return self._replay_kvloop(0)
        batches = [b for b in (self._decode_batch(p) for _, p in items) if b is not None]
        self._deliver_reset(reason)
        for batch in batches:
            self._deliver(batch, info.next_seq, SNAPSHOT)
        self._seq.synced(info)
        with self._cv:
            self._cv.notify_all()
        return True

    def _restart(self, epoch: str | None, reason: str) -> None:
        """The publisher is a new incarnation: forget this worker, then rebuild."""
        self._stats.restarts += 1
        self._seq.reset()
        self._poll_tail = None
        if epoch is not None:
            self._seq.adopt_epoch(epoch)
        if self._stats.kvloop_publisher and self._dealer is not None:
            was, self._resyncing = self._resyncing, True
            try:
                if self._full_sync(reason):
                    return
            finally:
                self._resyncing = was
        if epoch is None:  # the new epoch is not known yet: the next heartbeat adopts it
            self._seq.forget_epoch()
        self._deliver_reset(reason)

    def _current_info(self) -> proto.PublisherInfo | None:
        """The publisher's info, at most 0.1 s old; None without a kvloop replay socket."""
        if self._dealer is None or not self._stats.kvloop_publisher:
            return None
        now = time.monotonic()
        if self._last_info is not None and now - self._last_info[0] < 0.1:
            return self._last_info[1]
        reply = self._request((b"", proto.KVLOOP, proto.CMD_INFO), proto.CMD_INFO)
        if reply is None or reply[0] is None:
            return None
        self._last_info = (time.monotonic(), reply[0])
        return reply[0]

    def _request(self, frames: tuple[bytes, ...], cmd: bytes | None
                 ) -> tuple[proto.PublisherInfo | None, list[tuple[int, bytes]]] | None:
        """Send one replay-socket request and read its whole answer.

        `cmd` None: vLLM's replay (no header). Returns (header, [(seq, payload)...]) or None
        when the publisher stays silent for `request_timeout_s` (the socket is then replaced,
        so a late answer can never be mistaken for the next one's).
        """
        dealer = self._dealer
        assert dealer is not None
        dealer.send_multipart(frames)
        header: proto.PublisherInfo | None = None
        items: list[tuple[int, bytes]] = []
        while True:
            if not dealer.poll(self._timeout_ms):
                self._new_dealer()
                return None
            msg = dealer.recv_multipart()
            if len(msg) == 4 and msg[0] == b"" and msg[1] == proto.KVLOOP:
                info = self._decode_info(msg[3])
                if info is not None and msg[2] == cmd and header is None:
                    header = info
                    if cmd == proto.CMD_INFO:
                        return header, items
                elif info is not None and msg[2] == proto.CMD_INFO:
                    self._probe_sent = None  # a probe's late answer: still a sign of life
                    self._last_heard = time.monotonic()
            elif len(msg) == 4 and msg[0] == b"" and msg[2] == proto.END_SEQ:
                if cmd is not None and header is None:
                    self._new_dealer()
                    return None
                self._last_heard = time.monotonic()
                return header, items
            elif len(msg) == 4 and msg[0] == b"" and len(msg[2]) == 8:
                items.append((proto.seq_from_bytes(msg[2]), msg[3]))
            else:
                self._stats.malformed += 1
