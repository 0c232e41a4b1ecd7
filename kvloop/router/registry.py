"""Workers: who they are, how loaded, whether their cache signal can be trusted.

Owner: the registry owns every `WorkerState` (load snapshots, in-flight tickets, liveness
marks, self-verification samples, alarms). The index owns block ownership; the router
only reads worker states through the registry and reports what happened to it.

Alarms (each names the worker and the likely cause, and turns routing to that worker
load-only until it clears):

    config_mismatch   the worker's block size / hash algorithm / seed / role differs from
                      the fleet's (learned at registration, or seen in its events)
    no_event_source   the worker advertises no KV-event endpoint
    silent            it served traffic but sent no event and no heartbeat for a window
    predictions_miss  hits the router predicted keep not happening
    unpredicted_hits  the worker keeps reporting hits the router did not predict
    wrong_event_source  the events on its KV-event endpoint are another worker's (their
                      publisher's epoch is not this worker's)
    no_stored_blocks  a prefill worker served prefills that should have stored blocks, but
                      no BlockStored reached the router for a window (heartbeats do not count)
    prefill_failing   its last prefill legs all failed: it is left out of remote prefills
                      until a window has passed
    no_kv_connector   a prefill worker without a connector that holds blocks (no prefill leg
                      goes to it; a decode worker without one that loads them is only
                      warned about: it serves, prefilling everything itself)
    unreachable_event_source  it advertises a KV-event address the router cannot dial (a
                      wildcard, or loopback on another host): set at registration
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

import msgspec

from kvloop.config import DEFAULT_ROLE, ROLES
from kvloop.events.types import TIER_DEVICE
from kvloop.router.config import HashSpec, LivenessConfig
from kvloop.router.groups import GroupSpec
from kvloop.wire import WorkerInfo

CONFIG_MISMATCH = "config_mismatch"
NO_EVENT_SOURCE = "no_event_source"
SILENT = "silent"
PREDICTIONS_MISS = "predictions_miss"
UNPREDICTED_HITS = "unpredicted_hits"
WRONG_SUBJECT = "wrong_subject"
WRONG_EVENT_SOURCE = "wrong_event_source"
NO_STORED_BLOCKS = "no_stored_blocks"
PREFILL_FAILING = "prefill_failing"
NO_KV_CONNECTOR = "no_kv_connector"
UNREACHABLE_EVENT_SOURCE = "unreachable_event_source"
TIER_UNKNOWN = "unindexed"   # the tier an unpredicted hit came from: none the router knows
ALARMS = (CONFIG_MISMATCH, NO_EVENT_SOURCE, SILENT, PREDICTIONS_MISS, UNPREDICTED_HITS,
          WRONG_SUBJECT, WRONG_EVENT_SOURCE, NO_STORED_BLOCKS, PREFILL_FAILING, NO_KV_CONNECTOR,
          UNREACHABLE_EVENT_SOURCE)

_CAUSES = {
    SILENT: "its KV events do not reach the router: wrong --kv-events-endpoint (or a "
            "firewall / wrong advertised address), or the publisher is down",
    PREDICTIONS_MISS: "the router's hashes do not match the worker's: different hash seed "
                      "(PYTHONHASHSEED / --hash-seed), hash algorithm or block size, or "
                      "BlockRemoved events are lost",
    UNPREDICTED_HITS: "its events are not indexed: wrong KV-event endpoint, or a different "
                      "hash seed, hash algorithm or block size",
    NO_EVENT_SOURCE: "the worker was started without --kv-events-endpoint (or hides it from "
                     "a router whose key it does not accept: --worker-api-key)",
    WRONG_SUBJECT: "the worker publishes on another NATS subject than the router listens "
                   "on: its component changed (aggregated `backend` vs disaggregated "
                   "`prefill` / `decode`) or its namespace differs (--dyn-component, "
                   "--dyn-namespace, DYN_COMPONENT, DYN_NAMESPACE)",
    WRONG_EVENT_SOURCE: "the router subscribes to another worker's KV-event endpoint (a "
                        "wrong events= override, or two workers' addresses swapped)",
    NO_STORED_BLOCKS: "the router subscribes to another worker's KV-event endpoint (a "
                      "decode worker's, which stores nothing), or the worker runs without "
                      "prefix caching",
    PREFILL_FAILING: "the prefill worker has no KV connector (started without "
                     "--kv-transfer-config) or its engine fails these requests",
    UNREACHABLE_EVENT_SOURCE: "the worker binds its KV events on a wildcard or loopback "
                              "address and advertises it: start it with --advertise-host "
                              "HOST (and --kv-events-endpoint tcp://0.0.0.0:0 or its own "
                              "address), or name the endpoint here (URL,events=tcp://...)",
    NO_KV_CONNECTOR: "the worker was started without --kv-transfer-config, or with the "
                     "wrong kv_role (`kvloop fleet --prefill N --decode M` sets both)",
}


def likely_cause(kind: str) -> str:
    return _CAUSES.get(kind, "")


@dataclass(frozen=True)
class EventSource:
    """Where one worker's KV events come from (on a NATS event plane: `subject` and the
    `worker_id` its messages carry, besides the server's URL as `endpoint`)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    subject: str | None = None
    worker_id: int | None = None
    payload_format: str | None = None
    curve: bool = False    # its ZMQ sockets admit only the fleet's CURVE keys


