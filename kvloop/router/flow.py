"""Flow control: requests wait at the router, not in the engines, while the fleet is saturated.

    admit(request) ── fleet has headroom and nobody queued ──────────────► permit (route it)
          │ saturated (or others queued first)
          ├─ sheddable (priority < 0) ────────────────────────────────────► 429 Retry-After
          ├─ queue full (`max_queue` requests or `max_queue_bytes`) ──────► 503 Retry-After
          └─ queued in its band, behind its tenant's earlier requests
                 released: highest band first, tenants of a band in turn ──► permit
                 its queue timeout passed ───────────────────────────────► 503 Retry-After
                 the client left ────────────────────────────────────────► 499

Saturation is read from each worker's own figures (`headroom`): polled waiting requests and
KV usage, both older than `staleness_s` meaning saturated, and, for a kvloop worker, the
router's own in-flight count beyond its `max_num_seqs` (exact, never stale). A permit counts
as one request on the fleet from its release until the router has opened its ticket
(`Permit.close()`), so a burst released at once is not released twice.

Batch lines (kvloop/batch) wait in their own band, `BATCH_PRIORITY`, below every objective's:
never shed, released only when no other band waits. Only the router's own batch runner can
name that band: its objective name (`batch_objective`) is random per router.

A request's band is its objective's priority (`x-gateway-inference-objective`, looked up in
the objectives file; an unknown objective is the default band 0), else minus vLLM's
`priority` field (vLLM serves lower values first; bands serve higher first), else 0. Its
tenant is `x-gateway-inference-fairness-id`, else its API key, else one shared tenant;
tenants are kept as digests, never as the strings a client sent. The fairness header and a
band above 0 are a *trusted* caller's only (`FlowConfig`: the fleet token, the admin key, or
`--trusted-front`): from anyone else the fairness header is ignored and an objective or
`priority` may only lower its band, so a client can neither name itself many tenants nor
jump the queue.

Owner: `FlowControl` owns the queue (`FlowQueue`: pure, no I/O), the permits in transit and
the dispatcher task that releases waiters; it reads workers only through `pool()`.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import secrets
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.responses import JSONResponse

from kvloop.front.auth import presented_authorization
from kvloop.router.flow_config import PRIORITY_RANGE, FlowConfig
from kvloop.router.registry import WorkerState
from kvloop.router.relay import error_response

OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
SHED = "shed"                    # sheddable while saturated: 429
QUEUE_FULL = "queue_full"        # `max_queue` waiting already: 503
QUEUE_TIMEOUT = "queue_timeout"  # waited its whole queue timeout: 503
REJECTIONS = (SHED, QUEUE_FULL, QUEUE_TIMEOUT)
DISPATCH_TICK_S = 0.01           # how often a non-empty queue looks for headroom
BATCH_PRIORITY = PRIORITY_RANGE[0] - 1   # below any objective's (an int32)
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def headroom(w: WorkerState, cfg: FlowConfig, now: float) -> int:
    """How many more requests `w` takes before it is saturated (0: saturated)."""
    load = w.load
    if now - load.at > cfg.staleness_s or load.kv_usage >= cfg.kv_usage_threshold:
        return 0
    if w.description is None:   # no kvloop worker: its slots are unknown, its queue is not
        return max(0, max(cfg.max_waiting, 1) - load.waiting)
    queued = w.in_flight() - w.description.max_num_seqs   # < 0: free slots
    if load.waiting > 0:          # requests the router did not send (another router's)
        queued = max(queued, load.waiting)
    return max(0, cfg.max_waiting - queued)


def fleet_headroom(pool: list[WorkerState], cfg: FlowConfig, now: float) -> int | None:
    """The fleet's headroom; None without a usable worker (routing then answers 503)."""
    if not pool:
        return None
    return sum(headroom(w, cfg, now) for w in pool)


@dataclass(frozen=True)
class FlowKey:
    """Where a request waits: its band (higher first) and its tenant (a digest)."""

    priority: int = 0
    tenant: int = 0
    queue_timeout_s: float | None = None   # None: the config's
    sheddable: bool | None = None          # None: a negative priority is
    body_bytes: int = 0                    # what its body holds while it waits

    @property
    def shed_when_saturated(self) -> bool:
        return self.priority < 0 if self.sheddable is None else self.sheddable


@dataclass(eq=False)
class Waiter:
    """One queued request; `released` is set by the queue's owner."""

    key: FlowKey
    seq: int
    enqueued_at: float
    released: asyncio.Future[Permit] | None = None
    size: int = 0                           # its body's bytes


