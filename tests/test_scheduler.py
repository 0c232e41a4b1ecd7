"""Scheduler behaviour against vLLM's scenarios (docs/vllm-facts.md#conformance-scenarios)."""

from __future__ import annotations

import pytest

from kvloop.core.request import RequestStatus

from .core_helpers import make_request, make_scheduler, run_step

EOS = 50256


def add(sched, rid, n, max_tokens=16, arrival=None, **params):
    params.setdefault("eos_token_id", EOS)
    r = make_request(rid, [int(rid) if rid.isdigit() else 7] * n, max_tokens,
                     arrival=float(arrival if arrival is not None else len(sched.requests)),
                     hasher=None, **params)
    sched.add_request(r)
    return r


def test_add_and_abort():
    s = make_scheduler()
    for i in range(10):
        add(s, str(i), 10)
        assert len(s.waiting) == i + 1
    for i in range(10):
        s.finish_requests(str(i), RequestStatus.FINISHED_ABORTED)
        assert str(i) not in s.requests and len(s.waiting) == 9 - i
    s.check_invariants()


def test_schedule_all_in_arrival_order():
    s = make_scheduler()
    for i in range(10):
        add(s, str(i), 10)
    out = s.schedule()
    assert [d.req_id for d in out.scheduled_new_reqs] == [str(i) for i in range(10)]
    assert out.num_scheduled_tokens == {str(i): 10 for i in range(10)}
    assert len(s.waiting) == 0 and [r.request_id for r in s.running] == [str(i) for i in range(10)]


def test_long_prefill_threshold_with_peers():
    s = make_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=400)
    for i in range(3):
        add(s, str(i), 800)
    out, _ = run_step(s, default=1)
    assert list(out.num_scheduled_tokens.values()) == [400, 400, 224]
    out, outputs = run_step(s, default=1)
    assert list(out.num_scheduled_tokens.values()) == [400, 400, 224]
    assert sorted(o.request_id for o in outputs) == ["0", "1"]
    out, _ = run_step(s, default=1)
    assert list(out.num_scheduled_tokens.values()) == [1, 1, 352]


def test_threshold_ignored_when_alone_and_applied_with_peer():
    s = make_scheduler(max_num_batched_tokens=1024, max_model_len=4096,
                       long_prefill_token_threshold=400)
    add(s, "0", 2000)
    assert s.schedule().num_scheduled_tokens == {"0": 1024}
    s = make_scheduler(max_num_batched_tokens=1024, max_model_len=4096,
                       long_prefill_token_threshold=400)
    add(s, "0", 2000)
    add(s, "1", 10)
    assert s.schedule().num_scheduled_tokens == {"0": 400, "1": 10}


@pytest.mark.parametrize("chunked,expected", [(True, 2), (False, 1)])
def test_chunked_prefill_off_stops_scan(chunked, expected):
    s = make_scheduler(max_num_batched_tokens=1024, max_num_seqs=3,
                       enable_chunked_prefill=chunked)
    for i, n in enumerate([800, 800, 10, 10]):
        add(s, str(i), n)
    out = s.schedule()
    assert len(out.scheduled_new_reqs) == expected
    if chunked:
        assert out.num_scheduled_tokens == {"0": 800, "1": 224}


def _decode_ready(s, *rids):
    run_step(s, {rid: [10] for rid in rids})


def test_stop_on_eos_and_with_spec_tokens():
    s = make_scheduler()
    r0 = add(s, "0", 4)
    r1 = add(s, "1", 4)
    out, _ = run_step(s, {"0": [EOS], "1": [10]})
    assert r0.status == RequestStatus.FINISHED_STOPPED and r0.output_token_ids == [EOS]
    assert s.schedule().finished_req_ids == {"0"}
    s2 = make_scheduler()
    a = add(s2, "0", 4, max_tokens=10)
    run_step(s2, {"0": [5]})
    a.spec_token_ids = [10]
    out, _ = run_step(s2, {"0": [10, 11]})
    assert out.scheduled_spec_decode_tokens == {"0": [10]}
    assert out.num_scheduled_tokens == {"0": 2}
    assert a.output_token_ids == [5, 10, 11] and a.status == RequestStatus.RUNNING
    assert r1.status == RequestStatus.RUNNING


