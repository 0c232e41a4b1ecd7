"""The connector's counters, added to from its threads and taken once per engine step, and
the throttled warnings that go with them."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvloop.wire import KVTransferStats

WARN_EVERY_S = 10.0      # one line per kind of repeated warning per this many seconds


class TransferCounters:
    """A `KVTransferStats` under a lock (counters only; the connector fills the gauges)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = KVTransferStats()

    def add_sent(self, nbytes: int) -> None:
        with self._lock:
            self._stats.transfers_sent += 1
            self._stats.bytes_sent += nbytes

    def add_received(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._stats.transfers_received += 1
            self._stats.bytes_received += nbytes
            self._stats.transfer_seconds.append(seconds)

    def add_failure(self, reason: str) -> None:
        with self._lock:
            self._stats.failures[reason] = self._stats.failures.get(reason, 0) + 1

    def add_expired(self, n: int) -> None:
        with self._lock:
            self._stats.expired_requests += n

    def take(self) -> KVTransferStats:
        with self._lock:
            stats, self._stats = self._stats, KVTransferStats()
        return stats


class ThrottledLog:
    """Warnings of one kind at most once per `every` seconds, with a count of those held back
    (a peer that misbehaves in a loop cannot fill the log)."""

    def __init__(self, log: logging.Logger, every: float = WARN_EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        self.log, self.every, self.clock = log, every, clock
        self._last: dict[str, tuple[float, int]] = {}   # format -> (last logged, held back)

    def warning(self, fmt: str, *args: Any) -> None:
        now = self.clock()
        last, held = self._last.get(fmt, (-float("inf"), 0))
        if now - last < self.every:
            self._last[fmt] = (last, held + 1)
            return
        self._last[fmt] = (now, 0)
        suffix = f" ({held} more like this in the last {self.every:g} s)" if held else ""
        self.log.warning(fmt + suffix, *args)
