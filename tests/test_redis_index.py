"""The shared index in a real redis-server: llm-d's layout, replicas that see one view, a
replica's own resync that keeps the shared view, a cleared worker gone for all, Redis down
without a failed decision, and router replicas that agree on every decision."""

from __future__ import annotations

import json

import httpx
import pytest

from kvloop.router.config import IndexConfig, LivenessConfig, RouterConfig
from kvloop.router.redis_index import RedisIndex, pod_entry
from kvloop.router.router import make_index
from kvloop.router.services import redis_url

from .bus_helpers import redis_server
from .conftest import RouterThread, serving, wait_until

pytestmark = pytest.mark.processes


@pytest.fixture
def redis(tmp_path):
    with redis_server(tmp_path) as srv:
        yield srv


def shared(srv, **kw) -> RedisIndex:
    ix = make_index(IndexConfig(url=redis_url(srv), **kw))
    assert isinstance(ix, RedisIndex)
    for name in ("a:1", "b:2"):
        ix.add_worker(name, 100)
    return ix


def test_llm_d_layout(redis):
    ix = shared(redis)
    ix.store("a:1", [11, 12])
    r = ix.client
    assert r.hkeys("11") == [pod_entry("a:1")]
    assert json.loads(pod_entry("a:1")) == {"PodIdentifier": "a:1", "DeviceTier": "gpu"}
    assert r.hget("11", pod_entry("a:1")) == b""
    assert r.zrange("engine:12", 0, -1, withscores=True) == [(b"12", 0.0)]
    assert r.smembers("kvloop:pod:a:1") == {b"11", b"12"}
    ix.remove("a:1", [12])
    assert not r.exists("12") and not r.exists("engine:12")
    assert r.ttl("11") == -1   # nothing expires


def test_lower_tiers_stay_in_the_replica_and_extend_the_shared_device_prefix(redis):
    one, two = shared(redis), shared(redis)
    one.store("a:1", [1, 2])                          # device: mirrored into Redis
    one.store("a:1", [2, 3], "host_pinned")           # host: this replica's view only
    r = one.client
    assert r.hkeys("3") == [] and r.smembers("kvloop:pod:a:1") == {b"1", b"2"}
    assert one.match_tiers([1, 2, 3, 4]) == {"a:1": ("device", "device", "host_pinned")}
    assert two.match_tiers([1, 2, 3, 4]) == {"a:1": ("device", "device")}
    one.remove("a:1", [3], "host_pinned")             # never a Redis removal
    assert one.match_tiers([1, 2, 3]) == {"a:1": ("device", "device")}
    assert r.hkeys("2") == [pod_entry("a:1")]


def test_replicas_share_one_view(redis):
    one, two = shared(redis), shared(redis)
    one.store("a:1", [1, 2, 3])
    one.store("b:2", [1, 2])
    assert two.match([1, 2, 3, 4]) == {"a:1": 3, "b:2": 2} == one.match([1, 2, 3, 4])
    two.store("a:1", [1, 2, 3])          # the same events, applied by the other replica
    one.remove("a:1", [3])
    two.remove("a:1", [3])
    assert two.match([1, 2, 3]) == {"a:1": 2, "b:2": 2}
    assert two.match([1, 2, 3], workers=["b:2"]) == {"b:2": 2}


def test_forgetting_keeps_the_shared_view_and_clearing_drops_it(redis):
    one, two = shared(redis), shared(redis)
    one.store("a:1", [1, 2])
    assert one.forget_worker("a:1") == 2
    assert one.worker_blocks("a:1") == 0 and one.match([1, 2]) == {"a:1": 2}
    one.remove("a:1", [2])                # a removal of a block this replica never saw
    assert two.match([1, 2]) == {"a:1": 1}
    two.clear_worker("a:1")
    assert one.match([1, 2]) == {} and one.client.smembers("kvloop:pod:a:1") == set()


def test_local_bounds_evict_in_redis_too(redis):
    ix = make_index(IndexConfig(url=redis_url(redis), max_blocks_per_worker=3))
    ix.add_worker("a:1")
    ix.store("a:1", [1, 2, 3, 4, 5])
    assert ix.match([4, 5]) == {"a:1": 2} and ix.match([1]) == {}
    ix.check_invariants()


def test_provisional_entries_stay_in_the_replica(redis):
    one, two = shared(redis, provisional_ttl_s=30), shared(redis)
    one.add_provisional("a:1", [7, 8])
    assert one.match([7, 8]) == {"a:1": 2} and two.match([7, 8]) == {}
    assert one.match([7, 8], include_provisional=False) == {}


def test_redis_down_never_fails_a_decision(redis):
    ix = shared(redis)
    ix.store("a:1", [1, 2])
    redis.stop()
    assert ix.match([1, 2]) == {"a:1": 2}       # this replica's own view
    ix.store("a:1", [3])
    assert ix.errors >= 2 and ix.worker_blocks("a:1") == 3


