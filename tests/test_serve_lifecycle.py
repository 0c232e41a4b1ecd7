"""Process life of `kvloop serve`: overload, SIGTERM/SIGINT with requests in flight (to the
API server, or to the process group as Ctrl-C, systemd or `timeout` send them), draining with
`--shutdown-timeout`, signals during start-up, either process dying, a failed start, and the
KV-event publisher of the engine process. Each test starts its own server (they end them)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from kvloop.core.hashing import block_hashes
from kvloop.events import protocol as proto
from kvloop.events.types import BlockStored, KVEventBatch, event_int
from kvloop.front.launcher import ServeProcess

from .conftest import alive, sse_json, wait_until

pytestmark = pytest.mark.processes   # each test starts its own `kvloop serve`

SLOW = ["--model", "sim", "--sim-speedup", "1"]   # ~22 ms per step: requests stay in flight


def port_closed(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) != 0


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid`."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(stat.parent.name))
    return kids


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Any]:
    procs: list[ServeProcess] = []

    def start(*args: str, new_session: bool = False) -> ServeProcess:
        p = ServeProcess(list(args), tmp_path / f"serve{len(procs)}.log",
                         new_session=new_session).start()
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.stop()


def _stream_lines(url: str, body: dict[str, Any], out: list[str], started: threading.Event
                  ) -> None:
    """Read a whole SSE response into `out` (set `started` at the first data line)."""
    with contextlib.suppress(httpx.HTTPError), \
            httpx.stream("POST", url, json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line:
                out.append(line)
                started.set()


# --- admission control --------------------------------------------------------------------------
def test_overload_gets_503_with_retry_after_and_no_leaks(serve: Any) -> None:
    srv = serve(*SLOW, "--max-num-seqs", "2", "--max-waiting-requests", "2")
    body = {"prompt": "hold the line", "max_tokens": 400, "stream": True}
    with httpx.Client(timeout=30) as http, contextlib.ExitStack() as streams:
        # requests count as waiting until the API server sees the step that scheduled them:
        # send two, let them be scheduled, then two more that must wait behind them
        for expected in ((2, 0), (2, 2)):
            for _ in range(2):
                r = streams.enter_context(http.stream("POST", srv.url + "/v1/completions",
                                                      json=body))
                assert r.status_code == 200
            wait_until(lambda e=expected: (srv.engine_stats()["num_running_reqs"],
                                           srv.engine_stats()["num_waiting_reqs"]) == e,
                       10, f"(running, waiting) == {expected}")
            time.sleep(0.1)
        r = http.post(srv.url + "/v1/completions", json={"prompt": "one more"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert err["type"] == "ServiceUnavailableError" and err["code"] == 503
        r = http.post(srv.url + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "x"}], "stream": True})
        assert r.status_code == 503
        assert srv.metric("vllm:admission_rejections_total",
                      reason="max_waiting_requests") == 2
        assert srv.engine_stats()["num_requests"] == 4      # nothing queued behind the limit
    stats = srv.wait_idle()
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
    ok = httpx.post(srv.url + "/v1/completions", json={"prompt": "after", "max_tokens": 2})
    assert ok.status_code == 200


# --- signals ------------------------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_with_requests_in_flight(serve: Any, sig: int) -> None:
    srv = serve(*SLOW)
    engine_pid = httpx.get(srv.url + "/kvloop/worker").json()["engine_pid"]
    outs: list[list[str]] = [[], []]
    started = [threading.Event(), threading.Event()]
    bodies = [("/v1/completions", {"prompt": "a", "max_tokens": 500, "stream": True}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "b"}],
                                        "max_tokens": 500, "stream": True})]
    threads = [threading.Thread(target=_stream_lines, args=(srv.url + p, b, o, s))
               for (p, b), o, s in zip(bodies, outs, started, strict=True)]
    plain: list[httpx.Response] = []
    threads.append(threading.Thread(target=lambda: plain.append(httpx.post(
        srv.url + "/v1/completions", json={"prompt": "c", "max_tokens": 500}, timeout=30))))
    for t in threads:
        t.start()
    assert all(s.wait(10) for s in started)
    wait_until(lambda: srv.engine_stats()["num_running_reqs"] == 3, 10, "3 running requests")
    srv.signal(sig)
    assert srv.wait(20) == 0
    for t in threads:
        t.join(10)
    for lines in outs:
        chunks = sse_json(lines)
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
        assert lines[-1] == "data: [DONE]"
    assert plain[0].status_code == 503
    assert plain[0].json()["error"]["type"] == "ServiceUnavailableError"
    wait_until(lambda: not alive(engine_pid), 10, "the engine process to end")
    assert port_closed(srv.url)
    assert "Traceback" not in srv.log()


def _start_stream(url: str, max_tokens: int) -> tuple[threading.Thread, list[str]]:
    """A streaming completion in flight (its first chunk arrived) in a thread."""
    lines: list[str] = []
    started = threading.Event()
    t = threading.Thread(target=_stream_lines, args=(
        url + "/v1/completions", {"prompt": "s", "max_tokens": max_tokens, "stream": True,
                                  "return_token_ids": True}, lines, started))
    t.start()
    assert started.wait(10)
    return t, lines


def assert_clean_exit(srv: ServeProcess) -> None:
    """Both processes exited 0 (the API server logs the engine's exit code) and quietly."""
    log = srv.log()
    assert "engine core process exited with code 0" in log, log
    assert "Fatal Python error" not in log and "Traceback" not in log, log


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_process_group_signal_stops_both_processes_cleanly(serve: Any, sig: int) -> None:
    """As Ctrl-C, `timeout` or `kill -- -PGID` send it (the engine, in its own session, is
    then stopped by the API server)."""
    srv = serve("sim", "--sim-speedup", "1", new_session=True)
    engine_pid = httpx.get(srv.url + "/kvloop/worker").json()["engine_pid"]
    t, lines = _start_stream(srv.url, 500)
    srv.signal_group(sig)
    assert srv.wait(20) == 0
    t.join(10)
    assert sse_json(lines)[-1]["choices"][0]["finish_reason"] == "abort"
    assert lines[-1] == "data: [DONE]"
    assert not alive(engine_pid) and port_closed(srv.url)
    assert_clean_exit(srv)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_both_processes_stops_them_cleanly(serve: Any, sig: int) -> None:
    """As systemd's kill of the whole cgroup: the engine gets the signal too, with its stdin
    watchdog waiting (this once ended in `Fatal Python error: _enter_buffered_busy`)."""
    srv = serve("sim", "--sim-speedup", "1")
    engine_pid = httpx.get(srv.url + "/kvloop/worker").json()["engine_pid"]
    t, lines = _start_stream(srv.url, 500)
    os.kill(engine_pid, sig)
    srv.signal(sig)
    assert srv.wait(20) == 0
    t.join(10)
    assert sse_json(lines)[-1]["choices"][0]["finish_reason"] == "abort"
    assert not alive(engine_pid) and port_closed(srv.url)
    assert_clean_exit(srv)


def test_sigterm_to_the_engine_alone_stops_both_cleanly(serve: Any) -> None:
    srv = serve("sim", "--sim-speedup", "1")
    engine_pid = httpx.get(srv.url + "/kvloop/worker").json()["engine_pid"]
    t, lines = _start_stream(srv.url, 500)
    os.kill(engine_pid, signal.SIGTERM)
    assert srv.wait(20) == 0
    t.join(10)
    assert sse_json(lines)[-1]["choices"][0]["finish_reason"] == "abort"
    assert "the engine core process stopped" in srv.log()
    assert_clean_exit(srv)


@pytest.mark.parametrize("to_engine", [False, True], ids=["api", "api+engine"])
def test_sigterm_drains_with_a_shutdown_timeout(serve: Any, to_engine: bool) -> None:
    """Draining: /health and new requests get 503 while the stream in flight goes on to its
    end; then both processes exit 0, long before the timeout. An engine that gets the SIGTERM
    too (a cgroup kill) goes on serving until the API server stops it."""
    srv = serve("sim", "--sim-speedup", "1", "--shutdown-timeout", "60")
    engine_pid = httpx.get(srv.url + "/kvloop/worker").json()["engine_pid"]
    t, lines = _start_stream(srv.url, 100)   # >= 100 steps of ~22 ms
    start = time.monotonic()
    if to_engine:
        os.kill(engine_pid, signal.SIGTERM)
    srv.signal(signal.SIGTERM)
    wait_until(lambda: httpx.get(srv.url + "/health").status_code == 503, 5, "/health 503")
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "new", "max_tokens": 1})
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
    assert t.is_alive()                      # the stream is still going
    assert srv.wait(30) == 0 and time.monotonic() - start < 30
    t.join(10)
    chunks = sse_json(lines)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["choices"][0].get("token_ids") or []) for c in chunks) == 100
    assert lines[-1] == "data: [DONE]"
    assert "SIGTERM: draining 1 requests for up to 60 s" in srv.log()
    assert_clean_exit(srv)


