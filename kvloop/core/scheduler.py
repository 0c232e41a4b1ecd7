"""The scheduler: one loop that counts tokens.

Owner: the scheduler alone changes `Request.status`, `num_computed_tokens`, the token lists
and the waiting/running queues. Blocks are seen only through the KV cache manager.

There is no prefill or decode phase. Each request has `num_computed_tokens` chasing
`num_tokens_with_spec`; each step has a token budget; running requests go first, waiting
ones get what is left: `num_new_tokens = min(gap, budget)`, as vLLM names it, where the gap
is `num_tokens_with_spec - num_computed_tokens`. Chunked prefill, prefix hits (admission with
`num_computed_tokens > 0`) and speculative decoding (gap = 1 + k) all fall out of that.
Preemption (recompute) frees the blocks, resets the counter to 0 and puts the request back
at the front of the waiting queue. vLLM 0.33's rules are followed exactly
(docs/vllm-facts.md#scheduler).

With a KV connector (prefill/decode disaggregation, docs/vllm-facts.md#disaggregation) a
remote load is one more case of the same subtraction: `num_computed = local hit + external`.
A load that runs between steps puts the request in WAITING_FOR_REMOTE_KVS, holding all its
blocks, costing no budget, skipped by the waiting loop until the connector reports it; then
`num_computed_tokens` jumps to what was loaded (the last prompt token always recomputed) and
it is scheduled as any waiting request. A finished request whose blocks the connector holds
(P's delayed free, or an aborted load still being written) leaves the queues but stays in
`requests` until the connector reports it (`finished_sending` / `finished_recving`).

Why a waiting request is not ready yet (its grammar compiling, its remote KV loading) is
asked of one small object per reason (`kvloop.core.waiting`, which draws the lifecycle); a
feature whose requests must wait adds a reason to `wait_reasons`, not a branch in the loop.
"""

from __future__ import annotations

import heapq
import logging
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvloop.config import SchedulerConfig
from kvloop.core.block_pool import KVCacheBlock
from kvloop.core.chunk_cost import chunk_cost, fit_chunk
from kvloop.core.kv_cache_manager import KVCacheManager
from kvloop.core.kv_connector import KVConnector, cached_tokens_after_load
from kvloop.core.outputs import (
    CachedRequestData,
    KVConnectorOutput,
    NewRequestData,
    PromptLogprobs,
    RunnerOutput,
    SchedulerOutput,
)
from kvloop.core.request import Request, RequestStatus, finish_reason
from kvloop.core.structured_output import GRAMMAR_REJECTED
from kvloop.core.waiting import (
    AdapterSlots,
    GrammarCompile,
    Readiness,
    RemoteKVLoad,
    WaitReasons,
)
from kvloop.wire import (
    KV_LOAD_FAILED,
    EngineCoreOutput,
    LoRAStats,
    PromptLogprobsChunk,
    SchedulerStats,
    SpecDecodingStats,
    TopLogprobs,
)

logger = logging.getLogger("kvloop.scheduler")


class FCFSQueue:
    """Waiting queue in arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, r: Request) -> None:
        self._q.append(r)

    def prepend(self, r: Request) -> None:
        self._q.appendleft(r)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, r: Request) -> None:
        self._q.remove(r)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Waiting heap ordered by (priority, arrival_time, request_id); prepend is a push."""

    def __init__(self) -> None:
        self._h: list[Request] = []

    def add(self, r: Request) -> None:
        heapq.heappush(self._h, r)

    prepend = add

    def peek(self) -> Request:
        return self._h[0]

    def pop(self) -> Request:
        return heapq.heappop(self._h)

    def remove(self, r: Request) -> None:
        self._h.remove(r)
        heapq.heapify(self._h)

    def __len__(self) -> int:
        return len(self._h)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._h))


@dataclass
class Admission:
    """A waiting request moved to running in one step (for traces and stats)."""

    request_id: str
    resumed: bool
    prefix_hit_tokens: int
    num_tokens: int


@dataclass
class StepPlan:
    """Working state of one `schedule()` call."""

    token_budget: int
    threshold: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    charged: dict[str, int] = field(default_factory=dict)   # budget each took (chunk_cost)
    new_blocks: dict[str, list[int]] = field(default_factory=dict)
    spec: dict[str, list[int]] = field(default_factory=dict)
    running: list[Request] = field(default_factory=list)   # scheduled running reqs, in order
    new: list[Request] = field(default_factory=list)
    resumed: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Admission] = field(default_factory=list)


