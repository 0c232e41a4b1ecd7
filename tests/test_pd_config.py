"""The P/D contract's data: `--kv-transfer-config` (KVTransferConfig), `extra_args` and
`kv_transfer_params` on requests, D's reading of P's params, and the wire structs."""

from __future__ import annotations

import json
import logging
import uuid

import msgspec
import pytest

from kvloop.config import (
    DEFAULT_KV_LEASE_DURATION,
    DEFAULT_SIM_BANDWIDTH,
    DEFAULT_TRANSFER_TIMEOUT,
    EngineConfig,
    KVTransferConfig,
    RunnerConfig,
)
from kvloop.core.kv_connector import cached_tokens_after_load
from kvloop.core.request import Request, SamplingParams
from kvloop.kv_transfer.leases import LeaseTable
from kvloop.kv_transfer.params import RemotePrefill, parse_remote_prefill
from kvloop.wire import EngineCoreOutput, EngineStartConfig, KVTransferStats, SchedulerStats
from tests.conftest import FakeClock

BASE = {"kv_connector": "KvloopConnector", "kv_role": "kv_both"}


def test_the_defaults_are_vllm_s_and_the_engine_id_a_fresh_uuid():
    a, b = KVTransferConfig.from_json(json.dumps(BASE)), KVTransferConfig.from_dict(BASE)
    assert a.engine_id != b.engine_id and uuid.UUID(a.engine_id).version == 4
    assert a.kv_load_failure_policy == "fail" and a.is_kv_producer and a.is_kv_consumer
    extra = a.kv_connector_extra_config
    assert (extra.side_channel_host, extra.side_channel_port, extra.transport) == \
        ("127.0.0.1", 0, "auto")
    assert (extra.kv_lease_duration, extra.transfer_timeout, extra.sim_bandwidth) == \
        (DEFAULT_KV_LEASE_DURATION, DEFAULT_TRANSFER_TIMEOUT, DEFAULT_SIM_BANDWIDTH) == \
        (30.0, 10.0, 1.25e9)
    producer = KVTransferConfig.from_dict({**BASE, "kv_role": "kv_producer"})
    assert producer.is_kv_producer and not producer.is_kv_consumer


def test_every_key_is_read():
    c = KVTransferConfig.from_dict({
        **BASE, "engine_id": "p-1", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"side_channel_host": "10.0.0.5", "side_channel_port": 5600,
                                      "transport": "tcp", "kv_lease_duration": 5,
                                      "transfer_timeout": 2.5, "sim_bandwidth": 1e9}})
    assert c.engine_id == "p-1" and c.kv_load_failure_policy == "recompute"
    assert c.extra.side_channel_host == "10.0.0.5" and c.extra.side_channel_port == 5600
    assert c.extra.transport == "tcp" and c.extra.kv_lease_duration == 5.0
    assert isinstance(c.extra.kv_lease_duration, float)


@pytest.mark.parametrize("raw, message", [
    ({"kv_role": "kv_both"}, "missing required key(s) 'kv_connector'"),
    ({"kv_connector": "KvloopConnector"}, "missing required key(s) 'kv_role'"),
    ({**BASE, "kv_connector": "NixlConnector"},
     "kv_connector must be one of KvloopConnector, got 'NixlConnector'"),
    ({**BASE, "kv_role": "producer"}, "kv_role must be one of kv_producer, kv_consumer, "
                                      "kv_both, got 'producer'"),
    ({**BASE, "kv_load_failure_policy": "retry"}, "kv_load_failure_policy must be one of "
                                                  "fail, recompute, got 'retry'"),
    ({**BASE, "kv_connector_module_path": "x"}, "unknown key(s) 'kv_connector_module_path'"),
    ({**BASE, "kv_connector_extra_config": {"backends": ["UCX"]}},
     "kv_connector_extra_config: unknown key(s) 'backends'"),
    ({**BASE, "kv_connector_extra_config": {"transport": "rdma"}},
     "transport must be one of auto, tcp, shm, got 'rdma'"),
    ({**BASE, "kv_connector_extra_config": {"side_channel_port": "5600"}},
     "side_channel_port must be an integer, got '5600'"),
    ({**BASE, "kv_connector_extra_config": {"side_channel_port": 70000}},
     "side_channel_port must be in [0, 65535], got 70000"),
    ({**BASE, "kv_connector_extra_config": {"kv_lease_duration": 0}},
     "kv_lease_duration must be > 0, got 0"),
    ({**BASE, "kv_connector_extra_config": {"transfer_timeout": True}},
     "transfer_timeout must be a number, got True"),
    ({**BASE, "kv_connector_extra_config": []}, "kv_connector_extra_config must be a JSON "
                                                 "object"),
    ({**BASE, "engine_id": ""}, "engine_id must be a non-empty string"),
    ([1], "--kv-transfer-config must be a JSON object, got list"),
])
def test_bad_configs_are_refused_naming_the_key(raw, message):
    with pytest.raises(ValueError) as err:
        KVTransferConfig.from_dict(raw)
    assert message in str(err.value)


