"""CompileQueue: grammar compiles run fairly, bounded in time, and only while someone waits.

A grammar compile cannot be interrupted (xgrammar has no cancel, and it runs in C++ with the
GIL released), and its cost grows steeply with the schema: one request could hold the
compile workers for minutes. So the queue decides which compile runs when:

- tenants first, then smallest first: a compile belongs to a tenant (the API key that sent
  its first request; None: every keyless caller, one tenant). Pending compiles start in
  order of how many compiles their tenant has running (fewest first), then their spec's
  compile cost (then arrival): its length, or a regex's or grammar's unrolled size
  (`StructuredOutputsParams.compile_cost`: a 12-byte `[a-z]{1,128}` weighs 2,048);
- a tenant's share: one tenant runs at most `CompileLimits.tenant_threads` compiles at
  once (slow ones included: `num_workers + max_slow - 1`), so it never holds every thread a
  compile may have; a compile of another tenant finds a slot as soon as one of its slow
  compiles yields (issue 37, item 5: six clients' slow regexes no longer make a victim's
  tiny schema wait for their end, or time out);
- slots: at most `num_workers` compiles run that started less than `slow_after_s` ago. A
  compile older than that keeps its thread but gives up its slot, so a tiny schema behind a
  big one waits at most `slow_after_s`; at most `max_slow` compiles may be slow at once (past
  that, a slow one keeps its slot: the CPU that compiles take stays bounded);
- time limit: a compile running longer than `timeout_s` fails (`CompileTimeout`, which its
  requests report); its thread runs on to its end (counted as slow) and its result is
  dropped; a compile still pending `timeout_s` after its submission (slow compiles hold
  every slot) fails the same way and never starts;
- unwanted: a compile whose every waiter `release`d it (their requests finished or were
  aborted, the client gone) before it started is never started.

Owner: the queue's state (pending and running jobs) is guarded by one condition variable;
the dispatcher thread (`kvloop-grammar-dispatch`) starts and expires compiles; each compile
runs on its own thread (`kvloop-grammar`). Pure Python: no grammar engine is imported here.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_SLOW_AFTER_S = 0.5
DEFAULT_MAX_SLOW = 2
_MAX_WAIT_S = 1.0


class CompileTimeout(ValueError):
    """A compile ran past the queue's time limit (a ValueError: the request's spec is what
    was too costly, so its client gets a 400)."""


@dataclass(frozen=True)
class CompileLimits:
    """How compiles share the CPU (see the module docstring)."""

    num_workers: int = 1
    timeout_s: float = DEFAULT_TIMEOUT_S
    slow_after_s: float = DEFAULT_SLOW_AFTER_S
    max_slow: int = DEFAULT_MAX_SLOW

    def __post_init__(self) -> None:
        if self.num_workers < 1 or self.max_slow < 0:
            raise ValueError("num_workers must be >= 1 and max_slow >= 0")
        if self.timeout_s <= 0 or self.slow_after_s <= 0:
            raise ValueError("timeout_s and slow_after_s must be > 0")

    @property
    def tenant_threads(self) -> int:
        """The most compiles one tenant runs at once: one fewer than all the threads
        compiles may have (`num_workers` slots and `max_slow` slow ones), at least 1."""
        return max(1, self.num_workers + self.max_slow - 1)


@dataclass(order=True)
class CompileJob:
    """One compile: its future, its waiters, when it started (None: pending)."""

    size: int
    seq: int
    fn: Callable[[], Any] = field(compare=False)
    future: Future[Any] = field(compare=False, default_factory=Future)
    waiters: int = field(compare=False, default=1)
    started_at: float | None = field(compare=False, default=None)
    submitted_at: float = field(compare=False, default=0.0)
    tenant: str | None = field(compare=False, default=None)


class CompileQueue:
    """Runs `submit`ted compiles under `CompileLimits`; see the module docstring."""

    def __init__(self, limits: CompileLimits, clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self._clock = clock
        self._cv = threading.Condition()
        self._pending: list[CompileJob] = []     # in submission order (`_next` picks)
        self._running: list[CompileJob] = []     # started, thread not yet ended
        self._seq = itertools.count()
        self._stopped = False
        self._dispatcher: threading.Thread | None = None

    def submit(self, size: int, fn: Callable[[], Any], tenant: str | None = None) -> CompileJob:
        """Queue `fn` (a compile of a spec of compile cost `size`, for `tenant`) for one
        waiter."""
        job = CompileJob(size, next(self._seq), fn, submitted_at=self._clock(), tenant=tenant)
        with self._cv:
            if self._stopped:
                job.future.cancel()
                return job
            self._pending.append(job)
            self._start_dispatcher()
            self._cv.notify_all()
        return job

    def retain(self, job: CompileJob) -> None:
        """One more waiter for `job` (a request that found it in the cache)."""
        with self._cv:
            job.waiters += 1

    def release(self, job: CompileJob) -> None:
        """A waiter no longer waits; a pending job nobody waits for is dropped (cancelled)."""
        with self._cv:
            job.waiters -= 1
            if job.waiters <= 0 and job.started_at is None and job in self._pending:
                self._pending.remove(job)
                job.future.cancel()

    def num_pending(self) -> int:
        with self._cv:
            return len(self._pending)

    def num_running(self) -> int:
        """Compile threads alive (slow and timed-out ones included)."""
        with self._cv:
            return len(self._running)

    def shutdown(self) -> None:
        """Cancel what is pending; running compiles end on their own (daemon threads)."""
        with self._cv:
            self._stopped = True
            for job in self._pending:
                job.future.cancel()
            self._pending.clear()
            self._cv.notify_all()

    # --- the dispatcher thread ------------------------------------------------------------
    def _start_dispatcher(self) -> None:
        if self._dispatcher is None:
            self._dispatcher = threading.Thread(target=self._dispatch, daemon=True,
                                                name="kvloop-grammar-dispatch")
            self._dispatcher.start()

    def _dispatch(self) -> None:
        with self._cv:
            while not self._stopped:
                now = self._clock()
                self._expire(now)
                self._start_pending(now)
                self._cv.wait(self._next_wake(now))

    def _expire(self, now: float) -> None:
        lim = self.limits
        waited_out = [j for j in self._pending if now - j.submitted_at >= lim.timeout_s]
        for job in waited_out:
            self._pending.remove(job)
            job.future.set_exception(CompileTimeout(
                f"structured output: the grammar waited {lim.timeout_s:g} s for a compile "
                f"slot (other compiles hold them all); try again"))
        for job in self._running:
            assert job.started_at is not None
            if now - job.started_at >= lim.timeout_s and not job.future.done():
                job.future.set_exception(CompileTimeout(
                    f"structured output: the grammar did not compile within "
                    f"{lim.timeout_s:g} s (a smaller or simpler schema compiles faster)"))

    def _slots_held(self, now: float) -> int:
        slow = sum(1 for j in self._running
                   if j.started_at is not None and now - j.started_at >= self.limits.slow_after_s)
        return len(self._running) - min(slow, self.limits.max_slow)

    def _next(self) -> CompileJob | None:
        """The pending compile to start next: of a tenant under its share, the fewest of
        its tenant's running, then the smallest, then the oldest (None: none may start)."""
        running = Counter(j.tenant for j in self._running)
        share = self.limits.tenant_threads
        ready = [j for j in self._pending if running[j.tenant] < share]
        return min(ready, key=lambda j: (running[j.tenant], j), default=None)

    def _start_pending(self, now: float) -> None:
        while self._slots_held(now) < self.limits.num_workers:
            job = self._next()
            if job is None:
                return
            self._pending.remove(job)
            job.started_at = now
            job.future.set_running_or_notify_cancel()
            self._running.append(job)
            threading.Thread(target=self._run, args=(job,), daemon=True,
                             name="kvloop-grammar").start()

    def _next_wake(self, now: float) -> float:
        """Seconds until a running compile turns slow or times out (at most `_MAX_WAIT_S`)."""
        lim = self.limits
        times = [t for j in self._running if j.started_at is not None
                 for t in (j.started_at + lim.slow_after_s, j.started_at + lim.timeout_s)
                 if t > now]
        times += [j.submitted_at + lim.timeout_s for j in self._pending]
        return max(0.0, min([*times, now + _MAX_WAIT_S]) - now)

    def _run(self, job: CompileJob) -> None:
        """A compile thread: run, hand the result over unless the job timed out meanwhile."""
        try:
            result, error = job.fn(), None
        except BaseException as e:  # noqa: BLE001 (handed to the waiters)
            result, error = None, e
        with self._cv:
            self._running.remove(job)
            if not job.future.done():
                if error is None:
                    job.future.set_result(result)
                else:
                    job.future.set_exception(error)
            self._cv.notify_all()
