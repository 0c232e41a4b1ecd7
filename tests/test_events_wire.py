"""Byte-level compatibility with vLLM's KV-event stream (recorded frames of vLLM 0.33)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import msgspec
import pytest
import zmq

from kvloop.events.config import KVEventsConfig
from kvloop.events.protocol import END_SEQ, BatchDecoder, seq_bytes
from kvloop.events.publisher import ZmqEventPublisher
from kvloop.events.subscriber import KVEventSubscriber, WorkerBatch
from kvloop.events.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from .conftest import CONFORMANCE, wait_until

WIRE = json.loads((CONFORMANCE / "kv_events_wire.json").read_text())
LIVE = [bytes.fromhex(f["hex"]) for f in WIRE["live_message"]["frames"]]
PAYLOAD = LIVE[2]
DEALER_REPLIES = [[bytes.fromhex(f["hex"]) for f in m]
                  for m in WIRE["replay"]["dealer"]["messages_received"]]
REQ_REPLIES = [[bytes.fromhex(f["hex"]) for f in m]
               for m in WIRE["replay"]["req"]["messages_received"]]


def recorded_batch() -> KVEventBatch:
    return msgspec.msgpack.decode(PAYLOAD, type=KVEventBatch)


def test_recorded_payload_decodes_to_the_recorded_batch_and_back_byte_for_byte():
    batch = recorded_batch()
    assert batch.ts == 1700000000.5 and batch.data_parallel_rank == 0
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert isinstance(cleared, AllBlocksCleared)
    assert stored.block_hashes == [7142137847444424233, 11309060389865205804]
    assert stored.parent_block_hash == 3262291359910021016
    assert stored.token_ids == list(range(16, 48)) and stored.block_size == 16
    assert (stored.lora_id, stored.medium, stored.lora_name) == (None, "GPU", None)
    assert stored.extra_keys == [None, None] and stored.group_idx == 0
    assert stored.kv_cache_spec_kind == "full_attention"
    assert removed.block_hashes == [11309060389865205804] and removed.group_idx == 0
    assert msgspec.to_builtins(batch) == WIRE["published_batch"]["as_json"]
    assert msgspec.msgpack.encode(batch) == PAYLOAD
    # and a batch built field by field encodes to the same bytes
    rebuilt = KVEventBatch(ts=1700000000.5, data_parallel_rank=0, events=[
        BlockStored(block_hashes=[7142137847444424233, 11309060389865205804],
                    parent_block_hash=3262291359910021016, token_ids=list(range(16, 48)),
                    block_size=16, lora_id=None, medium="GPU", lora_name=None,
                    extra_keys=[None, None], group_idx=0, kv_cache_spec_kind="full_attention"),
        BlockRemoved(block_hashes=[11309060389865205804], medium="GPU", group_idx=0),
        AllBlocksCleared()])
    assert msgspec.msgpack.encode(rebuilt) == PAYLOAD


def test_recorded_payload_layout_as_the_annotation_says():
    assert PAYLOAD[:1] == b"\x93"  # [ts, events, data_parallel_rank]
    assert PAYLOAD[11:14] == bytes.fromhex("de000b")  # BlockStored: map16 of 11 entries
    raw = msgspec.msgpack.decode(PAYLOAD)  # untyped: maps keep the wire's key order
    assert list(raw[1][0]) == ["type", "block_hashes", "parent_block_hash", "token_ids",
                               "block_size", "lora_id", "medium", "lora_name", "extra_keys",
                               "group_idx", "kv_cache_spec_kind"]
    assert list(raw[1][1]) == ["type", "block_hashes", "medium", "group_idx"]
    assert raw[1][2] == {"type": "AllBlocksCleared"}


def test_recorded_replay_frames():
    assert DEALER_REPLIES[0][1:] == LIVE  # replayed payload == live payload
    assert DEALER_REPLIES[1] == [b"", b"", END_SEQ, b""]
    assert END_SEQ == (-1).to_bytes(8, "big", signed=True)
    assert REQ_REPLIES == [LIVE]


def test_older_positional_layout_decodes_too():
    old = msgspec.msgpack.encode([1.5, [
        ["BlockStored", [1, 2], None, list(range(32)), 16, None, "GPU"],
        ["BlockRemoved", [2], "GPU"], ["AllBlocksCleared"]]])
    batch = BatchDecoder().decode(old)
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == [1, 2]
    assert stored.token_ids == list(range(32)) and stored.medium == "GPU"
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [2]
    assert isinstance(cleared, AllBlocksCleared) and batch.data_parallel_rank is None
    with pytest.raises(msgspec.DecodeError):
        BatchDecoder().decode(b"\x93\x01")


@pytest.fixture
def vllm_like_publisher():
    pub = ZmqEventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:0",
                                           replay_endpoint="tcp://127.0.0.1:0",
                                           topic="kv-events")).start()
    yield pub
    pub.shutdown()


def _connected_sub(ctx: zmq.Context, pub: ZmqEventPublisher, topic: bytes) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.LINGER, 0)
    assert pub.endpoint is not None
    sub.connect(pub.endpoint)
    return sub


def test_our_frames_equal_vllms_recorded_frames(vllm_like_publisher):
    pub = vllm_like_publisher
    ctx = zmq.Context()
    try:
        sub = _connected_sub(ctx, pub, b"kv-events")
        # A slow-joining SUB misses what is sent before its subscription arrives; publish
        # until the first frame shows up, then check the frames of that message.
        got = None
        for _ in range(200):
            pub.publish(recorded_batch())
            if sub.poll(20):
                got = sub.recv_multipart()
                break
        assert got is not None
        assert got[0] == LIVE[0] and got[2] == LIVE[2] and len(got[1]) == 8
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", seq_bytes(0)])
        first = dealer.recv_multipart()
        assert first == DEALER_REPLIES[0]  # seq 0: byte-identical to vLLM's replay reply
        req = ctx.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(pub.replay_endpoint)
        req.send(seq_bytes(0))
        assert req.recv_multipart() == REQ_REPLIES[0]
        while True:  # the DEALER gets the rest and vLLM's end marker
            msg = dealer.recv_multipart()
            if msg[2] == END_SEQ:
                assert msg == DEALER_REPLIES[1]
                break
            assert msg[1] == LIVE[0] and msg[3] == PAYLOAD
    finally:
        ctx.destroy(linger=0)


# A consumer written from docs/vllm-facts.md#kv-events alone: its own trimmed structs, as
# vLLM's example does.
class _Ev(msgspec.Struct, tag=True):
    pass


class _Stored(_Ev, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int


class _Removed(_Ev, tag="BlockRemoved"):
    block_hashes: list[int]


class _Cleared(_Ev, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_Stored | _Removed | _Cleared]


def test_a_plain_consumer_written_from_the_spec_reads_our_stream():
    from .test_events_helpers import SimWorker

    worker = SimWorker(KVEventsConfig(endpoint="tcp://127.0.0.1:0", topic="kv-events"))
    ctx = zmq.Context()
    try:
        sub = _connected_sub(ctx, worker.publisher, b"kv-events")
        decoder = msgspec.msgpack.Decoder(_Batch)
        seen: dict[int, Any] = {}
        for _ in range(200):  # until the subscription is live
            worker.run(1)
            if sub.poll(20):
                break
        worker.run(6, min_batches=6)   # returns once every batch is sent
        while max(seen, default=-1) < worker.publisher.next_seq - 1:
            assert sub.poll(5000), "the batches sent after the subscription was live"
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv-events" and len(seq) == 8
            seen[int.from_bytes(seq, "big")] = decoder.decode(payload)
        seqs = sorted(seen)
        assert seqs == list(range(seqs[0], worker.publisher.next_seq))
        stored = [e for b in seen.values() for e in b.events if isinstance(e, _Stored)]
        assert stored and all(len(e.token_ids) == 16 * len(e.block_hashes) for e in stored)
        assert all(0 <= h < 2**64 for e in stored for h in e.block_hashes)
    finally:
        ctx.destroy(linger=0)
        worker.shutdown()


class FakeVllmPublisher:
    """Replays the recorded vLLM frames: PUB for live, ROUTER answering only vLLM's 3-frame
    replay request (anything else is ignored, as vLLM does)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:0")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:0")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.ignored = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                self.ignored += 1
                continue
            for msg in DEALER_REPLIES:
                self.router.send_multipart([frames[0], *msg])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.ctx.destroy(linger=0)