class Scheduler:
    """vLLM's V1 scheduler, synchronous (no async placeholders), single KV-cache group."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 log_stats: bool = True, connector: KVConnector | None = None,
                 kv_load_failure_policy: str = "fail"):
        """`connector`: the KV connector (None: none); `kv_load_failure_policy`: what a failed
        remote load does, "fail" (finish_reason "error") or "recompute" (prefill here)."""
        self.config = config
        self.connector = connector
        self.adapter_slots = (AdapterSlots(config.max_loras)
                              if config.max_loras is not None else None)
        self.wait_reasons = WaitReasons(GrammarCompile(), *filter(None, [self.adapter_slots]),
                                        RemoteKVLoad())
        self.kv_load_failure_policy = kv_load_failure_policy
        self.kv = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.max_model_len = config.max_model_len
        self.log_stats = log_stats
        self.requests: dict[str, Request] = {}
        self.waiting: FCFSQueue | PriorityQueue = (
            PriorityQueue() if config.policy == "priority" else FCFSQueue())
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.last_admissions: list[Admission] = []
        self.num_preemptions_total = 0
        self._step_preemptions = 0
        self._spec_stats: SpecDecodingStats | None = None   # drafts verified since make_stats
        self._external_queries = 0     # connector prefix stats of this step, in tokens
        self._external_hits = 0
        self.step_index = 0
        self._error_outputs: list[EngineCoreOutput] = []   # refused in schedule(), sent next

    # --- requests in and out --------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request: status WAITING, or the status of the first waiting reason
        holding it (WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR when it has a grammar, attached by
        the engine). Its id must not be in use."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        reason = self.wait_reasons.holding_new(request)
        if reason is not None:
            request.status = reason.status
        self.requests[request.request_id] = request
        self.waiting.add(request)
        if self.connector is not None:
            self.connector.on_new_request(request)

    def finish_requests(self, request_ids: str | Iterable[str] | None,
                        status: RequestStatus) -> list[Request]:
        """Finish requests from outside the loop (aborts). Unknown ids are ignored.

        Removes them from the queues, sets `status`, frees their blocks (unless the connector
        holds them: an aborted load); their ids reach the runner in the next
        SchedulerOutput's `finished_req_ids`.
        """
        if request_ids is None:
            ids = list(self.requests)
        elif isinstance(request_ids, str):
            ids = [request_ids]
        else:
            ids = list(request_ids)
        finished = []
        running_ids = set()
        for rid in ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                running_ids.add(rid)
            else:
                self.waiting.remove(req)
            req.status = status
            finished.append(req)
        if running_ids:
            self.running = [r for r in self.running if r.request_id not in running_ids]
        for req in finished:
            self._free_request(req)
        return finished

    def _free_request(self, request: Request) -> dict[str, Any] | None:
        """A finished request leaves: the connector decides whether its blocks wait (delayed
        free); returns the `kv_transfer_params` it hands on (None without)."""
        delay_free, params = False, None
        self.wait_reasons.release(request)
        if self.connector is not None:
            delay_free, params = self.connector.request_finished(
                request, self.kv.get_block_ids(request.request_id))
        self.finished_req_ids.add(request.request_id)
        if not delay_free:
            self._free_blocks(request)
        return params

    def _free_blocks(self, request: Request) -> None:
        self.kv.free(request)
        del self.requests[request.request_id]

    def has_requests(self) -> bool:
        """Anything to step for: requests (held ones included) or finished ids to report."""
        return bool(self.requests) or bool(self.finished_req_ids)

    def has_unfinished_requests(self) -> bool:
        """Requests not finished: running or waiting (loading ones included)."""
        return bool(self.running) or bool(len(self.waiting))

    def has_schedulable_work(self) -> bool:
        """Whether a step could do something without news from the connector: running
        requests, waiting ones not loading, or finished ids to report."""
        if self.running or self.finished_req_ids:
            return True
        return any(r.status != RequestStatus.WAITING_FOR_REMOTE_KVS for r in self.waiting)

    def get_request_counts(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting)

    # --- schedule -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decide who runs this step and how many tokens each computes.

        Mutates: queues, statuses, blocks (via the KV cache manager), and, after building the
        output, `num_computed_tokens += scheduled` for every scheduled request (optimistic:
        before the model runs, as vLLM does).
        """
        cfg = self.config
        threshold = cfg.long_prefill_token_threshold
        if len(self.running) + len(self.waiting) <= 1:
            threshold = 0
        plan = StepPlan(token_budget=cfg.max_num_batched_tokens, threshold=threshold)
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        return self._build_output(plan)

    def _schedule_running(self, plan: StepPlan) -> None:
        req_index = 0
        while req_index < len(self.running) and plan.token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = request.num_tokens_with_spec - request.num_computed_tokens
            if 0 < plan.threshold < num_new_tokens:
                num_new_tokens = plan.threshold
            num_new_tokens = min(self._fit(num_new_tokens, plan, request.num_computed_tokens),
                                 self.max_model_len - request.num_computed_tokens - 1)
            if num_new_tokens <= 0:
                req_index += 1
                continue
            blocks = self._allocate_or_preempt(request, num_new_tokens, req_index, plan)
            if blocks is None:
                if self.config.policy == "priority":
                    continue  # the request preempted itself; the next one slid into its place
                break
            new_ids, req_index = blocks
            plan.running.append(request)
            plan.num_scheduled[request.request_id] = num_new_tokens
            plan.new_blocks[request.request_id] = new_ids
            self._charge(plan, request.request_id, num_new_tokens, request.num_computed_tokens)
            req_index += 1
            if request.spec_token_ids:
                k = num_new_tokens + request.num_computed_tokens - request.num_tokens
                if k > 0:
                    plan.spec[request.request_id] = request.spec_token_ids[:k]
                request.spec_token_ids = []

    def _fit(self, num_new_tokens: int, plan: StepPlan, num_computed: int) -> int:
        """The longest chunk of at most `num_new_tokens` after `num_computed` whose charge
        fits the budget left (`kvloop.core.chunk_cost`; each token 1 unless the config sets
        `attention_keys_per_token`)."""
        return fit_chunk(num_new_tokens, plan.token_budget, num_computed,
                         self.config.attention_keys_per_token)

    def _charge(self, plan: StepPlan, rid: str, num_new_tokens: int, num_computed: int) -> None:
        """Mutates `plan`: the budget less what this chunk costs, remembered for `_unschedule`."""
        cost = chunk_cost(num_new_tokens, num_computed, self.config.attention_keys_per_token)
        plan.charged[rid] = cost
        plan.token_budget -= cost

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int, req_index: int,
                             plan: StepPlan) -> tuple[list[int], int] | None:
        """Allocate slots for a running request, preempting victims until it fits.

        Returns (new block ids, updated req_index), or None if the request itself was
        preempted.
        """
        while True:
            new_blocks = self.kv.allocate_slots(
                request, num_new_tokens, num_lookahead_tokens=self.config.num_lookahead_tokens)
            if new_blocks is not None:
                return [b.block_id for b in new_blocks], req_index
            victim = self._pick_victim()
            idx = self.running.index(victim)
            self.running.pop(idx)
            if idx < req_index:
                req_index -= 1
            if victim.request_id in plan.num_scheduled:
                self._unschedule(victim, plan)
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is request:
                return None

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _unschedule(self, victim: Request, plan: StepPlan) -> None:
        rid = victim.request_id
        plan.num_scheduled.pop(rid)
        plan.token_budget += plan.charged.pop(rid)
        plan.new_blocks.pop(rid, None)
        plan.spec.pop(rid, None)
        plan.running.remove(victim)

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: free blocks, counter to 0, back to the waiting front."""
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._step_preemptions += 1
        self.waiting.prepend(request)

    def _schedule_waiting(self, plan: StepPlan) -> None:
        skipped: list[Request] = []   # passed over this step (held by a waiting reason, or
        #                               the connector asks again): back in place after
        try:
            self._admit_waiting(plan, skipped)
        finally:
            for request in reversed(skipped):
                self.waiting.prepend(request)

    def _admit_waiting(self, plan: StepPlan, skipped: list[Request]) -> None:
        cfg = self.config
        while len(self.waiting) and plan.token_budget > 0:
            if len(self.running) >= cfg.max_num_seqs:
                break
            request = self.waiting.peek()
            if self._held(request):
                self.waiting.pop()
                if not request.is_finished:
                    skipped.append(request)
                continue
            hits: list[KVCacheBlock] = []
            num_hit = 0
            fresh = request.num_computed_tokens == 0
            if fresh:
                hits, num_hit = self.kv.get_computed_blocks(request)
            num_external, load_async = self._num_external_tokens(request, num_hit, fresh)
            if num_external is None:
                skipped.append(self.waiting.pop())   # the connector asks again next step
                continue
            num_computed = request.num_computed_tokens + num_hit + num_external
            num_new_tokens = 0 if load_async else request.num_tokens - num_computed
            if 0 < plan.threshold < num_new_tokens:
                num_new_tokens = plan.threshold
            if not cfg.enable_chunked_prefill and num_new_tokens > plan.token_budget:
                break
            num_new_tokens = self._fit(num_new_tokens, plan, num_computed)
            new_blocks = self.kv.allocate_slots(
                request, num_new_tokens, num_hit, hits,
                0 if load_async else cfg.num_lookahead_tokens,
                full_sequence_must_fit=cfg.scheduler_reserve_full_isl,
                has_scheduled_reqs=bool(self.running),
                num_external_computed_tokens=num_external, delay_cache_blocks=load_async)
            if new_blocks is None:
                break
            self._after_alloc(request, num_hit, num_external, fresh)
            self.waiting.pop()
            if load_async:
                self._wait_for_remote_kvs(request, num_hit)
                skipped.append(request)
                continue
            self._admit(request, num_new_tokens, num_computed, num_hit, plan)
            plan.new_blocks[request.request_id] = [b.block_id for b in new_blocks]

    def _num_external_tokens(self, request: Request, num_hit: int,
                             fresh: bool) -> tuple[int | None, bool]:
        """The connector's tokens beyond the local hit (fresh requests only), and whether
        they load between steps."""
        if self.connector is None or not fresh:
            return 0, False
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_hit)
        if num_external is None:
            return None, False
        return num_external, load_async and num_external > 0

    def _after_alloc(self, request: Request, num_hit: int, num_external: int,
                     fresh: bool) -> None:
        """Tell the connector about the allocation; count the lookups (fresh ones only)."""
        if self.connector is not None:
            self.connector.update_state_after_alloc(
                request, self.kv.get_block_ids(request.request_id), num_external)
        if fresh:
            request.num_external_computed_tokens = num_external
        if not (self.log_stats and fresh):
            return
        self.kv.record_prefix_cache_stats(request, num_hit)
        if self.connector is not None:
            self._external_queries += request.num_tokens - num_hit
            self._external_hits += num_external

    def _wait_for_remote_kvs(self, request: Request, num_hit: int) -> None:
        """Park a request whose blocks are all allocated until its load reports (vLLM's
        WAITING_FOR_REMOTE_KVS); its cached tokens are its hits and what the other side had
        cached (`cached_tokens_after_load`: P's hit; a tier's blocks), never tokens P
        computed for it."""
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_cached_tokens = cached_tokens_after_load(request, num_hit)
        request.num_local_cached_tokens = num_hit

    def _held(self, request: Request) -> bool:
        """Whether a waiting reason still holds `request` (the queue's head), asking it: one
        ready now becomes WAITING (admitted as any request); one that never will be is
        finished (FINISHED_ERROR) with an error output, sent with this step's outputs."""
        reason = self.wait_reasons.holding(request)
        readiness = Readiness.READY
        while reason is not None:       # a reason ready hands over to the next that holds it
            readiness = reason.poll(request)
            if readiness is not Readiness.READY:
                break
            reason = self.wait_reasons.holding_after(request, reason)
            request.status = RequestStatus.WAITING if reason is None else reason.status
        if reason is None:
            return False
        if readiness is Readiness.FAILED:
            request.status = RequestStatus.FINISHED_ERROR
            self._free_request(request)
            self._error_outputs.append(EngineCoreOutput(
                request.request_id, [], finish_reason=finish_reason(request.status),
                error=reason.error(request)))
        return True

    def _admit(self, request: Request, num_new_tokens: int, num_computed: int, num_hit: int,
               plan: StepPlan) -> None:
        resumed = request.status == RequestStatus.PREEMPTED
        self.running.append(request)
        (plan.resumed if resumed else plan.new).append(request)
        plan.admitted.append(Admission(request.request_id, resumed, num_hit, request.num_tokens))
        plan.num_scheduled[request.request_id] = num_new_tokens
        self._charge(plan, request.request_id, num_new_tokens, num_computed)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_computed

    def _build_output(self, plan: StepPlan) -> SchedulerOutput:
        out = SchedulerOutput(
            num_scheduled_tokens=plan.num_scheduled,
            total_num_scheduled_tokens=sum(plan.num_scheduled.values()),
            scheduled_spec_decode_tokens=plan.spec,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=[r.request_id for r in plan.preempted])
        assert out.total_num_scheduled_tokens <= self.config.max_num_batched_tokens
        assert len(self.running) <= self.config.max_num_seqs
        for req in plan.new + plan.resumed:
            rid = req.request_id
            n = plan.num_scheduled[rid]
            c = req.num_computed_tokens
            out.scheduled_new_reqs.append(NewRequestData(
                req_id=rid, prompt_token_ids=req.prompt_token_ids,
                all_token_ids=list(req.all_token_ids), sampling_params=req.sampling_params,
                block_ids=self.kv.get_block_ids(rid), num_computed_tokens=c,
                token_ids=req.all_token_ids[c:c + n], resumed=req in plan.resumed,
                pooling_params=req.pooling_params, lora_name=req.lora_name))
        for req in plan.running:
            rid = req.request_id
            n = plan.num_scheduled[rid]
            c = req.num_computed_tokens
            out.scheduled_cached_reqs.append(CachedRequestData(
                req_id=rid, new_block_ids=plan.new_blocks.get(rid, []),
                num_computed_tokens=c, token_ids=req.all_token_ids[c:c + n],
                num_output_tokens=req.num_output_tokens))
        for req in plan.running + plan.new + plan.resumed:
            req.num_computed_tokens += plan.num_scheduled[req.request_id]
            if req.num_computed_tokens >= req.num_tokens:
                out.sampling_req_ids.add(req.request_id)
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        self.finished_req_ids = set()
        self.last_admissions = plan.admitted
        self.step_index += 1
        return out

    # --- update ---------------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: RunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, rewind rejected drafts, check stops, free finished requests.

        With drafts, the runner returns 1 + accepted tokens: the rejected drafts are taken
        back from `num_computed_tokens` (their KV slots are overwritten later) and counted in
        the step's `SpecDecodingStats` (with `log_stats`). Drafts for the next step are not
        handled here: the engine proposes them afterwards (`update_draft_token_ids`).

        Returns one `EngineCoreOutput` per request that got tokens or finished.
        """
        index = runner_output.index()
        sampled = runner_output.sampled_token_ids
        outputs, self._error_outputs = self._error_outputs, []
        stopped: set[str] = set()
        for rid in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue  # aborted while the step ran
            i = index.get(rid)
            if request.is_pooling:
                if rid in scheduler_output.sampling_req_ids:   # its whole prompt is computed
                    outputs.append(self._finish_pooling(request, runner_output, i))
                    stopped.add(rid)
                continue
            generated = sampled[i] if i is not None else []
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(rid)
            if drafts and generated:
                self._rewind_rejected(request, len(drafts), len(generated))
            prompt_lps = _prompt_logprobs(request.prompt_token_ids,
                                          runner_output.prompt_logprobs.get(rid))
            if not generated:
                if prompt_lps is not None:    # a prefill chunk's scored prompt tokens
                    outputs.append(EngineCoreOutput(
                        rid, [], num_cached_tokens=request.num_cached_tokens or 0,
                        new_prompt_logprobs=prompt_lps))
                continue
            kept, is_stopped = self._append_and_check(request, generated)
            logprobs = self._logprobs(runner_output, i, len(kept))
            out = EngineCoreOutput(request_id=rid, new_token_ids=kept,
                                   num_cached_tokens=request.num_cached_tokens or 0,
                                   new_logprobs=logprobs, new_prompt_logprobs=prompt_lps,
                                   num_external_computed_tokens=(
                                       request.num_external_cached_tokens))
            if is_stopped:
                out.finish_reason = finish_reason(request.status)
                out.stop_reason = request.stop_reason
                if request.status == RequestStatus.FINISHED_ERROR:
                    out.error = GRAMMAR_REJECTED.format(token=kept[-1])
                stopped.add(rid)
                out.kv_transfer_params = self._free_request(request)
            outputs.append(out)
        if stopped:
            self.running = [r for r in self.running if r.request_id not in stopped]
        if runner_output.kv_connector_output is not None:
            outputs.extend(self._update_from_kv_xfer_finished(runner_output.kv_connector_output))
        return outputs

    def _finish_pooling(self, request: Request, runner_output: RunnerOutput,
                        i: int | None) -> EngineCoreOutput:
        """A pooling request whose last prompt token was computed finishes with its vector
        and no token (FINISHED_STOPPED, as vLLM's), its blocks freed (full ones stay cached).
        A runner that returned no vector for it fails it (FINISHED_ERROR)."""
        vectors = runner_output.pooler_output
        vector = vectors[i] if vectors is not None and i is not None else None
        request.status = (RequestStatus.FINISHED_STOPPED if vector is not None
                          else RequestStatus.FINISHED_ERROR)
        out = EngineCoreOutput(request.request_id, [], finish_reason=finish_reason(request.status),
                               num_cached_tokens=request.num_cached_tokens or 0,
                               pooling_output=vector)
        if vector is None:
            out.error = "the runner returned no pooled vector for this pooling request"
        out.kv_transfer_params = self._free_request(request)
        return out

    def _rewind_rejected(self, request: Request, num_drafts: int, num_generated: int) -> None:
        """`num_generated` = accepted + 1: the rejected drafts were computed in vain.

            | known ... | d0 d1 d2 d3 |      scheduled: 1 + 4, num_computed = c + 5
            | known ... | a  a  x  .  |      2 accepted, 1 recovered token: rewind by 2
        """
        num_accepted = max(num_generated - 1, 0)
        rejected = num_drafts - num_accepted
        if rejected > 0:
            request.num_computed_tokens -= rejected
        if self.log_stats:
            if self._spec_stats is None:
                self._spec_stats = SpecDecodingStats()
            self._spec_stats.observe_draft(num_drafts, num_accepted)

    # --- the connector's reports ----------------------------------------------------------
    def _update_from_kv_xfer_finished(self, kv_out: KVConnectorOutput) -> list[EngineCoreOutput]:
        """Free held requests whose transfer ended; move finished loads on (or fail them).
        Ids of requests already gone are ignored (an abort after the load reported).
        Returns the error outputs of loads failed under the "fail" policy."""
        if self.connector is not None:
            self.connector.update_connector_output(kv_out)
        for rid in kv_out.finished_sending:
            req = self.requests.get(rid)
            if req is not None and req.is_finished:
                self._free_blocks(req)
        outputs: list[EngineCoreOutput] = []
        for rid in kv_out.finished_recving:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.is_finished:
                self._free_blocks(req)      # aborted while loading: the blocks are ours again
            elif req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                outputs.extend(self._end_remote_load(req, kv_out))
        return outputs

    def _end_remote_load(self, request: Request,
                         kv_out: KVConnectorOutput) -> list[EngineCoreOutput]:
        bad = self._first_invalid_block(request, kv_out)
        if bad is None:
            self._finish_remote_load(request)
            return []
        error = kv_out.failed_recving.get(request.request_id) or "invalid KV blocks"
        miss = request.request_id in kv_out.recompute_recving
        return self._fail_remote_load(request, bad * self.block_size, error, miss)

    def _first_invalid_block(self, request: Request, kv_out: KVConnectorOutput) -> int | None:
        """Index of the request's first block the load did not fill (None: all filled); a
        failure reported without block ids invalidates everything past the local hit."""
        ids = self.kv.get_block_ids(request.request_id)
        bad = [i for i, b in enumerate(ids) if b in kv_out.invalid_block_ids]
        if bad:
            return bad[0]
        if request.request_id in kv_out.failed_recving:
            return self.kv.get_num_cached_blocks(request.request_id)
        return None

    def _finish_remote_load(self, request: Request) -> None:
        """vLLM's rule: the loaded blocks count as computed, except the last prompt token,
        always recomputed here (it produces the first output token's logits)."""
        num_blocks = len(self.kv.get_block_ids(request.request_id))
        n = min(num_blocks * self.block_size, request.num_tokens)
        if n == request.num_tokens:
            n -= 1
        self.kv.cache_blocks(request, n)
        request.num_computed_tokens = n
        request.status = RequestStatus.WAITING

    def _fail_remote_load(self, request: Request, num_valid: int, error: str,
                          miss: bool) -> list[EngineCoreOutput]:
        """Truncate at the first bad block, then the failure policy: "fail" finishes the
        request with an error output; "recompute" prefills the rest here (as does a `miss`:
        blocks that failed a checksum, whatever the policy)."""
        rid = request.request_id
        policy = "recompute" if miss else self.kv_load_failure_policy
        logger.warning("KV load of request %s failed (%s); %s", rid, error,
                       "failing it" if policy == "fail"
                       else f"recomputing from token {num_valid}")
        if policy == "fail":
            self.finish_requests(rid, RequestStatus.FINISHED_ERROR)
            return [EngineCoreOutput(rid, [], finish_reason=finish_reason(request.status),
                                     error=f"{KV_LOAD_FAILED}: {error}")]
        request.num_cached_tokens = min(request.num_cached_tokens or 0, num_valid)
        if num_valid == 0:
            self.kv.free(request)            # nothing valid: start over as a fresh request
            request.num_cached_tokens = request.num_local_cached_tokens = None
        else:
            self.kv.cache_blocks(request, num_valid)
        request.num_computed_tokens = num_valid
        request.status = RequestStatus.WAITING
        return []

    def _append_and_check(self, request: Request, generated: list[int]) -> tuple[list[int], bool]:
        kept: list[int] = []
        for tok in generated:
            request.append_output_token_ids(tok)
            kept.append(tok)
            if self._check_stop(request):
                if len(kept) < len(generated):
                    request.num_computed_tokens -= len(generated) - len(kept)
                return kept, True
        return kept, False

    def _check_stop(self, request: Request) -> bool:
        """After appending a token: its grammar (refused: FINISHED_ERROR), then vLLM's order:
        EOS, stop token ids, a terminated grammar, then max_tokens / max_model_len."""
        last = request.all_token_ids[-1]
        so_req = request.structured_output_request
        if so_req is not None and not so_req.accept_token(last):
            request.status = RequestStatus.FINISHED_ERROR
            return True
        if request.eos_token_id is not None and last == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in request.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
        if so_req is not None and so_req.is_terminated():
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if (request.num_tokens >= self.max_model_len
                or (request.max_tokens is not None
                    and request.num_output_tokens >= request.max_tokens)):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    @staticmethod
    def _logprobs(runner_output: RunnerOutput, i: int | None,
                  num_kept: int) -> list[TopLogprobs] | None:
        if runner_output.logprobs is None or i is None:
            return None
        entries = runner_output.logprobs[i]
        if entries is None:
            return None
        return [TopLogprobs(token_id=tok, logprob=lp.sampled_logprob, rank=lp.sampled_rank,
                            top_token_ids=lp.top_token_ids, top_logprobs=lp.top_logprobs)
                for tok, lp in zip(runner_output.sampled_token_ids[i][:num_kept],
                                   entries[:num_kept], strict=False)]

    def update_draft_token_ids(self, drafts: dict[str, list[int]],
                               scheduler_output: SchedulerOutput) -> None:
        """Attach next-step drafts (`spec_token_ids`), after `update_from_output` of the step
        `scheduler_output` describes; dropped for finished requests and partial prefill
        chunks, cut to the room left before `max_model_len` and, for a constrained request,
        to the longest prefix its grammar accepts (vLLM's `validate_tokens`)."""
        for rid, ids in drafts.items():
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if rid not in scheduler_output.sampling_req_ids:
                req.spec_token_ids = []
                continue
            room = self.max_model_len - req.num_tokens - 1
            kept = list(ids[:max(room, 0)])
            if req.structured_output_request is not None:
                kept = req.structured_output_request.valid_prefix(kept)
            req.spec_token_ids = kept

    # --- stats and checks -----------------------------------------------------------------
    def make_stats(self) -> SchedulerStats:
        pool = self.kv.block_pool
        stats = SchedulerStats(
            num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
            kv_cache_usage=pool.get_usage(), num_free_blocks=pool.get_num_free_blocks(),
            num_total_blocks=pool.num_usable_blocks,
            prefix_cache_stats=self.kv.take_prefix_cache_stats(),
            num_preemptions=self._step_preemptions, step_index=self.step_index,
            spec_decoding_stats=self._spec_stats,
            num_waiting_by_reason=self.wait_reasons.count(self.waiting))
        self._step_preemptions = 0
        self._spec_stats = None
        if self.adapter_slots is not None:
            stats.lora = LoRAStats(self.adapter_slots.max_loras, _adapters(self.running),
                                   _adapters(self.waiting))
        if self.connector is not None:
            stats.kv_transfer = self.connector.take_stats()
            stats.kv_transfer.external_prefix_cache_queries = self._external_queries
            stats.kv_transfer.external_prefix_cache_hits = self._external_hits
            self._external_queries = self._external_hits = 0
        return stats

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget the prefix cache; with `reset_running_requests`, preempt everyone first."""
        if reset_running_requests:
            while self.running:
                self._preempt(self.running.pop())
        return self.kv.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Queues disjoint and consistent with statuses; counters within bounds; blocks
        cover the computed tokens; a request loading holds blocks for its hit and what it loads; the
        requests outside the queues are finished ones whose transfer the connector still
        owns; the KV cache manager's and pool's invariants."""
        self.kv.check_invariants()
        running_ids = [r.request_id for r in self.running]
        waiting_ids = [r.request_id for r in self.waiting]
        held_ids = {rid for rid, r in self.requests.items() if r.is_finished}
        assert len(set(running_ids)) == len(running_ids), "request twice in running"
        assert not set(running_ids) & set(waiting_ids), "request both running and waiting"
        assert set(running_ids) | set(waiting_ids) | held_ids == set(self.requests), \
            "lost request"
        loading = {r.request_id for r in self.waiting
                   if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS}
        if self.connector is None:
            assert not held_ids and not loading, "held or loading requests without a connector"
        else:
            assert loading | held_ids == self.connector.request_ids_in_transfer(), \
                "the scheduler's loading/held requests differ from the connector's transfers"
        assert len(self.running) <= self.config.max_num_seqs
        for r in self.running:
            assert r.status == RequestStatus.RUNNING, f"{r} in running"
            assert 0 <= r.num_computed_tokens <= r.num_tokens_with_spec, f"{r} counter"
            held = len(self.kv.req_to_blocks.get(r.request_id, ()))
            assert held * self.block_size >= r.num_computed_tokens, f"{r} lacks blocks"
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED,
                                *self.wait_reasons.statuses()), f"{r} waiting"
            held = len(self.kv.req_to_blocks.get(r.request_id, ()))
            if r.status == RequestStatus.PREEMPTED:
                assert r.num_computed_tokens == 0
                assert r.request_id not in self.kv.req_to_blocks
            elif r.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                assert r.num_computed_tokens == 0, f"{r} loading with computed tokens"
                loaded = (self.kv.get_num_cached_blocks(r.request_id) * self.block_size
                          + r.num_external_computed_tokens)
                assert held * self.block_size >= loaded, f"{r} loading without blocks"
            else:
                assert held * self.block_size >= r.num_computed_tokens, f"{r} lacks blocks"


def _prompt_logprobs(prompt: list[int], chunk: PromptLogprobs | None
                     ) -> PromptLogprobsChunk | None:
    """A runner's prompt logprobs for the wire, each entry with the prompt token it scores."""
    if chunk is None:
        return None
    first = chunk.first_position
    return PromptLogprobsChunk(first, [
        TopLogprobs(token_id=prompt[first + j], logprob=lp.sampled_logprob,
                    rank=lp.sampled_rank, top_token_ids=lp.top_token_ids,
                    top_logprobs=lp.top_logprobs)
        for j, lp in enumerate(chunk.entries)])


def _adapters(requests: Iterable[Request]) -> list[str]:
    """The distinct LoRA adapters of `requests`, sorted."""
    return sorted({r.lora_name for r in requests if r.lora_name is not None})