def test_stop_token_mid_step_discards_rest():
    s = make_scheduler()
    r = add(s, "0", 4, max_tokens=10, stop_token_ids=(42, 43))
    run_step(s, {"0": [5]})
    r.spec_token_ids = [10, 42]
    _, outputs = run_step(s, {"0": [10, 42, 12]})
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 42
    assert r.output_token_ids == [5, 10, 42]
    assert outputs[0].new_token_ids == [10, 42] and outputs[0].finish_reason == "stop"
    assert outputs[0].stop_reason == 42


def test_max_tokens_mid_step():
    s = make_scheduler()
    r = add(s, "0", 4, max_tokens=3)
    run_step(s, {"0": [5]})
    r.spec_token_ids = [10, 11]
    _, outputs = run_step(s, {"0": [10, 11, 12]})
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.output_token_ids == [5, 10, 11] and outputs[0].finish_reason == "length"


def test_ignore_eos_keeps_running():
    s = make_scheduler()
    r = add(s, "0", 4, max_tokens=10, ignore_eos=True)
    run_step(s, {"0": [EOS]})
    r.spec_token_ids = [EOS, 10]
    run_step(s, {"0": [EOS, 10, 11]})
    assert r.status == RequestStatus.RUNNING and r.output_token_ids == [EOS, EOS, 10, 11]


def test_rejected_drafts_rewind_counter():
    s = make_scheduler()
    r = add(s, "0", 4, max_tokens=20)
    run_step(s, {"0": [5]})
    r.spec_token_ids = [1, 2, 3]
    out, _ = run_step(s, {"0": [1, 9]})  # one accepted, two rejected
    assert out.num_scheduled_tokens == {"0": 4}
    assert r.num_computed_tokens == 6 and r.num_tokens == 7


def test_check_stop_order_and_min_tokens():
    s = make_scheduler(max_model_len=10)
    r = add(s, "0", 3, max_tokens=500, min_tokens=5)
    run_step(s, {"0": [10]})
    for _ in range(5):
        run_step(s, {"0": [11]})
    assert r.status == RequestStatus.RUNNING
    run_step(s, {"0": [12]})
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and r.num_tokens == 10
    s = make_scheduler()
    r = add(s, "0", 3, max_tokens=20, min_tokens=5)
    run_step(s, {"0": [10]})
    run_step(s, {"0": [EOS]})  # the sampler masks EOS before min_tokens; the scheduler still stops
    assert r.status == RequestStatus.FINISHED_STOPPED


def test_priority_order():
    s = make_scheduler(policy="priority")
    for rid, prio, arr in [("0", 2, 1), ("1", 0, 2), ("2", 1, 3)]:
        add(s, rid, 4, arrival=arr, priority=prio)
    assert list(s.schedule().num_scheduled_tokens) == ["1", "2", "0"]
    s = make_scheduler(policy="priority")
    for rid, arr in [("0", 3), ("1", 1), ("2", 2)]:
        add(s, rid, 4, arrival=arr, priority=1)
    assert list(s.schedule().num_scheduled_tokens) == ["1", "2", "0"]
    s = make_scheduler(policy="priority")
    for rid, prio, arr in [("0", 2, 1), ("1", 1, 3), ("2", 1, 2), ("3", 0, 4)]:
        add(s, rid, 4, arrival=arr, priority=prio)
    assert list(s.schedule().num_scheduled_tokens) == ["3", "2", "1", "0"]


def test_priority_with_max_num_seqs():
    s = make_scheduler(policy="priority", max_num_seqs=2)
    for i, prio in enumerate([3, 1, 2, 0]):
        add(s, str(i), 4, arrival=i, priority=prio)
    assert set(s.schedule().num_scheduled_tokens) == {"3", "1"}
    assert [r.request_id for r in s.waiting] == ["2", "0"]