@pytest.mark.slow   # waits until the unanswered probes make it vLLM's publisher
def test_our_subscriber_consumes_a_vllm_publisher():
    fake = FakeVllmPublisher()
    got: list[WorkerBatch] = []
    sub = KVEventSubscriber(fake.endpoint, fake.replay_endpoint, "kv-events", got.append,
                            request_timeout_s=0.2, probe_interval_s=0.05)
    sub.start()
    try:
        wait_until(lambda: len(got) == 1, 5, "the replayed batch")
        assert got[0].source == "replay" and got[0].seq == 0
        assert msgspec.msgpack.encode(got[0].batch) == PAYLOAD
        second = [LIVE[0], seq_bytes(1), PAYLOAD.replace(b"\x41\xd9\x54\xfc\x40\x20",
                                                         b"\x41\xd9\x54\xfc\x40\x21")]
        for _ in range(250):  # live: the recorded seq 0 again (a duplicate), then seq 1
            fake.pub.send_multipart(LIVE)
            fake.pub.send_multipart(second)
            if len(got) >= 2:
                break
            time.sleep(0.02)
        assert [g.seq for g in got] == [0, 1] and got[1].source == "live"
        assert got[1].batch.ts != got[0].batch.ts
        deadline = time.monotonic() + 10
        while sub.stats.kvloop_publisher is not False:  # probes ignored while batches flow
            assert time.monotonic() < deadline, "vLLM publisher not detected"
            fake.pub.send_multipart(second)
            time.sleep(0.02)
        st = sub.stats
        assert st.duplicates >= 1 and st.current_epoch is None and st.snapshots == 0
        assert fake.ignored >= 1  # our info probe, ignored like vLLM does
    finally:
        sub.stop()
        fake.close()
