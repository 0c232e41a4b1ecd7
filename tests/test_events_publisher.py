"""ZmqEventPublisher: vLLM's publisher scenarios (docs/vllm-facts.md#kv-events) and kvloop's
extensions."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from kvloop.events import protocol as proto
from kvloop.events.config import KVEventsConfig
from kvloop.events.publisher import ZmqEventPublisher, endpoint_for_rank
from kvloop.events.types import AllBlocksCleared, BlockStored, KVEventBatch
from kvloop.events.view import CacheView
from kvloop.events.wakeup import WakeupPipe

from .conftest import block_removed, wait_until
from .conftest import block_stored as stored
from .conftest import event_batch as batch

LOCAL = "tcp://127.0.0.1:0"
OWN_TOPICS = (proto.HEARTBEAT_TOPIC, proto.RECENCY_TOPIC)


class Client:
    """A plain pyzmq SUB + DEALER, as any consumer would write them."""

    def __init__(self, pub: ZmqEventPublisher, topic: bytes = b""):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        assert pub.endpoint is not None
        self.sub.connect(pub.endpoint)
        self.dealer = self.ctx.socket(zmq.DEALER)
        if pub.replay_endpoint:
            self.dealer.connect(pub.replay_endpoint)

    def recv(self, timeout_ms: int = 2000) -> list[bytes] | None:
        return self.sub.recv_multipart() if self.sub.poll(timeout_ms) else None

    def request(self, *frames: bytes) -> list[list[bytes]]:
        """Send on the DEALER; read replies up to vLLM's end marker (or one info header)."""
        self.dealer.send_multipart([b"", *frames])
        out = []
        while self.dealer.poll(2000):
            msg = self.dealer.recv_multipart()
            out.append(msg)
            if msg[2] == proto.END_SEQ or (frames[:2] == (proto.KVLOOP, proto.CMD_INFO)):
                return out
        raise AssertionError("no end marker")

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture
def started():
    pubs: list[ZmqEventPublisher] = []
    clients: list[Client] = []

    def make(**kw) -> tuple[ZmqEventPublisher, Client]:
        kw.setdefault("endpoint", LOCAL)
        topic = kw.pop("sub_topic", kw.get("topic", "").encode())
        pub = ZmqEventPublisher(KVEventsConfig(**kw)).start()
        pubs.append(pub)
        client = Client(pub, topic)
        clients.append(client)
        return pub, client

    yield make
    for c in clients:
        c.close()
    for p in pubs:
        p.shutdown()


def warm_up(pub: ZmqEventPublisher, client: Client) -> int:
    """Publish to an idle `pub` until the (slow-joining) SUB gets something, then read up to
    the last batch published (a connected SUB gets every one); returns the next seq expected.
    Messages on kvloop's own topics (heartbeats, recency) are skipped."""
    last = pub.next_seq - 1
    for _ in range(300):
        pub.publish(batch(AllBlocksCleared()))
        last += 1
        msg = client.recv(10)
        if msg is not None:
            break
    else:
        raise AssertionError("subscriber never connected")
    while msg[0] in OWN_TOPICS or proto.seq_from_bytes(msg[1]) < last:
        msg = client.recv()
        assert msg is not None, f"the warm-up batches up to {last}"
    return last + 1


def test_sequence_numbers_start_at_zero_and_count_batches(started):
    pub, client = started(topic="test", replay_endpoint=LOCAL)
    assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith(":0")
    first = warm_up(pub, client)
    for i in range(10):
        pub.publish(batch(stored(100 + i)))
    msgs = [client.recv() for _ in range(10)]
    assert [proto.seq_from_bytes(m[1]) for m in msgs] == list(range(first, first + 10))
    assert all(m[0] == b"test" for m in msgs)
    got = msgspec.msgpack.decode(msgs[0][2], type=KVEventBatch)
    assert got.data_parallel_rank == 0 and got.events[0].block_hashes == [100]
    # the very first batch was seq 0, as the replay buffer shows
    replies = client.request(proto.seq_bytes(0))
    assert proto.seq_from_bytes(replies[0][2]) == 0


def test_replay_from_the_middle_then_the_end_marker(started):
    pub, client = started(topic="test", replay_endpoint=LOCAL)
    for i in range(19):
        pub.publish(batch(stored(i)))
    wait_until(lambda: pub.stats.published == 19)
    replies = client.request(proto.seq_bytes(10))
    assert [proto.seq_from_bytes(r[2]) for r in replies[:-1]] == list(range(10, 19))
    assert all(r[0] == b"" and r[1] == b"test" for r in replies[:-1])
    assert replies[-1] == [b"", b"", proto.END_SEQ, b""]


