"""The router fails loud and never hangs (issue 25), with real workers on 127.0.0.1.

- a worker killed (-9) before it sent its headers: the client gets the documented JSON 502,
  the router's in-flight count for it is 0, and stays 0 once it restarts on the same port;
- a frozen (SIGSTOP) prefill worker: the in-flight P/D requests fall back to decode-only
  within --prefill-timeout and complete; new requests avoid it at once;
- malformed field types: the router answers 400 with the worker's own words, never 500;
- a client's kv_transfer_params: 400 (the router's to set), in both routing modes;
- with a fleet secret the router presents the fleet token on forwarded requests, never on
  probes, and never passes a client's on;
- /health never says "unavailable" without a reason.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from kvloop.front.prometheus_text import metric_value
from kvloop.router.config import IndexConfig, LivenessConfig, PDConfig, RouterConfig
from kvloop.router.fleet import Fleet, FleetConfig
from kvloop.router.pd import PREFILL_TIMEOUT
from kvloop.router.registry import PREFILL_FAILING, WorkerSpec
from kvloop.trust import INTERNAL_TOKEN_HEADER, PURPOSE_INTERNAL_HTTP, FleetSecret
from tests.conftest import RouterThread, held_port, wait_until
from tests.test_router_pd_fleet import BANDWIDTH, SECRET, SPEEDUP, pd_fleet

pytestmark = pytest.mark.processes   # real workers; routers on threads

SLOW_ARGS = ("--sim-speedup", "1", "--num-gpu-blocks-override", "200")
PREFILL_TIMEOUT_S = 2.0


def _router(**pd: object) -> RouterConfig:
    return RouterConfig(liveness=LivenessConfig(window_s=30.0, poll_interval_s=0.2),
                        index=IndexConfig(provisional_ttl_s=2.0), pd=PDConfig(**pd))


@pytest.fixture(scope="module")
def one_worker() -> Iterator[Fleet]:
    f = Fleet(FleetConfig(1, "sim", ("both",), SLOW_ARGS, start_timeout_s=120,
                          stop_timeout_s=10, echo_output=False))
    try:
        f.start()
        yield f
    finally:
        f.stop()


def _hold(port: int):
    try:
        return held_port(port)
    except OSError:
        return None


def test_a_worker_killed_before_its_headers_gives_json_502_and_releases_in_flight(one_worker):
    spec = one_worker.specs()[0]
    with RouterThread(_router(), [spec]) as rt:
        w = rt.router.registry.get(spec.name)
        assert w is not None and w.up
        with ThreadPoolExecutor(1) as pool:   # non-streamed: headers come with the answer
            answer = pool.submit(httpx.post, rt.url + "/v1/completions", timeout=60,
                                 json={"prompt": [7] * 32, "max_tokens": 2000,
                                       "ignore_eos": True})
            wait_until(lambda: w.in_flight() == 1, 10, "the request to be in flight")
            time.sleep(0.3)
            os.kill(one_worker.workers[0].pid, signal.SIGKILL)
            r = answer.result(timeout=30)
        assert r.status_code == 502, r.text
        assert r.headers["content-type"] == "application/json"
        err = r.json()["error"]
        assert err["type"] == "BadGatewayError" and err["code"] == 502
        assert f"worker {spec.name} failed before answering" in err["message"]
        assert w.in_flight() == 0
        assert httpx.get(rt.url + "/workers").json()[spec.name]["in_flight"] == 0
        # restarted on the same port: re-registered, nothing left in flight
        port = int(spec.url.rsplit(":", 1)[1])
        with wait_until(lambda: _hold(port), 10, f"port {port} to be let go"):
            restarted = one_worker.worker(0, "--port", str(port))
            one_worker.workers[0] = restarted
            restarted.start(60)
        wait_until(lambda: w.up, 10, "the restarted worker to be registered")
        ok = httpx.post(rt.url + "/v1/completions", timeout=30,
                        json={"prompt": [8] * 32, "max_tokens": 2})
        assert ok.status_code == 200
        assert w.in_flight() == 0
        text = httpx.get(rt.url + "/metrics").text
        assert metric_value(text, "kvloop_router_worker_in_flight", worker=spec.name) == 0
        assert metric_value(text, "kvloop_router_requests_total", worker=spec.name,
                            outcome="worker_error") == 1


def test_clients_that_leave_release_in_flight_on_every_path(one_worker):
    """Streamed (gone right after the headers) and not streamed (gone while the worker is
    still computing): the worker's in-flight count returns to 0 each time."""
    spec = one_worker.specs()[0]
    body = {"prompt": [9] * 32, "max_tokens": 2000, "ignore_eos": True}
    with RouterThread(_router(), [spec]) as rt:
        w = rt.router.registry.get(spec.name)
        with httpx.stream("POST", rt.url + "/v1/completions", json={**body, "stream": True},
                          timeout=30) as r:
            assert r.status_code == 200
        wait_until(lambda: w.in_flight() == 0, 5, "the stream's ticket to close")
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(rt.url + "/v1/completions", json=body, timeout=0.5)
        wait_until(lambda: w.in_flight() == 0, 5, "the request's ticket to close")
        text = httpx.get(rt.url + "/metrics").text
        assert metric_value(text, "kvloop_router_requests_total", worker=spec.name,
                            outcome="disconnected") == 2


