"""Router replicas that agree (kvloop/router/replicas.py), with a real nats-server and real
simulated workers: a burst split across two replicas lands on the workers as it does from
one router.

- a hot prefix, 16 concurrent requests: one router lets its holder take `saturation_floor`
  (8) and replicates the prefix to one more worker; two replicas that do not share their
  load each let the holder take 8 (all 16 on one worker); two that share do as one router;
- 200 concurrent requests of 8 prefixes split between two replicas: per-worker load within
  25 % of one router's;
- `ReplicaSync` between two in-process routers: what a peer applies, what it refuses, and
  that a ticket never closed is dropped.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from dataclasses import replace

import httpx
import pytest

from kvloop.events.config import NatsPlaneConfig
from kvloop.front.prometheus_text import metric_value
from kvloop.router.config import BusConfig, RouterConfig
from kvloop.router.fleet import Fleet, FleetConfig
from kvloop.router.registry import WorkerSpec

from .bus_helpers import NATS_PASSWORD, NATS_USER, nats_server
from .conftest import RouterThread
from .test_router_fleet import SIM_ARGS, random_ids, router_config, shared_prefix_prompts


@pytest.fixture(scope="module")
def bus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BusConfig]:
    with nats_server(tmp_path_factory.mktemp("nats")) as srv:
        plane = NatsPlaneConfig(f"nats://{srv.host}:{srv.port}", user=NATS_USER,
                                password=NATS_PASSWORD, namespace="replicas")
        yield BusConfig(plane=plane, allow_unsigned=True)   # sim workers sign nothing


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    f = Fleet(FleetConfig(4, "sim", ("both",), SIM_ARGS + ("--sim-speedup", "4"),
                          start_timeout_s=120, stop_timeout_s=10, echo_output=False))
    try:
        f.start()
        yield f
    finally:
        f.stop()


def _burst(urls: list[str], prompts: list[list[int]], max_tokens: int,
           paced: list[RouterThread] | None = None) -> None:
    """Every prompt at once, the i-th to `urls[i % len(urls)]`. With `paced` (the routers
    behind `urls`, sharing a bus), the i-th is sent once every other router has applied the
    opens of those before it: the burst then tests what replicas do with what they were told,
    not whether NATS outran 16 concurrent routing decisions (it did not, under load)."""
    async def go() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(i: int, p: list[int]) -> None:
                r = await client.post(urls[i % len(urls)] + "/v1/completions", json={
                    "prompt": p, "max_tokens": max_tokens, "ignore_eos": True})
                assert r.status_code == 200, r.text
            base = [_opened(rt) for rt in paced or []]
            tasks = []
            for i, p in enumerate(prompts):
                tasks.append(asyncio.create_task(one(i, p)))
                if paced:
                    await _peers_told(paced, base, i + 1)
            await asyncio.gather(*tasks)
    asyncio.run(go())


def _opened(rt: RouterThread) -> int:
    """Peer opens `rt`'s ReplicaSync has applied."""
    from kvloop.router.replicas import ReplicaSync

    assert isinstance(rt.router.replicas, ReplicaSync)
    return rt.router.replicas.describe()["applied"]


async def _peers_told(routers: list[RouterThread], base: list[int], sent: int) -> None:
    """Wait until each router has applied the opens of the first `sent` requests of a paced
    burst that the others routed (request k went to router k % n)."""
    n = len(routers)
    want = [b + sum(1 for k in range(sent) if k % n != j) for j, b in enumerate(base)]
    deadline = time.monotonic() + 30
    while any(_opened(rt) < w for rt, w in zip(routers, want, strict=True)):
        assert time.monotonic() < deadline, ([_opened(rt) for rt in routers], want)
        await asyncio.sleep(0.005)


def _served(urls: list[str], specs: list[WorkerSpec]) -> list[float]:
    """Requests each worker got from these routers, most first."""
    texts = [httpx.get(u + "/metrics").text for u in urls]
    return sorted((sum(metric_value(t, "kvloop_router_requests_total", worker=s.name)
                       for t in texts) for s in specs), reverse=True)


def _hot_burst(fleet: Fleet, configs: list[RouterConfig], seed: int) -> list[float]:
    """One request makes a prefix hot on one worker; then 16 with it at once, split across
    the routers (paced by what the peers were told where they share a bus): what each worker
    got of the 16."""
    rng = random.Random(seed)
    prefix = random_ids(rng, 256)
    specs = fleet.specs()
    routers = [RouterThread(c, specs) for c in configs]
    try:
        for rt in routers:
            rt.__enter__()
        urls = [rt.url for rt in routers]
        _burst(urls[:1], [prefix + random_ids(rng, 16)], 1)
        time.sleep(0.3)   # its provisional entry is the router's; the cache is the worker's
        before = _served(urls, specs)
        shared = [rt for rt in routers if rt.router.replicas is not None]
        _burst(urls, [prefix + random_ids(rng, 16) for _ in range(16)], 200,
               paced=shared if len(shared) > 1 else None)
        return [a - b for a, b in zip(_served(urls, specs), before, strict=True)]
    finally:
        for rt in routers:
            rt.__exit__(None, None, None)


