"""EngineCore: the step order (aborts after the forward pass), lifecycle, events, traces."""

from __future__ import annotations

import json

from kvloop.config import CacheConfig, EngineConfig, SchedulerConfig
from kvloop.core.engine import EngineCore
from kvloop.core.outputs import RunnerOutput, SchedulerOutput
from kvloop.core.request import SamplingParams
from kvloop.core.trace import TraceWriter
from kvloop.sim.runner import SimRunner


def make_engine(runner=None, blocks=64, budget=64, events=True) -> EngineCore:
    cfg = EngineConfig(cache=CacheConfig(num_gpu_blocks=blocks, enable_kv_cache_events=events),
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8,
                                                 max_model_len=512),
                       check_invariants=True)
    return EngineCore(cfg, runner or SimRunner())


def add(engine, rid, n, max_tokens=4, **kw):
    engine.add_request(engine.make_request(rid, list(range(100, 100 + n)),
                                           SamplingParams(max_tokens=max_tokens, **kw)))


class AbortingRunner(SimRunner):
    """Aborts a request from 'another thread' while the forward pass runs."""

    def __init__(self, engine_ref, victim):
        super().__init__()
        self.engine_ref, self.victim, self.seen = engine_ref, victim, []

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.seen.append(out)
        if len(self.seen) == 2:
            self.engine_ref[0].abort_requests([self.victim])
        return super().execute(out)


def test_abort_during_forward_pass_is_applied_before_accounting():
    ref: list = []
    runner = AbortingRunner(ref, "b")
    engine = make_engine(runner)
    ref.append(engine)
    add(engine, "a", 20, max_tokens=5)
    add(engine, "b", 20, max_tokens=5)
    engine.step()
    res = engine.step()  # "b" is aborted while this step's forward pass runs
    assert "b" in res.scheduler_output.num_scheduled_tokens
    assert [o.request_id for o in res.outputs] == ["a"]  # no output for the aborted one
    assert "b" not in engine.scheduler.requests
    nxt = engine.step()
    assert nxt.scheduler_output.finished_req_ids == {"b"}
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_pool.get_num_free_blocks() == 63


def test_lifecycle_add_step_abort():
    engine = make_engine()
    add(engine, "0", 10)
    assert engine.scheduler.get_request_counts() == (0, 1)
    engine.step()
    assert engine.scheduler.get_request_counts() == (1, 0)
    add(engine, "1", 10)
    add(engine, "2", 10)
    engine.step()
    assert engine.scheduler.get_request_counts() == (3, 0)
    engine.abort_requests(["1"])
    engine.step()
    assert engine.scheduler.get_request_counts()[0] == 2
    engine.abort_requests(["0", "2"])
    res = engine.step()
    assert not engine.has_unfinished_requests() and not res.executed
    add(engine, "0", 10)  # ids may be reused once finished
    assert engine.has_unfinished_requests()


def test_outputs_events_stats_and_first_output_cached_tokens():
    engine = make_engine()
    add(engine, "a", 40, max_tokens=3)
    res = engine.step()
    assert res.outputs[0].num_cached_tokens == 0 and res.events is not None
    assert [len(e.block_hashes) for e in res.events.events] == [2]
    while engine.has_unfinished_requests():
        res = engine.step()
    assert res.outputs[-1].finish_reason == "length"
    add(engine, "b", 40, max_tokens=3)
    res = engine.step()
    assert res.outputs[0].num_cached_tokens == 32
    assert res.stats is not None and res.stats.prefix_cache_stats.hits == 32
    assert res.stats.prefix_cache_stats.queries == 40


def test_prompt_too_long_rejected():
    engine = make_engine()
    try:
        engine.make_request("x", list(range(512)), SamplingParams())
    except ValueError as e:
        assert "maximum context length" in str(e)
    else:
        raise AssertionError("no error")


def test_trace_records_kinds(tmp_path):
    engine = make_engine(blocks=6, budget=32)
    add(engine, "a", 40, max_tokens=30)
    add(engine, "b", 20, max_tokens=30)
    path = tmp_path / "t.jsonl"
    writer = TraceWriter(str(path))
    kinds = set()
    for _ in range(60):
        res = engine.step()
        if res.record is not None:
            writer.write(res.record)
            kinds |= {w.kind for w in res.record.scheduled.values()}
        if not engine.has_unfinished_requests():
            break
    writer.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0]["scheduled"]["a"] == {"tokens": 32, "kind": "prefill",
                                          "num_computed_before": 0}
    assert any(rec["preempted"] for rec in lines)
    assert {"prefill", "decode", "recompute"} <= kinds
    assert all(rec["total_tokens"] <= rec["budget"] for rec in lines)
