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


def test_the_simulator_serves_adapters_with_a_modelled_load_time() -> None:
    """Sim runner, max_loras 1: x's and y's requests run in turn (y waits for the slot);
    each switch is one load of `lora_load_s`; greedy outputs depend on the adapter."""
    import dataclasses

    from kvloop.config import LoRAConfig
    from kvloop.core.engine import EngineCore
    from kvloop.core.request import SamplingParams
    from kvloop.llm import engine_config
    from kvloop.sim.worker import SimWorkerRunner

    slept: list[float] = []
    runner = SimWorkerRunner(None, 64, 256, lora=LoRAConfig(max_loras=1), lora_load_s=0.5,
                             sleep=slept.append, block_size=16)
    config = engine_config(256, block_size=16, num_gpu_blocks=64)
    config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler,
                                                                       max_loras=1))
    engine = EngineCore(config, runner, num_gpu_blocks=64)
    for name in ("x", "y"):
        engine.add_lora(name, f"/adapters/{name}")
    sp = SamplingParams(temperature=0.0, max_tokens=3)
    outputs: dict[str, list[int]] = {}
    for rid, name in (("a", "x"), ("b", "y"), ("c", "x"), ("d", None)):
        engine.add_request(engine.make_request(rid, list(range(1, 20)), sp, lora_name=name))
    while engine.has_unfinished_requests():
        for o in engine.step().outputs:
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert runner.num_lora_loads == 2 and slept == [0.5, 0.5]    # x (a and c), then y
    assert outputs["a"] == outputs["c"] != outputs["b"]
    assert outputs["d"] not in (outputs["a"], outputs["b"])
    assert engine.list_loras() == ["x", "y"] == sorted(runner.list_loras())


@pytest.mark.parametrize("num_slots", [1, 2, 3])
def test_slot_lru_random_sequences_keep_slots_distinct(num_slots: int) -> None:
    """Random activates and drops: the step's names all resident on distinct slots in
    range, loads are exactly those not resident before, nothing resident twice."""
    import random

    rng = random.Random(num_slots)
    lru = SlotLRU(num_slots)
    names = ["a", "b", "c", "d", "e"]
    for _ in range(500):
        if rng.random() < 0.2:
            lru.drop(rng.choice(names))
            continue
        step = set(rng.sample(names, rng.randint(1, num_slots)))
        before = set(lru.resident)
        slot_of, loads = lru.activate(step)
        assert set(slot_of) == step and set(loads) == step - before
        assert len(set(lru.resident.values())) == len(lru.resident) <= num_slots
        assert all(0 <= s < num_slots for s in lru.resident.values())
        assert all(lru.resident[n] == slot_of[n] for n in step)
        assert list(lru.resident)[-len(step):] == sorted(step, key=list(lru.resident).index)
