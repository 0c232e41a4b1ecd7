"""Tier-aware routing through the real router in front of real simulated workers.

Two `kvloop serve --model sim` workers; the router (in-process, real sockets) reads worker A's
own KV events and, for worker B, a ZMQ publisher of this test that speaks vLLM's wire format
([topic, 8-byte sequence, msgpack batch]) and announces host-tier (`medium` "CPU") blocks, as
vLLM's OffloadingConnector does. Requests for those prefixes go to B; B's engine never held
them, so its reported hits disagree and the self-verification alarm names the host tier.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import httpx
import msgspec
import pytest
import zmq

from kvloop.core.hashing import block_hashes
from kvloop.events.protocol import seq_bytes
from kvloop.events.types import TIER_HOST, BlockStored, KVEventBatch, event_int
from kvloop.router.config import IndexConfig, LivenessConfig, RouterConfig
from kvloop.router.fleet import Fleet
from kvloop.router.registry import PREDICTIONS_MISS, WorkerSpec

from .conftest import RouterThread, held_port, wait_until
from .test_router_fleet import random_ids, start_fleet

pytestmark = pytest.mark.processes

BS = 16


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    f = start_fleet(2)
    try:
        yield f
    finally:
        f.stop()


class VllmPublisher:
    """vLLM's KV-event PUB socket, reduced to what a subscriber reads."""

    def __init__(self, endpoint: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.bind(endpoint)
        self.seq = itertools.count()

    def publish(self, *events: BlockStored) -> None:
        payload = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=list(events)))
        self.sock.send_multipart([b"", seq_bytes(next(self.seq)), payload])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def host_stored(tokens: list[int], seed: str) -> BlockStored:
    hashes = [event_int(h) for h in block_hashes(tokens, BS, "sha256", seed)]
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens,
                       block_size=BS, lora_id=None, medium="CPU", lora_name=None)


def test_host_tier_holders_get_the_prefix_and_a_wrong_host_tier_is_named(fleet):
    a, b = fleet.specs()
    with held_port() as s:
        endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    pub = VllmPublisher(endpoint)
    cfg = RouterConfig(liveness=LivenessConfig(window_s=60, poll_interval_s=0.2,
                                               verify_window=4, verify_min_samples=4),
                       index=IndexConfig(provisional_ttl_s=0.0))
    b_via_test = WorkerSpec(b.url, events_endpoint=endpoint)
    try:
        with RouterThread(cfg, [a, b_via_test]) as rt:
            router = rt.router
            wait_until(lambda: router.hash_spec is not None and len(
                router.registry.usable()) == 2, 30, "both workers registered")
            seed = router.hash_spec.seed
            rng = random.Random(7)
            prefixes = [random_ids(rng, 8 * BS) for _ in range(4)]
            probe = random_ids(rng, BS)

            def probe_seen() -> bool:   # the subscription is up (ZMQ joins late)
                pub.publish(host_stored(probe, seed))
                return router.index.tier_blocks(b.name)[TIER_HOST] > 0
            wait_until(probe_seen, 20, "the router reads the test's publisher")
            for p in prefixes:
                pub.publish(host_stored(p, seed))
            wait_until(lambda: router.index.tier_blocks(b.name)[TIER_HOST] >= 33, 10,
                       "the host-tier blocks indexed")
            served = []
            for p in prefixes:
                r = httpx.post(f"{rt.url}/v1/completions", timeout=60, json={
                    "prompt": p + random_ids(rng, 5), "max_tokens": 2})
                assert r.status_code == 200, r.text
                served.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            state = router.registry.get(b.name)
            assert state.served == 4 and router.registry.get(a.name).served == 0
            assert served == [0, 0, 0, 0]            # B's engine never had them
            assert state.verifier.predicted_by_tier == {TIER_HOST: 4 * 8 * BS}
            router.check_liveness()
            alarm = state.alarms[PREDICTIONS_MISS]
            assert "tier host_pinned disagrees (4 of them)" in alarm.detail
            text = httpx.get(f"{rt.url}/metrics", timeout=10).text
            assert (f'kvloop_router_tier_predicted_hit_tokens_total{{tier="host_pinned",'
                    f'worker="{b.name}"}} 512.0') in text
    finally:
        pub.close()
