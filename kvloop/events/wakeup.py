"""WakeupPipe: wakes a thread that sleeps in a `zmq.Poller`, from any other thread.

The sleeping thread registers `fd` with its poller (POLLIN) and calls `drain()` after waking;
any thread calls `wake()`; the owner calls `close()` once the sleeping thread has stopped.
A wake after `close()` is a no-op: the descriptors are never written once closed (nor after
the kernel has handed their numbers to someone else).
"""

from __future__ import annotations

import os
import threading


class WakeupPipe:
    """A non-blocking pipe whose read end a `zmq.Poller` can watch; see the module docstring."""

    def __init__(self) -> None:
        read, write = os.pipe()
        for fd in (read, write):
            os.set_blocking(fd, False)
        self.fd = read
        self._write: int | None = write
        self._lock = threading.Lock()

    def wake(self) -> None:
        """Make `fd` readable (from any thread); a no-op once closed."""
        with self._lock:
            if self._write is not None:
                try:
                    os.write(self._write, b"\0")
                except OSError:   # the pipe is full: the thread is awake anyway
                    pass

    def drain(self) -> None:
        """Read what `wake()` wrote, so `fd` is quiet again (the sleeping thread's call)."""
        try:
            os.read(self.fd, 4096)
        except BlockingIOError:
            pass

    def close(self) -> None:
        """Close both ends; call once the sleeping thread stopped. Idempotent."""
        with self._lock:
            if self._write is not None:
                os.close(self._write)
                os.close(self.fd)
                self._write = None
