"""Flow control and session affinity without HTTP: the queue's exact order, saturation from
the workers' figures, shedding, queue limits and timeouts, the objectives file, metrics."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from kvloop.front.prometheus_text import metric_value
from kvloop.router.config import CostConfig, LivenessConfig
from kvloop.router.flow import (
    DISPATCH_TICK_S,
    QUEUE_FULL,
    QUEUE_TIMEOUT,
    SHED,
    FlowControl,
    FlowKey,
    FlowQueue,
    Permit,
    Rejection,
    Waiter,
    headroom,
    rejection_response,
)
from kvloop.router.flow_config import FlowConfig, Objective, load_objectives
from kvloop.router.registry import LoadSnapshot, Registry, WorkerSpec
from kvloop.router.scorer import SESSION, Candidate, RouteRequest, estimate_cost, kv_aware
from kvloop.router.sessions import SessionTable, session_key

from .conftest import FakeClock
from .test_router_core import PROMPT_A, desc, make_router

ON = FlowConfig(enabled=True, max_waiting=0, staleness_s=1.0, max_queue=4,
                queue_timeout_s=5.0,
                objectives=(Objective("chat", 10), Objective("batch", -1, 0.05)))


async def until(cond: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    """Yield to the loop's other tasks until `cond()` holds; AssertionError naming `what`
    after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(0.001)


def waiter(priority: int, tenant: int, seq: int) -> Waiter:
    return Waiter(FlowKey(priority, tenant), seq, 0.0)


# --- the queue ----------------------------------------------------------------------------
def test_queue_serves_bands_high_first_and_tenants_in_turn_fifo_within_one():
    q = FlowQueue()
    order = [(0, 1), (0, 1), (0, 1), (0, 2), (5, 3), (0, 2), (5, 3), (0, 3)]
    for seq, (band, tenant) in enumerate(order):
        q.push(waiter(band, tenant, seq))
    assert len(q) == 8 and q.lengths() == {0: 6, 5: 2}
    popped = [w.seq for w in iter(q.pop, None)]
    # band 5 first (FIFO); band 0: tenants 1, 2, 3 in turn, each its oldest first
    assert popped == [4, 6, 0, 3, 7, 1, 5, 2]
    assert len(q) == 0 and q.lengths() == {} and q.pop() is None


def test_queue_remove_takes_out_one_waiter_and_drops_empty_tenants_and_bands():
    q = FlowQueue()
    a, b, c = waiter(0, 1, 0), waiter(0, 1, 1), waiter(3, 2, 2)
    for w in (a, b, c):
        q.push(w)
    assert q.remove(c) and q.lengths() == {0: 2}
    assert not q.remove(c)
    assert q.remove(a) and q.pop() is b and len(q) == 0


# --- saturation -----------------------------------------------------------------------------
def _registry(*loads: LoadSnapshot, max_num_seqs: int = 2) -> tuple[Registry, FakeClock]:
    clock = FakeClock()
    reg = Registry(LivenessConfig(), clock)
    for i, load in enumerate(loads):
        name = reg.add(WorkerSpec(f"http://w:{i + 1}")).name
        d = desc()
        reg.mark_up(name, type(d)(**{**{f: getattr(d, f) for f in d.__struct_fields__},
                                    "max_num_seqs": max_num_seqs}))
        reg.set_load(name, load)
    return reg, clock


def _open(reg: Registry, name: str, n: int) -> list:
    return [reg.open_ticket(name, 10, 10, 0, False) for _ in range(n)]