@dataclass(frozen=True)
class WorkerSpec:
    """How a worker was named to the router: `URL[,role][,events=EP][,replay=EP]`."""

    url: str
    role: str = DEFAULT_ROLE
    events_endpoint: str | None = None
    replay_endpoint: str | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"worker URL must look like http://HOST:PORT, got {self.url!r}")
        if self.role not in ROLES:
            raise ValueError(f"worker role must be one of {ROLES}, got {self.role!r}")

    @classmethod
    def parse(cls, text: str) -> WorkerSpec:
        url, *rest = [p.strip() for p in text.split(",")]
        kw: dict[str, str] = {}
        for item in rest:
            key, eq, value = item.partition("=")
            if not eq:
                kw["role"] = key
            elif key in ("events", "replay"):
                kw[f"{key}_endpoint"] = value
            else:
                raise ValueError(f"unknown worker option {key!r} in {text!r} "
                                 f"(expected URL[,role][,events=EP][,replay=EP])")
        return cls(url.rstrip("/"), **kw)

    @property
    def name(self) -> str:
        """The worker's identity in logs, metrics and the index: `host:port`."""
        return urlsplit(self.url).netloc


class WorkerDescription(WorkerInfo, frozen=True, kw_only=True):
    """What a kvloop worker says about itself: its `GET /kvloop/worker` answer, decoded as the
    server's `WorkerInfo` (no field of its own; an answer that does not decode is refused)."""

    def hash_spec(self) -> HashSpec:
        return HashSpec(self.block_size, self.hash_algo, self.hash_seed)


def event_source(spec: WorkerSpec, desc: WorkerDescription | None) -> EventSource | None:
    """Where the worker's KV events come from: the endpoints it advertises, overridden by the
    spec's (`desc` None: not a kvloop worker, only the spec's)."""
    ev = desc.kv_events if desc is not None else None
    endpoint = spec.events_endpoint or (ev.endpoint if ev is not None else None)
    if endpoint is None:
        return None
    replay = spec.replay_endpoint or (ev.replay_endpoint if ev is not None else None)
    if ev is None:
        return EventSource(endpoint, replay)
    return EventSource(endpoint, replay, ev.topic, ev.subject, ev.worker_id,
                       ev.payload_format, ev.curve)