def test_second_sigterm_ends_the_drain_at_once(serve: Any) -> None:
    srv = serve("sim", "--sim-speedup", "1", "--shutdown-timeout", "60")
    t, lines = _start_stream(srv.url, 2000)
    srv.signal(signal.SIGTERM)
    wait_until(lambda: httpx.get(srv.url + "/health").status_code == 503, 5, "/health 503")
    srv.signal(signal.SIGTERM)
    assert srv.wait(20) == 0
    t.join(10)
    assert sse_json(lines)[-1]["choices"][0]["finish_reason"] == "abort"
    assert_clean_exit(srv)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_while_the_engine_starts_exits_0(tmp_path: Path, sig: int) -> None:
    """The engine blocks at start-up opening its latency file, a FIFO nobody writes: a
    process-group signal then stops both processes, exit 0."""
    fifo = tmp_path / "latency.fifo"
    os.mkfifo(fifo)
    srv = ServeProcess(["sim", "--sim-latency-file", str(fifo)], tmp_path / "serve.log",
                       new_session=True)

    def signal_once_the_engine_runs() -> None:
        wait_until(lambda: srv.proc is not None and children(srv.pid), 30, "the engine")
        srv.signal_group(sig)

    threading.Thread(target=signal_once_the_engine_runs, daemon=True).start()
    with pytest.raises(RuntimeError, match="did not start"):
        srv.start(timeout_s=60)
    assert srv.proc is not None and srv.proc.returncode == 0
    assert "stopped before the engine core was ready" in srv.log()
    assert_clean_exit(srv)