def test_headroom_counts_free_slots_reported_waiting_kv_usage_and_staleness():
    fresh = 1000.0
    reg, clock = _registry(LoadSnapshot(0, 0, 0.1, fresh))
    w = reg.all()[0]
    cfg = FlowConfig(enabled=True, max_waiting=1, staleness_s=1.0, kv_usage_threshold=0.9)
    assert headroom(w, cfg, clock()) == 3           # 2 free slots + 1 may wait
    _open(reg, w.name, 2)
    assert headroom(w, cfg, clock()) == 1
    _open(reg, w.name, 1)
    assert headroom(w, cfg, clock()) == 0           # one waits in the engine: saturated
    reg.set_load(w.name, LoadSnapshot(2, 5, 0.1, fresh))   # another router's requests
    assert headroom(w, cfg, clock()) == 0
    reg, clock = _registry(LoadSnapshot(0, 0, 0.9, fresh))
    assert headroom(reg.all()[0], cfg, clock()) == 0      # KV usage at the threshold
    reg, clock = _registry(LoadSnapshot(0, 0, 0.0, fresh))
    clock.t += 1.5
    assert headroom(reg.all()[0], cfg, clock()) == 0      # stale figures: saturated
    never_polled = _registry(LoadSnapshot())[0].all()[0]
    assert headroom(never_polled, cfg, 1000.0) == 0


def test_a_worker_that_does_not_say_its_max_num_seqs_counts_its_reported_waiting():
    reg, clock = _registry(LoadSnapshot(7, 0, 0.0, 1000.0))
    w = reg.all()[0]
    w.description = None    # not a kvloop worker
    assert headroom(w, FlowConfig(max_waiting=0), clock()) == 1   # never 0 by config alone
    reg.set_load(w.name, LoadSnapshot(7, 3, 0.0, 1000.0))
    assert headroom(w, FlowConfig(max_waiting=2), clock()) == 0


# --- admission ----------------------------------------------------------------------------
def _flow(cfg: FlowConfig = ON, seqs: int = 1) -> tuple[FlowControl, Registry, FakeClock]:
    reg, clock = _registry(LoadSnapshot(0, 0, 0.0, 1000.0), max_num_seqs=seqs)
    return FlowControl(cfg, lambda: reg.usable(), clock), reg, clock


def test_flow_control_off_lets_everything_through():
    flow, reg, _ = _flow(FlowConfig())
    _open(reg, reg.all()[0].name, 50)
    assert isinstance(asyncio.run(flow.admit(FlowKey(-5))), Permit)


def test_permits_in_transit_count_until_routed_and_sheddable_is_refused_when_full():
    async def go() -> None:
        flow, reg, _ = _flow()
        first = await flow.admit(FlowKey(0))
        assert isinstance(first, Permit) and flow.in_transit == 1 and flow.room() == 0
        shed = await flow.admit(FlowKey(-1))
        assert isinstance(shed, Rejection) and (shed.reason, shed.status) == (SHED, 429)
        first.close()
        first.close()                                 # idempotent
        assert flow.in_transit == 0 and flow.room() == 1
        assert isinstance(await flow.admit(FlowKey(-1)), Permit)   # room: sheddable passes
    asyncio.run(go())


def test_queued_requests_are_released_by_band_then_tenant_as_room_appears():
    async def go() -> list[tuple[int, int]]:
        flow, reg, _ = _flow()
        name = reg.all()[0].name
        busy = _open(reg, name, 1)[0]                # the one slot is taken
        keys = [FlowKey(0, 1), FlowKey(0, 1), FlowKey(0, 2), FlowKey(10, 3)]
        served: list[tuple[int, int]] = []

        async def client(k: FlowKey) -> None:
            p = await flow.admit(k)
            assert isinstance(p, Permit)
            served.append((k.priority, k.tenant))
            t = _open(reg, name, 1)[0]                # routed: its ticket counts it
            p.close()
            await asyncio.sleep(2 * DISPATCH_TICK_S)  # being served, while the dispatcher looks
            reg.close_ticket(t, True)

        tasks = [asyncio.create_task(client(k)) for k in keys]
        await until(lambda: len(flow.queue) == 4, "four queued")
        assert served == []
        reg.close_ticket(busy, True)
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        return served
    assert asyncio.run(go()) == [(10, 3), (0, 1), (0, 2), (0, 1)]


