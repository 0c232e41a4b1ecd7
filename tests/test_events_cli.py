"""`kvloop events tail`, in process and as a real command stopped by SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvloop.cli import build_parser, main
from kvloop.events.cli_args import add_publisher_args, publisher_config_from_args
from kvloop.events.config import KVEventsConfig

from .conftest import serving
from .test_events_helpers import SimWorker

ROOT = Path(__file__).resolve().parents[1]


def test_tail_prints_the_snapshot_then_live_batches(capsys):
    worker = SimWorker(KVEventsConfig(endpoint="tcp://127.0.0.1:0",
                                      replay_endpoint="tcp://127.0.0.1:0", topic="kv"))
    try:
        worker.run(4, min_batches=4)
        stop = threading.Event()

        def feed() -> None:  # keep the worker busy while the tail listens
            while not stop.is_set():
                worker.run(1)
                time.sleep(0.01)

        feeder = threading.Thread(target=feed)
        feeder.start()
        try:
            rc = main(["events", "tail", "--endpoint", worker.endpoint, "--replay-endpoint",
                       worker.replay_endpoint, "--topic", "kv", "--count", "3",
                       "--timeout", "10", "--idle-warn", "0.5"])
        finally:
            stop.set()
            feeder.join()
        out, err = capsys.readouterr()
    finally:
        worker.shutdown()
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith("-- reset (join)") and worker.publisher.epoch[:8] in lines[0]
    assert lines[1].startswith("snapshot through seq=")
    heads = [ln for ln in lines if ln.startswith("seq=")]
    assert len(heads) >= 2 and all(ln.split()[1] == "live" for ln in heads)
    assert any(ln.startswith("  BlockStored ") for ln in lines)
    stats = json.loads(err.strip().splitlines()[-1])["stats"]
    assert stats["snapshots"] == 1 and stats["current_epoch"] == worker.publisher.epoch
    assert "kvloop events tail:" not in err   # batches kept coming: no idle warning


def test_tail_json_lines(capsys):
    worker = SimWorker(KVEventsConfig(endpoint="tcp://127.0.0.1:0",
                                      replay_endpoint="tcp://127.0.0.1:0", topic="kv"))
    try:
        worker.run(3, min_batches=3)
        rc = main(["events", "tail", "--endpoint", worker.endpoint, "--replay-endpoint",
                   worker.replay_endpoint, "--json", "--count", "1", "--timeout", "10"])
    finally:
        worker.shutdown()
    assert rc == 0
    objs = [json.loads(ln) for ln in capsys.readouterr()[0].splitlines()]
    assert objs[0]["source"] == "reset" and objs[0]["events"] == [{"type": "AllBlocksCleared"}]
    assert objs[1]["source"] == "snapshot"
    assert all(ev["type"] == "BlockStored" for ev in objs[1]["events"])


@pytest.mark.processes
def test_tail_stops_cleanly_on_sigterm():
    worker = SimWorker(KVEventsConfig(endpoint="tcp://127.0.0.1:0", topic="kv"))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvloop", "events", "tail", "--endpoint", worker.endpoint,
         "--topic", "kv", "--heartbeats"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()  # a heartbeat shows the tail is subscribed
        assert line.strip().startswith("heartbeat epoch=")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=10)
        assert proc.returncode == 0
        assert '"heartbeats"' in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        worker.shutdown()


def test_publisher_flags_build_the_config():
    import argparse

    ap = argparse.ArgumentParser()
    add_publisher_args(ap)
    assert publisher_config_from_args(ap.parse_args([])) is None
    assert publisher_config_from_args(ap.parse_args(["--kv-events-topic", "kv"])) is None
    assert publisher_config_from_args(ap.parse_args(["--enable-kv-cache-events"])) == \
        KVEventsConfig(omit_token_ids=True)      # no subscriber authenticates: hashes only
    assert publisher_config_from_args(ap.parse_args(["--enable-kv-cache-events"]),
                                      has_secret=True) == KVEventsConfig(curve=True)
    assert publisher_config_from_args(ap.parse_args(
        ["--enable-kv-cache-events", "--no-kv-events-curve"]), has_secret=True) == \
        KVEventsConfig(omit_token_ids=True)
    assert publisher_config_from_args(ap.parse_args(
        ["--enable-kv-cache-events", "--no-kv-events-omit-token-ids"])) == KVEventsConfig()
    cfg = publisher_config_from_args(ap.parse_args(
        ["--kv-events-endpoint", "tcp://127.0.0.1:0", "--kv-events-replay-endpoint",
         "tcp://127.0.0.1:0", "--kv-events-topic", "kv", "--kv-events-recency",
         "--no-kv-events-heartbeat"]))
    assert cfg == KVEventsConfig(endpoint="tcp://127.0.0.1:0",
                                 replay_endpoint="tcp://127.0.0.1:0", topic="kv",
                                 recency=True, heartbeat=False, omit_token_ids=True)
    with pytest.raises(ValueError, match="endpoint must look like tcp://HOST:PORT"):
        publisher_config_from_args(ap.parse_args(["--kv-events-endpoint", "127.0.0.1:5557"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["events", "tail"])  # --endpoint is required


# --- when nothing arrives --------------------------------------------------------------------
def _warnings(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("kvloop events tail:")]


@pytest.mark.slow   # waits out its timeouts
def test_tail_says_so_when_nothing_answers(capsys, free_port):
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    rc = main(["events", "tail", "--endpoint", pub, "--topic", "kv", "--idle-warn", "0.3",
               "--exit-on-idle"])
    out, err = capsys.readouterr()
    assert rc == 1 and out == ""
    (warning,) = _warnings(err)
    assert warning.startswith(f"kvloop events tail: no KV event batch from {pub} in 0.3 s; "
                              f"nothing answered there (no --replay-endpoint given")
    for cause in ("a wrong endpoint or port", "without --enable-kv-cache-events or "
                  "--kv-events-endpoint", "a topic mismatch (this tail subscribes to topic "
                  "'kv'", "idle worker without heartbeats"):
        assert cause in warning, cause
    assert warning.endswith(". Exiting (--exit-on-idle).")
    assert json.loads(err.strip().splitlines()[-1])["stats"]["batches_received"] == 0
    # without --exit-on-idle: one warning, then it keeps waiting (here until --timeout)
    rc = main(["events", "tail", "--endpoint", pub, "--replay-endpoint", replay,
               "--idle-warn", "0.3", "--timeout", "1"])
    (warning,) = _warnings(capsys.readouterr()[1])
    assert rc == 0 and f"nothing answered there nor on the replay endpoint {replay}." in warning
    assert "every topic" in warning and warning.endswith(". Still waiting.")


@pytest.mark.slow   # waits out its idle time
@pytest.mark.parametrize("case", ["idle worker", "topic mismatch"])
def test_tail_says_the_publisher_is_there_but_sends_nothing(capsys, case):
    """Replay replies (idle worker) or heartbeats (other topic) show someone is there."""
    worker = SimWorker(KVEventsConfig(endpoint="tcp://127.0.0.1:0",
                                      replay_endpoint="tcp://127.0.0.1:0", topic="kv",
                                      heartbeat_interval_s=0.1))
    stop = threading.Event()

    def feed() -> None:  # batches flow, on a topic the tail does not subscribe to
        while not stop.is_set():
            worker.run(1)
            time.sleep(0.02)

    feeder = threading.Thread(target=feed)
    try:
        worker.run(3, min_batches=3)
        if case == "idle worker":
            args = ["--replay-endpoint", worker.replay_endpoint, "--topic", "kv"]
        else:
            args = ["--topic", "other"]
            feeder.start()
        rc = main(["events", "tail", "--endpoint", worker.endpoint, *args, "--idle-warn",
                   "1", "--exit-on-idle"])   # 10 heartbeats apart
    finally:
        stop.set()
        if feeder.is_alive():
            feeder.join()
        worker.shutdown()
    out, err = capsys.readouterr()
    (warning,) = _warnings(err)
    topic = "'kv'" if case == "idle worker" else "'other'"
    assert rc == 1 and warning == (
        f"kvloop events tail: no KV event batch from {worker.endpoint} in 1 s; the "
        f"publisher is there (heartbeats or replay replies, epoch {worker.publisher.epoch[:8]})"
        f" but sent no batch on topic {topic}: the worker is idle (events flow only while its "
        f"KV cache changes), or it publishes on another topic (its --kv-events-topic). "
        f"Exiting (--exit-on-idle).")
    if case == "idle worker":   # the current cache came first, then the silence
        assert out.splitlines()[1].startswith("snapshot through seq=")
    else:
        assert out == ""


def test_idle_flags_are_checked():
    for bad in (["--idle-warn", "-1"], ["--idle-warn", "0", "--exit-on-idle"]):
        with pytest.raises(SystemExit, match="--idle-warn"):
            main(["events", "tail", "--endpoint", "tcp://127.0.0.1:1", *bad])


@pytest.mark.processes
def test_tail_against_kvloop_serve_with_heartbeats(tmp_path_factory, capsys):
    """`kvloop serve --kv-events-heartbeat` on vLLM's empty topic: an idle worker is heard."""
    with serving(tmp_path_factory, "tail_serve", [
            "--model", "sim", "--enable-kv-cache-events", "--kv-events-heartbeat"]) as srv:
        endpoint = httpx.get(srv.url + "/kvloop/worker").json()["kv_events"]["endpoint"]
        rc = main(["events", "tail", "--endpoint", endpoint, "--heartbeats", "--idle-warn",
                   "2.5", "--exit-on-idle"])
    out, err = capsys.readouterr()
    assert rc == 1 and out.splitlines()[0].startswith("   heartbeat epoch=")
    (warning,) = _warnings(err)
    assert "the publisher is there (heartbeats or replay replies, epoch " in warning
