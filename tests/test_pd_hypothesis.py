"""Random prefill/decode operation sequences on a simulated P and D talking over a real side
channel: both legs, local requests, aborts on either side, lease expiry, slow and fast
transfers, both failure policies; both schedulers' invariants (which compare the queues with
the connectors' transfers) after every operation, and no block held anywhere once
everything is aborted, expired or done."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvloop.core.engine import EngineCore
from kvloop.core.request import SamplingParams
from tests.conftest import FakeClock
from tests.test_pd_engine import BLOCK_BYTES, PREFILL, free, kv_config, sim_engine, usable

pytestmark = pytest.mark.processes     # the engines listen on side channels

PREFIXES = [list(range(100, 132)), list(range(200, 216)), []]
LEASE = 30.0

ops = st.lists(st.one_of(
    st.tuples(st.just("pd"), st.integers(0, 2), st.integers(1, 40), st.integers(1, 6)),
    st.tuples(st.just("pd"), st.integers(0, 2), st.integers(1, 40), st.integers(1, 6)),
    st.tuples(st.just("prefill"), st.integers(0, 2), st.integers(1, 40)),
    st.tuples(st.just("decode"), st.integers(0, 9), st.integers(1, 6)),
    st.tuples(st.just("decode"), st.integers(0, 9), st.integers(1, 6)),
    st.tuples(st.just("local"), st.integers(0, 2), st.integers(1, 30), st.integers(1, 6)),
    st.tuples(st.just("step_p"), st.integers(1, 3)),
    st.tuples(st.just("step_d"), st.integers(1, 3)),
    st.tuples(st.just("abort_p"), st.integers(0, 9)),
    st.tuples(st.just("abort_d"), st.integers(0, 9)),
    st.tuples(st.just("expire"),),
    st.tuples(st.just("wait"),),
), min_size=1, max_size=30)


class World:
    """P (its lease clock a FakeClock) and D, the params P handed on, the prompts P got."""

    def __init__(self, p_blocks: int, d_blocks: int, caching: bool, bandwidth: float,
                 policy: str):
        self.clock = FakeClock()
        self.p = sim_engine(p_blocks, budget=64, max_model_len=256, clock=self.clock)
        self.d = sim_engine(d_blocks, budget=64, max_model_len=256, caching=caching,
                            kv=kv_config(policy=policy, sim_bandwidth=bandwidth))
        self.params: list[dict[str, Any]] = []
        self.prompts: dict[str, list[int]] = {}
        self.n = 0
        self.loads = self.failures = 0     # for the statistics: what the examples covered

    def step(self, engine: EngineCore) -> None:
        result = engine.step()
        for out in result.outputs:
            if engine is self.p and out.kv_transfer_params is not None:
                self.params.append(out.kv_transfer_params)
        kv = result.stats.kv_transfer if result.stats else None
        if kv is not None:
            self.loads += kv.transfers_received
            self.failures += sum(kv.failures.values())
        self.check()

    def check(self) -> None:
        self.p.scheduler.check_invariants()
        self.d.scheduler.check_invariants()

    def add(self, engine: EngineCore, prompt: list[int], max_tokens: int,
            params: dict[str, Any] | None) -> None:
        rid = f"r{self.n}"
        self.n += 1
        self.prompts[rid] = prompt
        sp = SamplingParams(max_tokens=max_tokens, min_tokens=1, temperature=0,
                            extra_args={"kv_transfer_params": params} if params else None)
        engine.add_request(engine.make_request(rid, prompt, sp))

    def fresh(self, prefix: int, length: int) -> list[int]:
        return PREFIXES[prefix] + [300 + self.n + i for i in range(length)]

    def run(self, op: tuple[Any, ...]) -> None:
        kind = op[0]
        if kind == "prefill":                 # P's leg, run until P hands on (or 3 steps)
            self.add(self.p, self.fresh(op[1], op[2]), 1, dict(PREFILL))
            for _ in range(3):
                self.step(self.p)
        elif kind == "pd":                    # both legs: D gets the params at once
            self.run(("prefill", op[1], op[2]))
            self.run(("decode", len(self.params) - 1, op[3]))
        elif kind == "decode" and self.params:
            params = self.params.pop(op[1] % len(self.params))
            self.add(self.d, self.prompts[params["remote_request_id"]], op[2], params)
        elif kind == "local":
            self.add(self.d, self.fresh(op[1], op[2]), op[3], None)
        elif kind in ("step_p", "step_d"):
            for _ in range(op[1]):
                self.step(self.p if kind == "step_p" else self.d)
        elif kind in ("abort_p", "abort_d"):
            (self.p if kind == "abort_p" else self.d).abort_requests([f"r{op[1]}"])
        elif kind == "expire":
            self.clock.t += LEASE + 1
        elif kind == "wait":
            time.sleep(0.01)

    def drain(self) -> None:
        """Run on a little, then abort everything, let the transfers end and the leases
        expire (at most 10 s)."""
        for _ in range(10):
            self.step(self.p)
            self.step(self.d)
            time.sleep(0.002)
        deadline = time.monotonic() + 10
        everyone = [f"r{i}" for i in range(self.n)]
        self.p.abort_requests(everyone)
        self.d.abort_requests(everyone)
        engines = (self.p, self.d)
        while time.monotonic() < deadline and any(
                e.has_transfers() or e.has_unfinished_requests() for e in engines):
            self.clock.t += LEASE + 1
            for engine in engines:
                self.step(engine)
            time.sleep(0.002)
        for engine in engines:
            assert not engine.has_transfers() and not engine.has_unfinished_requests()
            assert free(engine) == usable(engine) and not engine.scheduler.requests

    def shutdown(self) -> None:
        self.p.shutdown()
        self.d.shutdown()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p_blocks=st.integers(4, 16), d_blocks=st.integers(4, 16), caching=st.booleans(),
       slow=st.booleans(), policy=st.sampled_from(["fail", "recompute"]), operations=ops)
def test_random_pd_operations_keep_invariants_and_leak_nothing(p_blocks, d_blocks, caching,
                                                                slow, policy, operations):
    bandwidth = BLOCK_BYTES / (0.02 if slow else 1e-4)   # seconds per block
    world = World(p_blocks, d_blocks, caching, bandwidth, policy)
    try:
        for op in operations:
            world.run(op)
            world.check()
        world.drain()
        event(f"loads finished: {min(world.loads, 2)}, failed: {min(world.failures, 2)}")
    finally:
        world.shutdown()
