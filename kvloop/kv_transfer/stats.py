"""The connector's counters, added to from its threads and taken once per engine step."""

from __future__ import annotations

import threading

from kvloop.wire import KVTransferStats


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
