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

import pytest

from kvloop.cli import build_parser, main
from kvloop.events.cli_args import add_publisher_args, publisher_config_from_args
from kvloop.events.publisher import KVEventsConfig

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
                       "--timeout", "10"])
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
    cfg = publisher_config_from_args(ap.parse_args(
        ["--kv-events-endpoint", "tcp://127.0.0.1:0", "--kv-events-replay-endpoint",
         "tcp://127.0.0.1:0", "--kv-events-topic", "kv", "--kv-events-recency",
         "--no-kv-events-heartbeat", "--kv-events-buffer-steps", "50"]), data_parallel_rank=2)
    assert cfg == KVEventsConfig(endpoint="tcp://127.0.0.1:0",
                                 replay_endpoint="tcp://127.0.0.1:0", topic="kv",
                                 recency=True, heartbeat=False, buffer_steps=50,
                                 data_parallel_rank=2)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["events", "tail"])  # --endpoint is required