class FlowQueue:
    """Bands of tenants of FIFO queues. Pure: no clock, no I/O.

    `pop()` takes the highest band; within it, the tenant at the head of the band's rotation
    gives its oldest request and moves to the back (round-robin between tenants, FIFO within
    one). Empty tenants and bands are dropped at once, so memory is bounded by `len()`;
    `bytes` is the sum of the waiters' body sizes."""

    def __init__(self) -> None:
        self._bands: dict[int, dict[int, deque[Waiter]]] = {}   # insertion order = rotation
        self._len = 0
        self.bytes = 0

    def __len__(self) -> int:
        return self._len

    def push(self, w: Waiter) -> None:
        tenants = self._bands.setdefault(w.key.priority, {})
        tenants.setdefault(w.key.tenant, deque()).append(w)
        self._len += 1
        self.bytes += w.size

    def pop(self) -> Waiter | None:
        if not self._bands:
            return None
        band = max(self._bands)
        tenants = self._bands[band]
        tenant = next(iter(tenants))
        queue = tenants.pop(tenant)
        w = queue.popleft()
        if queue:
            tenants[tenant] = queue      # re-inserted: to the back of the rotation
        elif not tenants:
            del self._bands[band]
        self._len -= 1
        self.bytes -= w.size
        return w

    def remove(self, w: Waiter) -> bool:
        """Take `w` out (timed out, or its client left); False if it is not queued."""
        tenants = self._bands.get(w.key.priority)
        queue = tenants.get(w.key.tenant) if tenants is not None else None
        if queue is None or w not in queue:
            return False
        queue.remove(w)
        if not queue:
            del tenants[w.key.tenant]   # type: ignore[union-attr]
            if not tenants:
                del self._bands[w.key.priority]
        self._len -= 1
        self.bytes -= w.size
        return True

    def lengths(self) -> dict[int, int]:
        """Queued requests per band."""
        return {b: sum(len(q) for q in t.values()) for b, t in self._bands.items()}


class Permit:
    """A request let through: one request in transit until the router opened its ticket."""

    def __init__(self, flow: FlowControl | None):
        self._flow = flow

    def close(self) -> None:
        """Routed (or failed to): no longer in transit. Idempotent."""
        flow, self._flow = self._flow, None
        if flow is not None:
            flow.in_transit -= 1


FREE = Permit(None)   # flow control off: nothing to account


@dataclass(frozen=True)
class Rejection:
    """Why a request is refused, and the status that says so."""

    reason: str
    status: int
    message: str


class FlowControl:
    """The router's queue and its dispatcher (one per router, on its event loop)."""

    def __init__(self, cfg: FlowConfig, pool: Callable[[], list[WorkerState]],
                 clock: Callable[[], float], prom: CollectorRegistry | None = None):
        self.cfg = cfg
        self.pool = pool
        self.clock = clock
        self.queue = FlowQueue()
        self.in_transit = 0
        self._seq = itertools.count()
        self.batch_objective = "kvloop-batch-" + secrets.token_hex(16)
        self._dispatcher: asyncio.Task[None] | None = None
        self.metrics = FlowMetrics(self, prom or CollectorRegistry())

    # --- classification -------------------------------------------------------------------
    def key_of(self, headers: Mapping[str, str], body: Mapping[str, Any],
               trusted: bool = False) -> FlowKey:
        """The request's band, tenant and queue timeout (module docstring); `trusted`: the
        caller is a trusted front (or `FlowConfig.trusted_front` says every caller is). The
        batch objective's name is secret (random per router): whoever sends it is the
        router's own batch runner, whose fairness header names the batch's owner."""
        name = headers.get(OBJECTIVE_HEADER)
        if name == self.batch_objective:
            tenant = headers.get(FAIRNESS_HEADER) or presented_authorization(headers) or ""
            return FlowKey(BATCH_PRIORITY, _digest(tenant), sheddable=False)
        trusted = trusted or self.cfg.trusted_front
        if not trusted:   # its key's tenant; an objective or priority may only lower it
            key = self._key(headers, body, name, None)
            if key.priority > 0:
                key = self._key(headers, body, None, None)
                return FlowKey(min(key.priority, 0), key.tenant, None)
            return key
        return self._key(headers, body, name, headers.get(FAIRNESS_HEADER))

    def _key(self, headers: Mapping[str, str], body: Mapping[str, Any],
             objective_name: str | None, fairness_id: str | None) -> FlowKey:
        objective = self.cfg.objective(objective_name)
        if objective is not None:
            priority, timeout = objective.priority, objective.queue_timeout_s
        else:
            vllm = body.get("priority")
            priority = -vllm if isinstance(vllm, int) and not isinstance(vllm, bool) else 0
            timeout = None
        tenant = fairness_id or presented_authorization(headers) or ""
        return FlowKey(priority, _digest(tenant), timeout)

    # --- admission ------------------------------------------------------------------------
    async def admit(self, key: FlowKey, size: int | None = None) -> Permit | Rejection:
        """Wait for room (module docstring); cancelled (the client left): leaves the queue.
        `size`: the request's body bytes, which it holds while it waits (None: the key's)."""
        size = key.body_bytes if size is None else size
        if not self.cfg.enabled:
            return FREE
        room = self.room()
        if not self.queue and (room is None or room > 0):
            return self._release_now(key, 0.0)
        if key.shed_when_saturated:
            return self._reject(key, SHED, 429, "the fleet is saturated and this request is "
                                                "sheddable (negative priority)")
        if len(self.queue) >= self.cfg.max_queue:
            return self._reject(key, QUEUE_FULL, 503,
                                f"the router's queue is full ({self.cfg.max_queue} "
                                "requests wait for a saturated fleet)")
        if self.queue.bytes + size > self.cfg.max_queue_bytes:
            return self._reject(key, QUEUE_FULL, 503,
                                f"the router's queue is full ({self.cfg.max_queue_bytes} "
                                "bytes of requests wait for a saturated fleet)")
        return await self._wait(key, size)

    async def _wait(self, key: FlowKey, size: int) -> Permit | Rejection:
        loop = asyncio.get_running_loop()
        w = Waiter(key, next(self._seq), self.clock(), loop.create_future(), size)
        assert w.released is not None
        self.queue.push(w)
        self._ensure_dispatcher()
        timeout = key.queue_timeout_s or self.cfg.queue_timeout_s
        try:
            await asyncio.wait({w.released}, timeout=timeout)
        except asyncio.CancelledError:   # the client left (or the router stops)
            if not self.queue.remove(w) and w.released.done():
                w.released.result().close()   # released, but nobody will route it
            raise
        if w.released.done():
            return w.released.result()
        self.queue.remove(w)
        return self._reject(key, QUEUE_TIMEOUT, 503, f"waited {timeout:g} s at the router "
                                                     "for a saturated fleet (queue timeout)")

    def _release_now(self, key: FlowKey, waited: float) -> Permit:
        self.in_transit += 1
        self.metrics.wait.labels(self.metrics.band(key.priority)).observe(waited)
        return Permit(self)

    def _reject(self, key: FlowKey, reason: str, status: int, message: str) -> Rejection:
        self.metrics.rejections.labels(reason, self.metrics.band(key.priority)).inc()
        return Rejection(reason, status, message)

    def room(self) -> int | None:
        """The fleet's headroom less the permits in transit (None: no usable worker)."""
        room = fleet_headroom(self.pool(), self.cfg, self.clock())
        return None if room is None else room - self.in_transit

    # --- dispatch -------------------------------------------------------------------------
    def _ensure_dispatcher(self) -> None:
        if self._dispatcher is None or self._dispatcher.done():
            self._dispatcher = asyncio.get_running_loop().create_task(self._dispatch())

    async def _dispatch(self) -> None:
        while self.queue:
            self.release_ready()
            await asyncio.sleep(DISPATCH_TICK_S)

    def release_ready(self) -> int:
        """Release as many waiters as the fleet has room for; how many were released."""
        room = self.room()
        released = 0
        while self.queue and (room is None or room > 0):
            w = self.queue.pop()
            assert w is not None and w.released is not None
            w.released.set_result(self._release_now(w.key, self.clock() - w.enqueued_at))
            released += 1
            room = None if room is None else room - 1
        return released

    async def stop(self) -> None:
        if self._dispatcher is not None:
            self._dispatcher.cancel()