def test_queue_full_and_queue_timeout_answer_503_and_a_leaving_client_leaves_the_queue():
    async def go() -> None:
        flow, reg, _ = _flow()
        _open(reg, reg.all()[0].name, 1)
        waiting = [asyncio.create_task(flow.admit(FlowKey(0, i))) for i in range(4)]
        await until(lambda: len(flow.queue) == 4, "four queued")
        full = await flow.admit(FlowKey(0))
        assert isinstance(full, Rejection) and (full.reason, full.status) == (QUEUE_FULL, 503)
        waiting[0].cancel()
        await until(lambda: waiting[0].done(), "the cancelled waiter gone")
        assert len(flow.queue) == 3
        late = await flow.admit(FlowKey(1, 9, queue_timeout_s=0.02))
        assert isinstance(late, Rejection) and (late.reason, late.status) == (QUEUE_TIMEOUT,
                                                                              503)
        assert len(flow.queue) == 3
        for t in waiting:
            t.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        assert len(flow.queue) == 0 and flow.in_transit == 0
    asyncio.run(go())


def test_a_waiter_released_as_its_client_leaves_gives_its_permit_back():
    async def go() -> None:
        flow, reg, _ = _flow()
        t = _open(reg, reg.all()[0].name, 1)[0]
        task = asyncio.create_task(flow.admit(FlowKey(0)))
        await until(lambda: len(flow.queue) == 1, "one queued")
        reg.close_ticket(t, True)
        assert flow.release_ready() == 1 and flow.in_transit == 1
        task.cancel()                                  # before it resumes with its permit
        with pytest.raises(asyncio.CancelledError):
            await task
        assert flow.in_transit == 0
    asyncio.run(go())


def test_without_a_usable_worker_requests_pass_to_the_router_which_answers_503():
    flow = FlowControl(ON, lambda: [], FakeClock())
    assert isinstance(asyncio.run(flow.admit(FlowKey(0))), Permit)


def test_rejections_say_why_with_retry_after_and_metrics_count_them():
    async def go() -> FlowControl:
        flow, reg, _ = _flow()
        _open(reg, reg.all()[0].name, 1)
        await flow.admit(FlowKey(-1))
        await flow.admit(FlowKey(123, queue_timeout_s=0.01))   # a band no objective names
        return flow
    flow = asyncio.run(go())
    r = rejection_response(Rejection(SHED, 429, "busy"), ON)
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.headers["x-kvloop-flow-rejected"] == SHED
    assert json.loads(bytes(r.body))["error"]["code"] == 429
    text = generate_latest(flow.metrics.prom).decode()
    assert metric_value(text, 'kvloop_router_flow_rejections_total'
                              '{priority="-1",reason="shed"}') == 1
    assert metric_value(text, 'kvloop_router_flow_rejections_total'
                              '{priority="other",reason="queue_timeout"}') == 1
    assert metric_value(text, 'kvloop_router_flow_queue_length{priority="10"}') == 0
    assert metric_value(text, "kvloop_router_flow_saturated") == 1
    assert metric_value(text, 'kvloop_router_flow_wait_seconds_count{priority="other"}') \
        == 0


# --- classification -----------------------------------------------------------------------
def test_band_from_objective_else_minus_vllm_priority_tenant_from_header_else_key():
    flow = FlowControl(ON, lambda: [], FakeClock())
    key = functools.partial(flow.key_of, trusted=True)   # a trusted front's request
    chat = key({"x-gateway-inference-objective": "chat"}, {"priority": 99})
    assert (chat.priority, chat.queue_timeout_s) == (10, None)
    batch = key({"x-gateway-inference-objective": "batch"}, {})
    assert (batch.priority, batch.queue_timeout_s) == (-1, 0.05)
    assert key({"x-gateway-inference-objective": "nope"}, {}).priority == 0
    assert key({}, {"priority": -3}).priority == 3      # vLLM: lower is earlier
    assert key({}, {"priority": 2}).priority == -2      # later than default: shed
    assert key({}, {"priority": True}).priority == 0
    a = key({"authorization": "Bearer a"}, {})
    b = key({"authorization": "Bearer b"}, {})
    fair = key({"authorization": "Bearer a", "x-gateway-inference-fairness-id": "team"}, {})
    assert len({a.tenant, b.tenant, fair.tenant, key({}, {}).tenant}) == 4
    assert key({"x-api-key": "a"}, {}).tenant == a.tenant
    assert FlowControl(replace(ON, trusted_front=True), lambda: [], FakeClock()).key_of(
        {"x-gateway-inference-objective": "chat"}, {}).priority == 10   # --trusted-front


