"""Every Prometheus metric of the router, in one place (one registry per router).

Counters and histograms are updated as things happen; per-worker gauges (liveness, index
size, alarms) are read from the registry and the index at scrape time, so they are never
stale and need no bookkeeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvloop.router.registry import ALARMS

if TYPE_CHECKING:
    from kvloop.router.index import BlockIndex
    from kvloop.router.registry import Registry, WorkerState

# no `_created` series, as on the workers (kvloop/server/metrics.py)
disable_created_metrics()  # type: ignore[no-untyped-call]

P = "kvloop_router_"
FRACTION_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
LATENCY_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1)
PREFILL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    """The router's metrics; `render()` gives the Prometheus text exposition."""

    def __init__(self, registry: Registry, index: BlockIndex,
                 clock: Callable[[], float] = time.monotonic):
        self.prom = CollectorRegistry()
        r = self.prom
        self.decisions = Counter(P + "decisions", "Routing decisions by policy and reason",
                                 ["policy", "reason"], registry=r)
        self.requests = Counter(P + "requests", "Requests forwarded, by worker and outcome",
                                ["worker", "outcome"], registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens routed",
                                     ["worker"], registry=r)
        self.predicted_hit = Counter(P + "predicted_hit_tokens",
                                     "Cached prompt tokens the router predicted",
                                     ["worker"], registry=r)
        self.actual_hit = Counter(P + "actual_hit_tokens",
                                  "Cached prompt tokens the worker reported (usage)",
                                  ["worker"], registry=r)
        self.alarms_raised = Counter(P + "alarms_raised", "Alarms raised",
                                     ["worker", "alarm"], registry=r)
        self.pd_decisions = Counter(P + "pd_decisions",
                                    "P/D: requests prefilled remotely or locally, and why",
                                    ["decision", "reason"], registry=r)
        self.pd_fallbacks = Counter(P + "pd_fallbacks",
                                    "P/D: prefill legs that failed, so the request was "
                                    "served decode-only", ["worker", "reason"], registry=r)
        self.pd_prefill_seconds = Histogram(P + "pd_prefill_seconds",
                                            "P/D: time of each prefill leg (request to answer)",
                                            buckets=PREFILL_BUCKETS, registry=r)
        self.migrations = Counter(P + "migrations", "Streams moved mid-stream to another "
                                  "worker (--migration-limit), by the worker that failed and "
                                  "outcome (migrated, or failed: no worker took it)",
                                  ["worker", "outcome"], registry=r)
        self.match_fraction = Histogram(P + "match_fraction",
                                        "Predicted cached share of each routed prompt",
                                        buckets=FRACTION_BUCKETS, registry=r)
        self.decision_seconds = Histogram(P + "decision_seconds",
                                          "Time to tokenize-hash-score-pick one request",
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.untokenized = Counter(P + "untokenized_requests",
                                   "Text and chat requests routed by load only: the router "
                                   "has no tokenizer for their model (/health says why)",
                                   ["model"], registry=r)
        self.prompts_refused = Counter(P + "prompts_too_long",
                                       "Requests refused before routing: the prompt fits "
                                       "no worker's context (max_model_len)", registry=r)
        self.tokenizer_missing = Gauge(P + "tokenizer_missing",
                                       "1 while the router cannot get the model's tokenizer",
                                       ["model"], registry=r)
        r.register(_StateCollector(registry, index, clock))

    def render(self) -> bytes:
        return generate_latest(self.prom)

    @staticmethod
    def pd_counts(counter: Counter) -> dict[str, float]:
        """A counter's samples as {"label/label": value} (for /health)."""
        out: dict[str, float] = {}
        for metric in counter.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    out["/".join(sample.labels.values())] = sample.value
        return out


class _StateCollector(Collector):
    """Gauges read at scrape time from the registry and the index."""

    def __init__(self, registry: Registry, index: BlockIndex, clock: Callable[[], float]):
        self.registry = registry
        self.index = index
        self.clock = clock

    def collect(self) -> Iterator[Any]:
        yield _gauge("index_blocks", "(block, worker) entries in the prefix index",
                     [([], self.index.num_blocks())])
        yield _gauge("index_hashes", "Distinct block hashes in the prefix index",
                     [([], self.index.num_hashes())])
        yield _gauge("index_provisional", "Provisional (not yet confirmed) entries",
                     [([], self.index.num_provisional())])
        yield _gauge("index_degraded", "1 while the index reports a problem (/health "
                     "names it: a shared index unreachable, resyncing or empty)",
                     [([], float(bool(self.index.alarms())))])
        workers = self.registry.all()
        yield from self._worker_gauges(workers)
        yield from self._event_counters(workers)
        yield from self._tier_families(workers)

    def _tier_families(self, workers: list[WorkerState]) -> Iterator[Any]:
        """Per worker and tier: index entries, predicted and confirmed hit tokens, and the
        feed's lower-tier interop counts (placeholders mapped/ignored, skipped blocks)."""
        blocks = GaugeMetricFamily(P + "worker_tier_blocks", "Blocks the index attributes "
                                   "to the worker, by tier (external: its shared store)",
                                   labels=["worker", "tier"])
        pred = CounterMetricFamily(P + "tier_predicted_hit_tokens", "Cached prompt tokens "
                                   "the router predicted, by the tier predicted to serve them",
                                   labels=["worker", "tier"])
        found = CounterMetricFamily(P + "tier_found_hit_tokens", "Of those, the tokens the "
                                    "worker then reported cached", labels=["worker", "tier"])
        interop = CounterMetricFamily(P + "worker_tier_events", "Lower-tier KV-event blocks "
                                      "by outcome", labels=["worker", "outcome"])
        for w in workers:
            for tier, n in self.index.tier_blocks(w.name).items():
                blocks.add_metric([w.name, tier], n)
            for tier, n in w.verifier.predicted_by_tier.items():
                pred.add_metric([w.name, tier], n)
                found.add_metric([w.name, tier], w.verifier.found_by_tier.get(tier, 0))
            e = w.events
            for outcome, n in (("placeholder_mapped", e.placeholders_mapped),
                               ("placeholder_ignored", e.placeholders_ignored),
                               ("block_size_skipped", e.tier_size_skipped),
                               ("unknown_medium", e.unknown_medium),
                               *((f"stored_{t}", v) for t, v in e.tier_stored.items())):
                interop.add_metric([w.name, outcome], n)
        yield from (blocks, pred, found, interop)

    def _worker_gauges(self, workers: list[WorkerState]) -> Iterator[Any]:
        now = self.clock()
        rows: dict[str, list[tuple[list[str], float]]] = {
            "worker_up": [], "worker_in_flight": [], "worker_index_blocks": [],
            "worker_degraded": [], "worker_last_event_age_seconds": [],
        }
        alarms: list[tuple[list[str], float]] = []
        for w in workers:
            n = w.name
            rows["worker_up"].append(([n], float(w.up)))
            rows["worker_in_flight"].append(([n], w.in_flight()))
            rows["worker_index_blocks"].append(([n], self.index.worker_blocks(n)))
            rows["worker_degraded"].append(([n], float(w.load_only)))
            last = w.events.last_event_at
            age = now - (last if last is not None else w.subscribed_at)
            rows["worker_last_event_age_seconds"].append(([n], age))
            alarms += [([n, a], float(a in w.alarms)) for a in ALARMS]
        helps = {
            "worker_up": "1 if the worker answers",
            "worker_in_flight": "Requests the router sent that have not finished",
            "worker_index_blocks": "Blocks the index attributes to the worker",
            "worker_degraded": "1 while routing to the worker is load-only (an alarm is set)",
            "worker_last_event_age_seconds":
                "Seconds since the worker's last KV event (since subscribing if none)",
        }
        for name, samples in rows.items():
            yield _gauge(name, helps[name], samples, ["worker"])
        yield _gauge("worker_alarm", "1 while the alarm is set on the worker", alarms,
                     ["worker", "alarm"])

    def _event_counters(self, workers: list[WorkerState]) -> Iterator[Any]:
        names = ("events_received", "heartbeats", "gaps", "replays", "snapshots", "epochs",
                 "malformed", "event_batches", "stored_blocks", "removed_blocks",
                 "refused_batches")
        fams = {k: CounterMetricFamily(P + "worker_" + k, f"KV-event feed: {k}",
                                       labels=["worker"]) for k in names}
        for w in workers:
            for k, v in _event_stats(w).items():
                if k in fams:
                    fams[k].add_metric([w.name], v)
        yield from fams.values()


def _gauge(name: str, help_text: str, samples: list[tuple[list[str], float]],
           labels: list[str] | None = None) -> GaugeMetricFamily:
    fam = GaugeMetricFamily(P + name, help_text, labels=labels or [])
    for values, v in samples:
        fam.add_metric(values, float(v))
    return fam


def _event_stats(w: WorkerState) -> dict[str, float]:
    stats = dict(w.subscriber_stats()) if w.subscriber_stats is not None else {}
    e = w.events
    stats.setdefault("events_received", e.batches)
    stats.setdefault("heartbeats", 0)
    stats.update(event_batches=e.batches, stored_blocks=e.stored_blocks,
                 removed_blocks=e.removed_blocks, refused_batches=e.refused)
    return {k: float(v) for k, v in stats.items() if isinstance(v, int | float)}
