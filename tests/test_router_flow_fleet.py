"""Flow control in front of real simulated workers on 127.0.0.1, offered 3x their capacity.

Two `kvloop serve --model sim` workers with `--max-num-seqs 2` (the fleet runs 4 requests
at once); the router runs in-process with flow control on and no request waiting in an
engine (`max_waiting` 0). Prompts are random ids (no cache hits), so every request costs
the same; load comes from closed-loop clients. The tests assert orders and counts read from
the router's own queue and metrics, never a latency (the figures are the benchmarks').
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from kvloop.front.prometheus_text import metric_value
from kvloop.router.config import LivenessConfig, RouterConfig
from kvloop.router.fleet import Fleet, FleetConfig
from kvloop.router.flow import FAIRNESS_HEADER, OBJECTIVE_HEADER, FlowQueue, Waiter
from kvloop.router.flow_config import FlowConfig, Objective

from .conftest import RouterThread
from .test_router_fleet import random_ids

pytestmark = pytest.mark.processes

SEQS, WORKERS = 2, 2
CAPACITY = SEQS * WORKERS
SIM_ARGS = ("--sim-speedup", "5", "--max-num-seqs", str(SEQS),
            "--max-num-batched-tokens", "2048")
LOW_PROMPT, MAX_TOKENS = 32, 16
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


def body(rng: random.Random, **extra: Any) -> dict[str, Any]:
    return {"prompt": random_ids(rng, LOW_PROMPT), "max_tokens": MAX_TOKENS,
            "ignore_eos": True, **extra}


class RecordingQueue(FlowQueue):
    """The router's own queue, noting in order each waiter that enters and leaves it (released
    or gone) as (what, band, seq): the router's dispatch order, read after the run."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, int, int]] = []

    def push(self, w: Waiter) -> None:
        self.log.append(("push", w.key.priority, w.seq))
        super().push(w)

    def pop(self) -> Waiter | None:
        w = super().pop()
        if w is not None:
            self.log.append(("pop", w.key.priority, w.seq))
        return w

    def remove(self, w: Waiter) -> bool:
        removed = super().remove(w)
        if removed:
            self.log.append(("gone", w.key.priority, w.seq))
        return removed


def overtakes(log: list[tuple[str, int, int]], high: int, low: int) -> tuple[list[int], list]:
    """Per `high` waiter, how many `low` ones queued before it were still queued when it was
    released; and every violation of band order (a `low` released while a `high` waited)."""
    queued: dict[int, set[int]] = {high: set(), low: set()}
    ahead: dict[int, set[int]] = {}
    counts: list[int] = []
    violations = []
    for what, band, seq in log:
        if what == "push":
            queued[band].add(seq)
            if band == high:
                ahead[seq] = set(queued[low])
            continue
        queued[band].discard(seq)
        if what == "pop" and band == high:
            counts.append(len(ahead.pop(seq) & queued[low]))
        elif what == "pop" and band == low and queued[high]:
            violations.append((seq, sorted(queued[high])))
    return counts, violations


async def _closed_loop(client: httpx.AsyncClient, rng: random.Random,
                       running: Callable[[], bool], headers: dict[str, str],
                       statuses: list[int], tokens: list[int]) -> None:
    """Send back to back while `running()`; every status, and the completion tokens of each
    200 answered while still running (the backlog queued then is served after: not while
    every client is backlogged)."""
    while running():
        r = await client.post("/v1/completions", json=body(rng), headers=headers)
        statuses.append(r.status_code)
        if r.status_code == 200 and running():
            tokens.append(r.json()["usage"]["completion_tokens"])
        elif r.status_code == 429:
            assert r.headers["retry-after"] and r.json()["error"]["code"] == 429
            await asyncio.sleep(0.2)


OVERTAKES = 8   # high-priority requests that must pass queued low ones before the run ends


def test_saturated_fleet_serves_high_priority_first_and_sheds_sheddable(fleet):
    """Low-priority clients (3x the fleet's slots) keep the router's queue full while one
    high-priority client sends one request at a time, and two sheddable ones try too. From the
    router's own queue: no low request is released while a high one waits; the high ones
    released past low ones queued before them (counted until OVERTAKES of them, not timed);
    every low request served, sheddable ones refused with 429."""
    async def run(url: str, queue: RecordingQueue) -> dict[str, Any]:
        rng = random.Random(1)
        stop = asyncio.Event()
        async with httpx.AsyncClient(base_url=url, timeout=120,
                                     limits=httpx.Limits(max_connections=128)) as client:
            low: list[int] = []
            shed: list[int] = []
            high: list[int] = []
            loops = [_closed_loop(client, random.Random(10 + i), lambda: not stop.is_set(),
                                  {}, low, []) for i in range(3 * CAPACITY)]
            loops += [_closed_loop(client, random.Random(50 + i), lambda: not stop.is_set(),
                                   {OBJECTIVE_HEADER: "batch"}, shed, [])
                      for i in range(2)]
            load = asyncio.gather(*loops)
            deadline = time.monotonic() + 120      # a bound, not a figure: counts end it
            while time.monotonic() < deadline:
                r = await client.post("/v1/completions", json=body(rng, max_tokens=2),
                                      headers={OBJECTIVE_HEADER: "chat"})
                high.append(r.status_code)
                passed, _ = overtakes(list(queue.log), 10, 0)
                if sum(n > 0 for n in passed) >= OVERTAKES and 429 in shed:
                    break
            stop.set()
            await load
            return {"low": low, "shed": shed, "high": high}

    with flow_router(fleet) as rt:
        queue = RecordingQueue()
        rt.server.app.flow.queue = queue        # empty until the first request
        out = asyncio.run(run(rt.url, queue))
        metrics = httpx.get(rt.url + "/metrics").text
    passed, violations = overtakes(queue.log, 10, 0)
    summary = (f"high {len(out['high'])} sent, {len(passed)} queued, overtaking {passed}; "
               f"low {len(out['low'])} sheddable {len(out['shed'])}")
    print(summary)
    assert violations == [], summary                       # band order, every release
    assert sum(n > 0 for n in passed) >= OVERTAKES, summary
    assert set(out["high"]) == {200}, summary
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
            running = lambda: time.perf_counter() < until  # noqa: E731
            loops = [_closed_loop(client, random.Random(i), running, {FAIRNESS_HEADER: "big"},
                                  statuses, big) for i in range(10 * SMALL)]
            loops += [_closed_loop(client, random.Random(100 + i), running,
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