def test_an_untrusted_caller_is_its_keys_tenant_in_the_default_band_or_below():
    flow = FlowControl(ON, lambda: [], FakeClock())
    mine = flow.key_of({"authorization": "Bearer a"}, {})
    for headers, body in [({"x-gateway-inference-fairness-id": "x1"}, {}),
                          ({"x-gateway-inference-objective": "chat"}, {}),
                          ({}, {"priority": -100})]:
        k = flow.key_of({"authorization": "Bearer a", **headers}, body)
        assert (k.priority, k.tenant, k.queue_timeout_s) == (0, mine.tenant, None)
    assert flow.key_of({}, {"priority": 2}).priority == -2   # lowering itself is its right
    batch = flow.key_of({"x-gateway-inference-objective": "batch"}, {})
    assert (batch.priority, batch.queue_timeout_s) == (-1, 0.05)


def test_a_client_sending_many_fairness_ids_cannot_move_a_victims_share():
    """Probe 8: the attacker names a new tenant per request; untrusted, they are all its
    key's, so a victim queued beside it still gets every other release."""
    flow = FlowControl(ON, lambda: [], FakeClock())
    queue = FlowQueue()
    for i in range(40):
        attacker = flow.key_of({"authorization": "Bearer attacker",
                                "x-gateway-inference-fairness-id": f"t{i}",
                                "x-gateway-inference-objective": "chat"}, {"priority": -9})
        queue.push(Waiter(attacker, i, 0.0))
    victim_key = flow.key_of({"authorization": "Bearer victim"}, {})
    for i in range(40):
        queue.push(Waiter(victim_key, 100 + i, 0.0))
    released = [queue.pop() for _ in range(40)]
    assert sum(w is not None and w.key.tenant == victim_key.tenant for w in released) == 20
    trusted = flow.key_of({"x-gateway-inference-fairness-id": "t1"}, {}, trusted=True)
    assert trusted.tenant != victim_key.tenant   # a trusted front still names tenants


def test_the_queue_is_bounded_in_bytes_as_well_as_requests():
    async def run() -> list[object]:
        flow, reg, _ = _flow(replace(ON, max_queue_bytes=100))
        _open(reg, reg.all()[0].name, 1)                # saturated: every request waits
        first = asyncio.ensure_future(flow.admit(FlowKey(), 60))
        await asyncio.sleep(0)
        refused = await flow.admit(FlowKey(), 60)       # 120 bytes would wait: refused
        fits = asyncio.ensure_future(flow.admit(FlowKey(), 40))
        await asyncio.sleep(0)
        queued = (len(flow.queue), flow.queue.bytes)
        first.cancel()
        fits.cancel()
        await asyncio.gather(first, fits, return_exceptions=True)
        return [refused, queued, flow.queue.bytes]

    refused, queued, left = asyncio.run(run())
    assert isinstance(refused, Rejection) and refused.reason == QUEUE_FULL
    assert queued == (2, 100) and left == 0


def test_objectives_file_is_read_strictly(tmp_path):
    good = tmp_path / "o.json"
    good.write_text(json.dumps({"objectives": [{"name": "chat", "priority": 10},
                                               {"name": "bg", "priority": -2,
                                                "queue_timeout_s": 3}]}))
    assert load_objectives(good) == (Objective("chat", 10), Objective("bg", -2, 3))
    for bad in ({"objectives": [{"name": "x", "priority": "high"}]},
                {"objectives": [{"name": "", "priority": 1}]},
                {"objectives": [{"name": "x", "priority": 2**31}]},
                {"objectives": [{"name": "x", "queue_timeout_s": "1"}]},
                {"objectives": [{"name": "x", "extra": 1}]}, [1]):
        f = tmp_path / "bad.json"
        f.write_text(json.dumps(bad))
        with pytest.raises(ValueError):
            load_objectives(f)
    with pytest.raises(ValueError, match="unique"):
        FlowConfig(objectives=(Objective("a"), Objective("a", 1)))
    with pytest.raises(ValueError):
        load_objectives(tmp_path / "missing.json")
    example = load_objectives(Path(__file__).parents[1] / "docs" / "objectives.json")
    assert [(o.name, o.priority) for o in example] == [("chat", 10), ("batch", -1),
                                                      ("reports", 0)]