BAD_BODIES = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": "abc"}, "body.max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream_options": "x"},
     "body.stream_options"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": "two"}, "body.n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True,
                         "stream_options": "x"}, "body.stream_options"),
    ("/v1/chat/completions", {"messages": "hi", "max_tokens": 2}, "body.messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": [1]}, "body.max_completion_tokens"),
]


def test_malformed_field_types_get_the_workers_400_from_the_router(one_worker):
    spec = one_worker.specs()[0]
    with RouterThread(_router(), [spec]) as rt:
        for path, body, param in BAD_BODIES:
            via_router = httpx.post(rt.url + path, json=body, timeout=30)
            direct = httpx.post(spec.url + path, json=body, timeout=30)
            assert via_router.status_code == direct.status_code == 400, (body, via_router.text)
            assert via_router.json() == direct.json(), body
            assert via_router.json()["error"]["param"] == param
        # what the worker coerces, the router coerces too (n "2" is 2 to both)
        r = httpx.post(rt.url + "/v1/completions", timeout=30,
                       json={"prompt": "hi", "max_tokens": 2, "n": "2"})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        assert rt.router.registry.get(spec.name).in_flight() == 0


def test_a_clients_kv_transfer_params_are_refused(one_worker):
    spec = one_worker.specs()[0]
    with RouterThread(_router(), [spec]) as rt:
        for params in ({"do_remote_prefill": True, "remote_host": "127.0.0.1",
                        "remote_port": 9, "remote_engine_id": "evil",
                        "remote_block_ids": [1, 2, 3]}, {}):
            r = httpx.post(rt.url + "/v1/completions", timeout=30,
                           json={"prompt": [5] * 40, "max_tokens": 2,
                                 "kv_transfer_params": params})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "kv_transfer_params" and "set by the router" in err["message"]
        text = httpx.get(rt.url + "/metrics").text
        assert metric_value(text, "kvloop_router_requests_total") == 0   # nothing forwarded


def test_health_names_why_it_is_unavailable():
    with RouterThread(_router(), []) as rt:
        r = httpx.get(rt.url + "/health")
        assert r.status_code == 503
        body = r.json()
        assert body["status"] == "unavailable" and body["reasons"] == ["no worker is registered"]