@dataclass(frozen=True)
class LoadSnapshot:
    """The worker's own figures, from its /metrics (vLLM names; `draining`: kvloop's gauge,
    or a refusal that said so, kvloop/front/drain.py)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    at: float = 0.0
    lora_adapters: frozenset[str] = frozenset()   # vllm:lora_requests_info: active adapters
    max_loras: int | None = None                  # ... its max_lora (None: no such gauge)
    draining: bool = False


@dataclass(frozen=True)
class Alarm:
    kind: str
    worker: str
    detail: str
    since: float

    @property
    def message(self) -> str:
        cause = likely_cause(self.kind)
        text = f"worker {self.worker}: {self.kind}: {self.detail}"
        return f"{text} (likely cause: {cause})" if cause else text


@dataclass
class Ticket:
    """One request the router sent to a worker, until it finishes."""

    request_id: int
    worker: str
    prompt_tokens: int
    uncached_tokens: int
    predicted_tokens: int
    sent_at: float
    first_token_at: float | None = None
    verify: bool = True   # False: the worker's reported hit is not its own (a pulled prompt)
    tiers: tuple[str, ...] = ()   # the tier of each predicted block (empty: all device)
    closed: bool = False  # closed or dropped: it counts no longer (closing twice is a no-op)


class Verifier:
    """Self-verification: predicted vs reported cached tokens, over a sliding window.

    Only requests where either side saw at least one block count. A sample misses when
    the worker found less than half of a predicted hit (`predictions_miss`), or when it
    found a hit of which the router predicted less than half (`unpredicted_hits`).

    By tier: an engine uses its device prefix first, then loads the following blocks from
    below, so a reported hit of k blocks covers the first k predicted blocks. A missed
    prediction is blamed on the tier of the first predicted block the worker did not find;
    an unpredicted hit on the tier the router has nothing for (`TIER_UNKNOWN`). Per tier,
    `predicted_by_tier` / `found_by_tier` count tokens (what was predicted from the tier, and
    how much of that the worker then reported), and the alarm names the tier to blame most.
    """

    def __init__(self, cfg: LivenessConfig):
        self.cfg = cfg
        self.samples: deque[tuple[str, str | None]] = deque(maxlen=cfg.verify_window)
        self.predicted_tokens = 0
        self.actual_tokens = 0
        self.predicted_by_tier: dict[str, int] = {}
        self.found_by_tier: dict[str, int] = {}

    def record(self, predicted: int, actual: int, block_size: int,
               tiers: tuple[str, ...] = ()) -> None:
        self.predicted_tokens += predicted
        self.actual_tokens += actual
        tiers = tiers or (TIER_DEVICE,) * (predicted // block_size)
        found = min(actual, predicted) // block_size
        for i, tier in enumerate(tiers):
            self.predicted_by_tier[tier] = self.predicted_by_tier.get(tier, 0) + block_size
            if i < found:
                self.found_by_tier[tier] = self.found_by_tier.get(tier, 0) + block_size
        if predicted < block_size and actual < block_size:
            return
        if predicted >= block_size and actual * 2 < predicted:
            self.samples.append((PREDICTIONS_MISS, tiers[found] if found < len(tiers)
                                 else None))
        elif actual >= block_size and predicted * 2 < actual:
            self.samples.append((UNPREDICTED_HITS, TIER_UNKNOWN))
        else:
            self.samples.append(("ok", None))

    def verdict(self) -> tuple[str, str] | None:
        """(alarm kind, detail) when the window says predictions are broken, else None."""
        n = len(self.samples)
        if n < self.cfg.verify_min_samples:
            return None
        miss = sum(1 for s, _ in self.samples if s == PREDICTIONS_MISS)
        unpred = sum(1 for s, _ in self.samples if s == UNPREDICTED_HITS)
        if (miss + unpred) / n < self.cfg.verify_miss_ratio:
            return None
        kind = PREDICTIONS_MISS if miss >= unpred else UNPREDICTED_HITS
        return kind, (f"{miss + unpred} of the last {n} cache predictions were wrong "
                      f"({miss} predicted hits missed, {unpred} hits not predicted)"
                      f"{self._blame(kind)}")

    def _blame(self, kind: str) -> str:
        """`; tier X disagrees (k of them)` for the tier most samples of `kind` blame."""
        counts: dict[str, int] = {}
        for s, tier in self.samples:
            if s == kind and tier is not None:
                counts[tier] = counts.get(tier, 0) + 1
        if not counts:
            return ""
        tier = max(sorted(counts), key=lambda t: counts[t])
        return f"; tier {tier} disagrees ({counts[tier]} of them)"

    def reset(self) -> None:
        self.samples.clear()


@dataclass
class EventCounters:
    """What the router's event feed saw from one worker (besides the subscriber's stats)."""

    batches: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    refused: int = 0
    verified_roots: int = 0
    tier_stored: dict[str, int] = field(default_factory=dict)  # below the device, per tier
    placeholders_mapped: int = 0     # tokenless lower-tier blocks mirroring device blocks
    placeholders_ignored: int = 0    # ... mirroring nothing the router knows
    tier_size_skipped: int = 0       # lower-tier blocks of another block size
    unknown_medium: int = 0          # blocks of a medium no tier names
    last_event_at: float | None = None
    last_heartbeat_at: float | None = None
    clears_by_reason: dict[str, int] = field(default_factory=dict)
    # KV-cache groups its BlockStored events named (`kvloop.router.groups`); empty or one
    # full-attention group: the plain longest-prefix match is the engine's rule
    groups: dict[int, GroupSpec] = field(default_factory=dict)


class WorkerState:
    """Everything the router knows about one worker. Mutated only through the registry."""

    def __init__(self, spec: WorkerSpec, cfg: LivenessConfig, now: float):
        self.spec = spec
        self.name = spec.name
        self.description: WorkerDescription | None = None   # None: not probed, or no kvloop
        self.up = False
        self.down_reason = "not probed yet"
        self.load = LoadSnapshot()
        # requests `load` counted that the router has seen finish since (tickets sent before
        # the snapshot, closed after it) and their prompt blocks: `reported_load()`
        self.finished_since_load = 0
        self.finished_blocks_since_load = 0
        self.tickets: dict[int, Ticket] = {}
        self.verifier = Verifier(cfg)
        self.alarms: dict[str, Alarm] = {}
        self.events = EventCounters()
        self.subscribed_at = now
        self.first_unsignalled_send: float | None = None
        self.first_unstored_send: float | None = None   # prefill role: awaiting a BlockStored
        self.stored_at_unstored_send = 0
        self.epoch_mismatch_since: float | None = None
        self.prefill_failures = 0                        # consecutive failed prefill legs
        self.last_prefill_failure: float | None = None
        self.kv_bytes_per_token: float | None = None     # from its kv_fingerprint, once seen
        self.served = 0
        self.failed = 0
        self.subscriber_stats: Callable[[], dict[str, Any]] | None = None

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def load_only(self) -> bool:
        """True while any alarm says the worker's cache signal is not to be trusted."""
        return bool(self.alarms)

    def in_flight(self) -> int:
        return len(self.tickets)

    def reported_load(self) -> LoadSnapshot:
        """Its last load snapshot less what the router has seen finish since: requests sent
        before the snapshot and closed after it (running first, then waiting) and their
        prompt blocks' share of its KV usage. The next poll would not count them either.
        A session's next turn comes right after its last one finished, on the worker that
        served it: the plain snapshot would show that worker busy to exactly that turn."""
        n, load = self.finished_since_load, self.load
        if not n:
            return load
        running = max(0, load.running - n)
        waiting = max(0, load.waiting - max(0, n - load.running))
        cap = self.description.kv_capacity_blocks if self.description is not None else 0
        freed = self.finished_blocks_since_load / cap if cap > 0 else 0.0
        return replace(load, running=running, waiting=waiting,
                       kv_usage=max(0.0, load.kv_usage - freed))

    @property
    def kv_role(self) -> str | None:
        """Its KV connector's kv_role; None: no connector. A worker that is no kvloop worker
        does not say: it is taken to do what its role needs (`kv_both`)."""
        d = self.description
        if d is None:
            return "kv_both"
        return d.kv_transfer.kv_role if d.kv_transfer is not None else None

    @property
    def caches_prefixes(self) -> bool:
        """Whether its blocks are cached and published (unknown for a non-kvloop worker)."""
        return self.description is None or self.description.enable_prefix_caching

    def prefilling(self) -> list[Ticket]:
        return [t for t in self.open_tickets() if t.first_token_at is None]

    def open_tickets(self) -> list[Ticket]:
        """Its tickets now (a copy: decisions may run on another thread than the closes)."""
        return list(self.tickets.values())