def rejection_response(rej: Rejection, cfg: FlowConfig) -> JSONResponse:
    """The OpenAI error JSON of a refusal, with `Retry-After`."""
    r = error_response(rej.message, rej.status)
    r.headers["retry-after"] = str(cfg.retry_after_s)
    r.headers["x-kvloop-flow-rejected"] = rej.reason
    return r


def _digest(text: str) -> int:
    if not text:
        return 0
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@dataclass
class FlowMetrics:
    """Queue length per band (read at scrape time), wait times, refusals by reason. Band
    labels are the configured objectives' priorities and 0; any other band is `other`."""

    flow: FlowControl
    prom: CollectorRegistry
    known: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        self.known = frozenset({0, *(o.priority for o in self.flow.cfg.objectives)})
        P = "kvloop_router_flow_"
        self.wait = Histogram(P + "wait_seconds", "Time requests waited in the router's queue "
                              "(0 when let through at once)", ["priority"],
                              buckets=WAIT_BUCKETS, registry=self.prom)
        self.rejections = Counter(P + "rejections", "Requests refused by flow control, by "
                                  "reason", ["reason", "priority"], registry=self.prom)
        self.prom.register(_QueueCollector(self))

    def band(self, priority: int) -> str:
        if priority == BATCH_PRIORITY:
            return "batch"
        return str(priority) if priority in self.known else "other"


class _QueueCollector(Collector):
    def __init__(self, m: FlowMetrics):
        self.m = m

    def collect(self) -> Iterator[GaugeMetricFamily]:
        flow = self.m.flow
        g = GaugeMetricFamily("kvloop_router_flow_queue_length",
                              "Requests waiting in the router's queue, by priority band",
                              labels=["priority"])
        per_band: dict[str, int] = {self.m.band(b): 0 for b in self.m.known}
        for band, n in flow.queue.lengths().items():
            label = self.m.band(band)
            per_band[label] = per_band.get(label, 0) + n
        for label, n in sorted(per_band.items()):
            g.add_metric([label], n)
        yield g
        s = GaugeMetricFamily("kvloop_router_flow_saturated",
                              "1 while every usable worker is saturated (flow control)")
        if flow.cfg.enabled:
            room = flow.room()
            s.add_metric([], float(room is not None and room <= 0))
            yield s
