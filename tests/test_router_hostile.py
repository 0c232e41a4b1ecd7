"""Hostile load on the router (issue 37): no legal request takes it down, no client moves
another's share, a cut stream is never relayed as complete, a deep body is a 400.

The large-prompt load is the probe's: 16 concurrent /v1/completions with an 8 MiB text prompt
(each under the 32 MiB body limit) against a real `kvloop router` process in front of one
simulated worker (`--max-model-len 2048`), while /health is read and a small client is
served. The cut streams come from a tiny real HTTP worker in this process (`_FakeWorker`).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from kvloop.router.config import LivenessConfig, RouterConfig
from kvloop.router.fleet import Fleet, FleetConfig
from kvloop.router.registry import WorkerSpec

from .conftest import RouterThread, lines_until

MAX_MODEL_LEN = 2048
BIG_PROMPT = ("hello world, " * (8 * 1024 * 1024 // 13 + 1))[:8 * 1024 * 1024]
BIG_BODY = json.dumps({"prompt": BIG_PROMPT, "max_tokens": 4}).encode()
CLIENTS = 16
HEALTH_LIMIT_S = 0.5
RSS_LIMIT_BYTES = 768 * 1024 * 1024   # peak router RSS (the old router reached 2.1 GB)


@pytest.fixture(scope="module")
def sim_fleet() -> Iterator[Fleet]:
    f = Fleet(FleetConfig(1, "sim", ("both",), ("--max-model-len", str(MAX_MODEL_LEN)),
                          start_timeout_s=120, stop_timeout_s=10, echo_output=False))
    f.start()
    try:
        yield f
    finally:
        f.stop()


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        kb = re.search(r"VmHWM:\s+(\d+) kB", f.read())
    assert kb is not None
    return int(kb.group(1)) * 1024


class _Watch:
    """Reads /health every 0.1 s and the worker's state while the load runs."""

    def __init__(self, url: str):
        self.url = url
        self.latencies: list[float] = []
        self.bodies: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        """curl times each answer in its own process (this one's threads send the load)."""
        while not self.stop.is_set():
            out = subprocess.run(["curl", "-sS", "--max-time", "60", "-w", "\\n%{time_total}",
                                  self.url + "/health"], capture_output=True, text=True,
                                 check=True).stdout
            body, seconds = out.rsplit("\n", 1)
            self.latencies.append(float(seconds))
            self.bodies.append(json.loads(body))
            self.stop.wait(0.1)


@pytest.mark.processes
def test_sixteen_8mib_prompts_leave_health_workers_and_small_clients_answered(sim_fleet):
    spec = sim_fleet.specs()[0]
    cmd = [sys.executable, "-m", "kvloop", "router", "--port", "0", "--worker",
           f"{spec.url},both", "--poll-interval", "0.2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = lines_until(proc, "kvloop router on", 60)
        url = re.search(r"kvloop router on (http://\S+)", lines[-1])
        assert url is not None, lines
        watch = _Watch(url.group(1))
        _load(url.group(1), watch, proc.pid)
        proc.send_signal(signal.SIGTERM)   # with the load's second wave in flight
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def _load(url: str, watch: _Watch, pid: int) -> None:
    small = {"prompt": "hi there", "max_tokens": 2}
    with ThreadPoolExecutor(CLIENTS + 1) as pool, httpx.Client(timeout=120) as c:
        assert c.post(url + "/v1/completions", json=small).status_code == 200
        watch.thread.start()
        big = [pool.submit(c.post, url + "/v1/completions", content=BIG_BODY,
                           headers={"content-type": "application/json"})
               for _ in range(CLIENTS)]
        time.sleep(0.2)
        served = c.post(url + "/v1/completions", json=small)
        answers = [f.result() for f in big]
        watch.stop.set()
        watch.thread.join(30)
        for _ in range(4):   # a second wave, for the SIGTERM
            pool.submit(c.post, url + "/v1/completions", content=BIG_BODY,
                        headers={"content-type": "application/json"})
        peak = _peak_rss(pid)
        assert served.status_code == 200, served.text
        for r in answers:   # refused cheaply, in vLLM's words, never a 5xx
            assert r.status_code == 400, r.text[:300]
            assert "maximum context length is 2048 tokens" in r.json()["error"]["message"]
        assert watch.latencies and max(watch.latencies) < HEALTH_LIMIT_S, watch.latencies
        assert all(b["status"] == "ok" for b in watch.bodies), watch.bodies
        assert peak < RSS_LIMIT_BYTES, f"router peak RSS {peak / 2**20:.0f} MiB"


# --- a stream cut without its end --------------------------------------------------------------
def _chunk(text: str, finish: str | None = None) -> bytes:
    payload = {"id": "cmpl-fake", "object": "text_completion", "created": 1, "model": "fake",
               "choices": [{"index": 0, "text": text, "finish_reason": finish,
                            "logprobs": None}]}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


class _FakeWorker:
    """A real HTTP worker (no kvloop one: /kvloop/worker is 404) whose streams either end
    properly ("whole") or stop after `cut_after` chunks with a clean end of the HTTP
    response and no `[DONE]` ("cut")."""

    def __init__(self, kind: str, cut_after: int = 1):
        self.kind, self.cut_after = kind, cut_after
        self.posts = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                body = b"" if self.path == "/metrics" else b'{"detail": "Not Found"}'
                self._send(200 if self.path == "/metrics" else 404, body)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                fake.posts += 1
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                events = [_chunk("whole ", None), _chunk("answer", "stop"),
                          b"data: [DONE]\n\n"]
                if fake.kind == "cut":
                    events = [_chunk("cut ", None)] * fake.cut_after
                for e in events:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(e), e))
                self.wfile.write(b"0\r\n\r\n")   # the response ends cleanly

            def _send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _stream(url: str) -> list[str]:
    """The data of every event of one streamed completion."""
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        return [ln[5:].strip() for ln in r.iter_lines() if ln.startswith("data:")]