class Registry:
    """The set of workers and their states; thread-safe."""

    def __init__(self, cfg: LivenessConfig, clock: Callable[[], float] = time.monotonic,
                 pd_failures_to_skip: int = 3):
        self.cfg = cfg
        self.pd_failures_to_skip = pd_failures_to_skip
        self._clock = clock
        self._lock = threading.RLock()
        self._workers: dict[str, WorkerState] = {}
        self._ids = itertools.count(1)

    # --- membership -----------------------------------------------------------------------
    def add(self, spec: WorkerSpec) -> WorkerState:
        with self._lock:
            if spec.name in self._workers:
                raise ValueError(f"worker {spec.name} is already registered")
            w = WorkerState(spec, self.cfg, self._clock())
            self._workers[spec.name] = w
            return w

    def remove(self, name: str) -> WorkerState | None:
        with self._lock:
            return self._workers.pop(name, None)

    def get(self, name: str) -> WorkerState | None:
        return self._workers.get(name)

    def all(self) -> list[WorkerState]:
        with self._lock:
            return list(self._workers.values())

    def usable(self, roles: tuple[str, ...] = ROLES
               ) -> list[WorkerState]:
        """Workers that are up, not draining, and serve one of `roles`."""
        return [w for w in self.all() if w.up and not w.load.draining and w.role in roles]

    # --- liveness -------------------------------------------------------------------------
    def mark_up(self, name: str, description: WorkerDescription | None) -> None:
        with self._lock:
            w = self._workers[name]
            w.description = description
            w.up = True
            w.down_reason = ""

    def note_unreachable(self, name: str, reason: str) -> None:
        """A registered worker that has never answered (stays down, with the reason)."""
        with self._lock:
            w = self._workers.get(name)
            if w is not None and not w.up:
                w.down_reason = reason

    def mark_down(self, name: str, reason: str) -> bool:
        """Returns True if the worker was up (so the caller clears its index entries)."""
        with self._lock:
            w = self._workers.get(name)
            if w is None or not w.up:
                return False
            w.up = False
            w.down_reason = reason
            w.first_unsignalled_send = None
            w.first_unstored_send = None
            w.verifier.reset()
            w.alarms.pop(SILENT, None)
            return True

    def refresh_adapters(self, name: str, desc: WorkerDescription) -> None:
        """A worker of the same epoch described itself again: take its LoRA adapters (the
        one part of a description that changes without a restart)."""
        w = self._workers.get(name)
        if w is not None and w.description is not None \
                and w.description.lora_adapters != desc.lora_adapters:
            w.description = msgspec.structs.replace(w.description,
                                                    lora_adapters=list(desc.lora_adapters))

    def set_load(self, name: str, load: LoadSnapshot) -> None:
        w = self._workers.get(name)
        if w is not None:
            w.load = load
            w.finished_since_load = w.finished_blocks_since_load = 0

    def mark_draining(self, name: str) -> None:
        """`name` refused a request because it drains: nothing more goes there until a poll
        of its /metrics (or its restart) says otherwise."""
        w = self._workers.get(name)
        if w is not None:
            w.load = replace(w.load, draining=True)

    def note_signal(self, name: str, heartbeat: bool = False) -> None:
        """An event batch (or a heartbeat) arrived from `name`."""
        w = self._workers.get(name)
        if w is None:
            return
        now = self._clock()
        if heartbeat:
            w.events.last_heartbeat_at = now
        else:
            w.events.last_event_at = now
        w.first_unsignalled_send = None

    def restart_liveness(self, name: str) -> None:
        """A new subscription (or epoch): the silence window starts again."""
        w = self._workers.get(name)
        if w is not None:
            w.subscribed_at = self._clock()
            w.first_unsignalled_send = None
            w.first_unstored_send = None
            w.epoch_mismatch_since = None
            w.verifier.reset()

    # --- tickets --------------------------------------------------------------------------
    def open_ticket(self, name: str, prompt_tokens: int, uncached_tokens: int,
                    predicted_tokens: int, expects_event: bool, verify: bool = True,
                    tiers: tuple[str, ...] = ()) -> Ticket:
        with self._lock:
            w = self._workers[name]
            now = self._clock()
            t = Ticket(next(self._ids), name, prompt_tokens, uncached_tokens,
                       predicted_tokens, now, verify=verify, tiers=tiers)
            w.tickets[t.request_id] = t
            if expects_event and w.first_unsignalled_send is None:
                w.first_unsignalled_send = now
            if expects_event and w.role == "prefill" and w.first_unstored_send is None:
                w.first_unstored_send = now
                w.stored_at_unstored_send = w.events.stored_blocks
            return t

    def first_token(self, t: Ticket) -> None:
        if t.first_token_at is None:
            t.first_token_at = self._clock()

    def serve_locally(self, t: Ticket) -> None:
        """A decode leg whose prompt will not be pulled: it prefills what it lacks itself,
        and its reported hit is its own again."""
        t.uncached_tokens = t.prompt_tokens - t.predicted_tokens
        t.verify = True

    def drop_ticket(self, t: Ticket) -> None:
        """A leg that was never sent: forget its ticket without counting it."""
        with self._lock:
            t.closed = True
            w = self._workers.get(t.worker)
            if w is not None:
                w.tickets.pop(t.request_id, None)

    def close_ticket(self, t: Ticket, ok: bool) -> bool:
        """Close `t` (its worker's in-flight count drops); False if it was closed already."""
        with self._lock:
            if t.closed:
                return False
            t.closed = True
            w = self._workers.get(t.worker)
            if w is None:
                return True
            w.tickets.pop(t.request_id, None)
            if t.sent_at < w.load.at:        # its last snapshot counted it: no longer
                w.finished_since_load += 1
                bs = w.description.block_size if w.description is not None else 0
                w.finished_blocks_since_load += -(-t.prompt_tokens // bs) if bs > 0 else 0
            if ok:
                w.served += 1
            else:
                w.failed += 1
            return True

    # --- alarms ---------------------------------------------------------------------------
    def raise_alarm(self, name: str, kind: str, detail: str) -> Alarm | None:
        """Set alarm `kind` on `name`; returns it if it is new (the caller logs it)."""
        with self._lock:
            w = self._workers.get(name)
            if w is None or kind in w.alarms:
                return None
            alarm = Alarm(kind, name, detail, self._clock())
            w.alarms[kind] = alarm
            return alarm

    def clear_alarm(self, name: str, kind: str) -> Alarm | None:
        with self._lock:
            w = self._workers.get(name)
            return None if w is None else w.alarms.pop(kind, None)

    def evaluate(self) -> tuple[list[Alarm], list[Alarm]]:
        """Re-check the time- and sample-based alarms of every worker.

        Returns (raised, cleared). `config_mismatch` and `no_event_source` are set and
        cleared by registration, not here.
        """
        raised: list[Alarm] = []
        cleared: list[Alarm] = []
        now = self._clock()
        epochs = {w.description.epoch: w for w in self.all()
                  if w.up and w.description is not None and w.description.epoch}
        for w in self.all():
            if not w.up:
                continue
            self._judge(w, WRONG_EVENT_SOURCE, self._foreign_events(w, now, epochs), raised,
                        cleared)
            self._judge(w, SILENT, self._silence(w, now), raised, cleared)
            self._judge(w, NO_STORED_BLOCKS, self._unstored(w, now), raised, cleared)
            self._judge(w, PREFILL_FAILING, self._failing(w, now), raised, cleared)
            verdict = w.verifier.verdict()
            for kind in (PREDICTIONS_MISS, UNPREDICTED_HITS):
                detail = verdict[1] if verdict is not None and verdict[0] == kind else None
                self._judge(w, kind, detail, raised, cleared)
        return raised, cleared

    def _judge(self, w: WorkerState, kind: str, detail: str | None,
               raised: list[Alarm], cleared: list[Alarm]) -> None:
        if detail is not None:
            a = self.raise_alarm(w.name, kind, detail)
            if a is not None:
                raised.append(a)
        else:
            a = self.clear_alarm(w.name, kind)
            if a is not None:
                cleared.append(a)

    def _silence(self, w: WorkerState, now: float) -> str | None:
        """Detail of the `silent` alarm, or None while the worker is not silent."""
        if NO_EVENT_SOURCE in w.alarms or w.first_unsignalled_send is None:
            return None
        quiet = now - max(w.first_unsignalled_send, w.subscribed_at)
        if quiet < self.cfg.window_s:
            return None
        last = max((t for t in (w.events.last_event_at, w.events.last_heartbeat_at)
                    if t is not None), default=None)
        ago = "never" if last is None else f"{now - last:.1f}s ago"
        return (f"served traffic but sent no KV event or heartbeat for {quiet:.1f}s "
                f"(window {self.cfg.window_s:g}s; last signal: {ago})")

    def _foreign_events(self, w: WorkerState, now: float,
                        epochs: dict[str, WorkerState]) -> str | None:
        """Detail of `wrong_event_source`, or None. A kvloop publisher names its worker's
        epoch in every heartbeat: another registered worker's epoch is wrong wiring at once;
        an unknown one counts after a window (a restart shows its new epoch to the
        subscriber before the poller re-reads the worker)."""
        stats = w.subscriber_stats() if w.subscriber_stats is not None else {}
        heard = stats.get("current_epoch")
        own = w.description.epoch if w.description is not None else None
        if heard is None or own is None or heard == own:
            w.epoch_mismatch_since = None
            return None
        other = epochs.get(heard)
        if other is None:
            if w.epoch_mismatch_since is None:
                w.epoch_mismatch_since = now
            if now - w.epoch_mismatch_since < self.cfg.window_s:
                return None
            whose = f"an unknown publisher's (epoch {heard})"
        else:
            whose = f"worker {other.name}'s (role {other.role}, epoch {heard})"
        return (f"{w.role} worker: the KV events it is subscribed to are {whose}, not its "
                f"own (epoch {own}); they are refused, so routing to it is load-only")

    def _unstored(self, w: WorkerState, now: float) -> str | None:
        """Detail of `no_stored_blocks` (a prefill worker whose events store nothing), or
        None. A silent worker has the stronger alarm; a BlockStored since the first prefill
        that awaited one clears it."""
        if w.first_unstored_send is None or SILENT in w.alarms:
            return None
        if w.events.stored_blocks > w.stored_at_unstored_send:
            w.first_unstored_send = None
            return None
        quiet = now - max(w.first_unstored_send, w.subscribed_at)
        if quiet < self.cfg.window_s:
            return None
        storing = sorted(x.name for x in self.all()
                         if x.role != "prefill" and x.up and x.events.stored_blocks)
        also = (f"; BlockStored events arrive only from {', '.join(storing)} (not prefill "
                "workers)" if storing else "")
        return (f"prefill worker served prefills for {quiet:.1f}s but none of its KV events "
                f"stored a block (window {self.cfg.window_s:g}s; {w.events.batches} event "
                f"batches, none storing){also}: the prefill role's index stays empty, so "
                "prefill routing to it is load-only")

    def _failing(self, w: WorkerState, now: float) -> str | None:
        """Detail of `prefill_failing` while its failure streak is recent, else None."""
        last = w.last_prefill_failure
        limit = self.pd_failures_to_skip
        if w.prefill_failures < limit or last is None:
            return None
        if now - last >= self.cfg.window_s:
            w.prefill_failures = limit - 1   # one more try; one more failure re-raises
            return None
        return (f"its last {w.prefill_failures} prefill legs failed; requests are served "
                f"decode-only without it for {self.cfg.window_s:g}s")

    # --- P/D ------------------------------------------------------------------------------
    def set_kv_bytes_per_token(self, name: str, value: float) -> None:
        w = self._workers.get(name)
        if w is not None:
            w.kv_bytes_per_token = value

    def prefill_frozen(self, name: str) -> None:
        """A prefill leg on `name` timed out: its failure streak reaches the limit at once,
        so it is left out of remote prefills for one window (`prefill_failing`)."""
        w = self._workers.get(name)
        if w is not None:
            w.prefill_failures = max(w.prefill_failures, self.pd_failures_to_skip)
            w.last_prefill_failure = self._clock()

    def prefill_leg_done(self, name: str, ok: bool) -> None:
        """A prefill leg on `name` ended: a success ends its failure streak."""
        w = self._workers.get(name)
        if w is None:
            return
        if ok:
            w.prefill_failures = 0
        else:
            w.prefill_failures += 1
            w.last_prefill_failure = self._clock()
