"""The router under faults, with real simulated workers: it never fails silently.

One fleet: three correct workers and one started with a different hash seed.
- wrong wiring: the wrong-seed worker, and a correct worker registered with KV-event
  endpoints nobody publishes on, are both named in /health (degraded) and in the alarm
  metric within the liveness window, while every request keeps succeeding;
- a worker killed mid-stream: its stream fails with a clear error, new requests go
  elsewhere, its index entries are dropped; restarted (new epoch), it is re-indexed;
- a router restart rebuilds its index from snapshot/replay, equal to the workers' caches.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
from collections.abc import Iterator

import httpx
import openai
import pytest

from kvloop.front.prometheus_text import metric_value
from kvloop.router.fleet import Fleet, FleetConfig
from kvloop.router.registry import WorkerSpec
from tests.conftest import RouterThread, held_port, sdk, wait_until
from tests.test_router_fleet import (
    SIM_ARGS,
    _drive,
    random_ids,
    router_config,
    shared_prefix_prompts,
)

pytestmark = pytest.mark.processes   # a fleet of real workers; routers on threads

DEAD = "tcp://127.0.0.1:9"   # the discard port: nothing publishes there


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    cfg = FleetConfig(4, "sim", ("both",), SIM_ARGS + ("--num-gpu-blocks-override", "120"),
                      start_timeout_s=120, stop_timeout_s=10, echo_output=False)
    f = Fleet(cfg)
    f.workers[3] = f.worker(3, "--hash-seed", "not-the-fleet-seed")
    try:
        f.start()
        yield f
    finally:
        f.stop()


def _cold_prompts(n: int, seed: int, length: int = 96) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_ids(rng, length) for _ in range(n)]


def _send(url: str, prompts: list[list[int]], concurrency: int = 3) -> None:
    results = asyncio.run(_drive(url, prompts, concurrency, 2))
    assert all(r["usage"]["completion_tokens"] == 2 for r in results)


def test_wrong_seed_and_wrong_endpoint_are_named_while_requests_succeed(fleet):
    good, other, _, wrong_seed = fleet.specs()
    wrong_wire = WorkerSpec(other.url, "both", events_endpoint=DEAD, replay_endpoint=DEAD)
    cfg = router_config(window_s=1.5, verify_min_samples=4)
    with RouterThread(cfg, [good, wrong_wire, wrong_seed]) as rt:
        # the seed is disclosed at registration: refused at once, loudly
        health = httpx.get(rt.url + "/health").json()
        assert health["status"] == "degraded"
        assert any(wrong_seed.name in r and "hash seed" in r for r in health["reasons"])
        # traffic: cold prompts reach every worker; repeats make hits
        workload = [p for _, p in shared_prefix_prompts(6, 64, 16, 4, seed=5)]
        _send(rt.url, _cold_prompts(9, seed=1) + workload)
        wait_until(lambda: any(wrong_wire.name in r for r in
                               httpx.get(rt.url + "/health").json()["reasons"]),
                   6, "the silent worker to be named")
        _send(rt.url, _cold_prompts(6, seed=2) + workload)
        health = httpx.get(rt.url + "/health")
        body = health.json()
        text = httpx.get(rt.url + "/metrics").text
    assert health.status_code == 200 and body["status"] == "degraded"
    reasons = "\n".join(body["reasons"])
    assert f"worker {wrong_wire.name}: silent" in reasons
    assert "kv-events-endpoint" in reasons
    assert f"worker {wrong_seed.name}: config_mismatch" in reasons
    workers = body["workers"]
    assert workers[good.name]["alarms"] == {} and workers[good.name]["routing"] == "cache-aware"
    assert workers[wrong_wire.name]["routing"] == "load-only"
    assert workers[wrong_seed.name]["routing"] == "load-only"
    assert metric_value(text, "kvloop_router_worker_alarm", worker=wrong_wire.name,
                        alarm="silent") == 1
    assert metric_value(text, "kvloop_router_worker_alarm", worker=wrong_seed.name,
                        alarm="config_mismatch") == 1
    assert metric_value(text, "kvloop_router_worker_alarm", worker=good.name) == 0
    assert metric_value(text, "kvloop_router_worker_degraded", worker=good.name) == 0
    assert metric_value(text, "kvloop_router_requests_total", outcome="ok") == 9 + 24 + 6 + 24
    assert metric_value(text, "kvloop_router_decisions_total", reason="load_only") > 0


def _hold(port: int) -> socket.socket | None:
    """`held_port(port)`, or None while the port is still listened on."""
    try:
        return held_port(port)
    except OSError:
        return None


def _stats(url: str) -> dict:
    return httpx.get(url + "/kvloop/stats", timeout=10).json()


def _index(rt: RouterThread) -> dict[str, list[int]]:
    return httpx.get(rt.url + "/router/index").json()["workers"]


def test_killed_worker_fails_its_stream_clearly_and_is_reindexed_after_restart(fleet):
    specs = fleet.specs()[:3]
    victim_proc = None
    with RouterThread(router_config(), specs) as rt:
        _send(rt.url, _cold_prompts(6, seed=3))
        client = sdk(rt.url, "x")
        stream = client.completions.create(model="sim", prompt=[9] * 40, max_tokens=850,
                                           stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        victim = next(w for w in rt.router.registry.all() if w.in_flight())
        victim_proc = next(p for p in fleet.workers if p.url == victim.spec.url)
        wait_until(lambda: rt.router.index.worker_blocks(victim.name) > 0, 5,
                   "the victim's blocks to be indexed")
        os.kill(victim_proc.pid, signal.SIGKILL)
        with pytest.raises(openai.APIError, match=f"worker {victim.name} failed mid-stream"):
            for _ in stream:
                pass
        # new requests go elsewhere; the dead worker's entries are gone
        _send(rt.url, _cold_prompts(6, seed=4))
        assert not victim.up
        assert _index(rt)[victim.name] == []
        health = httpx.get(rt.url + "/health").json()
        assert health["status"] == "degraded"
        assert any(f"worker {victim.name} is down" in r for r in health["reasons"])
        # restart it on the same port: a new epoch, re-registered by the poller. The port is
        # held from the moment the dead worker lets it go until the new one listens on it
        old_epoch = victim.description.epoch
        port = int(victim.spec.url.rsplit(":", 1)[1])
        index = fleet.workers.index(victim_proc)
        with wait_until(lambda: _hold(port), 10, f"port {port} to be let go"):
            restarted = fleet.worker(index, "--port", str(port))
            fleet.workers[index] = restarted
            restarted.start(60)
        wait_until(lambda: victim.up, 10, "the restarted worker to be registered")
        assert victim.description.epoch != old_epoch
        prompts = _cold_prompts(8, seed=6)
        _send(rt.url, prompts)
        served = victim.served
        assert served > 0
        wait_until(lambda: len(_index(rt)[victim.name])
                   == _stats(victim.spec.url)["num_cached_blocks"] > 0,
                   5, "the restarted worker to be re-indexed")
        assert httpx.get(rt.url + "/health").json()["status"] == "ok"


def test_router_restart_rebuilds_the_index_from_the_workers(fleet):
    specs = fleet.specs()[:3]
    workload = [p for _, p in shared_prefix_prompts(8, 80, 16, 3, seed=9)]
    with RouterThread(router_config(), specs) as first:
        _send(first.url, workload + _cold_prompts(6, seed=7))
        before = wait_until(lambda: _settled(first, specs), 5, "events to settle")
    with RouterThread(router_config(), specs) as second:
        after = wait_until(lambda: _settled(second, specs), 10, "the new router to catch up")
        assert after == before
        # and it routes on it: a repeated prompt is a predicted hit
        r = httpx.post(second.url + "/v1/completions",
                       json={"prompt": workload[0], "max_tokens": 1}).json()
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 80
        text = httpx.get(second.url + "/metrics").text
        assert metric_value(text, "kvloop_router_predicted_hit_tokens_total") >= 80


def _settled(rt: RouterThread, specs: list[WorkerSpec]) -> dict[str, list[int]] | None:
    """The router's index when every worker's entry count equals its engine's cache."""
    index = _index(rt)
    for s in specs:
        if len(index.get(s.name, [])) != _stats(s.url)["num_cached_blocks"]:
            return None
    return index
