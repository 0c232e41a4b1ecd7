"""P's lease table: the finished requests whose blocks P holds for a decode worker.

Owner: the table, under its lock; the engine thread adds leases (`add`) and sweeps and
collects them (`sweep`, `take_released`), the side-channel thread reads, extends and ends
them (`begin_read` / `end_read`, `heartbeat`, `done`).

A lease ends by `done` (D has what it needs) or by expiry (`sweep`: no `Done` and no
heartbeat in time); a heartbeat sets `expiry = max(expiry, now + 2/3 * duration)` (vLLM's
extension); a lease being read never expires (the sweep skips it). An ended lease waits in
`released` until the engine takes it (`take_released`) and frees its blocks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

HEARTBEAT_EXTENSION = 2 / 3     # of the lease duration, per heartbeat (vLLM's)
HEARTBEAT_INTERVAL = 1 / 6      # of the lease duration, between D's heartbeats (vLLM's)


@dataclass
class Lease:
    request_id: str
    block_ids: list[int]          # the blocks D may read (the prompt's)
    created: float
    expiry: float
    reading: int = 0              # Reads being served now
    num_reads: int = 0            # Reads served
    shm_files: list[str] = field(default_factory=list)   # files written for it, not unlinked


@dataclass
class Released:
    lease: Lease
    expired: bool


class LeaseTable:
    """Leases by P's request id (see the module docstring)."""

    def __init__(self, duration: float, clock: Callable[[], float] = time.monotonic):
        self.duration = duration
        self.clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._released: dict[str, Released] = {}

    def add(self, request_id: str, block_ids: list[int]) -> float:
        """Hold `block_ids` for `request_id`; returns the lease duration."""
        now = self.clock()
        with self._lock:
            self._leases[request_id] = Lease(request_id, list(block_ids), now,
                                             now + self.duration)
        return self.duration

    def heartbeat(self, request_ids: Iterable[str]) -> int:
        """Extend the named leases; returns how many were found."""
        expiry = self.clock() + HEARTBEAT_EXTENSION * self.duration
        found = 0
        with self._lock:
            for rid in request_ids:
                lease = self._leases.get(rid)
                if lease is not None:
                    lease.expiry = max(lease.expiry, expiry)
                    found += 1
        return found

    def begin_read(self, request_id: str, block_ids: list[int]) -> str | None:
        """Pin a lease for a Read of `block_ids`; None, or why the Read is refused."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return f"request {request_id!r} is not held here (unknown, freed or expired)"
            missing = sorted(set(block_ids) - set(lease.block_ids))
            if missing:
                return f"blocks {missing} are not held for request {request_id!r}"
            lease.reading += 1
            return None

    def end_read(self, request_id: str, shm_file: str | None = None) -> None:
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return
            lease.reading -= 1
            lease.num_reads += 1
            if shm_file is not None:
                lease.shm_files.append(shm_file)

    def done(self, request_id: str) -> bool:
        """End a lease on D's `Done`; False if it was not held."""
        with self._lock:
            lease = self._leases.pop(request_id, None)
            if lease is None:
                return False
            self._released[request_id] = Released(lease, expired=False)
            return True

    def sweep(self) -> list[Lease]:
        """End every lease past its expiry that is not being read (all of them are looked
        at: heartbeats move expiries in place); returns the expired ones."""
        now = self.clock()
        with self._lock:
            expired = [lease for lease in self._leases.values()
                       if lease.expiry <= now and lease.reading == 0]
            for lease in expired:
                del self._leases[lease.request_id]
                self._released[lease.request_id] = Released(lease, expired=True)
        return expired

    def take_released(self) -> list[Released]:
        with self._lock:
            released, self._released = list(self._released.values()), {}
        return released

    def has_news(self) -> bool:
        """Something ended, or is due to expire."""
        now = self.clock()
        with self._lock:
            return bool(self._released) or any(
                lease.expiry <= now and lease.reading == 0 for lease in self._leases.values())

    def request_ids(self) -> set[str]:
        """Held leases and ended ones not yet taken."""
        with self._lock:
            return set(self._leases) | set(self._released)

    def num_held(self) -> int:
        with self._lock:
            return len(self._leases)

    def expires_in(self, request_id: str) -> float | None:
        with self._lock:
            lease = self._leases.get(request_id)
            return None if lease is None else lease.expiry - self.clock()