def test_replay_keeps_only_the_last_buffer_steps_batches(started):
    pub, client = started(topic="test", replay_endpoint=LOCAL, buffer_steps=100)
    for i in range(110):
        pub.publish(batch(stored(i)))
    wait_until(lambda: pub.stats.published == 110)
    replies = client.request(proto.seq_bytes(0))
    assert [proto.seq_from_bytes(r[2]) for r in replies[:-1]] == list(range(10, 110))
    assert pub.info().oldest_seq == 10 and pub.info().next_seq == 110


def test_topics_filter(started):
    pub, client = started(topic="foo", sub_topic=b"bar", replay_endpoint=None,
                          heartbeat_interval_s=0.01)
    # heartbeats tell when the SUB is connected, and when all 20 batches are past it: a
    # heartbeat sent after them (it carries next_seq 20) arrives after them
    client.sub.setsockopt(zmq.SUBSCRIBE, proto.HEARTBEAT_TOPIC)
    assert (msg := client.recv()) is not None and msg[0] == proto.HEARTBEAT_TOPIC
    for _ in range(20):
        pub.publish(batch(AllBlocksCleared()))
    topics = []
    while not (topics and msg[0] == proto.HEARTBEAT_TOPIC and proto.seq_from_bytes(msg[1]) == 20):
        msg = client.recv()
        assert msg is not None, "a heartbeat after the 20 batches"
        topics.append(msg[0])
    assert set(topics) == {proto.HEARTBEAT_TOPIC}


def test_data_parallel_rank_offsets_the_port_and_tags_batches(started, free_port):
    base = free_port() - 1   # rank 1 binds base + 1, the reserved port; base itself is unused
    assert endpoint_for_rank(f"tcp://127.0.0.1:{base}", 1) == f"tcp://127.0.0.1:{base + 1}"
    assert endpoint_for_rank("tcp://127.0.0.1:0", 3) == "tcp://127.0.0.1:0"
    assert endpoint_for_rank("ipc:///tmp/x", 2) == "ipc:///tmp/x_dp2"
    pub, client = started(endpoint=f"tcp://127.0.0.1:{base}", data_parallel_rank=1)
    assert pub.endpoint == f"tcp://127.0.0.1:{base + 1}"
    warm_up(pub, client)
    pub.publish(batch(stored(7)))
    msg = client.recv()
    assert msgspec.msgpack.decode(msg[2], type=KVEventBatch).data_parallel_rank == 1


def test_binds_literal_addresses_and_connects_only_when_asked(free_port):
    ctx = zmq.Context()
    try:
        # ">" = connect: the consumer binds, the publisher connects to it
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.bind("tcp://127.0.0.1:0")
        addr = sub.getsockopt_string(zmq.LAST_ENDPOINT)
        pub = ZmqEventPublisher(KVEventsConfig(endpoint=">" + addr)).start()
        try:
            assert pub.endpoint == addr
            for _ in range(300):
                pub.publish(batch(AllBlocksCleared()))
                if sub.poll(10):
                    break
            assert sub.recv_multipart()[0] == b""
        finally:
            pub.shutdown()
        # a literal address is bound: a second publisher on it fails loudly
        port = free_port()
        one = ZmqEventPublisher(KVEventsConfig(endpoint=f"tcp://127.0.0.1:{port}")).start()
        try:
            with pytest.raises(OSError, match=str(port)):
                ZmqEventPublisher(KVEventsConfig(endpoint=f"tcp://127.0.0.1:{port}")).start()
        finally:
            one.shutdown()
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize("kw, match", [
    ({"endpoint": "localhost:5557"}, "tcp://HOST:PORT"),
    ({"endpoint": "tcp://127.0.0.1"}, "no port"),
    ({"replay_endpoint": ">tcp://127.0.0.1:1"}, "always bound"),
    ({"buffer_steps": 0}, "buffer_steps"),
    ({"max_queue_size": 0}, "max_queue_size"),
    ({"heartbeat_interval_s": 0}, "heartbeat_interval_s"),
    ({"data_parallel_rank": -1}, "data_parallel_rank"),
])
def test_bad_config_is_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        KVEventsConfig(**kw)


def test_vllm_defaults():
    cfg = KVEventsConfig()
    assert (cfg.buffer_steps, cfg.hwm, cfg.max_queue_size, cfg.topic) == \
        (10_000, 100_000, 100_000, "")
    assert cfg.replay_endpoint is None and not cfg.recency


