"""LoRA in the pure-Python core: the slots' LRU, the scheduler's `AdapterSlots` waiting
reason (at most --max-loras adapters among admitted requests, queue order kept), reasons
chained, and block hashes namespaced by adapter."""

from __future__ import annotations

import pytest

from kvloop.core.lora_slots import SlotLRU
from kvloop.core.request import Request, RequestStatus
from kvloop.core.waiting import AdapterSlots, Readiness, WaitReasons

from .core_helpers import HASHER, make_request, make_scheduler, run_step


def test_slot_lru_evicts_the_least_recently_used_outside_the_step() -> None:
    lru = SlotLRU(2)
    assert lru.activate({"a"}) == ({"a": 0}, ["a"])
    assert lru.activate({"b"}) == ({"b": 1}, ["b"])
    assert lru.activate({"a"}) == ({"a": 0}, [])          # a is now the most recent
    assert lru.activate({"c"}) == ({"c": 1}, ["c"])        # b (least recent) out
    assert list(lru.resident) == ["a", "c"]
    assert lru.activate({"c", "b"}) == ({"c": 1, "b": 0}, ["b"])   # a out, c kept
    with pytest.raises(RuntimeError, match="max-loras"):
        lru.activate({"a", "b", "c"})
    lru.drop("b")
    assert lru.activate({"d"}) == ({"d": 0}, ["d"])        # b's freed slot


def _lora_request(rid: str, name: str | None, arrival: float) -> Request:
    req = make_request(rid, list(range(1, 20)), max_tokens=2, arrival=arrival)
    req.lora_name = name
    return req


def test_adapter_slots_hold_the_third_adapter_until_one_is_free() -> None:
    """max_loras 2: x, y, z, x, base arrive; z waits (WAITING_FOR_LORA) while x and y run,
    keeping its place; the x and base requests behind it are admitted; once y's request
    finishes z runs. Every scheduled new request names its adapter."""
    sched = make_scheduler(max_loras=2)
    assert sched.adapter_slots is not None
    for name in ("x", "y", "z"):
        sched.adapter_slots.register(name)
    reqs = [_lora_request(r, n, t) for t, (r, n) in enumerate(
        [("a", "x"), ("b", "y"), ("c", "z"), ("d", "x"), ("e", None)])]
    for r in reqs:
        sched.add_request(r)
    assert reqs[0].status == RequestStatus.WAITING_FOR_LORA
    out, _ = run_step(sched, default=7)
    assert [(n.req_id, n.lora_name) for n in out.scheduled_new_reqs] == [
        ("a", "x"), ("b", "y"), ("d", "x"), ("e", None)]
    assert reqs[2].status == RequestStatus.WAITING_FOR_LORA
    assert sched.adapter_slots.users == {"x": 2, "y": 1}
    stats = sched.make_stats()
    assert stats.lora is not None and stats.lora.waiting_lora_adapters == ["z"]
    assert stats.lora.running_lora_adapters == ["x", "y"]
    out, _ = run_step(sched, default=7)      # a, b, d, e finish (max_tokens 2)
    assert not out.scheduled_new_reqs
    out, _ = run_step(sched, default=7)
    assert [(n.req_id, n.lora_name) for n in out.scheduled_new_reqs] == [("c", "z")]
    assert sched.adapter_slots.users == {"z": 1}


def test_an_unknown_adapter_fails_its_request() -> None:
    sched = make_scheduler(max_loras=1)
    req = _lora_request("a", "nope", 0.0)
    sched.add_request(req)
    _, outputs = run_step(sched)
    assert req.status == RequestStatus.FINISHED_ERROR
    assert any(o.request_id == "a" and "not loaded" in (o.error or "") for o in outputs)


class _Gate:
    """A waiting reason released by hand (another feature's wait, e.g. a grammar)."""

    status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR

    def __init__(self) -> None:
        self.open = False

    def holds_new(self, request: Request) -> bool:
        return True

    def poll(self, request: Request) -> Readiness:
        return Readiness.READY if self.open else Readiness.NOT_YET

    def error(self, request: Request) -> str:
        return ""

    def release(self, request: Request) -> None:
        pass


def test_reasons_chain_a_ready_request_to_the_next_that_holds_it() -> None:
    gate, slots = _Gate(), AdapterSlots(1)
    reasons = WaitReasons(gate, slots)
    lora = _lora_request("a", "x", 0.0)
    base = _lora_request("b", None, 0.0)
    assert reasons.holding_after(lora, gate) is slots
    assert reasons.holding_after(base, gate) is None
    assert reasons.holding_after(lora, slots) is None


def test_block_hashes_differ_per_adapter_and_from_the_base() -> None:
    tokens = list(range(1, 50))
    hashes = {n: Request(f"r{n}", tokens, make_request("t", [1]).sampling_params,
                         hasher=HASHER, lora_name=n).block_hashes for n in ("x", "y", None)}
    assert all(len(h) == 3 for h in hashes.values())
    assert len({h for hs in hashes.values() for h in hs}) == 9
