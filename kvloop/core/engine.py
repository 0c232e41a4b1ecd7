"""EngineCore: the step, in full.

    out     = scheduler.schedule()
    runner.execute_model(out)                    (the forward pass starts, in the background)
    grammar = structured_output.grammar_bitmask  (meanwhile, on this thread)
    result  = runner.sample_tokens(grammar)      (waits for the forward, masks, samples)
    (with a KV connector, around those three: bind its metadata, start loads, ...,
     wait for saves, collect `get_finished`)
    apply pending aborts            (after the forward pass, before accounting)
    outputs = scheduler.update_from_output(out, result)
    drafts  = proposer.propose(...)  -> scheduler.update_draft_token_ids   (speculative
                                        decoding only: vLLM's post-step, kvloop.core.spec_decode)
    events  = kv_cache_manager.take_events()     (one batch per step)

A runner with only `execute(out)` (the simulator) runs the first three lines as that one call
and cannot serve structured output.

Owner: the engine owns the scheduler, the KV cache manager, the block pool, the runner, the
structured-output manager (`kvloop.core.structured_output`; present when built with a
grammar backend) and the KV connector (built by whoever builds the engine:
`kvloop.kv_transfer`). Aborts may be
requested from another thread (`abort_requests`); they are applied between steps or, for a
step in flight, after its forward pass returns.

With a connector the engine also steps while requests only wait on transfers (held leases,
loads in flight), but `has_work()` is then False until the connector has news, so an idle
loop can sleep in `wait_for_work()` (or its own wait, woken by `set_wakeup`'s callback).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvloop.config import EngineConfig
from kvloop.core.block_pool import BlockPool
from kvloop.core.compile_queue import CompileLimits
from kvloop.core.hashing import BlockHasher
from kvloop.core.kv_cache_groups import FULL_ONLY
from kvloop.core.kv_cache_manager import KVCacheManager
from kvloop.core.kv_connector import KVConnector
from kvloop.core.outputs import RunnerOutput, SchedulerOutput
from kvloop.core.request import (
    NO_GRAMMAR_BACKEND,
    PoolingParams,
    Request,
    RequestStatus,
    SamplingParams,
    check_context_length,
)
from kvloop.core.runner import HybridRunner, LoRARunner, Runner, SplitRunner
from kvloop.core.scheduler import Admission, Scheduler
from kvloop.core.spec_decode import make_proposer
from kvloop.core.structured_output import (
    GrammarBackend,
    StructuredOutputManager,
    default_num_workers,
)
from kvloop.core.trace import StepRecord, StepTiming, make_step_record
from kvloop.core.waiting import AdapterSlots
from kvloop.events.types import KVEvent, KVEventBatch
from kvloop.wire import EngineCoreOutput, SchedulerStats

# How long a loop waits after a step that executed nothing while requests wait on what no
# wake-up announces (a grammar compiling, blocks to be freed): the engine process and `LLM`.
IDLE_BACKOFF_S = 0.001

logger = logging.getLogger("kvloop.engine")


@dataclass
class StepResult:
    """Everything one step produced; the only object that leaves `EngineCore.step()`."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    events: KVEventBatch | None = None
    stats: SchedulerStats | None = None
    scheduler_output: SchedulerOutput | None = None
    admissions: list[Admission] = field(default_factory=list)
    record: StepRecord | None = None
    executed: bool = False