def test_heartbeats_only_where_no_vllm_consumer_can_receive_them(started):
    assert not KVEventsConfig(topic="").heartbeats_enabled
    assert KVEventsConfig(topic="kv-events").heartbeats_enabled
    assert KVEventsConfig(topic="", heartbeat=True).heartbeats_enabled
    assert not KVEventsConfig(topic="kv", heartbeat=False).heartbeats_enabled
    pub, everything = started(topic="kv-events", sub_topic=b"", heartbeat_interval_s=0.01)
    msg = everything.recv()
    assert msg[0] == proto.HEARTBEAT_TOPIC
    info = proto.decode_info(msg[2])
    assert info.epoch == pub.epoch and info.next_seq == 0 and proto.seq_from_bytes(msg[1]) == 0
    # a consumer of the data topic never sees them: the batch published after two more
    # heartbeats is the next thing it receives
    data_only = Client(pub, b"kv-events")
    try:
        first = warm_up(pub, data_only)
        beats = pub.stats.heartbeats
        wait_until(lambda: pub.stats.heartbeats >= beats + 2, 5, "two more heartbeats")
        pub.publish(batch(stored(1)))
        msg = data_only.recv()
        assert msg[0] == b"kv-events" and proto.seq_from_bytes(msg[1]) == first
        assert msgspec.msgpack.decode(msg[2], type=KVEventBatch).events == [stored(1)]
    finally:
        data_only.close()
    # with the empty topic, nothing but data (a connected SUB of "" would get them)
    pub2, client2 = started(topic="", heartbeat_interval_s=0.01)
    warm_up(pub2, client2)
    assert client2.recv(50) is None
    assert pub2.stats.heartbeats == 0


def test_info_and_snapshot_on_the_replay_socket(started):
    pub, client = started(topic="kv", replay_endpoint=LOCAL, heartbeat=False)
    a, b, c = 11, 12, 13
    pub.publish(batch(stored(a, b, parent=None)))  # chain a <- b
    pub.publish(batch(stored(c, parent=b)))  # c extends it
    pub.publish(batch(stored(b, parent=a)))  # a second physical copy of b
    pub.publish(batch(block_removed(a)))  # parent gone, child kept
    pub.publish(batch(stored(a, parent=None)))  # ...and stored again, after its children
    wait_until(lambda: pub.stats.published == 5)
    [info_msg] = client.request(proto.KVLOOP, proto.CMD_INFO)
    info = proto.decode_info(info_msg[3])
    assert info_msg[:3] == [b"", proto.KVLOOP, proto.CMD_INFO]
    assert (info.epoch, info.next_seq, info.oldest_seq, info.snapshot) == (pub.epoch, 5, 0, True)
    replies = client.request(proto.KVLOOP, proto.CMD_SNAPSHOT)
    header, body, end = replies[0], replies[1:-1], replies[-1]
    assert proto.decode_info(header[3]).next_seq == 5 and end[2] == proto.END_SEQ
    assert all(r[1] == b"kv" and proto.seq_from_bytes(r[2]) == 5 for r in body)
    events = [e for r in body for e in msgspec.msgpack.decode(r[3], type=KVEventBatch).events]
    order = [h for e in events for h in e.block_hashes]
    assert order.index(a) < order.index(b) < order.index(c)  # parents first
    assert order.count(b) == 2  # both copies
    rebuilt = CacheView()
    rebuilt.apply(events)
    assert rebuilt.hashes() == {a, b, c} and rebuilt.copies(b) == 2
    blocks = {}  # hash -> (parent, tokens), block by block
    for e in events:
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            blocks[h] = (parent, e.token_ids[i * 4:(i + 1) * 4])
            parent = h
    assert blocks == {a: (None, [11] * 4), b: (a, [12] * 4), c: (b, [13] * 4)}
    # replay from a number the buffer no longer holds: header only, so the client snapshots
    small, client2 = started(topic="kv", replay_endpoint=LOCAL, buffer_steps=2)
    for i in range(5):
        small.publish(batch(stored(i)))
    wait_until(lambda: small.stats.published == 5)
    replies = client2.request(proto.KVLOOP, proto.CMD_REPLAY, proto.seq_bytes(1))
    assert len(replies) == 2 and proto.decode_info(replies[0][3]).oldest_seq == 3
    replies = client2.request(proto.KVLOOP, proto.CMD_REPLAY, proto.seq_bytes(3))
    assert [proto.seq_from_bytes(r[2]) for r in replies[1:-1]] == [3, 4]


def test_malformed_requests_are_ignored(started):
    pub, client = started(replay_endpoint=LOCAL)
    client.dealer.send_multipart([b"", b"abc"])  # 3 frames at the ROUTER, bad seq
    client.dealer.send_multipart([b"", b"1", b"2", b"3"])
    client.dealer.send_multipart([b"", proto.KVLOOP, b"nope"])
    wait_until(lambda: pub.stats.bad_requests == 3)
    assert client.request(proto.seq_bytes(0)) == [[b"", b"", proto.END_SEQ, b""]]