def test_engine_death_stops_the_api_server(serve: Any) -> None:
    srv = serve(*SLOW)
    engine_pid = httpx.get(srv.url + "/kvloop/worker").json()["engine_pid"]
    lines: list[str] = []
    started = threading.Event()
    t = threading.Thread(target=_stream_lines, args=(
        srv.url + "/v1/completions", {"prompt": "x", "max_tokens": 500, "stream": True},
        lines, started))
    t.start()
    assert started.wait(10)
    os.kill(engine_pid, signal.SIGKILL)
    assert srv.wait(20) == 1
    t.join(10)
    assert json.loads(lines[-2][6:])["error"]["code"] == 500 and lines[-1] == "data: [DONE]"
    assert port_closed(srv.url)


def test_api_server_death_stops_the_engine(tmp_path: Path) -> None:
    """A killed API server cannot remove its sockets' folder: the engine, which then
    ends, does."""
    srv = ServeProcess(list(SLOW), tmp_path / "serve.log", env={"TMPDIR": str(tmp_path)})
    with srv.start():
        (folder,) = tmp_path.glob("kvloop-engine-*")
        engine_pid = httpx.get(srv.url + "/kvloop/worker").json()["engine_pid"]
        srv.signal(signal.SIGKILL)
        srv.wait(10)
        assert wait_until(lambda: not alive(engine_pid), 15, "the engine process to end")
    assert not folder.exists()


def test_failed_engine_start_exits_1(tmp_path: Path) -> None:
    srv = ServeProcess(["--model", "sim", "--sim-latency-file", str(tmp_path / "missing.json")],
                       tmp_path / "serve.log")
    with pytest.raises(RuntimeError, match="cannot read latency file"):
        srv.start(timeout_s=60)
    assert srv.proc is not None and srv.proc.returncode == 1


