"""Waiting reasons: why a request in the waiting queue is not ready to be admitted yet.

Owner: the scheduler holds the reasons (a `WaitReasons`) and alone changes `Request.status`;
a reason only reports. Each reason is one small object with its own status (vLLM's
`WAITING_FOR_*`); a request waits for at most one reason at a time, named by its status.
A feature whose requests must wait (a tier loading their blocks, an adapter loading) adds a
reason object to the scheduler's registry, not a branch in the waiting loop.

The life of a waiting request (`Scheduler._admit_waiting` peeks the queue's head each time):

    add_request ── held by a reason (`holds_new`)? ── yes ─▶ status = reason.status
         │ no                                                      │
         ▼                                                         ▼
      WAITING ◀── READY ─── `poll(request)` whenever it reaches the queue's head (READY
         │                    hands it to the next registered reason holding it, if any):
         │                    NOT_YET: skipped this step, back in its place afterwards
         │                    FAILED:  FINISHED_ERROR, with an error output
         ▼ at the queue's head
      local prefix hit, then the connector's tokens beyond it (the connector may ask
      again: skipped as NOT_YET), then the allocation (no room: the loop stops)
         │
         ├── an asynchronous load ─▶ WAITING_FOR_REMOTE_KVS (`RemoteKVLoad`), skipped
         │                           until the connector reports it: WAITING, or failed
         ▼
      RUNNING

Whatever a request waited for is `release`d when it finishes, waiting or not (an aborted
request no longer wants its grammar compile). The queue's order is vLLM's exactly: a held
request keeps its place while the requests behind it are admitted
(docs/vllm-facts.md#scheduler).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Protocol

from kvloop.core.request import Request, RequestStatus
from kvloop.wire import LORA_UNAVAILABLE

MAX_UNREADABLE = 64     # adapters remembered as unreadable (for the error of those waiting)

# `vllm:num_requests_waiting_by_reason` labels besides each reason's own (`reason_label`):
CAPACITY = "capacity"   # vLLM's: waiting for room (token budget, KV blocks), held by nothing
DEFERRED = "deferred"   # vLLM's: held by some reason (the sum of the reasons' labels)


def reason_label(status: RequestStatus) -> str:
    """A reason's label: its status without WAITING_FOR_ (WAITING_FOR_LORA -> "lora")."""
    return status.name.removeprefix("WAITING_FOR_").lower()


class Readiness(enum.Enum):
    """A reason's answer about one request it holds."""

    READY = enum.auto()      # no longer held: WAITING, admitted like any waiting request
    NOT_YET = enum.auto()    # skipped this step, back in its place afterwards
    FAILED = enum.auto()     # never will be: finished with the reason's `error`


class WaitReason(Protocol):
    """One reason a waiting request may not be admitted yet. Reasons mutate no request."""

    status: RequestStatus   # the status of the requests this reason holds

    def holds_new(self, request: Request) -> bool:
        """Whether a request just added must wait for this reason first."""
        ...

    def poll(self, request: Request) -> Readiness:
        """Asked by the waiting loop whenever a request with `status` reaches the head."""
        ...

    def error(self, request: Request) -> str:
        """Why `request` can never be ready (after `poll` answered FAILED)."""
        ...

    def release(self, request: Request) -> None:
        """`request` finished (whatever its status): drop what it waited on. Idempotent."""
        ...


class GrammarCompile:
    """A constrained request waits for its grammar's compile (vLLM's
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR); a failed or timed-out compile fails it."""

    status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR

    def holds_new(self, request: Request) -> bool:
        return request.structured_output_request is not None

    def poll(self, request: Request) -> Readiness:
        so_req = request.structured_output_request
        assert so_req is not None
        if so_req.poll():
            return Readiness.READY
        return Readiness.NOT_YET if so_req.error is None else Readiness.FAILED

    def error(self, request: Request) -> str:
        so_req = request.structured_output_request
        assert so_req is not None and so_req.error is not None
        return so_req.error

    def release(self, request: Request) -> None:
        if request.structured_output_request is not None:
            request.structured_output_request.release()   # its compile, if still wanted


class RemoteKVLoad:
    """A request whose prompt KV the connector loads between steps (vLLM's
    WAITING_FOR_REMOTE_KVS). It enters at its admission (an asynchronous load) and leaves
    when the connector reports the load, which the scheduler handles in
    `update_from_output`; until then the waiting loop only skips it."""

    status = RequestStatus.WAITING_FOR_REMOTE_KVS

    def holds_new(self, request: Request) -> bool:
        return False

    def poll(self, request: Request) -> Readiness:
        return Readiness.NOT_YET

    def error(self, request: Request) -> str:
        return "the remote KV load failed"   # never asked: failures come with the report

    def release(self, request: Request) -> None:
        pass   # the connector owns the transfer (`request_finished`)


