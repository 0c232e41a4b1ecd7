"""Flow control in front of real simulated workers on 127.0.0.1, offered 3x their capacity.

Two `kvloop serve --model sim` workers with `--max-num-seqs 2` (the fleet runs 4 requests
at once); the router runs in-process with flow control on and no request waiting in an
engine (`max_waiting` 0). Prompts are random ids (no cache hits), so every request costs
the same; load comes from closed-loop clients that stop at a deadline.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvloop.front.prometheus_text import metric_value
from kvloop.router.config import LivenessConfig, RouterConfig
from kvloop.router.fleet import Fleet, FleetConfig
from kvloop.router.flow import FAIRNESS_HEADER, OBJECTIVE_HEADER
from kvloop.router.flow_config import FlowConfig, Objective

from .conftest import RouterThread
from .test_router_fleet import random_ids

pytestmark = pytest.mark.processes

SEQS, WORKERS = 2, 2
CAPACITY = SEQS * WORKERS
SIM_ARGS = ("--sim-speedup", "5", "--max-num-seqs", str(SEQS),
            "--max-num-batched-tokens", "2048")
# high priority: long prompts, its TTFT mostly prefill; the load: short prompts that decode
HIGH_PROMPT, LOW_PROMPT, MAX_TOKENS = 1024, 32, 16
FLOW = FlowConfig(enabled=True, max_waiting=0, staleness_s=2.0, max_queue=256,
                  queue_timeout_s=25.0,
                  objectives=(Objective("chat", 10), Objective("batch", -1)),
                  trusted_front=True)   # the test plays the gateway that sets the headers


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    f = Fleet(FleetConfig(WORKERS, "sim", ("both",), SIM_ARGS, start_timeout_s=120,
                          stop_timeout_s=10, echo_output=False))
    f.start()
    try:
        yield f
    finally:
        f.stop()


def flow_router(fleet: Fleet) -> RouterThread:
    cfg = RouterConfig(liveness=LivenessConfig(poll_interval_s=0.1), flow=FLOW)
    return RouterThread(cfg, fleet.specs())


def body(rng: random.Random, prompt_len: int = LOW_PROMPT, **extra: Any) -> dict[str, Any]:
    return {"prompt": random_ids(rng, prompt_len), "max_tokens": MAX_TOKENS,
            "ignore_eos": True, **extra}


async def _ttft(client: httpx.AsyncClient, rng: random.Random) -> float:
    """Seconds to the first token of one streamed high-priority request."""
    t0 = time.perf_counter()
    req = body(rng, HIGH_PROMPT, stream=True, max_tokens=2)
    async with client.stream("POST", "/v1/completions", json=req,
                             headers={OBJECTIVE_HEADER: "chat"}) as r:
        assert r.status_code == 200, await r.aread()
        ttft = None
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data:"):
                ttft = time.perf_counter() - t0
    assert ttft is not None
    return ttft


async def _closed_loop(client: httpx.AsyncClient, rng: random.Random, until: float,
                       headers: dict[str, str], statuses: list[int],
                       tokens: list[int]) -> None:
    """Send back to back until `until`; every status, and the completion tokens of each 200
    answered before `until` (the backlog queued then is served after: not while every
    client is backlogged)."""
    while time.perf_counter() < until:
        r = await client.post("/v1/completions", json=body(rng), headers=headers)
        statuses.append(r.status_code)
        if r.status_code == 200 and time.perf_counter() < until:
            tokens.append(r.json()["usage"]["completion_tokens"])
        elif r.status_code == 429:
            assert r.headers["retry-after"] and r.json()["error"]["code"] == 429
            await asyncio.sleep(0.2)


def p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))]


def test_saturated_fleet_serves_high_priority_first_and_sheds_sheddable(fleet):
    async def run(url: str) -> dict[str, Any]:
        rng = random.Random(1)
        async with httpx.AsyncClient(base_url=url, timeout=60,
                                     limits=httpx.Limits(max_connections=128)) as client:
            for _ in range(3):                       # warm the connections up
                await _ttft(client, rng)
            idle = [await _ttft(client, rng) for _ in range(25)]
            until = time.perf_counter() + 12.0
            low: list[int] = []
            shed: list[int] = []
            loops = [_closed_loop(client, random.Random(10 + i), until, {}, low, [])
                     for i in range(3 * CAPACITY)]
            loops += [_closed_loop(client, random.Random(50 + i), until,
                                   {OBJECTIVE_HEADER: "batch"}, shed, [])
                      for i in range(2)]
            load = asyncio.gather(*loops)
            await asyncio.sleep(1.0)                 # the queue fills
            busy = []
            while time.perf_counter() < until - 1.0:
                busy.append(await _ttft(client, rng))
                await asyncio.sleep(0.02)
            await load
            idle += [await _ttft(client, rng) for _ in range(25)]   # the box's load drifts
            return {"idle": idle, "busy": busy, "low": low, "shed": shed}

    with flow_router(fleet) as rt:
        out = asyncio.run(run(rt.url))
        metrics = httpx.get(rt.url + "/metrics").text
    idle, busy = out["idle"], out["busy"]
    summary = (f"idle p50 {statistics.median(idle):.3f} p99 {p99(idle):.3f}; busy p50 "
               f"{statistics.median(busy):.3f} p99 {p99(busy):.3f} ({len(busy)} samples); "
               f"low {len(out['low'])} sheddable {len(out['shed'])}")
    print(summary)
    assert len(busy) >= 20, summary   # ~0.3 s each; a loaded box gives fewer
    assert p99(busy) <= 2 * p99(idle), summary
    assert set(out["low"]) == {200}, summary               # low priority waits, never fails
    assert 429 in out["shed"] and set(out["shed"]) <= {200, 429}, summary
    waited = metric_value(metrics, 'kvloop_router_flow_wait_seconds_sum{priority="0"}')
    assert waited > 1.0, summary                           # it waited at the router
    assert metric_value(metrics, 'kvloop_router_flow_rejections_total'
                                 '{priority="-1",reason="shed"}') >= 1


SMALL = CAPACITY   # the small tenant's clients: as many as the fleet runs at once


def test_two_backlogged_tenants_offering_10_to_1_share_the_served_tokens(fleet):
    async def run(url: str) -> tuple[list[int], list[int], list[int]]:
        statuses: list[int] = []
        big: list[int] = []
        small: list[int] = []
        async with httpx.AsyncClient(base_url=url, timeout=60,
                                     limits=httpx.Limits(max_connections=128)) as client:
            until = time.perf_counter() + 8.0
            loops = [_closed_loop(client, random.Random(i), until, {FAIRNESS_HEADER: "big"},
                                  statuses, big) for i in range(10 * SMALL)]
            loops += [_closed_loop(client, random.Random(100 + i), until,
                                   {FAIRNESS_HEADER: "small"}, statuses, small)
                      for i in range(SMALL)]
            await asyncio.gather(*loops)
        return statuses, big, small

    with flow_router(fleet) as rt:
        statuses, big, small = asyncio.run(run(rt.url))
    share = sum(small) / (sum(small) + sum(big))
    summary = f"small share {share:.2f}: {len(small)} vs {len(big)} requests served"
    print(summary)
    assert set(statuses) == {200}, summary
    assert 0.4 <= share <= 0.6, summary
