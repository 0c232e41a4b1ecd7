"""`kvloop events tail`: print one worker's KV events as they arrive, readably or as JSON.

Works against a kvloop worker or a vLLM one (the subscriber speaks both). Stops after
`--count` batches, after `--timeout` seconds, or on SIGINT/SIGTERM, then prints the
subscriber's counters on stderr.
"""

from __future__ import annotations

import datetime as dt
import json
import signal
import sys
import threading
import time
from dataclasses import asdict
from typing import Any, TextIO

import msgspec

from kvloop.events.protocol import PublisherInfo
from kvloop.events.subscriber import KVEventSubscriber, WorkerBatch
from kvloop.events.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


def fmt_hash(h: int | bytes | None) -> str:
    if h is None:
        return "-"
    return h.hex() if isinstance(h, bytes) else f"{h:016x}"


def _fmt_hashes(hashes: list[int | bytes], limit: int = 4) -> str:
    shown = ",".join(fmt_hash(h) for h in hashes[:limit])
    return shown + (f",...(+{len(hashes) - limit})" if len(hashes) > limit else "")


def format_event(ev: KVEvent) -> str:
    """One event on one line."""
    if isinstance(ev, BlockStored):
        return (f"  BlockStored      {len(ev.block_hashes)} block(s) "
                f"parent={fmt_hash(ev.parent_block_hash)} "
                f"hashes={_fmt_hashes(ev.block_hashes)} tokens={len(ev.token_ids)} "
                f"bs={ev.block_size} medium={ev.medium}"
                + (f" lora={ev.lora_name}" if ev.lora_name else ""))
    if isinstance(ev, BlockRemoved):
        return f"  BlockRemoved     hashes={_fmt_hashes(ev.block_hashes)} medium={ev.medium}"
    if isinstance(ev, AllBlocksCleared):
        return "  AllBlocksCleared"
    return f"  {ev!r}"


def format_batch(wb: WorkerBatch) -> str:
    """A batch as a header line plus one line per event."""
    epoch = (wb.epoch or "?")[:8]
    if wb.is_reset:
        return f"-- reset ({wb.reason}): forget every block of {wb.worker_id} [epoch {epoch}]"
    ts = dt.datetime.fromtimestamp(wb.batch.ts).isoformat(timespec="milliseconds")
    where = (f"snapshot through seq={wb.seq - 1}" if wb.source == "snapshot" and wb.seq
             else f"seq={wb.seq} {wb.source}")
    head = (f"{where} epoch={epoch} ts={ts} dp={wb.batch.data_parallel_rank} "
            f"events={len(wb.events)}")
    return "\n".join([head] + [format_event(ev) for ev in wb.events])


def batch_json(wb: WorkerBatch) -> str:
    obj: dict[str, Any] = {"worker": wb.worker_id, "seq": wb.seq, "epoch": wb.epoch,
                           "source": wb.source, "ts": wb.batch.ts,
                           "data_parallel_rank": wb.batch.data_parallel_rank,
                           "events": msgspec.to_builtins(wb.events)}
    if wb.reason:
        obj["reason"] = wb.reason
    return json.dumps(obj)


class Tail:
    """Prints deliveries; counts data batches; signals `done` after `count` of them."""

    def __init__(self, out: TextIO, as_json: bool, count: int | None):
        self.out = out
        self.as_json = as_json
        self.count = count
        self.batches = 0
        self.done = threading.Event()
        self._lock = threading.Lock()

    def on_batch(self, wb: WorkerBatch) -> None:
        text = batch_json(wb) if self.as_json else format_batch(wb)
        with self._lock:
            print(text, file=self.out, flush=True)
            if not wb.is_reset:
                self.batches += 1
                if self.count is not None and self.batches >= self.count:
                    self.done.set()

    def on_heartbeat(self, worker: str, info: PublisherInfo) -> None:
        with self._lock:
            if self.as_json:
                print(json.dumps({"worker": worker, "heartbeat": msgspec.to_builtins(info)}),
                      file=self.out, flush=True)
            else:
                print(f"   heartbeat epoch={info.epoch[:8]} next_seq={info.next_seq}",
                      file=self.out, flush=True)

    def on_touch(self, worker: str, hashes: list[int | bytes]) -> None:
        with self._lock:
            if self.as_json:
                print(json.dumps({"worker": worker, "touch": msgspec.to_builtins(hashes)}),
                      file=self.out, flush=True)
            else:
                print(f"   touch {len(hashes)} block(s): {_fmt_hashes(hashes)}",
                      file=self.out, flush=True)


def run_tail(endpoint: str, replay_endpoint: str | None, topic: str, *, as_json: bool = False,
             count: int | None = None, timeout: float | None = None, heartbeats: bool = False,
             recency: bool = False, out: TextIO | None = None) -> int:
    """Subscribe and print until done; returns the exit status (0)."""
    tail = Tail(out or sys.stdout, as_json, count)
    sub = KVEventSubscriber(endpoint, replay_endpoint, topic, tail.on_batch,
                            on_heartbeat=tail.on_heartbeat if heartbeats else None,
                            on_touch=tail.on_touch if recency else None)
    restore = _install_signal_handlers(tail.done)
    sub.start()
    try:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not tail.done.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            tail.done.wait(0.2 if left is None else min(0.2, left))
    finally:
        sub.stop()
        restore()
    print(json.dumps({"stats": asdict(sub.stats)}), file=sys.stderr, flush=True)
    return 0


def _install_signal_handlers(done: threading.Event):
    """SIGINT/SIGTERM set `done` (main thread only); returns a function restoring the old."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum: int, frame: object) -> None:
        done.set()

    for s in old:
        signal.signal(s, handler)

    def restore() -> None:
        for s, h in old.items():
            signal.signal(s, h)

    return restore