def test_a_full_queue_drops_batches_and_publishes_a_clear_in_their_place(started):
    pub, client = started(max_queue_size=2, replay_endpoint=LOCAL)
    entered, release = threading.Event(), threading.Event()
    send = pub._send_batch

    def slow_send(b):
        entered.set()
        release.wait(5)
        send(b)

    pub._send_batch = slow_send  # type: ignore[method-assign]
    pub.publish(batch(stored(0)))
    assert entered.wait(5)  # the thread is busy with batch 0
    for i in range(1, 5):
        pub.publish(batch(stored(i)))
    assert pub.stats.dropped == 2
    release.set()
    wait_until(lambda: pub.stats.published == 4)
    pub.publish(batch(stored(5)))
    wait_until(lambda: pub.stats.published == 5)
    replies = client.request(proto.seq_bytes(0))[:-1]
    got = [msgspec.msgpack.decode(r[3], type=KVEventBatch).events[0] for r in replies]
    assert [type(e).__name__ for e in got] == ["BlockStored"] * 3 + ["AllBlocksCleared",
                                                                      "BlockStored"]
    assert [e.block_hashes for e in got if isinstance(e, BlockStored)] == [[0], [1], [2], [5]]
    assert pub.mirror_hashes() == {5}


def test_recency_notices_are_batched_deduplicated_and_opt_in(started):
    interval = 0.02
    pub, client = started(topic="kv", sub_topic=proto.RECENCY_TOPIC, recency=True,
                          recency_interval_s=interval)
    h0, h1, h2 = b"\x00" * 32, b"\x01" * 32, b"\x02" * 32
    ints = {h: int.from_bytes(h[-8:], "big") for h in (h0, h1, h2)}
    t0 = time.monotonic()
    while client.recv(0) is None and time.monotonic() - t0 < 5:  # until subscribed
        pub.publish_touches([h0])   # h0: notices of the warm-up, wherever they arrive
        time.sleep(0.005)
    pub.publish_touches([h1, h2, h1])
    pub.publish_touches([h2])
    notices: list[proto.Touches] = []

    def receive(timeout_ms: int) -> bool:
        """One notice that names h1 or h2 (others, h0's alone, are dropped); False if none."""
        while (msg := client.recv(timeout_ms)) is not None:
            notice = proto.decode_touches(msg[2])
            if set(notice.block_hashes) - {ints[h0]}:
                notices.append(notice)
                return True
        return False

    def named() -> set[int | bytes]:
        return {h for n in notices for h in n.block_hashes} - {ints[h0]}

    while named() != {ints[h1], ints[h2]}:
        assert receive(2000), f"notices naming h1 and h2, got {notices}"
    while receive(int(3 * interval * 1000)):   # any more would come within an interval
        pass
    assert 1 <= len(notices) <= 2  # 4 touches, one or two intervals
    assert named() == {ints[h1], ints[h2]}
    assert all(n.epoch == pub.epoch for n in notices)
    assert all(len(set(n.block_hashes)) == len(n.block_hashes) for n in notices)
    off, client2 = started(topic="kv", sub_topic=proto.RECENCY_TOPIC, recency_interval_s=0.01)
    off.publish_touches([h1])
    assert client2.recv(50) is None and off.stats.touch_notices == 0


def test_lifecycle_errors_and_idempotent_shutdown():
    pub = ZmqEventPublisher(KVEventsConfig())
    with pytest.raises(RuntimeError, match="before start"):
        pub.publish(batch(AllBlocksCleared()))
    pub.start()
    with pytest.raises(RuntimeError, match="twice"):
        pub.start()
    pub.publish(batch(AllBlocksCleared()))
    t0 = time.monotonic()
    pub.shutdown()
    pub.shutdown()
    assert time.monotonic() - t0 < 10   # no linger on unsent frames: no hang
    assert pub.stats.published == 1  # what was queued went out before the sockets closed
    pub.publish(batch(AllBlocksCleared()))  # after shutdown: a no-op
    assert pub.stats.published == 1


def test_a_wakeup_pipe_wakes_a_poller_until_drained_and_is_inert_once_closed():
    pipe = WakeupPipe()
    poller = zmq.Poller()
    poller.register(pipe.fd, zmq.POLLIN)
    assert poller.poll(0) == []
    pipe.wake()
    pipe.wake()
    assert poller.poll(0) == [(pipe.fd, zmq.POLLIN)]
    pipe.drain()
    assert poller.poll(0) == []
    pipe.close()
    other = WakeupPipe()   # most likely given the descriptor numbers just closed
    try:
        others = zmq.Poller()
        others.register(other.fd, zmq.POLLIN)
        pipe.wake()   # after close: writes nothing, to whatever file has its number now
        pipe.close()
        assert others.poll(0) == []
    finally:
        other.close()
