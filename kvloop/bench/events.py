"""KV-event throughput: what the publisher and the subscriber sustain.

    python -m kvloop.bench.events [--batches 20000] [--runs 5] [--snapshot-blocks 100000]
                                  [--nats]

Each batch is one step's worth of work: one BlockStored of 16 blocks (16 hashes, 256 token
ids, parent chained), as an engine emits for a 256-token prefill chunk.

- publisher: `publish()` from the caller's thread (the engine loop's cost) and the publisher
  thread encoding, sending on PUB, buffering for replay and (with a replay endpoint) updating
  its cache mirror; a plain SUB in another process receives. Rate = batches sent / time.
- subscriber: another process publishes the batches while the subscriber's callback is held,
  so they queue in the SUB socket; then the subscriber decodes, sequences and applies them to
  a CacheView as fast as it can. Rate = batches delivered / time.
- snapshot: a publisher whose mirror holds N blocks serves a snapshot to a subscriber that
  joins late; time from start() to the snapshot applied.

- `--nats`: the same publisher and late-joiner snapshot on a NATS event plane (a local
  nats-server started for the run), and the recovery of a gap: one replay request over
  request/reply for the last K batches.

Figures are medians over `--runs` runs (the machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import threading
import time
from typing import Any

import zmq

from kvloop.bench.cli_args import HelpFormatter
from kvloop.events.config import KVEventsConfig
from kvloop.events.publisher import ZmqEventPublisher
from kvloop.events.subscriber import KVEventSubscriber, WorkerBatch
from kvloop.events.types import BlockStored, KVEventBatch
from kvloop.events.view import CacheView

BLOCKS_PER_BATCH = 16
BLOCK_SIZE = 16
LOCAL = "tcp://127.0.0.1:0"


def make_batches(n: int, seed: int = 0) -> list[KVEventBatch]:
    """n batches of one 16-block BlockStored each, chains of 4 batches (64 blocks)."""
    rng = random.Random(seed)
    out = []
    parent: int | bytes | None = None
    for i in range(n):
        if i % 4 == 0:
            parent = None
        hashes: list[int | bytes] = [rng.getrandbits(64) for _ in range(BLOCKS_PER_BATCH)]
        tokens = [rng.randrange(32000) for _ in range(BLOCKS_PER_BATCH * BLOCK_SIZE)]
        ev = BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                         block_size=BLOCK_SIZE, lora_id=None, medium="GPU", lora_name=None,
                         extra_keys=[None] * BLOCKS_PER_BATCH, group_idx=0,
                         kv_cache_spec_kind="full_attention")
        out.append(KVEventBatch(ts=time.time(), events=[ev]))
        parent = hashes[-1]
    return out


def wait_for(pred: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark step timed out")
        time.sleep(0.001)


# --- publisher --------------------------------------------------------------------------
def _count_frames(endpoint: str, expected: int, conn: Any) -> None:
    """Child: a plain SUB that counts data frames until `expected` arrive (or 30 s)."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(endpoint)
    sub.recv_multipart()  # warm-up frame: the subscription is live
    conn.send("ready")
    n = 0
    while n < expected and sub.poll(30_000):
        sub.recv_multipart()
        n += 1
    conn.send(n)
    ctx.destroy(linger=0)


def bench_publisher(batches: list[KVEventBatch], replay: bool) -> dict[str, float]:
    cfg = KVEventsConfig(endpoint=LOCAL, replay_endpoint=LOCAL if replay else None, topic="kv",
                         heartbeat=False)
    pub = ZmqEventPublisher(cfg).start()
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_count_frames, args=(pub.endpoint, len(batches), child_conn))
    proc.start()
    try:
        while not parent_conn.poll(0.01):  # warm up until the SUB is connected
            pub.publish(KVEventBatch(ts=time.time(), events=[]))
        parent_conn.recv()
        wait_for(lambda: not pub._queue, 10)
        start_count = pub.stats.published
        t0 = time.perf_counter()
        call = 0.0
        for b in batches:
            c0 = time.perf_counter()
            pub.publish(b)
            call += time.perf_counter() - c0
        wait_for(lambda: pub.stats.published - start_count == len(batches), 60)
        elapsed = time.perf_counter() - t0
        received = parent_conn.recv()
    finally:
        proc.join(30)
        pub.shutdown()
    n = len(batches)
    return {"batches_per_s": n / elapsed, "blocks_per_s": n * BLOCKS_PER_BATCH / elapsed,
            "publish_call_us": call / n * 1e6, "received": received, "dropped": n - received}