class AdapterSlots:
    """A request with a LoRA adapter waits until its adapter is one of at most `max_loras`
    the admitted requests use (the runner holds that many resident: vLLM's rule that a step
    has at most --max-loras adapters). Owner of the registered adapters (`register`,
    `unregister`: the engine keeps them in step with the runner's) and of the count of
    admitted requests per adapter: a request counts from the poll that admits it until it
    finishes (a preempted one keeps its place). An adapter removed while a request waits
    for it fails that request.

    `set_reader(read)`: before a request is admitted, `read(name)` makes its adapter ready
    (the runner reads it again if it left host memory) and returns None, or why it cannot
    be read (its folder removed or moved): then the adapter is unregistered here (the
    reader has unloaded it from the runner), and this request and every one waiting for it
    fail with a `LORA_UNAVAILABLE` error; the engine lives on.

    `hash_key(name)`: what a request's LoRA extra key carries beside the name. None the
    first time a name is registered (so a router, which knows names only, computes the same
    hashes); after the name is registered again (an adapter reloaded, perhaps with new
    weights) a marker of that registration, so blocks cached under the old weights are never
    hit again (vLLM keys by name alone, and serves stale KV after an in-place reload)."""

    status = RequestStatus.WAITING_FOR_LORA

    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.names: dict[str, str | None] = {}       # registered adapter -> its hash key
        self._registrations: dict[str, int] = {}     # times each name was registered
        self.users: dict[str, int] = {}            # adapter -> admitted requests using it
        self._admitted: dict[str, str] = {}       # request id -> its adapter
        self._read: Callable[[str], str | None] | None = None
        self.unreadable: OrderedDict[str, str] = OrderedDict()   # name -> why, recent last

    def set_reader(self, read: Callable[[str], str | None]) -> None:
        self._read = read

    def holds_new(self, request: Request) -> bool:
        return request.lora_name is not None

    def poll(self, request: Request) -> Readiness:
        name = request.lora_name
        assert name is not None
        if name not in self.names:
            return Readiness.FAILED
        if name not in self.users and len(self.users) >= self.max_loras:
            return Readiness.NOT_YET
        why = self._read(name) if self._read is not None else None
        if why is not None:
            self._mark_unreadable(name, why)
            return Readiness.FAILED
        self.users[name] = self.users.get(name, 0) + 1
        self._admitted[request.request_id] = name
        return Readiness.READY

    def error(self, request: Request) -> str:
        why = self.unreadable.get(request.lora_name or "")
        if why is not None:
            return f"{LORA_UNAVAILABLE}: {why} (the adapter is unloaded)"
        return f"LoRA adapter {request.lora_name!r} is not loaded"

    def _mark_unreadable(self, name: str, why: str) -> None:
        self.unregister(name)
        self.unreadable[name] = why
        self.unreadable.move_to_end(name)
        while len(self.unreadable) > MAX_UNREADABLE:
            self.unreadable.popitem(last=False)

    def release(self, request: Request) -> None:
        name = self._admitted.pop(request.request_id, None)
        if name is None:
            return
        self.users[name] -= 1
        if not self.users[name]:
            del self.users[name]

    def in_use(self, name: str) -> bool:
        return name in self.users

    def register(self, name: str) -> None:
        self.unreadable.pop(name, None)
        n = self._registrations.get(name, 0)
        self._registrations[name] = n + 1
        self.names[name] = None if n == 0 else f"kvloop-reload-{n}"

    def unregister(self, name: str) -> None:
        self.names.pop(name, None)

    def hash_key(self, name: str) -> str | None:
        return self.names.get(name)


class WaitReasons:
    """The scheduler's registry of reasons, one per status, asked in registration order."""

    def __init__(self, *reasons: WaitReason):
        self._by_status: dict[RequestStatus, WaitReason] = {}
        for reason in reasons:
            if reason.status in self._by_status or not reason.status.name.startswith("WAITING_"):
                raise ValueError(f"a waiting reason needs its own WAITING_* status, "
                                 f"not {reason.status.name}")
            self._by_status[reason.status] = reason

    def holding(self, request: Request) -> WaitReason | None:
        """The reason holding `request` now (by its status); None: nothing holds it."""
        return self._by_status.get(request.status)

    def holding_new(self, request: Request) -> WaitReason | None:
        """The first reason a request just added must wait for (None: none)."""
        return next((r for r in self._by_status.values() if r.holds_new(request)), None)

    def holding_after(self, request: Request, reason: WaitReason) -> WaitReason | None:
        """The first reason registered after `reason` that holds `request` too (None: none):
        the one it waits for next, once `reason` answered READY."""
        reasons = list(self._by_status.values())
        later = reasons[reasons.index(reason) + 1:]
        return next((r for r in later if r.holds_new(request)), None)

    def release(self, request: Request) -> None:
        for reason in self._by_status.values():
            reason.release(request)

    def count(self, waiting: Iterable[Request]) -> dict[str, int]:
        """The waiting requests by reason: `CAPACITY`, `DEFERRED` and every registered
        reason's label, zeros included (so each series exists from the first step)."""
        by_status = dict.fromkeys(self._by_status, 0)
        capacity = 0
        for r in waiting:
            if r.status in by_status:
                by_status[r.status] += 1
            else:
                capacity += 1
        out = {CAPACITY: capacity, DEFERRED: sum(by_status.values())}
        out.update((reason_label(s), n) for s, n in by_status.items())
        return out

    def statuses(self) -> tuple[RequestStatus, ...]:
        """The statuses of held requests (for the scheduler's invariants)."""
        return tuple(self._by_status)