@pytest.mark.processes
def test_a_stream_cut_without_its_end_ends_with_the_error_event():
    cut = _FakeWorker("cut")
    try:
        with RouterThread(RouterConfig(), [WorkerSpec(cut.url)]) as rt:
            data = _stream(rt.url)
    finally:
        cut.close()
    assert cut.posts == 1
    assert data[-1] == "[DONE]", data
    error = json.loads(data[-2])["error"]
    assert error["code"] == 502 and "closed the stream before" in error["message"], data
    assert json.loads(data[0])["choices"][0]["text"] == "cut "


@pytest.mark.processes
def test_a_stream_cut_before_its_first_chunk_migrates_to_another_worker():
    cut, whole = _FakeWorker("cut", cut_after=0), _FakeWorker("whole")
    cfg = RouterConfig(policy="round-robin", migration_limit=1)
    try:
        with RouterThread(cfg, [WorkerSpec(cut.url), WorkerSpec(whole.url)]) as rt:
            answers = [_stream(rt.url) for _ in range(2)]   # round robin: each worker first
    finally:
        cut.close()
        whole.close()
    assert cut.posts >= 1 and whole.posts == 2   # each cut request went on on `whole`
    for data in answers:
        texts = [json.loads(d)["choices"][0]["text"] for d in data if d != "[DONE]"]
        assert texts == ["whole ", "answer"] and data[-1] == "[DONE]", data


# --- JSON nesting -------------------------------------------------------------------------------
DEEP = b"[" * 5000 + b"]" * 5000


@pytest.mark.processes
@pytest.mark.parametrize("depth", [5000, 129])
def test_a_deeply_nested_body_is_a_400_in_the_routes_own_shape(depth):
    deep = b'{"prompt": ' + b"[" * depth + b"]" * depth + b', "max_tokens": 1}'
    messages = (b'{"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": '
                + b"[" * depth + b"]" * depth + b"}]}")
    with RouterThread(RouterConfig(), []) as rt:
        openai = httpx.post(rt.url + "/v1/completions", content=deep,
                            headers={"content-type": "application/json"})
        anthropic = httpx.post(rt.url + "/v1/messages", content=messages,
                               headers={"content-type": "application/json"})
    assert openai.status_code == 400, openai.text
    assert "nested deeper" in openai.json()["error"]["message"]
    assert anthropic.status_code == 400, anthropic.text
    assert anthropic.json()["type"] == "error", anthropic.text
    assert anthropic.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.processes
def test_the_workers_api_server_answers_a_deep_body_400(sim_fleet):
    url = sim_fleet.specs()[0].url
    for path in ("/v1/completions", "/v1/messages"):
        r = httpx.post(url + path, content=DEEP, headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, r.status_code, r.text[:300])