# --- subscriber -------------------------------------------------------------------------
def _publish_all(n: int, conn: Any) -> None:
    """Child: a publisher that sends n batches when told to."""
    pub = ZmqEventPublisher(KVEventsConfig(endpoint=LOCAL, replay_endpoint=LOCAL, topic="kv",
                                           heartbeat_interval_s=0.05)).start()
    conn.send((pub.endpoint, pub.replay_endpoint))
    batches = make_batches(n, seed=1)
    conn.recv()  # go
    for b in batches:
        pub.publish(b)
    wait_for(lambda: pub.stats.published == n, 60)
    conn.send("published")
    conn.recv()  # done
    pub.shutdown()


def bench_subscriber(n: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_publish_all, args=(n, child_conn))
    proc.start()
    endpoint, replay = parent_conn.recv()
    view = CacheView()
    gate = threading.Event()
    t0 = [0.0]

    def on_batch(wb: WorkerBatch) -> None:
        if not gate.is_set():
            gate.wait()
            t0[0] = time.perf_counter()
        view.apply(wb.batch)

    sub = KVEventSubscriber(endpoint, replay, "kv", on_batch).start()
    try:
        wait_for(lambda: sub.stats.heartbeats > 0, 10)
        parent_conn.send("go")
        parent_conn.recv()  # everything is published, most of it queued at the SUB
        gate.set()
        wait_for(lambda: sub.stats.last_seq == n - 1, 120)
        elapsed = time.perf_counter() - t0[0]
        st = sub.stats
    finally:
        gate.set()
        parent_conn.send("done")
        proc.join(30)
        sub.stop()
    assert len(view) == n * BLOCKS_PER_BATCH, "the view lost blocks"
    return {"batches_per_s": n / elapsed, "blocks_per_s": n * BLOCKS_PER_BATCH / elapsed,
            "gaps": st.gaps, "replays": st.replays}


# --- snapshot ---------------------------------------------------------------------------
def bench_snapshot(num_blocks: int) -> dict[str, float]:
    batches = make_batches(num_blocks // BLOCKS_PER_BATCH, seed=2)
    pub = ZmqEventPublisher(KVEventsConfig(endpoint=LOCAL, replay_endpoint=LOCAL, topic="kv",
                                           heartbeat=False)).start()
    try:
        for b in batches:
            pub.publish(b)
        wait_for(lambda: pub.stats.published == len(batches), 120)
        view = CacheView()
        t0 = time.perf_counter()
        assert pub.endpoint is not None
        sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint, "kv",
                                lambda wb: view.apply(wb.batch)).start()
        wait_for(lambda: sub.stats.snapshots == 1, 60)
        elapsed = time.perf_counter() - t0
        sub.stop()
    finally:
        pub.shutdown()
    assert len(view) == len(batches) * BLOCKS_PER_BATCH
    return {"seconds": elapsed, "blocks_per_s": len(view) / elapsed}