# --- session affinity ---------------------------------------------------------------------
def test_session_credit_keeps_a_session_on_its_worker_unless_load_outweighs_it():
    cfg = CostConfig(decode_token_cost=16.0, marginal_work_weight=0.0, session_weight=0.5)
    req = RouteRequest(prompt_tokens=320, block_size=16, prefix_key=7)
    mine = Candidate("a", session_tokens=256, in_flight=1)
    # 320 - 0.5 * 256 credited + 16 * 1 active
    assert estimate_cost(mine, req, cfg) == 320 - 128 + 16
    d = kv_aware([mine, Candidate("b")], req, cfg)
    assert (d.worker, d.reason) == ("a", SESSION)
    busy = Candidate("a", session_tokens=256, in_flight=9)
    assert kv_aware([busy, Candidate("b")], req, cfg).worker == "b"
    # a larger index hit is no session decision; the session credit never adds to it
    hit = Candidate("a", cached_blocks=19, session_tokens=256)
    assert estimate_cost(hit, req, cfg) == 320 - 304
    assert kv_aware([hit, Candidate("b")], req, cfg).reason != SESSION


def test_session_key_and_table_bounds():
    assert session_key({"x-session-id": "s1"}, {"user": "u"}) == session_key(
        {"x-session-id": "s1"}, {})
    assert session_key({}, {"user": "u"}) is not None
    assert session_key({}, {"user": 5}) is None and session_key({}, {}) is None
    t = SessionTable(max_sessions=2, ttl_s=10.0)
    for k in (1, 2, 3):
        t.record(k, "w", k, now=0.0)
    assert len(t) == 2 and t.last_turn(1, 0.0) is None      # least recently used went
    assert t.last_turn(3, 5.0).worker == "w"
    assert t.last_turn(3, 20.0) is None and len(t) == 1      # older than the TTL
    t.forget_worker("w")
    assert len(t) == 0


def test_router_sends_a_session_back_to_its_busier_worker_without_any_cache_signal():
    r, clock, _ = make_router()
    for port in (1, 2, 3):
        r.register(WorkerSpec(f"http://w:{port}"), desc())
    key = session_key({"x-session-id": "conversation"}, {})
    first = r.route(PROMPT_A, session=key)
    r.first_token(first.ticket)                   # still decoding: that worker is busier
    clock.t += 5.0
    r.index.expire_provisional()                  # no event ever confirmed its blocks
    turn = PROMPT_A + list(range(2000, 2040))
    again = r.route(turn, session=key)
    assert (again.worker.name, again.decision.reason) == (first.worker.name, SESSION)
    r.finish(again.ticket, None)
    clock.t += 5.0
    r.index.expire_provisional()
    assert r.route(turn).worker.name != first.worker.name   # no session: by load


# --- flags --------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["router", "fleet"])
def test_router_and_fleet_flags_build_the_flow_config(command, tmp_path):
    from kvloop.cli import build_parser
    from kvloop.router.cli_args import router_config

    objectives = Path(__file__).parents[1] / "docs" / "objectives.json"
    args = build_parser().parse_args([
        command, "--flow-control", "--flow-max-waiting", "0", "--flow-kv-usage-threshold",
        "0.8", "--flow-staleness", "1.5", "--flow-max-queue", "64", "--flow-queue-timeout",
        "9", "--objectives-file", str(objectives), "--session-weight", "0.25"])
    cfg = router_config(args)
    assert cfg.flow == FlowConfig(enabled=True, max_waiting=0, kv_usage_threshold=0.8,
                                  staleness_s=1.5, max_queue=64, queue_timeout_s=9.0,
                                  objectives=load_objectives(objectives))
    assert cfg.cost.session_weight == 0.25
    assert not router_config(build_parser().parse_args([command])).flow.enabled
    with pytest.raises(ValueError, match="must exceed --poll-interval"):
        router_config(build_parser().parse_args([command, "--flow-control", "--flow-staleness",
                                                 "0.5", "--poll-interval", "0.5"]))
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="objectives file"):
        router_config(build_parser().parse_args([command, "--objectives-file", str(bad)]))
