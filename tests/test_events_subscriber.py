"""Publisher -> subscriber with a real EngineCore: after joins, losses, restarts, duplicates,
reordering and garbage, the subscriber's view equals the worker's actual block pool."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from kvloop.events.config import KVEventsConfig
from kvloop.events.protocol import HEARTBEAT_TOPIC, RECENCY_TOPIC, seq_bytes
from kvloop.events.subscriber import KVEventSubscriber

from .conftest import wait_until
from .test_events_helpers import Relay, SimWorker, ViewSubscriber, seq_of

LOCAL = "tcp://127.0.0.1:0"


def events_config(**kw) -> KVEventsConfig:
    kw.setdefault("endpoint", LOCAL)
    kw.setdefault("replay_endpoint", LOCAL)
    kw.setdefault("topic", "kv")
    kw.setdefault("heartbeat_interval_s", 0.02)
    return KVEventsConfig(**kw)


def restartable_config(free_port: Callable[[], int]) -> KVEventsConfig:
    """Fixed ports, reserved for the test (a restarted publisher binds the same addresses),
    empty topic (so heartbeats are off and epochs come from the replay socket)."""
    return events_config(endpoint=f"tcp://127.0.0.1:{free_port()}",
                         replay_endpoint=f"tcp://127.0.0.1:{free_port()}", topic="")


@pytest.fixture
def cleanup():
    items: list = []
    yield items
    for item in reversed(items):
        (item.stop if hasattr(item, "stop") else
         item.close if hasattr(item, "close") else item.shutdown)()


def test_live_stream_from_the_start(cleanup):
    worker = SimWorker(events_config())
    cleanup.append(worker)
    vs = ViewSubscriber(worker.endpoint, worker.replay_endpoint, "kv")
    cleanup.append(vs)
    wait_until(lambda: vs.sub.stats.heartbeats > 0, what="first heartbeat")
    worker.run(12, min_batches=20)
    vs.wait_equal(worker)
    st = vs.sub.stats
    assert len(worker.cached()) > 0
    assert (st.gaps, st.replays, st.snapshots, st.malformed, st.duplicates) == (0, 0, 0, 0, 0)
    assert st.last_seq == worker.publisher.next_seq - 1
    assert st.current_epoch == worker.publisher.epoch and st.epochs_seen == 1
    assert [d.seq for d in vs.deliveries] == list(range(worker.publisher.next_seq))
    assert worker.engine.block_pool.cached_hashes()  # evictions happened too:
    assert any(ev.__class__.__name__ == "BlockRemoved" for d in vs.deliveries
               for ev in d.events)


def test_late_join_gets_a_snapshot_then_the_live_stream(cleanup):
    worker = SimWorker(events_config(), seed=1)
    cleanup.append(worker)
    worker.run(10, min_batches=15)
    vs = ViewSubscriber(worker.endpoint, worker.replay_endpoint, "kv")
    cleanup.append(vs)
    vs.wait_equal(worker)
    assert vs.sub.stats.snapshots == 1
    assert vs.deliveries[0].is_reset and vs.deliveries[0].reason == "join"
    snap = [d for d in vs.deliveries if d.source == "snapshot"]
    assert snap and all(d.seq == worker.publisher.next_seq for d in snap)
    worker.run(6, min_batches=5)
    vs.wait_equal(worker)
    assert vs.sub.stats.snapshots == 1 and vs.sub.stats.gaps == 0


def test_missed_batches_within_the_buffer_are_replayed(cleanup):
    worker = SimWorker(events_config(), seed=2)
    cleanup.append(worker)
    lost = set(range(3, 9))
    relay = Relay(worker.endpoint, lambda f: [] if seq_of(f) in lost else [f])
    cleanup.append(relay)
    vs = ViewSubscriber(relay.endpoint, worker.replay_endpoint, "kv")
    cleanup.append(vs)
    wait_until(lambda: vs.sub.stats.heartbeats > 0, what="first heartbeat")
    worker.run(10, min_batches=15)
    vs.wait_equal(worker)
    st = vs.sub.stats
    # One gap, or two where a heartbeat (every 20 ms) came while the lost batches were still
    # being published: the first replay then ends where the publisher was, and the next live
    # batch finds the rest missing. Each is found and replayed, none needs a snapshot.
    assert st.gaps in (1, 2) and st.replays == st.gaps and st.snapshots == 0
    assert st.unrecovered_gaps == 0
    replayed = [d.seq for d in vs.deliveries if d.source == "replay"]
    assert replayed[:len(lost)] == sorted(lost)
    assert [d.seq for d in vs.deliveries if not d.is_reset] == \
        list(range(worker.publisher.next_seq))


def test_missed_more_than_the_buffer_falls_back_to_a_snapshot(cleanup):
    worker = SimWorker(events_config(buffer_steps=4), seed=3)
    cleanup.append(worker)
    lost = set(range(2, 12))
    relay = Relay(worker.endpoint, lambda f: [] if seq_of(f) in lost else [f])
    cleanup.append(relay)
    vs = ViewSubscriber(relay.endpoint, worker.replay_endpoint, "kv")
    cleanup.append(vs)
    wait_until(lambda: vs.sub.stats.heartbeats > 0, what="first heartbeat")
    worker.run(12, min_batches=20)
    vs.wait_equal(worker)
    st = vs.sub.stats
    # One snapshot, or two where a heartbeat found the loss while it was still going on (as
    # in the replay test above): each loss past the buffer is a snapshot, none unrecovered.
    assert st.snapshots in (1, 2) and st.gaps >= st.snapshots and st.unrecovered_gaps == 0
    reset = [d for d in vs.deliveries if d.is_reset]
    assert [d.reason for d in reset] == ["gap"] * st.snapshots


def test_lost_tail_is_found_by_the_heartbeat(cleanup):
    worker = SimWorker(events_config(), seed=4)
    cleanup.append(worker)
    drop = {"on": False}
    relay = Relay(worker.endpoint,
                  lambda f: [] if drop["on"] and seq_of(f) is not None else [f])
    cleanup.append(relay)
    vs = ViewSubscriber(relay.endpoint, worker.replay_endpoint, "kv")
    cleanup.append(vs)
    wait_until(lambda: vs.sub.stats.heartbeats > 0, what="first heartbeat")
    worker.run(4, min_batches=4)
    vs.wait_equal(worker)
    drop["on"] = True  # the last batches never arrive live; only heartbeats do
    worker.run(3, min_batches=2)
    vs.wait_equal(worker)   # only a heartbeat can have told it (one, or two mid-loss)
    assert vs.sub.stats.gaps in (1, 2) and vs.sub.stats.replays == vs.sub.stats.gaps


def test_publisher_restart_is_a_new_epoch(cleanup, free_port):
    # Empty topic: heartbeats are off (a vLLM consumer of "" would get them), so the
    # subscriber learns epochs from the replay socket (info probes and reply headers).
    cfg = restartable_config(free_port)
    assert not cfg.heartbeats_enabled
    first = SimWorker(cfg, seed=5)
    vs = ViewSubscriber(first.endpoint, first.replay_endpoint, "")
    cleanup.append(vs)
    first.run(8, min_batches=10)
    vs.wait_equal(first)
    old_epoch = first.publisher.epoch
    assert vs.sub.stats.current_epoch == old_epoch
    first.shutdown()
    second = SimWorker(cfg, seed=6)  # same addresses, fresh engine: empty cache, seq 0
    cleanup.append(second)
    assert second.publisher.epoch != old_epoch
    wait_until(lambda: vs.sub.stats.current_epoch == second.publisher.epoch, 5, "new epoch")
    # the reset that clears the old epoch's blocks is delivered right after the epoch flips
    wait_until(lambda: vs.view.hashes() <= second.cached(), 5, "old epoch cleared")
    second.run(6, min_batches=8)
    vs.wait_equal(second)
    st = vs.sub.stats
    assert st.epochs_seen == 2 and st.restarts >= 1
    assert not (vs.view.hashes() & (first.cached() - second.cached()))


def test_duplicates_reordering_and_garbage(cleanup):
    worker = SimWorker(events_config(), seed=7)
    cleanup.append(worker)
    state: dict = {"held": None, "n": 0}

    def mangle(frames):
        seq = seq_of(frames)
        if seq is None:
            return [frames]
        state["n"] += 1
        out = []
        if seq % 5 == 1:  # hold this one back: it arrives after its successor
            state["held"] = frames
            return []
        out.append(frames)
        if state["held"] is not None:
            out.append(state["held"])
            state["held"] = None
        if seq % 3 == 0:
            out.append(frames)  # duplicate
        if seq % 4 == 2:
            out += [[b"kv"], [b"kv", b"\x00" * 3, b"x"], [b"kv", seq_bytes(seq), b"\xc1junk"],
                    [b"kv", seq_bytes(seq + 1000), b"\x93\x01"],
                    [HEARTBEAT_TOPIC, seq_bytes(0), b"not msgpack \xc1"],
                    [RECENCY_TOPIC, seq_bytes(0), b"\xff\xff"]]
        return out

    relay = Relay(worker.endpoint, mangle)
    cleanup.append(relay)
    vs = ViewSubscriber(relay.endpoint, worker.replay_endpoint, "kv")
    cleanup.append(vs)
    wait_until(lambda: vs.sub.stats.heartbeats > 0, what="first heartbeat")
    worker.run(12, min_batches=25)
    vs.wait_equal(worker)
    st = vs.sub.stats
    assert st.duplicates > 0 and st.malformed > 0 and st.gaps > 0
    assert st.unrecovered_gaps == 0 and st.restarts == 0 and st.resets == 0
    seqs = [d.seq for d in vs.deliveries]
    assert seqs == list(range(worker.publisher.next_seq))  # in order, each once


def test_without_a_replay_socket_the_live_stream_still_matches(cleanup):
    worker = SimWorker(events_config(replay_endpoint=None), seed=8)
    cleanup.append(worker)
    vs = ViewSubscriber(worker.endpoint, None, "kv")
    cleanup.append(vs)
    wait_until(lambda: vs.sub.stats.heartbeats > 0, what="first heartbeat")
    worker.run(8, min_batches=10)
    vs.wait_equal(worker)
    assert vs.sub.stats.current_epoch == worker.publisher.epoch


def test_recency_touches_name_cached_blocks(cleanup):
    worker = SimWorker(events_config(recency=True, recency_interval_s=0.05), seed=9,
                       recency=True)
    cleanup.append(worker)
    touched: list = []
    stored: set = set()

    def on_batch(wb):
        for ev in wb.events:
            stored.update(getattr(ev, "block_hashes", []) if ev.__class__.__name__ ==
                          "BlockStored" else [])

    sub = KVEventSubscriber(worker.endpoint, worker.replay_endpoint, "kv", on_batch,
                            on_touch=lambda w, hs: touched.append(list(hs)))
    sub.start()
    cleanup.append(sub)
    wait_until(lambda: sub.stats.heartbeats > 0, what="first heartbeat")
    t0 = time.monotonic()
    worker.run(12, min_batches=15)
    wait_until(lambda: touched, 3, "a recency notice")
    elapsed = time.monotonic() - t0
    flat = [h for notice in touched for h in notice]
    assert all(len(set(n)) == len(n) for n in touched)  # deduplicated per notice
    assert set(flat) <= stored  # hits are on blocks that were stored
    assert worker.publisher.stats.touch_notices <= elapsed / 0.05 + 2  # rate-limited


def test_restart_that_continues_the_numbering_is_caught_by_the_epoch(cleanup, free_port):
    # The new process's first batches are lost, and the first one that arrives carries
    # exactly the number the subscriber expects: only the epoch can tell.
    cfg = restartable_config(free_port)
    state = {"drop_below": 0}
    relay = Relay(cfg.endpoint, lambda f: [] if (seq_of(f) or 0) < state["drop_below"]
                  else [f])
    cleanup.append(relay)
    first = SimWorker(cfg, seed=10)
    vs = ViewSubscriber(relay.endpoint, first.replay_endpoint, "")
    cleanup.append(vs)
    first.run(4, min_batches=6)
    vs.wait_equal(first)
    k = first.publisher.next_seq
    first.shutdown()
    state["drop_below"] = k
    second = SimWorker(cfg, seed=11)
    cleanup.append(second)
    second.run(8, min_batches=k + 4)
    vs.wait_equal(second)
    resets = [d.reason for d in vs.deliveries if d.is_reset]
    assert "epoch" in resets and vs.sub.stats.current_epoch == second.publisher.epoch


@pytest.mark.slow   # a second of unanswered probes
def test_subscriber_started_before_its_publisher(cleanup, free_port):
    cfg = restartable_config(free_port)
    vs = ViewSubscriber(cfg.endpoint, cfg.replay_endpoint, "", request_timeout_s=0.2,
                        probe_interval_s=0.05)
    cleanup.append(vs)
    time.sleep(1.0)  # several probes go unanswered: nobody is there yet
    assert vs.sub.stats.kvloop_publisher is None
    worker = SimWorker(cfg, seed=12)
    cleanup.append(worker)
    worker.run(6, min_batches=8)
    vs.wait_equal(worker)
    wait_until(lambda: vs.sub.stats.current_epoch == worker.publisher.epoch, 5, "epoch")
    assert vs.sub.stats.kvloop_publisher is True


def test_restart_without_a_replay_socket_is_found_by_heartbeats(cleanup, free_port):
    port = free_port()
    cfg = events_config(endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=None)
    first = SimWorker(cfg, seed=13)
    vs = ViewSubscriber(first.endpoint, None, "kv")
    cleanup.append(vs)
    wait_until(lambda: vs.sub.stats.current_epoch == first.publisher.epoch, what="epoch")
    first.run(5, min_batches=6)
    vs.wait_equal(first)
    first.shutdown()
    second = SimWorker(cfg, seed=14)
    cleanup.append(second)
    wait_until(lambda: vs.sub.stats.current_epoch == second.publisher.epoch, what="new epoch")
    assert len(vs.view) == 0  # the old incarnation's blocks are forgotten
    second.run(5, min_batches=6)
    vs.wait_equal(second)
    st = vs.sub.stats
    assert st.epochs_seen == 2 and [d.reason for d in vs.deliveries if d.is_reset] == ["epoch"]