class EngineCore:
    """Scheduler + KV cache + runner in one process, driven by `step()`.

    `grammar_backend` builds the grammar backend of structured output (called once, on the
    first constrained request); without it a constrained request is refused. It needs a
    `SplitRunner` (ValueError otherwise).
    """

    def __init__(self, config: EngineConfig, runner: Runner, num_gpu_blocks: int | None = None,
                 grammar_backend: Callable[[], GrammarBackend] | None = None,
                 connector: KVConnector | None = None):
        """`connector`: the KV connector (None: no disaggregation); the engine shuts it down."""
        self.config = config
        cc = config.cache
        self.num_gpu_blocks = num_gpu_blocks or cc.num_gpu_blocks
        self.block_pool = BlockPool(self.num_gpu_blocks, cc.enable_prefix_caching,
                                    cc.enable_kv_cache_events, cc.kv_events_int_hashes)
        groups = runner.kv_cache_groups if isinstance(runner, HybridRunner) else FULL_ONLY
        if connector is not None and len(groups) > 1:
            raise ValueError("a KV connector (disaggregation, KV tiers) needs a model of one "
                             "attention type; this model has sliding-window and full-"
                             "attention layers")
        self.kv_cache_manager = KVCacheManager(
            self.block_pool, cc.block_size, config.scheduler.max_model_len,
            cc.enable_prefix_caching, cc.watermark, groups)
        policy = config.kv_transfer.kv_load_failure_policy if config.kv_transfer else "fail"
        self.connector = connector
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager, config.log_stats,
                                   connector, policy)
        self.hasher = (BlockHasher(cc.block_size, cc.prefix_caching_hash_algo, cc.hash_seed)
                       if cc.enable_prefix_caching else None)
        self.runner = runner
        if self.scheduler.adapter_slots is not None and isinstance(runner, LoRARunner):
            self.scheduler.adapter_slots.set_reader(self._read_lora)
        self._split_runner = runner if isinstance(runner, SplitRunner) else None
        if grammar_backend is not None and self._split_runner is None:
            raise ValueError("structured output needs a runner with execute_model and "
                             "sample_tokens (a SplitRunner)")
        limits = CompileLimits(default_num_workers(),
                               timeout_s=config.grammar_compile_timeout_s)
        self.structured_output = (StructuredOutputManager(grammar_backend, limits=limits)
                                  if grammar_backend is not None else None)
        spec = config.speculative
        self.proposer = (make_proposer(spec, config.scheduler.max_model_len)
                         if spec is not None else None)
        self._pending_aborts: list[str] = []
        self._abort_lock = threading.Lock()
        self._arrivals = 0
        self._wake = threading.Event()
        if connector is not None:
            connector.set_wakeup(self._wake.set)

    # --- requests -------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt_token_ids: Sequence[int],
                     sampling_params: SamplingParams, arrival_time: float | None = None,
                     lora_name: str | None = None, client_index: int = 0,
                     pooling_params: PoolingParams | None = None) -> Request:
        """Build a Request hashed with this engine's block hasher (`pooling_params`: a
        pooling request, kvloop.pooling_params).

        Raises ContextLengthError (a ValueError) for a prompt that leaves no room in
        `max_model_len` for an output token, ValueError for an adapter when LoRA is off.
        """
        check_context_length(self.config.scheduler.max_model_len, len(prompt_token_ids))
        slots = self.scheduler.adapter_slots
        if lora_name is not None and slots is None:
            raise ValueError("LoRA is not enabled (--enable-lora)")
        lora_path = slots.hash_key(lora_name) if slots is not None and lora_name else None
        if arrival_time is None:
            self._arrivals += 1
            arrival_time = time.monotonic() + self._arrivals * 1e-9
        return Request(request_id, prompt_token_ids, sampling_params, arrival_time,
                       self.hasher, lora_name, client_index, pooling_params, lora_path)

    def add_request(self, request: Request) -> None:
        """Queue `request`; a constrained one gets its grammar (compiled in the background).
        ValueError for a constrained request when this engine has no grammar backend."""
        if request.use_structured_output:
            if self.structured_output is None:
                raise ValueError(NO_GRAMMAR_BACKEND)
            self.structured_output.grammar_init(request)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Thread-safe: queue aborts; they take effect at the next safe point."""
        with self._abort_lock:
            self._pending_aborts.extend(request_ids)
        self._wake.set()

    def _apply_aborts(self) -> list[str]:
        with self._abort_lock:
            ids, self._pending_aborts = self._pending_aborts, []
        if ids:
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        return ids

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        """Whether a step now could do anything: pending aborts, schedulable requests, or
        news from the connector (requests that only wait on transfers are not work)."""
        if self._pending_aborts:
            return True
        if self.connector is None:
            return self.scheduler.has_requests()
        return self.scheduler.has_schedulable_work() or self.connector.has_news()

    def has_transfers(self) -> bool:
        """Whether requests wait on the connector (P's held blocks, D's loads)."""
        return self.connector is not None and bool(self.connector.request_ids_in_transfer())

    def wait_for_work(self, timeout: float) -> None:
        """After a step that executed nothing: sleep until there is work (an abort, connector
        news) or `timeout` passes. Where a step could run now and still executed nothing
        (requests waiting on a grammar compile, or for blocks), a back-off of IDLE_BACKOFF_S
        (at most `timeout`) instead of a spin."""
        if not self.has_work():
            self._wake.wait(timeout)
        else:
            time.sleep(min(IDLE_BACKOFF_S, timeout))
        self._wake.clear()

    # --- the step -------------------------------------------------------------------------
    def step(self) -> StepResult:
        """One engine step. With nothing to do, returns an empty, not-executed result."""
        self._apply_aborts()
        if not self.scheduler.has_requests():   # a connector's events may still be news
            return StepResult(events=self.take_event_batch())
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        admissions = self.scheduler.last_admissions
        result, timing = self._execute(out)
        self._apply_aborts()
        sampling = self._sampling_requests(out)
        outputs = self.scheduler.update_from_output(out, result)
        self._propose_drafts(out, sampling)
        events = self.take_event_batch()
        stats = self.scheduler.make_stats() if self.config.log_stats else None
        if self.config.check_invariants:
            self.scheduler.check_invariants()
        record = make_step_record(out, admissions, outputs, time.perf_counter() - t0,
                                  self.config.scheduler.max_num_batched_tokens,
                                  self.block_pool, self.scheduler, result, timing)
        return StepResult(outputs, events, stats, out, admissions, record,
                          executed=not out.is_empty)

    def _execute(self, out: SchedulerOutput) -> tuple[RunnerOutput, StepTiming]:
        """The runner's step inside the connector's worker-side calls (vLLM's order)."""
        connector = self.connector
        if connector is None:
            return self._run(out)
        connector.bind_connector_metadata(out.kv_connector_metadata)
        connector.start_load_kv()
        result, timing = self._run(out)
        connector.wait_for_save()
        result.kv_connector_output = connector.get_finished(out.finished_req_ids)
        connector.clear_connector_metadata()
        return result, timing

    def _run(self, out: SchedulerOutput) -> tuple[RunnerOutput, StepTiming]:
        """The forward pass, with the grammar bitmask computed while it runs (vLLM's overlap:
        execute_model, grammar_bitmask, sample_tokens)."""
        runner = self._split_runner
        if runner is None:
            return self.runner.execute(out), StepTiming()
        runner.execute_model(out)
        grammar, window = None, None
        if self.structured_output is not None:
            start = time.perf_counter()
            grammar = self.structured_output.grammar_bitmask(self.scheduler.requests, out)
            window = (start, time.perf_counter()) if grammar is not None else None
        result = runner.sample_tokens(grammar)
        return result, StepTiming.of(result.forward_time, window)

    def _sampling_requests(self, out: SchedulerOutput) -> list[Request]:
        """The requests that sample in `out` (taken before accounting, which lets go of the
        ones that finish), for the proposer; [] without speculative decoding."""
        if self.proposer is None:
            return []
        requests = self.scheduler.requests
        return [requests[rid] for rid in sorted(out.sampling_req_ids) if rid in requests]

    def _propose_drafts(self, out: SchedulerOutput, sampling: list[Request]) -> None:
        """Drafts for the next step, for the requests that sampled in `out` and still run
        (the proposer also sees those that just finished, and which requests are live)."""
        if self.proposer is None:
            return
        drafts = self.proposer.propose(sampling, self.scheduler.requests)
        if drafts:
            self.scheduler.update_draft_token_ids(drafts, out)

    def take_event_batch(self) -> KVEventBatch | None:
        """The KV events queued since the last step (None when there are none)."""
        events: list[KVEvent] = self.kv_cache_manager.take_events()
        if self.connector is not None:
            events += self.connector.take_events()
        if not events:
            return None
        return KVEventBatch(ts=time.time(), events=events)

    # --- LoRA adapters --------------------------------------------------------------------
    def add_lora(self, name: str, path: str) -> None:
        """Register adapter `name` with the runner (which reads and checks it) and the
        scheduler's `AdapterSlots`. ValueError: LoRA is off, or the adapter is refused."""
        slots, runner = self._lora()
        runner.add_lora(name, path)
        slots.register(name)

    def remove_lora(self, name: str) -> None:
        """Forget adapter `name`; ValueError while an admitted request uses it."""
        slots, runner = self._lora()
        if slots.in_use(name):
            raise ValueError(f"LoRA adapter {name!r} is in use by running requests")
        runner.remove_lora(name)
        slots.unregister(name)

    def list_loras(self) -> list[str]:
        return [] if self.scheduler.adapter_slots is None else sorted(
            self.scheduler.adapter_slots.names)

    def _read_lora(self, name: str) -> str | None:
        """Ready adapter `name` for a step (`AdapterSlots.set_reader`): None, or why it
        cannot be read, after unloading it from the runner (one request fails, not the
        engine)."""
        assert isinstance(self.runner, LoRARunner)
        try:
            self.runner.prepare_lora(name)
            return None
        except ValueError as e:
            why = str(e)
        logger.warning("LoRA adapter %r cannot be read; unloading it: %s", name, why)
        with contextlib.suppress(ValueError):
            self.runner.remove_lora(name)
        return why

    def _lora(self) -> tuple[AdapterSlots, LoRARunner]:
        slots = self.scheduler.adapter_slots
        if slots is None or not isinstance(self.runner, LoRARunner):
            raise ValueError("LoRA is not enabled (--enable-lora)")
        return slots, self.runner

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (fails while blocks are in use), and the connector's own
        cache (vLLM's `reset_cache`: a tier's private blocks). The `AllBlocksCleared` event is
        queued; callers that publish events take it with `take_event_batch()`."""
        ok = self.scheduler.reset_prefix_cache()
        if ok and self.connector is not None:
            self.connector.reset_cache()
        return ok

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()
        if self.structured_output is not None:
            self.structured_output.shutdown()
        self.runner.shutdown()