def test_bad_json_is_refused_and_nccl_keys_are_ignored_with_a_warning(caplog):
    with pytest.raises(ValueError, match="--kv-transfer-config is not valid JSON"):
        KVTransferConfig.from_json("{kv_role: 1}")
    with caplog.at_level(logging.WARNING, "kvloop.config"):
        c = KVTransferConfig.from_dict({**BASE, "kv_ip": "127.0.0.1", "kv_port": 14579,
                                        "kv_buffer_size": 1e9})
    assert c.kv_role == "kv_both"
    assert "ignoring kv_buffer_size, kv_ip, kv_port" in caplog.text


def test_the_config_crosses_to_the_engine_process():
    c = KVTransferConfig.from_dict({**BASE, "kv_connector_extra_config": {"transport": "shm"}})
    start = EngineStartConfig(engine=EngineConfig(kv_transfer=c), runner=RunnerConfig(),
                              input_address="tcp://127.0.0.1:1", output_address="tcp://x:2")
    back = msgspec.json.decode(msgspec.json.encode(start), type=EngineStartConfig)
    assert back.engine.kv_transfer == c
    assert EngineConfig().kv_transfer is None


def test_extra_args_carry_kv_transfer_params_to_the_request():
    params = {"do_remote_decode": True, "remote_block_ids": None}
    sp = SamplingParams(extra_args={"kv_transfer_params": params, "other": [1, 2]})
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(sp), type=SamplingParams)
    assert wire.extra_args == {"kv_transfer_params": params, "other": [1, 2]}
    req = Request("r", [1, 2, 3], wire)
    assert req.kv_transfer_params == params
    req.kv_transfer_params["do_remote_decode"] = False          # the connector's own copy
    assert wire.extra_args["kv_transfer_params"]["do_remote_decode"] is True
    assert Request("s", [1], SamplingParams()).kv_transfer_params is None


@pytest.mark.parametrize("extra, message", [
    ({"kv_transfer_params": [1]}, "kv_transfer_params must be an object, got list"),
    ({"x": 2 ** 70}, "extra_args must be msgpack-serialisable"),
    ({"x": object()}, "extra_args must be msgpack-serialisable"),
    ({1: 2}, "extra_args must be an object with string keys"),
])
def test_bad_extra_args_are_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(extra_args=extra)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"extra_args": {"kv_transfer_params": 3}}),
                               type=SamplingParams)


GOOD = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r",
        "remote_host": "127.0.0.1", "remote_port": 5600, "remote_block_ids": [4, 5],
        "remote_num_tokens": 20, "block_size": 16, "lease_expires_in_s": 30.0}


def test_d_reads_p_s_params():
    remote = parse_remote_prefill(GOOD, 20, 16)
    assert remote == RemotePrefill(engine_id="p", request_id="r", host="127.0.0.1", port=5600,
                                   block_ids=[4, 5], num_tokens=20, block_size=16, lease_s=30.0)
    assert remote.peer == ("p", "127.0.0.1", 5600)
    minimal = {k: GOOD[k] for k in ("remote_engine_id", "remote_request_id", "remote_host",
                                    "remote_port", "remote_block_ids")}
    assert isinstance(parse_remote_prefill(minimal, 20, 16), RemotePrefill)   # vLLM's keys only