# --- the fleet token --------------------------------------------------------------------------
class _Recorder(BaseHTTPRequestHandler):
    """A stand-in worker that is no kvloop worker (404 on /kvloop/worker) and records the
    headers of every request in its server's `seen`."""

    server: _RecordingServer

    def _answer(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _record(self, method: str) -> None:
        headers = {k.lower(): v for k, v in self.headers.items()}
        self.server.seen.append((method, self.path, headers))

    def do_GET(self) -> None:
        self._record("GET")
        if self.path == "/metrics":
            self._answer(200, b"vllm:num_requests_running 0\n", "text/plain")
        else:
            self._answer(404, b'{"error": "no"}')

    def do_POST(self) -> None:
        n = int(self.headers.get("content-length", 0))
        self.rfile.read(n)
        self._record("POST")
        self._answer(200, json.dumps({"choices": [], "usage": None}).encode())

    def log_message(self, *args: object) -> None:
        pass


class _RecordingServer(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Recorder)
        self.seen: list[tuple[str, str, dict[str, str]]] = []


def test_the_router_presents_the_fleet_token_to_workers_only_on_forwarded_requests():
    secret = FleetSecret.generate()
    server = _RecordingServer()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        cfg = RouterConfig(fleet_secret=secret,
                           liveness=LivenessConfig(poll_interval_s=0.2))
        with RouterThread(cfg, [WorkerSpec(url)]) as rt:
            r = httpx.post(rt.url + "/v1/completions", timeout=30,
                           headers={INTERNAL_TOKEN_HEADER: "forged-by-a-client"},
                           json={"prompt": [3] * 20, "max_tokens": 2})
            assert r.status_code == 200
    finally:
        server.shutdown()
    posts = [h for m, _, h in server.seen if m == "POST"]
    gets = [h for m, _, h in server.seen if m == "GET"]
    assert len(posts) == 1 and gets
    assert posts[0][INTERNAL_TOKEN_HEADER] == secret.token(PURPOSE_INTERNAL_HTTP)
    assert all(INTERNAL_TOKEN_HEADER not in h for h in gets)   # probes and polls: never


# --- a frozen prefill worker -----------------------------------------------------------------
@pytest.fixture(scope="module")
def pd() -> Iterator[Fleet]:
    f = pd_fleet(1, 1)
    try:
        yield f
    finally:
        f.stop()


def test_a_frozen_prefill_worker_falls_back_within_the_leg_timeout(pd):
    cfg = RouterConfig(liveness=LivenessConfig(window_s=30.0, poll_interval_s=0.2),
                       fleet_secret=SECRET, pd=PDConfig(policy="always", speedup=SPEEDUP,
                                   transfer_bandwidth=BANDWIDTH,
                                   prefill_timeout_s=PREFILL_TIMEOUT_S))
    prefill = next(p for i, p in enumerate(pd.workers) if pd.config.role_of(i) == "prefill")
    with RouterThread(cfg, pd.specs()) as rt:
        wait_until(rt.router.pd_mode, 10, "P/D mode")
        ok = httpx.post(rt.url + "/v1/completions", timeout=30,
                        json={"prompt": [11] * 64, "max_tokens": 2})
        assert ok.status_code == 200
        p_name = next(w.name for w in rt.router.registry.all() if w.role == "prefill")
        os.kill(prefill.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with ThreadPoolExecutor(4) as pool:
                futures = [pool.submit(httpx.post, rt.url + "/v1/completions", timeout=60,
                                       json={"prompt": [20 + i] * 64, "max_tokens": 4})
                           for i in range(4)]
                answers = [f.result(timeout=60) for f in futures]
            elapsed = time.monotonic() - t0
            assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
            assert all(a.json()["usage"]["completion_tokens"] == 4 for a in answers)
            assert elapsed < PREFILL_TIMEOUT_S + 10, elapsed
            text = httpx.get(rt.url + "/metrics").text
            assert metric_value(text, "kvloop_router_pd_fallbacks_total", worker=p_name,
                                reason=PREFILL_TIMEOUT) == 4
            p = rt.router.registry.get(p_name)
            assert PREFILL_FAILING in p.alarms and p.in_flight() == 0
            # new requests avoid it at once: no second wait on the frozen worker
            t1 = time.monotonic()
            again = httpx.post(rt.url + "/v1/completions", timeout=30,
                               json={"prompt": [40] * 64, "max_tokens": 2})
            assert again.status_code == 200 and time.monotonic() - t1 < PREFILL_TIMEOUT_S
            health = httpx.get(rt.url + "/health").json()
            assert any(p_name in r and "timed out" in r for r in health["reasons"])
            assert all(w.in_flight() == 0 for w in rt.router.registry.all())
        finally:
            os.kill(prefill.pid, signal.SIGCONT)
