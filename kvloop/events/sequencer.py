"""EventSequencer: the order rules of one worker's KV-event stream, whatever carries it.

Both consumers of a worker's events, the ZMQ subscriber (`subscriber.py`) and a NATS worker
stream (`nats_subscriber.py`), apply the same rules; they are written here once. The sequencer
is pure: no sockets, no clock, no thread. A transport hands it each batch's sequence number
(and, for duplicate detection, a digest of its payload), each publisher epoch it hears of, and
each replay answer's header; it answers with a `Verdict`, and the transport fetches what the
verdict asks for (a replay from `expected`, a snapshot, the publisher's info) and then tells
the sequencer what it delivered (`accept`, `synced`, `reset`).

Owner: the transport's one thread; the sequencer owns `expected`, the digest window and the
epoch, and writes the stats fields that follow from them (`current_epoch`, `epochs_seen`,
`last_seq` and `snapshots` after a snapshot). Every other counter is the transport's.

The rules:

    batch numbered seq       expected None          -> FIRST    (not in step yet: the
                                                                 transport syncs or takes it)
                             seq == expected        -> APPLY
                             seq >  expected        -> GAP      (replay from `expected` first)
                             seq <  expected and the window holds seq's digest
                                                    -> DUPLICATE
                             ... holds another digest -> RESTART (another incarnation)
                             ... holds nothing      -> BEHIND   (already applied, unless the
                                                                 epoch changed: ask it)
    an epoch other than the known one               -> a restart: reset, then snapshot
    a replay's answer        other epoch            -> EPOCH    (restart)
                             `expected` no longer held -> SNAPSHOT
                             otherwise              -> REPLAY   (sequence its items as batches)
    a publisher's next_seq above `expected`         -> a gap at the tail: replay from expected

What it guarantees to consumers (with the transports): for each worker, batches arrive in
publisher order, each at most once; whenever what came before can no longer be trusted, a
*reset* (`source == RESET`, batch `[AllBlocksCleared()]`) comes first.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvloop.events.protocol import PublisherInfo
from kvloop.events.types import KVEvent, KVEventBatch

LIVE = "live"
REPLAY = "replay"
SNAPSHOT = "snapshot"
RESET = "reset"


@dataclass(frozen=True)
class WorkerBatch:
    """One delivery to `on_batch`: a batch of one worker, or a reset notice.

    `seq` is the publisher's sequence number (for a snapshot: the number the live stream
    continues at; None for a reset). `source` is "live", "replay", "snapshot" or "reset";
    `reason` (resets only) is "join", "gap", "epoch", "restart" or "reconnect".
    """

    worker_id: str
    batch: KVEventBatch
    seq: int | None
    epoch: str | None
    source: str
    reason: str | None = None

    @property
    def events(self) -> list[KVEvent]:
        return self.batch.events

    @property
    def is_reset(self) -> bool:
        return self.source == RESET


@dataclass
class SubscriberStats:
    """Counters of one worker's stream (a copy is returned by the subscribers' `stats`).

    Times are wall-clock `time.time()` of receipt. `unrecovered_gaps` counts batches known to
    be missing for good (no replay socket, or history gone and no snapshot): the view may then
    lack blocks until the next reset.
    """

    events_received: int = 0
    batches_received: int = 0
    last_event_time: float | None = None
    last_seq: int | None = None
    heartbeats: int = 0
    last_heartbeat_time: float | None = None
    gaps: int = 0
    unrecovered_gaps: int = 0
    replays: int = 0
    replay_failures: int = 0
    snapshots: int = 0
    resets: int = 0
    restarts: int = 0
    epochs_seen: int = 0
    current_epoch: str | None = None
    duplicates: int = 0
    malformed: int = 0
    touches: int = 0
    callback_errors: int = 0
    kvloop_publisher: bool | None = None


BatchCallback = Callable[[WorkerBatch], None]


def count_delivery(st: SubscriberStats, batch: KVEventBatch, seq: int | None,
                   source: str) -> None:
    """Count one batch handed on: a reset as such, any other as received (its events, the
    time; its sequence number unless it came from a snapshot)."""
    if source == RESET:
        st.resets += 1
        return
    st.batches_received += 1
    st.events_received += len(batch.events)
    st.last_event_time = time.time()
    if source != SNAPSHOT:
        st.last_seq = seq


class Verdict(enum.Enum):
    """What to do with a batch, or with a replay's answer (see the module docstring)."""

    FIRST = "first"
    APPLY = "apply"
    GAP = "gap"
    DUPLICATE = "duplicate"
    RESTART = "restart"
    BEHIND = "behind"
    EPOCH = "epoch"
    SNAPSHOT = "snapshot"
    REPLAY = "replay"