def test_priority_preemption_victim():
    s = make_scheduler(num_blocks=6, caching=False, policy="priority",
                       max_num_batched_tokens=200, max_num_seqs=3)
    lo = add(s, "10", 32, max_tokens=50, priority=5, arrival=1)
    run_step(s, default=1)
    hi = add(s, "20", 32, max_tokens=50, priority=0, arrival=2)
    run_step(s, default=1)
    assert s.kv.block_pool.get_num_free_blocks() == 0
    out, _ = run_step(s, default=1)
    assert out.preempted_req_ids == ["10"] and lo.status == RequestStatus.PREEMPTED
    assert list(out.num_scheduled_tokens) == ["20"] and hi.status == RequestStatus.RUNNING


def test_preempt_then_resume_recomputes_outputs():
    s = make_scheduler(num_blocks=5, caching=False, policy="priority",
                       max_num_batched_tokens=200, max_num_seqs=2)
    low = add(s, "1", 30, max_tokens=50, priority=1, arrival=1)
    run_step(s, default=100)
    high = add(s, "2", 32, max_tokens=3, priority=0, arrival=2)
    run_step(s, default=100)
    assert s.kv.block_pool.get_num_free_blocks() == 0
    out, _ = run_step(s, default=100)
    assert low.status == RequestStatus.PREEMPTED and [d.req_id for d in
                                                       out.scheduled_cached_reqs] == ["2"]
    assert len(s.waiting) == 1
    while high.status == RequestStatus.RUNNING:
        run_step(s, default=100)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"1": 32}
    assert out.scheduled_new_reqs[0].resumed and low.all_token_ids[31] == 100


def test_fcfs_preemption_goes_to_front_and_blocks_admission():
    s = make_scheduler(num_blocks=5, caching=False, max_num_batched_tokens=64, max_num_seqs=4)
    a = add(s, "1", 24, max_tokens=30)
    b = add(s, "2", 24, max_tokens=30)
    run_step(s, default=3)
    add(s, "3", 4, max_tokens=2)
    # a and b each hold 2 blocks; growth past 32 tokens needs a 5th block -> b is preempted
    preempted_at = None
    for step in range(10):
        out, _ = run_step(s, default=3)
        if out.preempted_req_ids:
            preempted_at = step
            assert out.preempted_req_ids == ["2"] and not out.scheduled_new_reqs
            assert [r.request_id for r in s.waiting][0] == "2"
            assert b.num_computed_tokens == 0 and b.num_preemptions == 1
            break
    assert preempted_at is not None and a.status == RequestStatus.RUNNING


def test_reset_prefix_cache_with_running_requests():
    s = make_scheduler(caching=True)
    for i in range(10):
        add(s, str(i), 20)
    run_step(s, default=1)
    assert s.reset_prefix_cache() is False
    assert s.reset_prefix_cache(reset_running_requests=True) is True
    assert not s.running and [r.request_id for r in s.waiting] == [str(i) for i in range(10)]
    s.check_invariants()


def test_prefix_cache_stats_at_admission_only():
    from .core_helpers import HASHER, make_request

    s = make_scheduler(caching=True)
    seed = make_request("s", [0] * 32, 1, hasher=HASHER)
    s.add_request(seed)
    run_step(s, default=1)
    s.kv.take_prefix_cache_stats()
    r = make_request("r", [0] * 48, 1, hasher=HASHER, arrival=1.0)
    s.add_request(r)
    run_step(s, default=1)
    st = s.kv.take_prefix_cache_stats()
    assert (st.requests, st.queries, st.hits) == (1, 48, 32)


def test_abort_running_frees_blocks_and_reports_finished():
    s = make_scheduler(num_blocks=20, caching=True)
    add(s, "1", 40)
    run_step(s, default=1)
    assert s.kv.block_pool.get_num_free_blocks() < 19
    s.finish_requests(["1", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert s.kv.block_pool.get_num_free_blocks() == 19
    assert not s.has_unfinished_requests() and s.has_requests()
    out = s.schedule()
    assert out.finished_req_ids == {"1"} and out.total_num_scheduled_tokens == 0
    assert not s.has_requests()


def test_duplicate_request_id_rejected():
    s = make_scheduler()
    add(s, "1", 4)
    with pytest.raises(ValueError, match="already in use"):
        add(s, "1", 4)
