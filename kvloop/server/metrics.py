"""Every Prometheus metric of the API server, with vLLM's names, types, labels and buckets.

A vLLM Grafana dashboard works unchanged (docs/vllm-facts.md#metrics). Each server owns
its own `CollectorRegistry` (no global registry), so several servers can live in one process.

Sources: scheduler gauges and prefix-cache counters come from the engine's `SchedulerStats`
(one per step), and so do the speculative-decoding counters (only with speculative decoding
on, positions 0..k-1 made up front, as vLLM's); request counters and latency histograms come
from `RequestTimes`, filled by the engine client as outputs arrive, and observed once when a
request finishes.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from kvloop.front.drain import DRAINING_METRIC
from kvloop.wire import (
    KV_FAILURE_REASONS,
    KVTransferStats,
    LoRAStats,
    SchedulerStats,
    SpecDecodingStats,
)

# vLLM serves its metrics through prometheus_client's multiprocess collector, which has no
# `_created` series; a process-wide switch, so the router's exposition matches too.
disable_created_metrics()  # type: ignore[no-untyped-call]

REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
# kvloop:kv_transfer_time_seconds: the buckets of vLLM's vllm:nixl_xfer_time_seconds
# (docs/vllm-facts.md#openai-server)
KV_TRANSFER_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0,
                            5.0)
KV_TRANSFER_SIDES = ("send", "recv")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's request-token buckets: 1, 2, 5, 10, 20, 50, ... up to `max_value`."""
    out: list[int] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10 ** exp
            if v > max_value:
                return out
            out.append(v)
        exp += 1


@dataclass
class RequestTimes:
    """One engine request's life as the API server saw it (monotonic seconds)."""

    arrival: float
    num_prompt_tokens: int
    max_tokens: int | None
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    num_external_cached_tokens: int = 0    # of num_cached_tokens: loaded (a tier, P's hit)
    num_preemptions: int = 0