def history_lost(start: int, info: PublisherInfo) -> bool:
    """True when the publisher that sent `info` no longer holds every batch from `start` on
    (a replay from `start` cannot make the view whole; a snapshot can)."""
    if start >= info.next_seq:
        return False
    return info.oldest_seq is None or start < info.oldest_seq


class EventSequencer:
    """The sequence state of one worker's stream; see the module docstring."""

    def __init__(self, stats: SubscriberStats, dedup_window: int = 4096):
        if dedup_window < 1:
            raise ValueError("dedup_window must be >= 1")
        self.stats = stats
        self.expected: int | None = None
        self._window: OrderedDict[int, int] = OrderedDict()
        self._window_size = dedup_window

    @property
    def epoch(self) -> str | None:
        return self.stats.current_epoch

    # --- batches --------------------------------------------------------------------------
    def classify(self, seq: int, digest: int | None = None) -> Verdict:
        """Where batch `seq` stands against `expected` (changes nothing)."""
        exp = self.expected
        if exp is None:
            return Verdict.FIRST
        if seq == exp:
            return Verdict.APPLY
        if seq > exp:
            return Verdict.GAP
        known = self._window.get(seq)
        if known is None:
            return Verdict.BEHIND
        return Verdict.DUPLICATE if known == digest else Verdict.RESTART

    def expect(self, seq: int) -> None:
        """The next batch must carry `seq` (a join at the stream's start, a snapshot's end)."""
        self.expected = seq

    def accept(self, seq: int, digest: int | None = None) -> None:
        """Batch `seq` was delivered: the next one must carry `seq + 1`. Its `digest` (when
        given) is kept, in a window of the most recent ones, to tell a duplicate later."""
        if digest is not None:
            window = self._window
            window[seq] = digest
            if len(window) > self._window_size:
                window.popitem(last=False)
        self.expected = seq + 1

    def reset(self) -> None:
        """Forget the stream's position (a reset was delivered, or is about to be)."""
        self.expected = None
        self._window.clear()

    def synced(self, info: PublisherInfo) -> None:
        """A snapshot described by `info` was delivered: the stream continues at its
        `next_seq`."""
        self.expected = info.next_seq
        self.stats.last_seq = info.next_seq - 1 if info.next_seq > 0 else None
        self.stats.snapshots += 1

    def missing_before(self, next_seq: int, from_start: bool = False) -> int | None:
        """The first missing number when the publisher says it will number its next batch
        `next_seq` (a batch lost at the tail), else None. `from_start`: before any batch,
        count from 0 (a publisher with a replay socket, whose history can be fetched)."""
        exp = self.expected
        if exp is None and from_start:
            exp = 0
        return exp if exp is not None and next_seq > exp else None

    # --- epochs ---------------------------------------------------------------------------
    def epoch_changed(self, epoch: str) -> bool:
        """True when `epoch` is not the known one (a restarted publisher); False while none
        is known."""
        current = self.stats.current_epoch
        return current is not None and epoch != current

    def adopt_epoch(self, epoch: str) -> bool:
        """Take `epoch` as the publisher's; True when it was not the known one."""
        if epoch == self.stats.current_epoch:
            return False
        self.stats.epochs_seen += 1
        self.stats.current_epoch = epoch
        return True

    def forget_epoch(self) -> None:
        """The publisher restarted and its new epoch is not known yet."""
        self.stats.current_epoch = None

    # --- replays --------------------------------------------------------------------------
    def replay_verdict(self, start: int, info: PublisherInfo) -> Verdict:
        """What a replay from `start` answered with header `info` allows: EPOCH (another
        publisher: restart), SNAPSHOT (the history is gone) or REPLAY (apply its items). Adopts
        the epoch unless it is EPOCH."""
        if self.epoch_changed(info.epoch):
            return Verdict.EPOCH
        self.adopt_epoch(info.epoch)
        return Verdict.SNAPSHOT if history_lost(start, info) else Verdict.REPLAY
