"""`kvloop fleet` as a user runs it: one command, every address printed, one signal stops all."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from kvloop.router.fleet import FleetConfig
from tests.conftest import alive, lines_until, wait_until
from tests.test_router_fleet import (
    TOKEN_RANGE,
    best_hit_share,
    run_workload,
    shared_prefix_prompts,
)


@pytest.mark.processes
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_fleet_starts_workers_and_router_and_one_signal_stops_everything(sig):
    cmd = [sys.executable, "-m", "kvloop", "fleet", "--workers", "2", "--port", "0",
           "--roles", "both", "--", "--sim-speedup", "40", "--num-gpu-blocks-override", "64"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = lines_until(proc, "kvloop router on", 90)
        url = re.search(r"kvloop router on (http://\S+)", "\n".join(lines)).group(1)
        worker_lines = [ln for ln in lines if ln.startswith("  worker ")]
        assert len(worker_lines) == 2 and all(": up, role both" in ln for ln in worker_lines)
        assert all("events tcp://127.0.0.1:" in ln for ln in worker_lines)
        workers = httpx.get(url + "/workers").json()
        assert len(workers) == 2
        pids = []
        for w in workers.values():
            info = httpx.get(w["url"] + "/kvloop/worker").json()
            pids += [info["api_pid"], info["engine_pid"]]
        r = httpx.post(url + "/v1/completions", json={"prompt": [5] * 40, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        # a shared-prefix workload of SmolLM2 token ids: one client, so after each prefix's
        # first prompt every repeat is routed to its prefix and hits it whole
        workload = shared_prefix_prompts(2, 64, 16, 3, seed=4)
        assert all(TOKEN_RANGE[0] <= t < TOKEN_RANGE[1] for _, p in workload for t in p)
        share = run_workload(url, [p for _, p in workload], concurrency=1)
        assert share == best_hit_share(workload, 64) == 4 * 64 / (6 * 80)
        assert httpx.get(url + "/health").json()["status"] == "ok"
        proc.send_signal(sig)
        assert proc.wait(30) == 0
        wait_until(lambda: not any(alive(p) for p in pids), 10,
                   "the workers to end (a worker process outlived the fleet)")
        assert "kvloop fleet: stopped" in lines[-1]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_fleet_config_builds_worker_command_lines():
    cfg = FleetConfig(3, "sim", ("prefill", "decode"), ("--sim-speedup", "5"))
    argv = cfg.argv(2)
    assert argv[argv.index("--role") + 1] == "prefill"
    assert argv[-2:] == ["--sim-speedup", "5"]          # user flags come last: they win
    assert "tcp://127.0.0.1:0" in argv and argv[argv.index("--port") + 1] == "0"
    assert "--num-threads" not in argv                  # simulated workers use no torch
    for bad in (dict(num_workers=0), dict(num_workers=1, roles=("sideways",))):
        try:
            FleetConfig(**bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} accepted")


@pytest.mark.processes
def test_fleet_hands_its_workers_the_nats_ca_and_refuses_it_for_its_own_server(tmp_path):
    from kvloop.events.config import NatsPlaneConfig
    from kvloop.front.launcher import kvloop_command

    ca = tmp_path / "ca.crt"
    ca.write_text("a CA")
    plane = NatsPlaneConfig("nats://10.0.0.9:4222", tls_ca=str(ca))
    argv = FleetConfig(2, "sim", event_plane=plane).argv(0)
    assert argv[argv.index("--nats-tls-ca") + 1] == str(ca)
    assert argv[argv.index("--event-plane") + 1] == "nats://10.0.0.9:4222"
    done = subprocess.run(kvloop_command("fleet", "--workers", "1", "--event-plane", "nats",
                                         "--nats-tls-ca", str(ca), "--", "--model", "sim"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "kvloop fleet: --event-plane nats starts a nats-server on this host without TLS" \
        in done.stderr


def test_fleet_config_of_a_pd_fleet():
    import json

    from kvloop.config import KVTransferConfig

    cfg = FleetConfig(1, "sim", num_prefill=2, num_decode=1,
                      kv_connector_extra_config='{"kv_lease_duration": 5}')
    assert cfg.total == 4 and [cfg.role_of(i) for i in range(4)] == [
        "both", "prefill", "prefill", "decode"]
    assert "--kv-transfer-config" not in cfg.argv(0)
    for i, kv_role in ((1, "kv_producer"), (3, "kv_consumer")):
        argv = cfg.argv(i)
        assert argv[argv.index("--role") + 1] == cfg.role_of(i)
        text = argv[argv.index("--kv-transfer-config") + 1]
        assert json.loads(text) == {"kv_connector": "KvloopConnector", "kv_role": kv_role,
                                    "kv_connector_extra_config": {"kv_lease_duration": 5}}
        parsed = KVTransferConfig.from_json(text)   # what `kvloop serve` will make of it
        assert parsed.kv_role == kv_role and parsed.extra.kv_lease_duration == 5
    for bad, message in ((dict(num_workers=0), "at least one worker"),
                         (dict(num_workers=0, num_decode=-1), "--decode must be >= 0"),
                         (dict(num_workers=0, num_prefill=1, kv_connector_extra_config="[1]"),
                          "must be a JSON object"),
                         (dict(num_workers=1, kv_connector_extra_config="{"), "is not JSON")):
        with pytest.raises(ValueError, match=message):
            FleetConfig(**bad)


def test_fleet_splits_cores_between_real_workers(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    for workers, threads in ((1, "5"), (2, "2"), (8, "1")):
        argv = FleetConfig(workers, "model.gguf").argv(0)
        assert argv[argv.index("--num-threads") + 1] == threads
    # the user's flag comes after ours, so argparse keeps theirs
    argv = FleetConfig(2, "model.gguf", worker_args=("--num-threads", "3")).argv(0)
    assert argv[-2:] == ["--num-threads", "3"]
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-threads", type=int)
    assert ap.parse_known_args(argv)[0].num_threads == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert "--num-threads" not in FleetConfig(2, "model.gguf").argv(0)


@pytest.mark.processes
def test_a_worker_that_cannot_start_is_named_and_the_fleet_cleans_up(tmp_path):
    from kvloop.router.fleet import Fleet

    fleet = Fleet(FleetConfig(2, "sim", worker_args=("--no-such-flag",), start_timeout_s=60,
                              echo_output=False))
    assert fleet.log_dir.is_dir()
    with pytest.raises(RuntimeError, match=r"worker 0 did not start \(exited with code 2\); "
                                           r"last output:\n(.|\n)*--no-such-flag"):
        fleet.start()
    assert not any(w.alive() for w in fleet.workers) and not fleet.log_dir.exists()
    kept = Fleet(FleetConfig(1, "sim", worker_args=("--no-such-flag",), echo_output=False,
                             log_dir=str(tmp_path)))
    with pytest.raises(RuntimeError, match="worker 0 did not start"):
        kept.start()
    assert "--no-such-flag" in (tmp_path / "worker0.log").read_text()


@pytest.mark.processes
def test_fleet_restarts_a_killed_worker_on_its_port_and_the_router_serves_through_it_again():
    """kill -9 of one of two workers: the fleet starts it again (a new pid on the same URL,
    the exit printed with its code), the router marks it down then up and routes to it again
    (round-robin), and requests kept succeeding on the other worker meanwhile."""
    cmd = [sys.executable, "-m", "kvloop", "fleet", "--workers", "2", "--port", "0",
           "--policy", "round-robin", "--max-worker-restarts", "2",
           "--worker-restart-backoff", "1", "--", "--sim-speedup", "40"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    counts = {"ok": 0, "failed": 0}
    stop = threading.Event()

    def client(url: str) -> None:
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                try:
                    r = c.post(url + "/v1/completions", json={"prompt": [7] * 8,
                                                              "max_tokens": 2})
                    counts["ok" if r.status_code == 200 else "failed"] += 1
                except httpx.HTTPError:
                    counts["failed"] += 1

    try:
        lines = lines_until(proc, "kvloop router on", 90)
        url = re.search(r"kvloop router on (http://\S+)", "\n".join(lines)).group(1)
        victim_url = sorted(w["url"] for w in httpx.get(url + "/workers").json().values())[0]
        old_pid = httpx.get(victim_url + "/kvloop/worker").json()["api_pid"]
        thread = threading.Thread(target=client, args=(url,), daemon=True)
        thread.start()
        wait_until(lambda: counts["ok"] >= 4, 30, "requests through the fleet")
        os.kill(old_pid, signal.SIGKILL)
        wait_until(lambda: any(not w["up"] for w in httpx.get(url + "/workers").json()
                               .values()), 30, "the router to mark the killed worker down")
        down_ok = counts["ok"]

        def new_pid() -> int | None:
            try:
                pid = httpx.get(victim_url + "/kvloop/worker", timeout=2).json()["api_pid"]
            except httpx.HTTPError:
                return None
            return pid if pid != old_pid else None

        pid = wait_until(new_pid, 60, "the killed worker back on its URL")
        assert counts["ok"] > down_ok   # the other worker served while it was away
        wait_until(lambda: all(w["up"] for w in httpx.get(url + "/workers").json().values()),
                   30, "the router to re-admit the restarted worker")
        wait_until(lambda: _generated(victim_url) > 0, 30, "the router to route to it again")
        stop.set()
        thread.join(35)
        # only the request in flight on the killed worker may have failed (one client)
        assert counts["failed"] <= 1 and counts["ok"] > down_ok
        assert alive(pid) and not alive(old_pid)
        text = "\n".join(lines)
        assert re.search(rf"worker \d \(pid {old_pid}\) ended, killed by SIGKILL \(exit code "
                         rf"-9\); restart 1 of 2 in 1 s on port \d+", text), text[-3000:]
        # the fleet says so once its own health poll sees the new pid (after the router may)
        wait_until(lambda: f"serving again on {victim_url} (pid {pid})" in "\n".join(lines),
                   30, "the fleet to report the restarted worker")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        wait_until(lambda: not alive(pid), 10, "the restarted worker to stop with the fleet")
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()


def _generated(url: str) -> float:
    from kvloop.front.prometheus_text import metric_value

    return metric_value(httpx.get(url + "/metrics").text, "vllm:generation_tokens_total")


def test_restart_policy_backs_off_and_refuses_bad_values():
    from kvloop.router.config import RestartPolicy
    from kvloop.router.fleet import exit_text

    p = RestartPolicy(max_restarts=5, backoff_s=1.0, max_backoff_s=8.0)
    assert [p.delay_s(n) for n in range(6)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert exit_text(-9) == "killed by SIGKILL (exit code -9)" and exit_text(3) == "exit code 3"
    for bad in (dict(max_restarts=-1), dict(backoff_s=0), dict(backoff_s=60.0)):
        with pytest.raises(ValueError):
            RestartPolicy(**bad)


@pytest.mark.processes
def test_a_worker_that_keeps_dying_is_restarted_at_most_max_restarts_times(capsys):
    """The restart limit: a killed worker whose port another process then holds fails its
    one restart (the bind error, printed with its exit code) and is left dead."""
    import socket
    from urllib.parse import urlsplit

    from kvloop.router.config import RestartPolicy
    from kvloop.router.fleet import Fleet

    cfg = FleetConfig(1, "sim", worker_args=("--sim-speedup", "40"), echo_output=False,
                      restart=RestartPolicy(max_restarts=1, backoff_s=1.0))
    fleet = Fleet(cfg)
    try:
        [spec] = fleet.start()
        first = fleet.workers[0]
        squatter = socket.socket()
        first.signal(signal.SIGKILL)
        first.wait(10)
        squatter.bind(("127.0.0.1", urlsplit(spec.url).port))   # before the 1 s backoff ends
        squatter.listen()
        err: list[str] = []
        wait_until(lambda: err.append(capsys.readouterr().err) or "not restarted" in
                   "".join(err), 60, "the fleet to give up on the worker")
        text = "".join(err)
        assert "ended, killed by SIGKILL (exit code -9); restart 1 of 1 in 1 s" in text
        assert re.search(r"ended, exit code [1-9]\d*; not restarted: --max-worker-restarts "
                         r"1 reached", text), text
        with fleet.lock:
            second = fleet.workers[0]
        assert second is not first and not second.alive() and second.proc.returncode > 0
        assert "in use" in second.log()
        squatter.close()
    finally:
        fleet.stop()