@pytest.mark.processes
def test_a_hot_burst_split_across_replicas_lands_as_from_one_router(fleet, bus):
    one = _hot_burst(fleet, [router_config()], seed=1)
    assert one[0] <= 9 and sum(one) == 16
    apart = _hot_burst(fleet, [router_config(), router_config()], seed=2)
    assert apart[0] == 16          # each replica alone lets the holder take its floor
    shared = _hot_burst(fleet, [replace(router_config(), bus=bus) for _ in range(2)], seed=3)
    assert shared[0] <= 1.25 * one[0], (one, shared)


@pytest.mark.processes
def test_200_concurrent_requests_split_between_replicas_load_workers_as_one_router(fleet,
                                                                                    bus):
    def run(configs: list[RouterConfig], seed: int) -> list[float]:
        prompts = [p for _, p in shared_prefix_prompts(8, 256, 32, 25, seed=seed)]
        routers = [RouterThread(c, fleet.specs()) for c in configs]
        try:
            for rt in routers:
                rt.__enter__()
            _burst([rt.url for rt in routers], prompts, 16)
            return _served([rt.url for rt in routers], fleet.specs())
        finally:
            for rt in routers:
                rt.__exit__(None, None, None)

    one = run([router_config()], seed=4)
    two = run([replace(router_config(), bus=bus) for _ in range(2)], seed=5)
    assert sum(one) == sum(two) == 200
    assert two[0] <= 1.25 * one[0], (one, two)


# --- ReplicaSync between two in-process routers ------------------------------------------------
class Loopback:
    """An in-process bus: every message published reaches every subscriber, the publisher's
    own included (as on NATS)."""

    def __init__(self) -> None:
        self.subscribers: list = []
        self.published: list[bytes] = []

    def subscribe(self, subject: str, callback) -> None:
        self.subscribers.append((subject, callback))

    def publish(self, subject: str, payload: bytes) -> None:
        self.published.append(payload)
        for s, cb in self.subscribers:
            if s == subject:
                cb(subject, payload, {})


def _replicas():
    from kvloop.router.replicas import ReplicaSync
    from tests.test_router_core import desc, make_router

    bus = Loopback()
    pair = []
    for _ in range(2):
        r, clock, _ = make_router()
        r.register(WorkerSpec("http://w:1"), desc())
        r.register(WorkerSpec("http://w:2"), desc())
        pair.append((r, clock, ReplicaSync(r, bus, "ns").start()))  # type: ignore[arg-type]
    return bus, pair


def test_a_peer_sees_each_ticket_opened_started_and_closed():
    bus, ((a, _, _), (b, _, sync_b)) = _replicas()
    routed = a.route(list(range(64)))
    w = b.registry.get(routed.worker.name)
    assert w is not None and w.in_flight() == 1 and len(w.prefilling()) == 1
    hashes = a.block_hashes(list(range(64)))
    assert b.index.match(hashes, [w.name]) == {w.name: 4}   # provisional: it will cache them
    assert a.registry.get(w.name).in_flight() == 1          # its own message changes nothing
    a.first_token(routed.ticket)
    a.first_token(routed.ticket)                            # one "first", not one per chunk
    assert len(bus.published) == 2 and w.prefilling() == []
    a.finish(routed.ticket, None)
    assert w.in_flight() == 0 and w.served == 0 and w.failed == 0
    assert sync_b.describe() == {"peer_in_flight": 0, "received": 3, "applied": 1,
                                 "refused": 0}


def test_a_peer_refuses_what_it_cannot_apply_and_drops_what_is_never_closed():
    import msgspec

    from kvloop.router.replicas import MAX_HASHES
    from kvloop.wire import RouterLoad

    bus, ((a, _, _), (b, clock_b, sync_b)) = _replicas()
    send = lambda **kw: bus.publish(sync_b.subject, msgspec.json.encode(  # noqa: E731
        RouterLoad(replica="peer", **kw)))
    bus.publish(sync_b.subject, b"not json")
    send(ticket=1, op="open", worker="nobody:1", prompt_tokens=5)
    send(ticket=2, op="open", worker="w:1", prompt_tokens=5, hashes=[1] * (MAX_HASHES + 1))
    send(ticket=3, op="open", worker="w:1", prompt_tokens=5, uncached_tokens=9)
    assert sync_b.refused == 4 and b.registry.get("w:1").in_flight() == 0
    send(ticket=4, op="open", worker="w:1", prompt_tokens=5)
    send(ticket=4, op="open", worker="w:1", prompt_tokens=5)   # twice: once
    assert b.registry.get("w:1").in_flight() == 1 and sync_b.refused == 5
    clock_b.t += b.config.liveness.request_timeout_s + 1
    b.check_liveness()
    assert b.registry.get("w:1").in_flight() == 0
