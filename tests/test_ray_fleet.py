"""`kvloop fleet --ray` on a real local Ray cluster (`ray start --head`, stopped at the end
with every process it started): the router and two sim workers as Ray actors; a worker
killed with SIGKILL comes back (a new pid, restarted by Ray), the router admits it and routes
to it, and clients lose at most the requests in flight on it; running the command again with
fewer workers drains the removed one (its stream finishes whole) and removes it; a killed
router comes back too and gets the workers; one SIGTERM stops the fleet. The fleet secret is
on no command line, and the router's process is not given it in its environment either (its
standard input brings it)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvloop.front.launcher import group_members, stop_processes
from kvloop.router.fleet import FleetConfig
from kvloop.router.ray_fleet import check_supported, start_error, worker_host
from tests.conftest import alive, held_port, lines_until, wait_until

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[1]
RAY = Path(sys.executable).with_name("ray")
SECRET = "ray-test-fleet-secret-0123456789abcdef"
STREAM_TOKENS = 800     # about 30 s at --sim-speedup 1: still running when the drain begins
SERVING = re.compile(r"kvloop fleet: worker (\d+) serving(?: again)? on (http://\S+) \(pid (\d+)")


def _env() -> dict[str, str]:
    """This checkout first on the path of every process (Ray's actors import kvloop)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "RAY_USAGE_STATS_ENABLED": "0"}


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if text.encode() in cmdline.read_bytes() and alive(int(cmdline.parent.name)):
                pids.append(int(cmdline.parent.name))
    return pids


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A one-node Ray cluster (2 CPUs, no dashboard) in a session of its own; its address.
    Stopped by signalling that session (not `ray stop`, which would stop every Ray cluster of
    this user on the host), then no process of it may be left. Ray's drain of a node on
    SIGTERM (for Ray Serve's proxies: up to 30 s, `RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S`) is
    off: nothing here serves through Ray Serve; with it, the node outlived the 10 s grace and
    was SIGKILLed, without it, it ends on SIGTERM within seconds."""
    tmp = tempfile.mkdtemp(prefix="kvray-", dir="/tmp")   # Ray's socket paths must be short
    held = [held_port() for _ in range(4)]
    port, agent, client, dashboard = (s.getsockname()[1] for s in held)
    for s in held:
        s.close()
    cmd = [str(RAY), "start", "--head", "--block", "--port", str(port), "--num-cpus", "2",
           "--include-dashboard=false", "--dashboard-port", str(dashboard),
           "--dashboard-agent-listen-port", str(agent), "--ray-client-server-port",
           str(client), "--object-store-memory", str(100 << 20), "--temp-dir", tmp,
           "--disable-usage-stats"]
    head = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**_env(), "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"},
                            start_new_session=True)
    try:
        lines_until(head, "Ray runtime started", 120)
        yield f"127.0.0.1:{port}"
    finally:
        stop_processes([("ray head", head)], 10, group=True)
        wait_until(lambda: not group_members(head.pid) and not _processes_mentioning(tmp), 30,
                   "every process of the Ray cluster to end")
        shutil.rmtree(tmp, ignore_errors=True)


def _serving(lines: list[str]) -> dict[int, tuple[str, int]]:
    """Each worker's latest URL and pid, as the fleet printed them."""
    found: dict[int, tuple[str, int]] = {}
    for line in list(lines):
        m = SERVING.search(line)
        if m:
            found[int(m.group(1))] = (m.group(2), int(m.group(3)))
    return found


def _workers(router: str) -> dict[str, dict]:
    return httpx.get(router + "/workers", timeout=10).json()


class _Load:
    """Two clients sending short completions through the router back to back."""

    def __init__(self, router: str):
        self.router = router
        self.ok = 0
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(2)]

    def _run(self, client: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                r = httpx.post(self.router + "/v1/completions",
                               json={"prompt": [client + 3, n % 200 + 10, 7, 7],
                                     "max_tokens": 4}, timeout=60)
                if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4:
                    self.ok += 1
                else:
                    self.failed.append(f"{r.status_code} {r.text[:200]}")
            except httpx.HTTPError as e:
                self.failed.append(repr(e))

    def __enter__(self) -> _Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(90)


def _stream(url: str, lines: list[str], out: dict) -> None:
    """A long stream straight to one worker; for each chunk, whether the fleet had already
    said it drains that worker."""
    out["chunks"], out["after_drain"] = 0, 0
    body = {"prompt": [5, 6, 7, 8], "max_tokens": STREAM_TOKENS, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                out["tokens"] = chunk["usage"]["completion_tokens"]
            if not chunk["choices"]:
                continue
            out["chunks"] += 1
            out["finish"] = chunk["choices"][0]["finish_reason"] or out.get("finish")
            if any("draining worker 1" in ln for ln in list(lines)):
                out["after_drain"] += 1


def test_a_start_failure_is_one_line():
    text = "worker 0 did not start (exited with code 2); last output:\n    usage: ...\n" \
           "    kvloop serve: error: unrecognized arguments: --x\n"
    assert start_error(text) == ("worker 0 did not start (exited with code 2): kvloop serve: "
                                 "error: unrecognized arguments: --x")
    assert start_error("router did not start in 5 s") == "router did not start in 5 s"


def test_worker_host_is_the_nodes_address_unless_the_fleet_keeps_to_loopback():
    assert worker_host("127.0.0.1", "10.0.0.5") == "127.0.0.1"
    assert worker_host("localhost", "10.0.0.5") == "localhost"
    assert worker_host("0.0.0.0", "10.0.0.5") == "10.0.0.5"
    assert worker_host("192.0.2.9", "10.0.0.5") == "10.0.0.5"


def test_what_ray_does_not_run_yet_is_refused_in_words():
    check_supported(FleetConfig(2))
    with pytest.raises(ValueError, match="--prefill and --decode are not supported"):
        check_supported(FleetConfig(0, num_prefill=1, num_decode=1))
    with pytest.raises(ValueError, match="a running nats-server"):
        check_supported(FleetConfig(1, nats_port=4222))


def test_no_cluster_at_the_address_is_one_line_at_once():
    with held_port() as nobody:   # bound, not listening: a connection is refused
        port = nobody.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "kvloop", "fleet", "--ray",
                            f"127.0.0.1:{port}", "--workers", "1", "--port", "0"],
                           capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        f"kvloop fleet: cannot connect to Ray at 127.0.0.1:{port}: [Errno 111] Connection "
        "refused (is a cluster running there? `ray start --head` starts one)"], r.stderr


def _host_actors() -> list[int]:
    """This host's processes of kvloop's actors (Ray names an actor's process after it)."""
    return [p for name in ("ray::WorkerHost", "ray::RouterHost", "kvloop.router.ray_fleet")
            for p in _processes_mentioning(name)]


def test_a_worker_that_cannot_start_fails_the_fleet_in_words(ray_cluster):
    r = subprocess.run([sys.executable, "-m", "kvloop", "fleet", "--ray", ray_cluster,
                        "--workers", "1", "--port", "0", "--", "--no-such-flag"],
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert ("kvloop fleet: worker 0 did not start (exited with code 2): kvloop serve: error: "
            "unrecognized arguments: --no-such-flag") in r.stderr.splitlines(), r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert r.stdout.splitlines()[-1] == "kvloop fleet: stopped"
    wait_until(lambda: not _host_actors(), 60, "the fleet's actors and processes to end")


def test_a_killed_fleet_command_takes_its_actors_and_processes_with_them(ray_cluster):
    """The actors belong to the command's Ray driver: when it dies (kill -9: nothing of it
    runs), Ray ends them, and their processes die with them. The actors' own processes
    never held the secret in their environment."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvloop", "fleet", "--ray", ray_cluster, "--workers", "1",
         "--port", "0", "--", "--sim-speedup", "10"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**_env(), "KVLOOP_FLEET_SECRET": SECRET}, start_new_session=True)
    try:
        lines = lines_until(proc, "kvloop router on", 240)
        [(url, pid)] = _serving(lines).values()
        [router_pid] = _processes_mentioning("kvloop.router.ray_fleet")
        actors = _processes_mentioning("ray::WorkerHost") + \
            _processes_mentioning("ray::RouterHost")
        assert len(actors) == 2
        for actor in actors:
            assert SECRET.encode() not in Path(f"/proc/{actor}/environ").read_bytes()
        assert SECRET.encode() in Path(f"/proc/{pid}/environ").read_bytes()   # kvloop serve's
        # its log in the Ray session's folder (removed with it), not left in /tmp
        assert re.search(r"/session_[^/]+/kvloop/kvloop-[^/]+/worker\.log$",
                         os.readlink(f"/proc/{pid}/fd/1"))
        proc.kill()
        proc.wait(30)
        wait_until(lambda: not alive(pid) and not alive(router_pid) and not _host_actors(),
                   120, "Ray to end the dead command's actors and their processes")
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.timeout(900)
def test_fleet_on_ray_restarts_a_killed_worker_and_drains_on_scale_down(ray_cluster):
    env = {**_env(), "KVLOOP_FLEET_SECRET": SECRET}
    fleet_cmd = [sys.executable, "-m", "kvloop", "fleet", "--ray", ray_cluster]
    proc = subprocess.Popen(
        [*fleet_cmd, "--workers", "2", "--port", "0", "--policy", "round-robin",
         "--max-worker-restarts", "3", "--ray-drain-timeout", "120",
         "--", "--sim-speedup", "1", "--num-gpu-blocks-override", "128"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True)
    try:
        lines = lines_until(proc, "kvloop router on", 240)
        router = re.search(r"kvloop router on (http://\S+)", "\n".join(lines)).group(1)
        first = _serving(lines)
        assert sorted(first) == [0, 1]
        wait_until(lambda: {w["url"]: w["up"] for w in _workers(router).values()}
                   == {first[0][0]: True, first[1][0]: True}, 60, "both workers up")
        # the secret: on no command line; the router has it (its KV event subscriptions are
        # CURVE-keyed from it and hear the workers) without it in its environment
        assert not _processes_mentioning(SECRET)
        wait_until(lambda: all(w["events"]["subscriber"]["heartbeats"] > 0
                               for w in _workers(router).values()), 60,
                   "the router to hear both workers' CURVE-keyed event sockets")
        [router_pid] = _processes_mentioning("kvloop.router.ray_fleet")
        assert SECRET.encode() not in Path(f"/proc/{router_pid}/environ").read_bytes()

        url0, pid0 = first[0]
        with _Load(router) as load:
            wait_until(lambda: load.ok >= 10, 60, "requests through the router")
            os.kill(pid0, signal.SIGKILL)
            wait_until(lambda: _serving(lines)[0][1] != pid0, 120,
                       "Ray to restart worker 0 (a new pid)")
            url0b, pid0b = _serving(lines)[0]
            assert alive(pid0b) and not alive(pid0)
            wait_until(lambda: (ws := _workers(router)).get(url0b.split("//")[1], {})
                       .get("up") and url0.split("//")[1] not in ws, 60,
                       "the router to admit the restarted worker (and drop its old URL)")
            served = load.ok
            wait_until(lambda: _workers(router)[url0b.split("//")[1]]["served"] >= 3
                       and load.ok >= served + 6, 60,
                       "requests routed to the restarted worker")
        assert len(load.failed) <= 2, load.failed   # at most those in flight on the killed one
        assert any("worker 0 (pid" in ln and "SIGKILL" in ln for ln in lines), lines[-20:]

        # scale down: worker 1 drains (its stream finishes whole), then leaves
        url1, pid1 = first[1]
        out: dict = {}
        streamer = threading.Thread(target=_stream, args=(url1, lines, out))
        streamer.start()
        wait_until(lambda: out.get("chunks", 0) >= 5, 60, "the stream to start")
        scaled = subprocess.run([*fleet_cmd, "--workers", "1"], capture_output=True,
                                text=True, env=_env(), timeout=300)
        assert scaled.returncode == 0, scaled.stdout + scaled.stderr
        assert "scaling its workers from 2 to 1" in scaled.stdout
        streamer.join(120)
        assert out["status"] == 200 and out["finish"] == "length"
        assert out["tokens"] == STREAM_TOKENS and out["after_drain"] > 0, out
        assert any("worker 1 drained and removed (exit code 0)" in ln for ln in lines)
        wait_until(lambda: not alive(pid1), 30, "the drained worker's process to end")
        wait_until(lambda: list(_workers(router)) == [url0b.split("//")[1]], 30,
                   "the router to list only worker 0")
        r = httpx.post(router + "/v1/completions", json={"prompt": [9, 9], "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200

        # the router killed: Ray restarts its actor on this node (--port 0: a new port), and
        # the fleet hands the new router its worker
        os.kill(router_pid, signal.SIGKILL)
        restarted = wait_until(lambda: next((m.group(1) for ln in list(lines) if (
            m := re.search(r"router restarted; kvloop router on (http://\S+)", ln))), None),
            120, "Ray to restart the router")
        wait_until(lambda: {n: w["up"] for n, w in _workers(restarted).items()}
                   == {url0b.split("//")[1]: True}, 60, "the new router to admit worker 0")
        r = httpx.post(restarted + "/v1/completions", json={"prompt": [9, 9], "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        [router_pid] = _processes_mentioning("kvloop.router.ray_fleet")

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
        wait_until(lambda: not alive(pid0b) and not alive(router_pid), 30,
                   "the fleet's processes to end")
        assert "kvloop fleet: stopped" in lines[-1]
    finally:
        if proc.poll() is None:
            proc.kill()