class ServerMetrics:
    """The metrics of one API server + engine (labels `model_name`, `engine`)."""

    def __init__(self, model_name: str, max_model_len: int, engine_index: int = 0,
                 cache_info: dict[str, str] | None = None, num_speculative_tokens: int = 0,
                 kv_transfer: bool = False):
        """`num_speculative_tokens` k > 0: speculative decoding is on (its counters exist);
        `kv_transfer`: the engine has a KV connector (its metrics exist)."""
        self.registry = CollectorRegistry()
        self._labels = {"model_name": model_name, "engine": str(engine_index)}
        self._model_name = model_name
        names = ["model_name", "engine"]
        self._build_gauges(names, cache_info or {}, str(engine_index))
        self._build_counters(names)
        self._build_histograms(names, max_model_len)
        self._build_spec_counters(names, num_speculative_tokens)
        # the KV connector's metrics, on a server whose engine has one
        self.kv_transfer = KVTransferMetrics(self) if kv_transfer else None
        self.lora_info: Gauge | None = None     # built at the first LoRA stats (--enable-lora)

    # --- construction ---------------------------------------------------------------------
    @property
    def labels(self) -> dict[str, str]:
        return dict(self._labels)

    def _gauge(self, name: str, doc: str, labels: list[str]) -> Gauge:
        return Gauge(name, doc, labels, registry=self.registry, multiprocess_mode="mostrecent")

    def _build_gauges(self, names: list[str], cache_info: dict[str, str], engine: str) -> None:
        lab = self._labels
        self.running = self._gauge("vllm:num_requests_running",
                                   "Number of requests in model execution batches.",
                                   names).labels(**lab)
        self.waiting = self._gauge("vllm:num_requests_waiting",
                                   "Number of requests waiting to be processed.",
                                   names).labels(**lab)
        # labels: capacity, deferred (vLLM's) and each of the engine's waiting reasons
        self.waiting_by_reason = self._gauge(
            "vllm:num_requests_waiting_by_reason", "Number of requests waiting, by reason "
            "(capacity: for room; deferred: held by any other reason, which the other "
            "labels name).", names + ["reason"])
        for reason in ("capacity", "deferred"):
            self.waiting_by_reason.labels(**lab, reason=reason).set(0)
        sleep = self._gauge("vllm:engine_sleep_state", "Engine sleep state (1 = current).",
                            names + ["sleep_state"])
        for state in ("awake", "weights_offloaded", "discard_all"):
            sleep.labels(**lab, sleep_state=state).set(1 if state == "awake" else 0)
        self.kv_usage = self._gauge("vllm:kv_cache_usage_perc",
                                    "KV-cache usage. 1 means 100 percent usage.",
                                    names).labels(**lab)
        self.draining = self._gauge(DRAINING_METRIC, "1 while the server drains (it refuses "
                                    "new requests and finishes those it holds).",
                                    names).labels(**lab)
        if cache_info:
            info = self._gauge("vllm:cache_config_info", "Information of the LLMEngine "
                               "CacheConfig", sorted(cache_info) + ["engine"])
            info.labels(**cache_info, engine=engine).set(1)

    def _counter(self, name: str, doc: str, labels: list[str] | None = None) -> Counter:
        return Counter(name, doc, labels or ["model_name", "engine"], registry=self.registry)

    def _build_counters(self, names: list[str]) -> None:
        lab = self._labels
        self.preemptions = self._counter("vllm:num_preemptions",
                                         "Cumulative number of preemption from the engine."
                                         ).labels(**lab)
        self.prefix_queries = self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.").labels(**lab)
        self.prefix_hits = self._counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.").labels(**lab)
        self.prompt_tokens = self._counter("vllm:prompt_tokens",
                                           "Number of prefill tokens processed.").labels(**lab)
        by_source = self._counter("vllm:prompt_tokens_by_source",
                                  "Number of prompt tokens by source.", names + ["source"])
        self.prompt_compute = by_source.labels(**lab, source="local_compute")
        self.prompt_cache_hit = by_source.labels(**lab, source="local_cache_hit")
        self.prompt_external = by_source.labels(**lab, source="external_kv_transfer")
        self.prompt_cached = self._counter("vllm:prompt_tokens_cached",
                                           "Number of cached prompt tokens (local + external)."
                                           ).labels(**lab)
        self.generation_tokens = self._counter("vllm:generation_tokens",
                                               "Number of generation tokens processed."
                                               ).labels(**lab)
        success = self._counter("vllm:request_success", "Count of successfully processed "
                                "requests.", names + ["finished_reason"])
        self.success = {r: success.labels(**lab, finished_reason=r) for r in FINISH_REASONS}
        self.rejections = self._counter("vllm:admission_rejections",
                                        "Requests rejected at admission.",
                                        ["model_name", "reason"])

    def _build_spec_counters(self, names: list[str], k: int) -> None:
        self.spec: list[Counter] | None = None
        self.spec_per_pos: list[Counter] = []
        if k <= 0:
            return
        lab = self._labels
        self.spec = [self._counter(name, doc).labels(**lab) for name, doc in (
            ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
            ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
            ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."))]
        per_pos = self._counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                "Accepted tokens per draft position.", names + ["position"])
        self.spec_per_pos = [per_pos.labels(**lab, position=str(i)) for i in range(k)]

    def _hist(self, name: str, doc: str, buckets: object) -> Histogram:
        h = Histogram(name, doc, ["model_name", "engine"], registry=self.registry,
                      buckets=list(buckets))  # type: ignore[call-overload]
        return h.labels(**self._labels)

    def _build_histograms(self, names: list[str], max_model_len: int) -> None:
        tok = build_1_2_5_buckets(max_model_len)
        self.h_prompt = self._hist("vllm:request_prompt_tokens",
                                   "Number of prefill tokens processed.", tok)
        self.h_generation = self._hist("vllm:request_generation_tokens",
                                       "Number of generation tokens processed.", tok)
        self.h_max_generation = self._hist("vllm:request_max_num_generation_tokens",
                                           "Histogram of maximum number of requested "
                                           "generation tokens.", tok)
        self.h_max_tokens = self._hist("vllm:request_params_max_tokens",
                                       "Histogram of the max_tokens request parameter.", tok)
        self.h_prefill_kv = self._hist("vllm:request_prefill_kv_computed_tokens",
                                       "Histogram of new KV tokens computed during prefill "
                                       "(excluding cached tokens).", tok)
        self.h_iteration = self._hist("vllm:iteration_tokens_total",
                                      "Histogram of number of tokens per engine_step.",
                                      ITERATION_TOKEN_BUCKETS)
        self.h_n = self._hist("vllm:request_params_n",
                              "Histogram of the n request parameter.", N_BUCKETS)
        self.h_ttft = self._hist("vllm:time_to_first_token_seconds",
                                 "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.h_itl = self._hist("vllm:inter_token_latency_seconds",
                                "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.h_tpot = self._hist("vllm:request_time_per_output_token_seconds",
                                 "Histogram of time_per_output_token_seconds per request.",
                                 ITL_BUCKETS)
        lat = REQUEST_LATENCY_BUCKETS
        self.h_e2e = self._hist("vllm:e2e_request_latency_seconds",
                                "Histogram of e2e request latency in seconds.", lat)
        self.h_queue = self._hist("vllm:request_queue_time_seconds",
                                  "Histogram of time spent in WAITING phase for request.", lat)
        self.h_inference = self._hist("vllm:request_inference_time_seconds",
                                      "Histogram of time spent in RUNNING phase for request.",
                                      lat)
        self.h_prefill = self._hist("vllm:request_prefill_time_seconds",
                                    "Histogram of time spent in PREFILL phase for request.", lat)
        self.h_decode = self._hist("vllm:request_decode_time_seconds",
                                   "Histogram of time spent in DECODE phase for request.", lat)
        self.h_preemptions = self._hist("vllm:request_num_preemptions",
                                        "Number of preemptions per request.",
                                        PREEMPTION_BUCKETS)

    # --- updates --------------------------------------------------------------------------
    def observe_scheduler_stats(self, stats: SchedulerStats) -> None:
        """One engine step's gauges and prefix-cache counters (preempted lookups excluded)."""
        self.running.set(stats.num_running_reqs)
        self.waiting.set(stats.num_waiting_reqs)
        for reason, n in (stats.num_waiting_by_reason or {}).items():
            self.waiting_by_reason.labels(**self._labels, reason=reason).set(n)
        self.kv_usage.set(stats.kv_cache_usage)
        if stats.num_preemptions:
            self.preemptions.inc(stats.num_preemptions)
        pcs = stats.prefix_cache_stats
        if pcs.queries:
            self.prefix_queries.inc(pcs.queries)
        if pcs.hits:
            self.prefix_hits.inc(pcs.hits)
        if stats.spec_decoding_stats is not None:
            self.observe_spec_decoding(stats.spec_decoding_stats)
        if stats.kv_transfer is not None and self.kv_transfer is not None:
            self.kv_transfer.observe(stats.kv_transfer)
        if stats.lora is not None:
            self.observe_lora(stats.lora)

    def observe_lora(self, lora: LoRAStats) -> None:
        """vLLM's `vllm:lora_requests_info`: one series whose labels name the adapters of the
        running and waiting requests (comma-joined) and --max-loras, its value the time of
        the update (a scraper takes the newest); the previous series is dropped, so the
        series count stays one whatever names clients use."""
        if self.lora_info is None:
            self.lora_info = self._gauge(
                "vllm:lora_requests_info", "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        self.lora_info.clear()
        self.lora_info.labels(max_lora=str(lora.max_lora),
                              waiting_lora_adapters=",".join(lora.waiting_lora_adapters),
                              running_lora_adapters=",".join(lora.running_lora_adapters),
                              ).set_to_current_time()

    def observe_spec_decoding(self, s: SpecDecodingStats) -> None:
        """One step's drafts (ignored when this server was built without speculation)."""
        if self.spec is None:
            return
        drafts, tokens, accepted = self.spec
        drafts.inc(s.num_drafts)
        tokens.inc(s.num_draft_tokens)
        accepted.inc(s.num_accepted_tokens)
        for counter, n in zip(self.spec_per_pos, s.num_accepted_tokens_per_pos, strict=False):
            counter.inc(n)

    def observe_iteration(self, num_tokens: int) -> None:
        if num_tokens:
            self.h_iteration.observe(num_tokens)

    def observe_first_token(self, t: RequestTimes) -> None:
        """A request's first output: TTFT and its prompt tokens (by source)."""
        assert t.first_token is not None
        self.h_ttft.observe(max(t.first_token - t.arrival, 0.0))
        cached = min(t.num_cached_tokens, t.num_prompt_tokens)
        external = min(t.num_external_cached_tokens, cached)
        self.prompt_tokens.inc(t.num_prompt_tokens)
        self.prompt_compute.inc(t.num_prompt_tokens - cached)
        self.prompt_cache_hit.inc(cached - external)
        self.prompt_external.inc(external)
        self.prompt_cached.inc(cached)

    def observe_tokens(self, num_new: int, itl: float | None) -> None:
        self.generation_tokens.inc(num_new)
        if itl is not None:
            self.h_itl.observe(max(itl, 0.0))

    def observe_finished(self, t: RequestTimes, reason: str, now: float) -> None:
        """Counters and latency histograms of a finished request (vLLM's derivations)."""
        self.success[reason if reason in self.success else "error"].inc()
        self.h_e2e.observe(max(now - t.arrival, 0.0))
        self.h_prompt.observe(t.num_prompt_tokens)
        self.h_generation.observe(t.num_generation_tokens)
        self.h_preemptions.observe(t.num_preemptions)
        if t.max_tokens is not None:
            self.h_max_tokens.observe(t.max_tokens)
            self.h_max_generation.observe(t.max_tokens)
        if t.first_scheduled is not None:
            self.h_queue.observe(max(t.first_scheduled - t.arrival, 0.0))
            self.h_prefill_kv.observe(max(t.num_prompt_tokens - t.num_cached_tokens, 0))
            if t.last_token is not None and t.first_token is not None:
                self.h_inference.observe(max(t.last_token - t.first_scheduled, 0.0))
                self.h_prefill.observe(max(t.first_token - t.first_scheduled, 0.0))
                decode = max(t.last_token - t.first_token, 0.0)
                self.h_decode.observe(decode)
                if t.num_generation_tokens > 1:
                    self.h_tpot.observe(decode / (t.num_generation_tokens - 1))

    def observe_n(self, n: int) -> None:
        self.h_n.observe(n)

    def reject(self, reason: str) -> None:
        self.rejections.labels(model_name=self._model_name, reason=reason).inc()

    def value(self, sample: str) -> float:
        """The current value of one sample of this server's labels (a counter's `..._total`,
        a gauge); 0.0 while it has none."""
        v = self.registry.get_sample_value(sample, self._labels)
        return 0.0 if v is None else v

    def spec_counts(self) -> tuple[float, ...]:
        """The speculative-decoding counters now: drafts, draft tokens, accepted tokens, then
        accepted tokens per position; () without speculative decoding."""
        if self.spec is None:
            return ()
        totals = [self.value(f"vllm:spec_decode_num_{n}_total")
                  for n in ("drafts", "draft_tokens", "accepted_tokens")]
        per_pos = [self.registry.get_sample_value(
            "vllm:spec_decode_num_accepted_tokens_per_pos_total",
            {**self._labels, "position": str(i)}) or 0.0 for i in range(len(self.spec_per_pos))]
        return (*totals, *per_pos)

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)


class KVTransferMetrics:
    """The KV connector's metrics (docs/disaggregation.md section 5): kvloop's names, and
    vLLM's connector prefix-cache counters, in tokens. Every series exists from the start, at
    0 (each side, each failure reason), so a dashboard's rate() sees the first transfer."""

    def __init__(self, m: ServerMetrics):
        lab, names = m.labels, list(m.labels)
        transfers = m._counter("kvloop:kv_transfers", "KV transfers: Reads served (side send, "
                               "prefill worker), loads finished with their blocks (side recv, "
                               "decode worker).", names + ["side"])
        nbytes = m._counter("kvloop:kv_transfer_bytes", "KV bytes transferred, by side.",
                            names + ["side"])
        self.transfers = {s: transfers.labels(**lab, side=s) for s in KV_TRANSFER_SIDES}
        self.bytes = {s: nbytes.labels(**lab, side=s) for s in KV_TRANSFER_SIDES}
        self._failures = m._counter("kvloop:kv_transfer_failures",
                                    "Failed KV loads (decode worker), by reason.",
                                    names + ["reason"])
        self._labels = lab
        for reason in KV_FAILURE_REASONS:
            self._failures.labels(**lab, reason=reason)
        self.expired = m._counter("kvloop:kv_expired_requests",
                                  "Held requests whose lease expired before a decode worker "
                                  "said Done (prefill worker).").labels(**lab)
        self.h_time = m._hist("kvloop:kv_transfer_time_seconds",
                              "Histogram of KV load time, admission to completion (decode "
                              "worker), in seconds.", KV_TRANSFER_TIME_BUCKETS)
        self.held = m._gauge("kvloop:kv_held_requests", "Finished requests whose blocks are "
                             "held for a decode worker (prefill worker).", names).labels(**lab)
        self.loading = m._gauge("kvloop:kv_loading_requests", "Requests waiting for their KV "
                                "from a prefill worker (decode worker).", names).labels(**lab)
        self.external_queries = m._counter(
            "vllm:external_prefix_cache_queries", "External prefix cache queries from KV "
            "connector cross-instance cache sharing, in terms of number of queried tokens."
        ).labels(**lab)
        self.external_hits = m._counter(
            "vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector "
            "cross-instance cache sharing, in terms of number of cached tokens.").labels(**lab)

    def observe(self, kv: KVTransferStats) -> None:
        """One step's connector counters, and its two gauges."""
        self.held.set(kv.held_requests)
        self.loading.set(kv.loading_requests)
        for side, n, b in (("send", kv.transfers_sent, kv.bytes_sent),
                           ("recv", kv.transfers_received, kv.bytes_received)):
            if n:
                self.transfers[side].inc(n)
            if b:
                self.bytes[side].inc(b)
        for seconds in kv.transfer_seconds:
            self.h_time.observe(max(seconds, 0.0))
        for reason, n in kv.failures.items():
            self._failures.labels(**self._labels, reason=reason).inc(n)
        if kv.expired_requests:
            self.expired.inc(kv.expired_requests)
        if kv.external_prefix_cache_queries:
            self.external_queries.inc(kv.external_prefix_cache_queries)
        if kv.external_prefix_cache_hits:
            self.external_hits.inc(kv.external_prefix_cache_hits)
