"""The shared Redis index under faults (issue 25), with a real redis-server and real workers:

- Redis restarts (its data gone): the router notices, asks every worker for its blocks again,
  and predicted cached tokens equal the reported ones within 10 s; /health names the resync;
- Redis frozen (SIGSTOP): requests keep being served, at most the first decision waits on
  Redis (the index is marked down at once and later decisions use the router's own view),
  /health and the `kvloop_router_index_degraded` gauge name the index problem; thawed, it is
  resynced.

"Predicted equals reported" always compares one request's two figures (the router's
prediction for it and the hit its worker reported), never two requests'.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import httpx
import pytest

from kvloop.front.prometheus_text import metric_value
from kvloop.router.config import IndexConfig, LivenessConfig, RouterConfig
from kvloop.router.registry import WorkerSpec
from kvloop.router.services import redis_url

from .bus_helpers import redis_server
from .conftest import RouterThread, serving, wait_until

pytestmark = pytest.mark.processes

DOWN = "decisions use this router's own view"   # /health while Redis does not answer
PROMPTS = [[100 + i] * 64 + [7] * 5 for i in range(4)]   # 4 full blocks each


@pytest.fixture(scope="module")
def workers(tmp_path_factory) -> Iterator[list]:
    """Two workers whose publishers answer snapshots (a replay socket), as kvloop's do."""
    from contextlib import ExitStack

    args = ["--model", "sim", "--kv-events-endpoint", "tcp://127.0.0.1:0",
            "--kv-events-replay-endpoint", "tcp://127.0.0.1:0",
            "--num-gpu-blocks-override", "128", "--sim-speedup", "40"]
    with ExitStack() as stack:
        yield [stack.enter_context(serving(tmp_path_factory, f"r{i}", args)) for i in range(2)]


@pytest.fixture
def redis(tmp_path):
    with redis_server(tmp_path) as srv:
        yield srv


def _router(srv, workers) -> RouterThread:
    # provisional entries off: a prediction can only come from the index itself
    cfg = RouterConfig(index=IndexConfig(url=redis_url(srv), provisional_ttl_s=0.0),
                       liveness=LivenessConfig(poll_interval_s=0.5))
    return RouterThread(cfg, [WorkerSpec(w.url) for w in workers])


def _totals(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return (metric_value(text, "kvloop_router_predicted_hit_tokens_total"),
            metric_value(text, "kvloop_router_actual_hit_tokens_total"))


def _send(url: str, prompt: list[int]) -> tuple[float, float]:
    """(predicted, reported) cached tokens of one request through the router."""
    before = _totals(url)
    r = httpx.post(url + "/v1/completions", timeout=30,
                   json={"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text
    after = _totals(url)
    return after[0] - before[0], after[1] - before[1]


def _predicted_right(url: str, prompt: list[int]) -> bool:
    """One request: the router predicted exactly the cached tokens its worker reported, and
    some were cached."""
    predicted, reported = _send(url, prompt)
    return predicted == reported > 0


def _predictions_right(rt: RouterThread) -> bool:
    return all([_predicted_right(rt.url, p) for p in PROMPTS])   # each prompt sent once


def _warm(rt: RouterThread) -> None:
    """Every prompt cached on its worker, and predicted as such."""
    for p in PROMPTS:
        _send(rt.url, p)
    wait_until(lambda: _predictions_right(rt), 10, "predictions to equal the reported hits")


def _index_down(rt: RouterThread) -> bool:
    return any("unreachable" in a for a in rt.router.index.alarms())


def test_a_redis_restart_is_resynced_from_the_workers_within_10_s(redis, workers):
    with _router(redis, workers) as rt:
        _warm(rt)
        redis.stop()
        redis.start()
        assert httpx.get(rt.url + "/health").status_code == 200
        wait_until(lambda: _predictions_right(rt), 10, "predictions right again")
        reasons = httpx.get(rt.url + "/health").json()["reasons"]
        assert any("shared index" in r and "resynced from the workers" in r for r in reasons)
        assert rt.router.index.resyncs >= 1


def test_a_frozen_redis_stalls_no_request_and_is_named(redis, workers):
    with _router(redis, workers) as rt:
        _warm(rt)
        os.kill(redis.proc.pid, signal.SIGSTOP)
        try:
            assert _send(rt.url, PROMPTS[0])[1] > 0   # its read timed out: the local view
            wait_until(lambda: _index_down(rt), 10, "the index to be marked down")
            for p in PROMPTS * 2:   # none of these reads Redis: no stall, hits as before
                assert _send(rt.url, p)[1] > 0
                assert _index_down(rt), "a decision while Redis is frozen brought it back"
            health = httpx.get(rt.url + "/health", timeout=5)   # the loop never waits on it
            assert health.status_code == 200 and health.json()["status"] == "degraded"
            assert any("shared index" in r and DOWN in r for r in health.json()["reasons"])
            text = httpx.get(rt.url + "/metrics", timeout=5).text
            assert metric_value(text, "kvloop_router_index_degraded") == 1
        finally:
            os.kill(redis.proc.pid, signal.SIGCONT)
        wait_until(lambda: not any(DOWN in r for r in
                                   httpx.get(rt.url + "/health").json()["reasons"]),
                   5, "the index to be back")
        reasons = httpx.get(rt.url + "/health").json()["reasons"]
        assert any("resynced from the workers" in r for r in reasons), reasons
        wait_until(lambda: _predictions_right(rt), 10, "predictions right again")
