"""`kvloop events tail`: print one worker's KV events as they arrive, readably or as JSON.

Works against a kvloop worker or a vLLM one (the subscriber speaks both). Stops after
`--count` batches, after `--timeout` seconds, or on SIGINT/SIGTERM, then prints the
subscriber's counters on stderr.

A ZMQ SUB socket cannot tell "nobody publishes there" from "nothing happens": when no batch
arrived for `--idle-warn` seconds (default 10; 0: never), one line on stderr says so, names
the endpoint and the likely causes, and says whether the publisher answered at all (a
heartbeat, or a reply on the replay endpoint); then the tail keeps waiting (the warning comes
again after the next batch and silence), or with `--exit-on-idle` stops with exit status 1.
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
from kvloop.trust import CurveKeys


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
    # the publisher's epoch once known (a heartbeat or the replay socket tells it; vLLM's
    # publishers have none): left out until then, never a placeholder on every line
    epoch = f" epoch={wb.epoch[:8]}" if wb.epoch else ""
    if wb.is_reset:
        return f"-- reset ({wb.reason}): forget every block of {wb.worker_id}{epoch}"
    ts = dt.datetime.fromtimestamp(wb.batch.ts).isoformat(timespec="milliseconds")
    where = (f"snapshot through seq={wb.seq - 1}" if wb.source == "snapshot" and wb.seq
             else f"seq={wb.seq} {wb.source}")
    head = (f"{where}{epoch} ts={ts} dp={wb.batch.data_parallel_rank} "
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
        self.last_batch_time = time.monotonic()   # of the last data batch, or the start
        self.done = threading.Event()
        self._lock = threading.Lock()

    def on_batch(self, wb: WorkerBatch) -> None:
        text = batch_json(wb) if self.as_json else format_batch(wb)
        with self._lock:
            print(text, file=self.out, flush=True)
            if not wb.is_reset:
                self.batches += 1
                self.last_batch_time = time.monotonic()
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


def idle_message(sub: KVEventSubscriber, seconds: float, exiting: bool) -> str:
    """The `--idle-warn` line: what was (not) heard from the publisher, and why that may be."""
    head = f"kvloop events tail: no KV event batch from {sub.endpoint} in {seconds:g} s"
    topic = f"topic {sub.topic!r}" if sub.topic else "every topic"
    if sub.seconds_since_heard() is not None:
        epoch = sub.epoch
        body = ("; the publisher is there (heartbeats or replay replies"
                + (f", epoch {epoch[:8]}" if epoch else "") + f") but sent no batch on "
                f"{topic}: the worker is idle (events flow only while its KV cache "
                f"changes), or it publishes on another topic (its --kv-events-topic)")
    else:
        where = (f" nor on the replay endpoint {sub.replay_endpoint}" if sub.replay_endpoint
                 else " (no --replay-endpoint given to tell a missing worker from an idle "
                      "one)")
        body = (f"; nothing answered there{where}. Likely causes: a wrong endpoint or port "
                f"(a kvloop worker lists its own under kv_events in GET /kvloop/worker); a "
                f"worker started without --enable-kv-cache-events or --kv-events-endpoint; a "
                f"topic mismatch (this tail subscribes to {topic}, the worker publishes on "
                f"its --kv-events-topic); or an idle worker without heartbeats "
                f"(--kv-events-heartbeat)")
    return head + body + (". Exiting (--exit-on-idle)." if exiting else ". Still waiting.")


def run_tail(endpoint: str, replay_endpoint: str | None, topic: str, *, as_json: bool = False,
             count: int | None = None, timeout: float | None = None, heartbeats: bool = False,
             recency: bool = False, idle_warn: float | None = None, exit_on_idle: bool = False,
             out: TextIO | None = None, curve_keys: CurveKeys | None = None) -> int:
    """Subscribe and print until done; returns the exit status: 0, or 1 when
    `exit_on_idle` stopped it after `idle_warn` seconds without a batch. `curve_keys`: the
    fleet's KV-event keys, for a worker started with --kv-events-curve."""
    tail = Tail(out or sys.stdout, as_json, count)
    sub = KVEventSubscriber(endpoint, replay_endpoint, topic, tail.on_batch,
                            on_heartbeat=tail.on_heartbeat if heartbeats else None,
                            on_touch=tail.on_touch if recency else None,
                            curve_keys=curve_keys)
    restore = _install_signal_handlers(tail.done)
    sub.start()
    try:
        rc = _wait(tail, sub, timeout, idle_warn, exit_on_idle)
    finally:
        sub.stop()
        restore()
    print(json.dumps({"stats": asdict(sub.stats)}), file=sys.stderr, flush=True)
    return rc


def _wait(tail: Tail, sub: KVEventSubscriber, timeout: float | None, idle_warn: float | None,
          exit_on_idle: bool) -> int:
    """Until done or the timeout; warn once per silent spell of `idle_warn` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    warned_for: float | None = None   # the last_batch_time the warning was about
    while not tail.done.is_set():
        now = time.monotonic()
        left = None if deadline is None else deadline - now
        if left is not None and left <= 0:
            break
        since = tail.last_batch_time
        if idle_warn and warned_for != since and now - since >= idle_warn:
            print(idle_message(sub, idle_warn, exit_on_idle), file=sys.stderr, flush=True)
            if exit_on_idle:
                return 1
            warned_for = since
        tail.done.wait(0.1 if left is None else min(0.1, left))
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
