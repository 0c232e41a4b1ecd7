"""`vllm:num_requests_waiting_by_reason` moves: every waiting reason of the scheduler's
registry (kvloop/core/waiting.py) has its own label value, beside vLLM's capacity and
deferred, set from each step's stats. Requests are put in each state (waiting for room, for
a grammar's compile, for a LoRA slot, for P's KV) and the gauge is read from the exposition."""

from __future__ import annotations

from prometheus_client import generate_latest

from kvloop.core.compile_queue import CompileJob
from kvloop.core.request import RequestStatus
from kvloop.core.structured_output import StructuredOutputRequest
from kvloop.core.waiting import reason_label
from kvloop.front.prometheus_text import metric_value
from kvloop.sampling_params import SamplingParams, StructuredOutputsParams
from kvloop.server.metrics import ServerMetrics
from kvloop.wire import SchedulerStats

from .core_helpers import make_request, make_scheduler, run_step
from .test_pd_engine import PROMPT, engines, prefill_and_token, step  # noqa: F401 (fixture)

GAUGE = "vllm:num_requests_waiting_by_reason"


def _gauge(stats: SchedulerStats) -> dict[str, float]:
    m = ServerMetrics("m", 4096)
    m.observe_scheduler_stats(stats)
    text = generate_latest(m.registry).decode()
    reasons = {line.split('reason="')[1].split('"')[0] for line in text.splitlines()
               if line.startswith(GAUGE + "{")}
    return {r: metric_value(text, GAUGE, reason=r) for r in reasons}


def _compiling() -> StructuredOutputRequest:
    """A grammar whose compile has not finished (its future is never set here)."""
    job = CompileJob(1, 0, lambda: None)
    return StructuredOutputRequest(StructuredOutputsParams(json={"type": "object"}), job,
                                   lambda g: g, lambda j: None)


def test_each_waiting_reason_is_its_own_label_and_the_gauge_follows_the_steps():
    sched = make_scheduler(max_loras=1, max_num_seqs=2)
    assert sched.adapter_slots is not None
    sched.adapter_slots.register("x")
    sched.adapter_slots.register("y")
    running = make_request("run-x", list(range(1, 20)), max_tokens=50, arrival=0)
    running.lora_name = "x"
    base = make_request("run-base", list(range(1, 20)), max_tokens=50, arrival=1)
    lora = make_request("wait-lora", list(range(1, 20)), max_tokens=2, arrival=2)
    lora.lora_name = "y"
    grammar = make_request("wait-grammar", list(range(1, 20)), max_tokens=2, arrival=3)
    grammar.structured_output_request = _compiling()
    room = make_request("wait-room", list(range(1, 20)), max_tokens=2, arrival=4)
    for r in (running, base, lora, grammar, room):
        sched.add_request(r)
    run_step(sched, default=7)
    assert (lora.status, grammar.status, room.status) == (
        RequestStatus.WAITING_FOR_LORA, RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
        RequestStatus.WAITING)
    stats = sched.make_stats()
    assert stats.num_waiting_reqs == 3
    assert _gauge(stats) == {"capacity": 1, "deferred": 2, "lora": 1,
                             "structured_output_grammar": 1, "remote_kvs": 0}
    # the labels are the registry's, one per reason
    assert sorted(reason_label(s) for s in sched.wait_reasons.statuses()) == [
        "lora", "remote_kvs", "structured_output_grammar"]
    # the gauge moves: the grammar's request leaves the queue (aborted), the others stay
    sched.finish_requests(["wait-grammar"], RequestStatus.FINISHED_ABORTED)
    run_step(sched, default=7)
    assert _gauge(sched.make_stats())["structured_output_grammar"] == 0


def test_a_request_waiting_for_p_s_kv_counts_as_remote_kvs(engines):  # noqa: F811
    p, d = engines(), engines()
    params, _ = prefill_and_token(p, "p1", PROMPT)
    sp = SamplingParams(max_tokens=5, temperature=0, extra_args={"kv_transfer_params": params})
    d.add_request(d.make_request("d1", PROMPT, sp))
    result = d.step()
    assert d.scheduler.requests["d1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert result.stats is not None
    assert _gauge(result.stats) == {"capacity": 0, "deferred": 1, "remote_kvs": 1,
                                    "structured_output_grammar": 0}
    while d.scheduler.requests.get("d1") is not None and \
            d.scheduler.requests["d1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS:
        step(d)
    assert _gauge(d.scheduler.make_stats())["remote_kvs"] == 0
