"""Tiers below the pool in real `kvloop serve` processes (the simulator: the accounting, not
the bytes, which tests/test_tiers_model.py checks).

- A worker restarted with its disk tier answers its old prefix from disk: cached tokens > 0
  on the first request after the restart.
- Two workers sharing a store on a real redis-server: B serves A's prefix from the store
  (cached tokens > 0 on B's first request), and the store holds only signed records.
"""

from __future__ import annotations

import os
import time
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from kvloop.core.hashing import block_hashes
from kvloop.events.types import (
    LOCALITY_LOCAL,
    MEDIUM_STORAGE,
    BlockStored,
    KVEventBatch,
    event_int,
)
from kvloop.front.launcher import ServeProcess
from kvloop.trust import FleetSecret, secret_env

from .bus_helpers import redis_server
from .conftest import serving, wait_until

pytestmark = pytest.mark.processes

BS = 16
SIM = ["--model", "sim", "--num-gpu-blocks-override", "64", "--max-model-len", "1024",
       "--debug-check-invariants", "--port", "0"]
SECRET = FleetSecret.generate()
PROMPT = [1000 + (i * 104729) % 30000 for i in range(200)]     # 12 full blocks and 8 tokens


def cached_tokens(srv: ServeProcess, prompt: list[int]) -> int:
    body: dict[str, Any] = {"model": "sim", "prompt": prompt, "max_tokens": 2,
                            "temperature": 0}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def replayed_stored(srv: ServeProcess) -> list[BlockStored]:
    """Every BlockStored the worker has published so far (its replay socket, from 0)."""
    endpoint = httpx.get(srv.url + "/kvloop/worker").json()["kv_events"]["replay_endpoint"]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    dec = msgspec.msgpack.Decoder(KVEventBatch)
    out: list[BlockStored] = []
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            frames = sock.recv_multipart()
            if not frames[-1]:
                return out
            out += [e for e in dec.decode(frames[-1]).events if isinstance(e, BlockStored)]
    finally:
        sock.close(linger=0)
        ctx.term()


def test_restarted_worker_answers_its_old_prefix_from_disk(tmp_path_factory):
    disk = tmp_path_factory.mktemp("kv-disk")
    args = [*SIM, "--kv-disk-path", str(disk), "--kv-disk-size", "0.05",
            "--enable-kv-cache-events", "--kv-events-endpoint", "tcp://127.0.0.1:0",
            "--kv-events-replay-endpoint", "tcp://127.0.0.1:0", "--no-kv-events-curve"]
    env = secret_env(SECRET)       # records signed: a restart may trust its files
    with serving(tmp_path_factory, "tiers-disk-1", args, env=env) as srv:
        assert cached_tokens(srv, PROMPT) == 0
        wait_until(lambda: len(os.listdir(disk)) >= 12, 10, "12 blocks on disk")
    expected = [event_int(h) for h in block_hashes(PROMPT, BS, "sha256")[:12]]
    with serving(tmp_path_factory, "tiers-disk-2", args, env=env) as srv:
        # before any request, the worker has announced its disk's blocks, parents first
        announced = wait_until(lambda: replayed_stored(srv), 10, "the disk's BlockStored")
        assert [h for e in announced for h in e.block_hashes] == expected
        assert {(e.medium, e.locality) for e in announced} == {(MEDIUM_STORAGE,
                                                                 LOCALITY_LOCAL)}
        assert cached_tokens(srv, PROMPT) == 12 * BS
        by_source = "vllm:prompt_tokens_by_source_total"
        assert srv.metric(by_source, source="external_kv_transfer") == 12 * BS
        assert srv.metric(by_source, source="local_cache_hit") == 0
        assert srv.metric("vllm:external_prefix_cache_hits_total") == 12 * BS
        assert srv.metric("vllm:external_prefix_cache_queries_total") == len(PROMPT)


