"""One fact, one place, on a live `kvloop serve --model sim --port 0`: the engine's facts go
from its handshake (`EngineReady`) to `GET /kvloop/worker` (`WorkerInfo`) to the router's
registry (`WorkerDescription`, decoded strictly: an answer that does not decode is refused,
with the reason); the `--kv-events-*` flags reach the engine's publisher as one
`KVEventsConfig`."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from kvloop.events import protocol as proto
from kvloop.front.launcher import ServeProcess
from kvloop.router.config import HashSpec
from kvloop.router.registry import WorkerDescription, WorkerSpec
from kvloop.wire import WorkerInfo

from .conftest import serving
from .test_router_fleet import ADMIN, RouterThread, router_config, wait_until
from .test_serve_auth import assert_error

pytestmark = pytest.mark.processes   # every test here starts processes or servers

BLOCKS = 64
BLOCK_SIZE = 32
SEED = "facts-seed"
WORKER_ARGS = ["--model", "sim", "--sim-speedup", "50", "--role", "decode",
               "--enable-prefix-caching",   # a decode worker's default is off
               "--num-gpu-blocks-override", str(BLOCKS), "--block-size", str(BLOCK_SIZE),
               "--hash-seed", SEED, "--max-model-len", "512",
               "--enable-kv-cache-events", "--kv-events-replay-endpoint", "tcp://127.0.0.1:0",
               "--kv-events-topic", "kv", "--kv-events-recency", "--no-kv-events-heartbeat"]


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with serving(tmp_path_factory, "worker_facts", WORKER_ARGS) as srv:
        yield srv


def _info(worker: ServeProcess) -> tuple[bytes, WorkerInfo]:
    body = httpx.get(worker.url + "/kvloop/worker", timeout=10).content
    return body, msgspec.json.decode(body, type=WorkerInfo)


def test_the_engines_facts_reach_the_routers_registry(worker: ServeProcess) -> None:
    body, info = _info(worker)
    assert (info.block_size, info.hash_algo, info.hash_seed) == (BLOCK_SIZE, "sha256", SEED)
    assert (info.num_gpu_blocks, info.kv_capacity_blocks) == (BLOCKS, BLOCKS - 1)
    assert (info.max_model_len, info.role, info.model) == (512, "decode", "sim")
    assert info.engine_pid != info.api_pid == worker.pid
    stats = httpx.get(worker.url + "/kvloop/stats", timeout=10).json()   # the engine's own
    assert (stats["num_gpu_blocks"], stats["num_total_blocks"]) == \
        (info.num_gpu_blocks, info.kv_capacity_blocks)
    ev = info.kv_events
    assert ev is not None and (ev.topic, ev.recency) == ("kv", True)
    assert ev.endpoint and ev.replay_endpoint and not ev.endpoint.endswith(":0")
    spec = WorkerSpec(worker.url, "decode")
    with RouterThread(router_config(), [spec]) as rt:
        w = rt.router.registry.get(spec.name)
        assert w is not None and w.up and w.alarms == {}
        assert w.description == msgspec.json.decode(body, type=WorkerDescription)
        assert rt.router.hash_spec == HashSpec(BLOCK_SIZE, "sha256", SEED)
        assert httpx.get(rt.url + "/workers").json()[spec.name]["epoch"] == info.epoch
        # the advertised endpoint, topic and hashing work: the router indexes the
        # worker's blocks, hashed as the router hashes them
        prompt = list(range(1000, 1000 + 3 * BLOCK_SIZE))
        r = httpx.post(rt.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                       timeout=30)
        assert r.status_code == 200, r.text
        wait_until(lambda: rt.router.index.match(rt.router.block_hashes(prompt)) ==
                   {spec.name: 3}, 10, "the worker's blocks in the router's index")
        assert w.alarms == {}


def test_the_events_flags_reach_the_publisher(worker: ServeProcess) -> None:
    """Every `--kv-events-*` flag of the worker shows in what its publisher says of itself
    (on the advertised replay endpoint): topic, recency, heartbeats off although the topic
    is not empty, snapshots (a replay endpoint is set), the worker's epoch."""
    _, info = _info(worker)
    assert info.kv_events is not None and info.kv_events.replay_endpoint is not None
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.connect(info.kv_events.replay_endpoint)
        dealer.send_multipart((b"", proto.KVLOOP, proto.CMD_INFO))
        assert dealer.poll(5000), "the publisher did not answer"
        empty, kvloop, cmd, payload = dealer.recv_multipart()
    finally:
        dealer.close(linger=0)
        ctx.term()
    assert (empty, kvloop, cmd) == (b"", proto.KVLOOP, proto.CMD_INFO)
    pub = proto.decode_info(payload)
    assert (pub.topic, pub.recency, pub.snapshot, pub.epoch) == ("kv", True, True, info.epoch)
    assert pub.heartbeat_interval_s == 0.0   # --no-kv-events-heartbeat
    assert pub.buffer_steps == 10_000        # KVEventsConfig's default, as vLLM's


class _Answering:
    """An HTTP server on 127.0.0.1 answering `GET /kvloop/worker` with a fixed body (a
    worker of another version, say) and `GET /metrics` with an empty page."""

    def __init__(self, body: dict[str, Any]):
        payload = json.dumps(body).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                found = self.path in ("/kvloop/worker", "/metrics")
                data = payload if self.path == "/kvloop/worker" else b""
                self.send_response(200 if found else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> _Answering:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def test_an_answer_that_does_not_decode_is_refused_with_the_reason(
        worker: ServeProcess) -> None:
    real = httpx.get(worker.url + "/kvloop/worker", timeout=10).json()
    missing = {k: v for k, v in real.items() if k != "block_size"}
    mistyped = {**real, "hash_seed": 0}
    synonym = {("model_name" if k == "model" else k): v for k, v in real.items()}
    good = WorkerSpec(worker.url, "decode")
    with _Answering(missing) as a, _Answering(mistyped) as b, _Answering(synonym) as c:
        at_start = WorkerSpec(a.url, "decode")
        with RouterThread(router_config(), [good, at_start]) as rt:
            # at start-up: registered, down, and /health says why
            health = httpx.get(rt.url + "/health").json()
            down = health["workers"][at_start.name]
            assert down["up"] is False, down
            assert f"{a.url}/kvloop/worker answered what this router cannot read: Object " \
                   "missing required field `block_size`" == down["down_reason"]
            assert any(at_start.name in r and "block_size" in r for r in health["reasons"])
            # at run time: not registered, 422 with the reason
            for answering, reason in ((b, "Expected `str`, got `int` - at `$.hash_seed`"),
                                      (c, "Object missing required field `model`")):
                r = httpx.post(rt.url + "/workers", headers=ADMIN,
                               json={"url": answering.url, "role": "decode"})
                err = assert_error(r, 422, "UnprocessableEntityError")
                assert "not registered" in err["message"] and reason in err["message"], err
            assert set(httpx.get(rt.url + "/workers").json()) == {good.name, at_start.name}
            r = httpx.post(rt.url + "/v1/completions", json={"prompt": [7] * 40,
                                                             "max_tokens": 1}, timeout=30)
            assert r.status_code == 200, r.text   # routed to the worker that decodes
