"""What every KV-event publisher keeps, whatever carries its messages (ZMQ or NATS).

- `BatchQueue`: the engine loop's side. `put(batch)` never blocks; when the queue is full
  the batch is dropped and, once per overflow, an `AllBlocksCleared` takes the place of the
  dropped batches, so consumers forget this worker's blocks rather than believe in blocks
  that are gone (their view becomes a subset of the cache).
- `BatchLog`: the publisher thread's record of what it sent: the sequence counter, the last
  `buffer_steps` encoded messages (for replay) and, optionally, a mirror of the worker's
  cache (a `CacheView` fed with every sent batch, for snapshots exact at a sequence number).

Owner: `BatchQueue.put` is called by the engine loop only, `pop` and everything of `BatchLog`
by the publisher thread only.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from itertools import islice

from kvloop.events.types import AllBlocksCleared, BlockStored, KVEvent, KVEventBatch
from kvloop.events.view import CacheView

_OVERFLOW = object()  # queue marker: batches were dropped here

QUEUED = "queued"
DROPPED = "dropped"
OVERFLOWED = "overflowed"   # dropped, and the first drop of this overflow (log it once)


class BatchQueue:
    """Bounded queue of batches between the engine loop and the publisher thread."""

    def __init__(self, max_size: int):
        self.max_size = max_size
        self._queue: deque[object] = deque()
        self._overflow_pending = False

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, batch: KVEventBatch) -> str:
        """Queue `batch`; `QUEUED`, or `DROPPED` / `OVERFLOWED` when the queue was full."""
        if len(self._queue) < self.max_size:
            self._queue.append(batch)
            return QUEUED
        if self._overflow_pending:
            return DROPPED
        self._overflow_pending = True
        self._queue.append(_OVERFLOW)
        return OVERFLOWED

    def pop(self) -> KVEventBatch | None:
        """The next batch to send (an overflow's `AllBlocksCleared` in its place); None when
        the queue is empty."""
        if not self._queue:
            return None
        item = self._queue.popleft()
        if item is _OVERFLOW:
            self._overflow_pending = False
            return KVEventBatch(ts=time.time(), events=[AllBlocksCleared()])
        assert isinstance(item, KVEventBatch)
        return item


class BatchLog:
    """Sequence numbers, replay buffer and mirror of one publisher (its thread's state).

    A message is what a consumer receives as one unit with one sequence number: one batch on
    vLLM's wire, one event in Dynamo's shape. `record` numbers them 0, 1, 2...
    """

    def __init__(self, buffer_steps: int, keep_mirror: bool):
        self.next_seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.mirror: CacheView | None = CacheView(keep_blocks=True) if keep_mirror else None

    def record(self, events: Sequence[KVEvent], payloads: Sequence[bytes]) -> int:
        """Number `payloads` (the messages that carry `events`), keep them for replay and
        apply `events` to the mirror; returns the first message's number."""
        first = self.next_seq
        for payload in payloads:
            self._buffer.append((self.next_seq, payload))
            self.next_seq += 1
        if self.mirror is not None:
            self.mirror.apply(events)
        return first

    @property
    def oldest_seq(self) -> int | None:
        """The oldest message still buffered (None when nothing is)."""
        return self._buffer[0][0] if self._buffer else None

    def history_lost(self, start: int) -> bool:
        """True when messages from `start` on are no longer all in the buffer."""
        if start >= self.next_seq:
            return False
        return not self._buffer or start < self._buffer[0][0]

    def since(self, start: int) -> list[tuple[int, bytes]]:
        """Every buffered (seq, payload) with seq >= `start`, oldest first."""
        buf = self._buffer
        skip = max(0, start - buf[0][0]) if buf else 0
        return list(islice(buf, skip, None))

    def snapshot(self, max_blocks: int, data_parallel_rank: int) -> list[KVEventBatch]:
        """The mirror as BlockStored batches of about `max_blocks` blocks each (empty without
        a mirror): applied to an empty view they rebuild it; they describe every message
        numbered below `next_seq`."""
        if self.mirror is None:
            return []
        return [KVEventBatch(ts=time.time(), events=events,
                             data_parallel_rank=data_parallel_rank)
                for events in _pack(self.mirror.snapshot_events(max_blocks), max_blocks)]


def _pack(events: list[BlockStored], max_blocks: int) -> list[list[KVEvent]]:
    """Group events into messages of about `max_blocks` blocks each (at least one event)."""
    out: list[list[KVEvent]] = []
    cur: list[KVEvent] = []
    n = 0
    for ev in events:
        if cur and n + len(ev.block_hashes) > max_blocks:
            out.append(cur)
            cur, n = [], 0
        cur.append(ev)
        n += len(ev.block_hashes)
    if cur:
        out.append(cur)
    return out