def test_a_redis_password_from_the_flags(tmp_path):
    from kvloop.router.services import local_redis

    from .conftest import held_port

    with held_port() as hold:
        port = hold.getsockname()[1]
        with local_redis("127.0.0.1", port, tmp_path / "r.log", password="pw-77") as srv:
            with pytest.raises(OSError):
                make_index(IndexConfig(url=redis_url(srv)))
            ix = make_index(IndexConfig(url=redis_url(srv), password="pw-77"))
            ix.add_worker("a:1")
            ix.store("a:1", [5])
            assert ix.match([5]) == {"a:1": 1}


def test_an_unreachable_index_fails_the_start_clearly(redis):
    url = f"redis://user:pw-secret@{redis.host}:1"
    with pytest.raises(OSError) as err:
        make_index(IndexConfig(url=url))
    assert "pw-secret" not in str(err.value) and "***@" in str(err.value)


# --- two router replicas ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def zmq_workers(tmp_path_factory):
    """Two workers on ZMQ without a replay socket (as vLLM by default): a router that joins
    late learns nothing of what they cached before."""
    from contextlib import ExitStack

    args = ["--model", "sim", "--kv-events-endpoint", "tcp://127.0.0.1:0",
            "--num-gpu-blocks-override", "128"]
    with ExitStack() as stack:
        yield [stack.enter_context(serving(tmp_path_factory, f"z{i}", args)) for i in range(2)]


def replica(srv, workers) -> RouterThread:
    from kvloop.router.registry import WorkerSpec

    # one poll at start, none during the test: both replicas then see the same load (their
    # own tickets), so only the shared index could make their decisions differ; with frequent
    # polls each replica samples the workers' queues at other moments (flaky under load)
    cfg = RouterConfig(index=IndexConfig(url=redis_url(srv)),
                       liveness=LivenessConfig(poll_interval_s=60.0))
    return RouterThread(cfg, [WorkerSpec(w.url) for w in workers])


def stream(n: int) -> list[list[int]]:
    """Prompts over four shared prefixes, so decisions follow cached prefixes."""
    return [[10 + i % 4] * 48 + [200 + i] * 20 for i in range(n)]


def _send_and_settle(worker_url: str, prompt: list[int], replicas: list[RouterThread],
                     name: str) -> None:
    r = httpx.post(worker_url + "/v1/completions", timeout=30,
                   json={"model": "sim", "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200
    hashes = replicas[0].router.block_hashes(prompt)
    wait_until(lambda: all(rt.router.index.match(hashes, [name]).get(name) == len(hashes)
                           for rt in replicas), 10, "every replica to see the new blocks")


def test_two_replicas_agree_on_every_decision_and_a_restarted_one_routes_at_once(
        redis, zmq_workers):
    with replica(redis, zmq_workers) as one, replica(redis, zmq_workers) as two:
        urls = {w.url.split("//")[1]: w.url for w in zmq_workers}
        for rt in (one, two):
            wait_until(lambda rt=rt: sum(w.up for w in rt.router.registry.all()) == 2, 10,
                       "both workers up")
        decisions = []
        for p in stream(12):
            a, b = one.router.route(p), two.router.route(p)
            decisions.append((a.worker.name, b.worker.name, a.predicted_tokens,
                              b.predicted_tokens))
            for rt, d in ((one, a), (two, b)):
                rt.router.first_token(d.ticket)
                rt.router.finish(d.ticket, None)
            _send_and_settle(urls[a.worker.name], p, [one, two], a.worker.name)
        assert all(x[0] == x[1] and x[2] == x[3] for x in decisions), decisions
        assert sum(x[2] > 0 for x in decisions) >= 8     # prefix hits drove them
    # a replica that restarts (and workers that cannot replay) routes from the shared view
    with replica(redis, zmq_workers) as again:
        wait_until(lambda: sum(w.up for w in again.router.registry.all()) == 2, 10, "up")
        for p, (chosen, _, predicted, _) in zip(stream(12)[-4:], decisions[-4:], strict=True):
            d = again.router.route(p)
            assert d.worker.name == chosen and d.predicted_tokens >= predicted > 0
            again.router.finish(d.ticket, None)
    # the same restart with an index of its own knows nothing yet
    from kvloop.router.registry import WorkerSpec

    alone = RouterThread(RouterConfig(), [WorkerSpec(w.url) for w in zmq_workers])
    with alone:
        wait_until(lambda: sum(w.up for w in alone.router.registry.all()) == 2, 10, "up")
        assert alone.router.route(stream(12)[-1]).predicted_tokens == 0


def test_the_decision_latency_script_times_both_indexes(redis):
    """`python -m kvloop.bench.router latency --indexes memory,redis`, small (the real run,
    1M blocks, is for a quiet machine)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "kvloop.bench.router", "latency", "--workers", "2",
         "--blocks", "2000", "--lengths", "256", "--decisions", "10", "--runs", "1",
         "--indexes", "memory,redis", "--redis-url", redis_url(redis)],
        capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "index (memory)" in out.stdout and "index (redis redis://127.0.0.1:" in out.stdout
    assert out.stdout.count("route  p50") == 2