# --- /health during a NATS outage -------------------------------------------------------------
@pytest.mark.processes
def test_health_says_degraded_with_the_cause_while_the_event_plane_is_down(tmp_path):
    from kvloop.events.config import NatsPlaneConfig
    from kvloop.router.config import BusConfig

    from .bus_helpers import NATS_PASSWORD, NATS_USER, nats_server
    from .conftest import wait_until

    with nats_server(tmp_path) as nats:
        plane = NatsPlaneConfig(f"nats://{nats.host}:{nats.port}", user=NATS_USER,
                                password=NATS_PASSWORD)
        whole = _FakeWorker("whole")
        cfg = RouterConfig(bus=BusConfig(plane=plane, allow_unsigned=True),
                           liveness=LivenessConfig(poll_interval_s=0.2))
        try:
            with RouterThread(cfg, [WorkerSpec(whole.url)]) as rt:
                def plane_reasons() -> list[str]:
                    body = httpx.get(rt.url + "/health", timeout=10).json()
                    assert body["status"] != "ok" or not body["reasons"], body
                    return [r for r in body["reasons"] if "event plane" in r]

                wait_until(lambda: rt.router.details["bus"]()["connected"], 10, "connected")
                assert plane_reasons() == []
                nats.stop()
                down = wait_until(plane_reasons, 15, "/health to say the event plane is down")
                assert "disconnected" in down[0] and "may be stale" in down[0], down
                nats.start()
                wait_until(lambda: not plane_reasons(), 30, "the reason gone once reconnected")
        finally:
            whole.close()


# --- the session table ----------------------------------------------------------------------------
def test_the_session_table_is_bounded_in_entries_and_bytes():
    """Probe: 6,000 session ids grew the router by 28 MB. A client naming a new session per
    request fills the table to its bound and no further; what it holds is measured."""
    import gc
    import tracemalloc

    from kvloop.router.sessions import (
        MAX_SESSION_BYTES,
        SESSION_ENTRY_BYTES,
        SessionTable,
        session_key,
    )

    table = SessionTable(max_bytes=512 * SESSION_ENTRY_BYTES)
    tracemalloc.start()   # (it traces what is allocated from here on: no collection before)
    try:
        for i in range(2000):
            table.record(session_key({"x-session-id": f"s{i}"}, {}), "worker-a", 64, float(i))
        gc.collect()
        # what the table's own code allocated and still holds (not other threads' work in
        # this test process, which a process-wide figure would count too)
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(True, "*/kvloop/router/sessions.py")])
        held = sum(stat.size for stat in snapshot.statistics("filename"))
    finally:
        tracemalloc.stop()
    assert len(table) == 512
    assert held <= 512 * SESSION_ENTRY_BYTES, held
    assert table.last_turn(session_key({"x-session-id": "s1999"}, {}), 2000.0) is not None
    assert table.last_turn(session_key({"x-session-id": "s0"}, {}), 2000.0) is None  # LRU
    assert SessionTable().max_sessions * SESSION_ENTRY_BYTES <= MAX_SESSION_BYTES


# --- bodies in flight ---------------------------------------------------------------------------
@pytest.mark.processes
def test_bodies_in_flight_are_bounded_in_bytes():
    """A request reserves its Content-Length before its body is read; one that finds no room
    within `body_wait_s` gets 503 `body_budget`; the room comes back when a request ends."""
    import socket
    from dataclasses import replace

    from kvloop.router.limits import BODY_BUDGET_REFUSED, RouterLimits

    limits = replace(RouterLimits(), max_inflight_body_bytes=1000, body_wait_s=0.3)
    body = json.dumps({"prompt": "x" * 500, "max_tokens": 1}).encode()
    with RouterThread(RouterConfig(limits=limits), []) as rt:
        host, port = rt.url.removeprefix("http://").split(":")
        slow = socket.create_connection((host, int(port)))
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: 800\r\n\r\n{\"prompt\": ")
        try:
            refused = _wait_for_refusal(rt.url, body)
        finally:
            slow.close()
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.headers["x-kvloop-flow-rejected"] == BODY_BUDGET_REFUSED
        assert "bytes of request bodies" in refused.json()["error"]["message"]
        from .conftest import wait_until

        later = wait_until(lambda: (r := httpx.post(rt.url + "/v1/completions", content=body,
                                                    headers={"content-type": "application/json"}))
                           .headers.get("x-kvloop-flow-rejected") != BODY_BUDGET_REFUSED and r,
                           10, "the slow request's bytes to come back")
        assert later.status_code == 503 and "no worker is registered" in later.text   # routed


def _wait_for_refusal(url: str, body: bytes) -> httpx.Response:
    """The first answer refused for the body budget (the slow request's headers must reach
    the router first)."""
    from .conftest import wait_until

    return wait_until(lambda: (r := httpx.post(url + "/v1/completions", content=body, headers={
        "content-type": "application/json"}, timeout=10)).status_code == 503 and
        r.headers.get("x-kvloop-flow-rejected") == "body_budget" and r, 10, "a refusal")