# --- KV events from the engine process ----------------------------------------------------------
def test_kv_events_published_with_actual_addresses(serve: Any) -> None:
    srv = serve("--model", "sim", "--sim-speedup", "50", "--enable-kv-cache-events",
                "--kv-events-replay-endpoint", "tcp://127.0.0.1:0", "--kv-events-topic", "kv",
                "--kv-events-recency")
    w = httpx.get(srv.url + "/kvloop/worker").json()
    ev = w["kv_events"]
    assert ev["topic"] == "kv" and ev["recency"] is True
    assert not ev["endpoint"].endswith(":0") and not ev["replay_endpoint"].endswith(":0")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(ev["endpoint"])
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.setsockopt(zmq.SUBSCRIBE, proto.RECENCY_TOPIC)
        time.sleep(0.3)   # slow joiner
        prompt = list(range(1000, 1040))   # 40 ids of SmolLM2's vocabulary: 2 full blocks
        for _ in range(2):
            httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        stored, touched = _collect_events(sub)
    finally:
        sub.close(linger=0)
        ctx.term()
    expected = [event_int(h) for h in block_hashes(prompt, 16, "sha256")]
    assert stored[:2] == expected            # the prompt's two full blocks, hashed as vLLM
    assert set(expected) <= set(touched)     # the second request hit both


def _collect_events(sub: zmq.Socket) -> tuple[list[int], list[int]]:
    stored: list[int] = []
    touched: list[int] = []
    dec = msgspec.msgpack.Decoder(KVEventBatch)
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not (stored and touched):
        if not poller.poll(100):
            continue
        topic, _, payload = sub.recv_multipart()
        if topic == proto.RECENCY_TOPIC:
            touched += msgspec.msgpack.decode(payload, type=proto.Touches).block_hashes
        else:
            stored += [h for e in dec.decode(payload).events if isinstance(e, BlockStored)
                       for h in e.block_hashes]
    return stored, touched


def test_reset_on_an_idle_worker_publishes_all_blocks_cleared_at_once(serve: Any) -> None:
    srv = serve("--model", "sim", "--sim-speedup", "50", "--enable-kv-cache-events",
                "--kv-events-topic", "kv", "--admin-api-key", "adm")
    ev = httpx.get(srv.url + "/kvloop/worker").json()["kv_events"]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(ev["endpoint"])
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        time.sleep(0.3)  # slow joiner
        httpx.post(srv.url + "/v1/completions", json={"prompt": list(range(2000, 2040)),
                                                      "max_tokens": 1})
        assert httpx.post(srv.url + "/reset_prefix_cache",
                          headers={"Authorization": "Bearer adm"}).status_code == 200
        dec = msgspec.msgpack.Decoder(KVEventBatch)
        kinds: list[str] = []
        deadline = time.monotonic() + 5
        while "AllBlocksCleared" not in kinds and time.monotonic() < deadline:
            if sub.poll(100):
                kinds += [type(e).__name__ for e in dec.decode(sub.recv_multipart()[2]).events]
    finally:
        sub.close(linger=0)
        ctx.term()
    # no request follows the reset: the event must not wait for the next engine step
    assert kinds[0] == "BlockStored" and kinds[-1] == "AllBlocksCleared"


def _listening_tcp_ports(pids: list[int]) -> set[int]:
    """TCP ports the processes `pids` listen on (from /proc: their sockets' inodes)."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if f[3] == "0A" and f[9] in inodes:   # 0A: LISTEN
                    ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def test_the_engine_sockets_are_private_ipc_files_and_only_http_listens(tmp_path: Path) -> None:
    """No other local user can reach the API server <-> engine sockets (they were loopback TCP
    ports, where anyone on the host could forge outputs or the handshake): they are IPC files
    in a mode-0700 folder, removed at exit; the worker listens on its HTTP port alone."""
    srv = ServeProcess(["--model", "sim"], tmp_path / "serve.log",
                       env={"TMPDIR": str(tmp_path)}).start()
    try:
        (folder,) = tmp_path.glob("kvloop-engine-*")
        assert folder.stat().st_mode & 0o777 == 0o700
        assert sorted(p.name for p in folder.iterdir()) == ["input", "output"]
        assert all(p.is_socket() for p in folder.iterdir())
        http_port = int(srv.url.rsplit(":", 1)[1])
        engine = children(srv.pid)
        assert engine, "the engine core process was not found"
        assert _listening_tcp_ports([srv.pid, *engine]) == {http_port}
        assert httpx.post(srv.url + "/v1/completions", timeout=30,
                          json={"prompt": "hi", "max_tokens": 3}).status_code == 200
    finally:
        srv.stop()
    assert not folder.exists()