@pytest.mark.parametrize("change, why", [
    ({"remote_host": None}, "missing remote_host"),
    ({"remote_block_ids": []}, "missing remote_block_ids"),
    ({"remote_engine_id": None, "remote_port": None}, "missing remote_engine_id, remote_port"),
    ({"remote_block_ids": [1, "2"]}, "remote_block_ids must be a list of block ids"),
    ({"remote_port": 0}, "remote_port must be a whole number from 1 to 65535, got 0"),
    ({"remote_port": "5000"}, "remote_port must be a whole number from 1 to 65535, got '5000'"),
    ({"block_size": 0}, "block_size must be a whole number from 1 to 65536, got 0"),
    ({"lease_expires_in_s": float("nan")}, "lease_expires_in_s must be seconds from 0"),
    ({"kv_fingerprint": "x"}, "kv_fingerprint must be an object"),
    ({"do_remote_prefill": "yes"}, "do_remote_prefill must be true or false"),
    ({"remote_request_id": 7}, "remote_request_id must be a string"),
    ({"remote_num_tokens": 19}, "remote_num_tokens is 19 but the prompt has 20 tokens"),
])
def test_invalid_params_say_why(change, why):
    assert why in parse_remote_prefill({**GOOD, **change}, 20, 16)


def test_cached_tokens_on_d_count_each_hit_once_and_never_the_load():
    def req(remote: object) -> Request:
        return Request("r", list(range(40)), SamplingParams(extra_args={
            "kv_transfer_params": {"remote_prefill_cached_tokens": remote}}))

    assert cached_tokens_after_load(req(32), 0) == 32          # P's hit
    assert cached_tokens_after_load(req(0), 16) == 16          # D's own
    assert cached_tokens_after_load(req(16), 32) == 32         # overlapping prefixes: once
    assert cached_tokens_after_load(req("x"), 0) == 0
    assert cached_tokens_after_load(req(99), 0) == 39          # never the whole prompt


def test_the_wire_structs_round_trip():
    stats = SchedulerStats(kv_transfer=KVTransferStats(
        transfers_received=1, bytes_received=10, transfer_seconds=[0.5],
        failures={"unreachable": 2}, held_requests=1))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=SchedulerStats) == stats
    assert stats.kv_transfer.has_counts and not KVTransferStats(held_requests=3).has_counts
    out = EngineCoreOutput("r", [1], finish_reason="length",
                           kv_transfer_params={"do_remote_prefill": True})
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=EngineCoreOutput) == out
    assert SchedulerStats().kv_transfer is None


def test_leases_expire_extend_by_heartbeat_and_never_while_read():
    clock = FakeClock(100.0)
    table = LeaseTable(30.0, clock)
    assert table.add("a", [1, 2]) == 30.0 and table.add("b", [3]) == 30.0
    clock.t = 120.0
    assert table.heartbeat(["a", "nobody"]) == 1          # a: max(130, 120 + 20) = 140
    clock.t = 105.0
    assert table.heartbeat(["b"]) == 1                    # b: max(130, 125) = 130: no change
    assert table.expires_in("a") == 35.0 and table.expires_in("b") == 25.0
    assert table.begin_read("b", [3]) is None             # a Read of b is being served
    assert "blocks [4] are not held" in table.begin_read("a", [1, 4])
    assert "'c' is not held here" in table.begin_read("c", [1])
    clock.t = 131.0
    assert not table.sweep() and table.has_news() is False   # b is pinned by its Read
    table.end_read("b", "/dev/shm/kvloop-x")
    assert table.has_news() and [lease.request_id for lease in table.sweep()] == ["b"]
    clock.t = 140.0
    assert [lease.request_id for lease in table.sweep()] == ["a"]
    released = {r.lease.request_id: r for r in table.take_released()}
    assert released["b"].expired and released["b"].lease.shm_files == ["/dev/shm/kvloop-x"]
    assert released["b"].lease.num_reads == 1 and table.request_ids() == set()
    table.add("c", [5])
    assert table.done("c") and not table.done("c") and table.num_held() == 0
    assert [r.expired for r in table.take_released()] == [False]