def test_two_workers_share_a_redis_store(tmp_path_factory):
    import redis

    tmp = tmp_path_factory.mktemp("redis")
    with redis_server(tmp) as store:
        args = [*SIM, "--kv-shared-store", f"redis://127.0.0.1:{store.port}"]
        env = secret_env(SECRET)
        client = redis.Redis(host="127.0.0.1", port=store.port)
        with serving(tmp_path_factory, "tiers-a", args, env=env) as a, \
                serving(tmp_path_factory, "tiers-b", args, env=env) as b:
            assert cached_tokens(a, PROMPT) == 0
            wait_until(lambda: len(client.keys("kvloop:kv:*")) >= 12, 10, "12 blocks stored")
            assert cached_tokens(b, PROMPT) == 12 * BS
            # both name the store to routers (no credentials: the URL has none)
            for srv in (a, b):
                facts = httpx.get(srv.url + "/kvloop/worker").json()
                assert facts["kv_shared_store"] == f"redis://127.0.0.1:{store.port}"
        client.close()


def spoil_redis_record(client: Any, block_hash: bytes, how: str) -> None:
    """One record of the store made bad: a bit flipped (a torn write, a redis fault) or the
    header re-signed with the key anybody computes (a forger with redis access, no secret)."""
    from kvloop.kv_transfer.tier_record import decode_header, encode_record, tier_key

    [name] = [k for k in client.keys("kvloop:kv:*") if k.endswith(block_hash.hex().encode())]
    data = client.get(name)
    if how == "flipped":
        client.set(name, data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
        return
    fp = bytes.fromhex(name.decode().removeprefix("kvloop:kv:").split("-")[0])
    header, _ = decode_header(data, tier_key(SECRET, fp))
    client.set(name, encode_record(header, [], tier_key(None, fp)))


@pytest.mark.parametrize("how", ["flipped", "forged"])
def test_a_bad_redis_record_costs_one_recompute(tmp_path_factory, how):
    """issue 37 (2): the request whose first block's record is bad finishes (recomputed), the
    refusal is counted once and logged once, and nothing loops."""
    import redis

    tmp = tmp_path_factory.mktemp("redis-bad")
    with redis_server(tmp) as store:
        args = [*SIM, "--num-gpu-blocks-override", "32",
                "--kv-shared-store", f"redis://127.0.0.1:{store.port}"]
        client = redis.Redis(host="127.0.0.1", port=store.port)
        with serving(tmp_path_factory, f"tiers-bad-{how}", args,
                     env=secret_env(SECRET)) as srv:
            assert cached_tokens(srv, PROMPT) == 0
            wait_until(lambda: len(client.keys("kvloop:kv:*")) >= 12, 10, "12 blocks stored")
            spoil_redis_record(client, block_hashes(PROMPT, BS, "sha256")[0], how)
            other = [7 + (i * 7919) % 30000 for i in range(480)]     # 30 blocks: the pool
            assert cached_tokens(srv, other) == 0
            assert cached_tokens(srv, PROMPT) == 0          # old code: never answered
            assert srv.metric("kvloop:kv_transfer_failures_total", reason="corrupt") == 1
            log = srv.log()
            assert log.count("refusing block") == 1, log[-4000:]
            assert log.count("missed in every tier") == 1, log[-4000:]
        client.close()


@pytest.mark.parametrize(("url", "why"), [
    ("redis://127.0.0.1:1", "needs the fleet secret"),
    ("redis://user:pw@127.0.0.1:1", "no credentials in the URL"),
])
def test_shared_store_refusals_at_start(tmp_path, url, why):
    log = tmp_path / "serve.log"
    with pytest.raises(Exception) as err, ServeProcess(
            [*SIM, "--kv-shared-store", url], log).start(timeout_s=30):
        pass
    assert why in str(err.value) + log.read_text()


def test_a_redis_outage_is_a_miss_not_an_error(tmp_path):
    from kvloop.kv_transfer.tiers import RedisTier

    with redis_server(tmp_path) as srv:
        tier = RedisTier(f"redis://127.0.0.1:{srv.port}", 60, 1 << 20, timeout_s=0.5)
        tier.put("k", b"record")
        assert tier.contains("k") and tier.get("k") == b"record"
        srv.stop()
        assert not tier.contains("k")              # the failed call: logged, a miss
        t0 = time.monotonic()
        assert tier.get("k") is None and tier.put("k2", b"x") == []
        assert time.monotonic() - t0 < 0.5         # both: not even one call's timeout
        tier.close()