# --- the NATS event plane ---------------------------------------------------------------
def bench_nats(url: str, batches: list[KVEventBatch], snapshot_blocks: int,
               replay_batches: int) -> dict[str, float]:
    """Publisher rate, late-joiner snapshot and gap replay on the NATS plane at `url`."""
    from kvloop.events.config import NatsPlaneConfig
    from kvloop.events.nats_plane import CMD_REPLAY
    from kvloop.events.nats_publisher import NatsEventPublisher
    from kvloop.events.nats_subscriber import NatsEventPlane

    plane_cfg = NatsPlaneConfig(url)
    pub = NatsEventPublisher(KVEventsConfig(nats=plane_cfg, buffer_steps=len(batches))).start()
    consumer = NatsEventPlane(NatsPlaneConfig(url, component="*")).start()
    try:
        live_view = CacheView()
        live = consumer.attach(pub.worker_id, "live", "backend",
                               lambda wb: live_view.apply(wb.batch), block_size=BLOCK_SIZE)
        wait_for(lambda: live.stats.snapshots + live.stats.resets >= 1, 60)
        t0 = time.perf_counter()
        for b in batches:
            pub.publish(b)
        wait_for(lambda: pub.stats.published == len(batches), 120)
        rate = len(batches) / (time.perf_counter() - t0)
        wait_for(lambda: live.stats.batches_received >= len(batches), 120)
        sub_rate = len(batches) / (time.perf_counter() - t0)
        extra = make_batches(max(0, snapshot_blocks // BLOCKS_PER_BATCH - len(batches)), 3)
        for b in extra:
            pub.publish(b)
        wait_for(lambda: pub.stats.published == len(batches) + len(extra), 120)
        view = CacheView()
        t0 = time.perf_counter()
        stream = consumer.attach(pub.worker_id, "bench", "backend",
                                 lambda wb: view.apply(wb.batch), block_size=BLOCK_SIZE)
        wait_for(lambda: stream.stats.snapshots == 1, 120)
        snapshot_s = time.perf_counter() - t0
        start = pub.next_seq - replay_batches
        t0 = time.perf_counter()
        reply = consumer._call(consumer.request(pub.replay_endpoint, CMD_REPLAY, start)
                               ).result(60)
        replay_s = time.perf_counter() - t0
        assert reply is not None and len(reply[1]) == replay_batches
    finally:
        consumer.stop()
        pub.shutdown()
    return {"batches_per_s": rate, "subscriber_batches_per_s": sub_rate, "snapshot_s": snapshot_s,
            "snapshot_blocks": float(len(view)), "replay_s": replay_s}


def run_nats(args: argparse.Namespace, batches: list[KVEventBatch]) -> None:
    import socket

    from kvloop.router.services import local_nats

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    replay = min(1000, len(batches))
    with local_nats("127.0.0.1", port) as srv:
        url = f"nats://{srv.host}:{srv.port}"
        runs = [bench_nats(url, batches, args.snapshot_blocks, replay)
                for _ in range(max(1, args.runs // 2))]
    print(f"NATS publisher            : {_median(runs, 'batches_per_s'):9.0f} batches/s "
          f"{_median(runs, 'batches_per_s') * BLOCKS_PER_BATCH:10.0f} blocks/s")
    print(f"NATS subscriber (+CacheView): {_median(runs, 'subscriber_batches_per_s'):6.0f} "
          f"batches/s {_median(runs, 'subscriber_batches_per_s') * BLOCKS_PER_BATCH:10.0f} "
          f"blocks/s (publish to the last batch applied)")
    print(f"NATS snapshot of {_median(runs, 'snapshot_blocks'):.0f} blocks to a late joiner: "
          f"{_median(runs, 'snapshot_s'):.2f} s")
    print(f"NATS replay of the last {replay} batches ({replay * BLOCKS_PER_BATCH} blocks): "
          f"{_median(runs, 'replay_s') * 1000:.0f} ms")


def _median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--batches", type=int, default=20_000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--snapshot-blocks", type=int, default=100_000)
    ap.add_argument("--nats", action="store_true",
                    help="measure the NATS event plane instead (a local nats-server)")
    args = ap.parse_args(argv)
    batches = make_batches(args.batches)
    if args.nats:
        run_nats(args, batches)
        return
    print(f"{args.batches} batches of one {BLOCKS_PER_BATCH}-block BlockStored; "
          f"median of {args.runs} runs")
    for replay in (False, True):
        runs = [bench_publisher(batches, replay) for _ in range(args.runs)]
        label = "publisher, replay+mirror" if replay else "publisher, PUB only    "
        print(f"{label}: {_median(runs, 'batches_per_s'):9.0f} batches/s "
              f"{_median(runs, 'blocks_per_s'):10.0f} blocks/s  publish() "
              f"{_median(runs, 'publish_call_us'):.2f} us/call  "
              f"lost at the SUB: {max(r['dropped'] for r in runs):.0f}")
    runs = [bench_subscriber(args.batches) for _ in range(args.runs)]
    print(f"subscriber (+CacheView)  : {_median(runs, 'batches_per_s'):9.0f} batches/s "
          f"{_median(runs, 'blocks_per_s'):10.0f} blocks/s  "
          f"gaps: {max(r['gaps'] for r in runs):.0f}")
    runs = [bench_snapshot(args.snapshot_blocks) for _ in range(max(1, args.runs // 2))]
    print(f"snapshot of {args.snapshot_blocks} blocks to a late joiner: "
          f"{_median(runs, 'seconds'):.2f} s ({_median(runs, 'blocks_per_s'):.0f} blocks/s)")


if __name__ == "__main__":
    main()
