"""A prefill worker's engine process (`python -m kvloop.engine.proc`, the simulator)
holding blocks for a decode engine in this process: its handshake reports the bound side
channel, its output carries the params, and while idle it frees on Done and on lease expiry
without spinning a core."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import msgspec
import pytest

from kvloop.config import CacheConfig, EngineConfig, RunnerConfig, SchedulerConfig, SimSettings
from kvloop.core.request import SamplingParams
from kvloop.wire import (
    EngineCoreOutputs,
    EngineStartConfig,
    KVTransferStats,
    RequestType,
    UtilityRequest,
)
from tests.conftest import wait_until
from tests.engine_proc_helpers import engine_core_process
from tests.test_engine_wire import Engine
from tests.test_pd_engine import BS, PREFILL, SECRET, generate, kv_config, sim_engine

pytestmark = pytest.mark.processes

LEASE = 1.0


@pytest.fixture
def prefill_worker() -> Iterator[tuple[Engine, int]]:
    """A P engine process (lease 1 s) and its pid."""
    def start(input_address: str, output_address: str) -> EngineStartConfig:
        engine = EngineConfig(cache=CacheConfig(block_size=BS, num_gpu_blocks=32),
                              scheduler=SchedulerConfig(max_num_batched_tokens=256,
                                                        max_num_seqs=8, max_model_len=256),
                              check_invariants=True,
                              kv_transfer=kv_config(kv_lease_duration=LEASE))
        runner = RunnerConfig(block_size=BS, num_gpu_blocks_override=32, max_model_len=256,
                              sim=SimSettings(model_latency=False))
        return EngineStartConfig(engine=engine, runner=runner, input_address=input_address,
                                 output_address=output_address, fleet_secret=SECRET.to_text())

    with engine_core_process(start) as e:
        yield Engine(e.router, e.pull, e.identity, e.ready), e.proc.pid
        assert e.proc.stdin is not None
        e.proc.stdin.close()
        assert e.proc.wait(timeout=20) == 0


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Watch:
    """The P process's transfers in flight (a utility call), and the KV stats of every
    step message read meanwhile."""

    def __init__(self, p: Engine):
        self.p = p
        self.stats: list[KVTransferStats] = []

    def transfers(self) -> int:
        self.p.send(RequestType.UTILITY, msgspec.msgpack.encode(UtilityRequest(1, "get_stats")))
        while True:
            assert self.p.pull.poll(20_000), "no answer from the engine"
            outs = msgspec.msgpack.decode(self.p.pull.recv(), type=EngineCoreOutputs)
            if outs.scheduler_stats is not None and outs.scheduler_stats.kv_transfer:
                self.stats.append(outs.scheduler_stats.kv_transfer)
            if outs.utility_output is not None:
                assert isinstance(outs.utility_output.result, dict)
                return int(outs.utility_output.result["num_kv_transfers"] or 0)


def test_an_idle_prefill_worker_frees_on_done_and_on_expiry(prefill_worker):
    p, pid = prefill_worker
    watch = Watch(p)
    transfers = watch.transfers
    info = p.ready.kv_transfer
    assert info is not None and info.kv_role == "kv_both" and info.side_channel_port > 0
    prompt = list(range(300, 340))
    sp = SamplingParams(max_tokens=1, min_tokens=1, temperature=0,
                        extra_args={"kv_transfer_params": dict(PREFILL)})
    p.add("pulled", prompt, sp)
    params = p.finished("pulled")["pulled"].kv_transfer_params
    assert params is not None and params["remote_port"] == info.side_channel_port
    assert params["remote_engine_id"] == info.engine_id and transfers() == 1
    d = sim_engine()
    try:
        tokens, last = generate(d, "d", prompt, 3, params)
        assert last.finish_reason == "length" and len(tokens) == 3
    finally:
        d.shutdown()
    wait_until(lambda: transfers() == 0, 5, "the idle P to free on Done")

    p.add("unread", prompt, sp)
    assert p.finished("unread")["unread"].kv_transfer_params is not None
    t0, cpu0 = time.monotonic(), cpu_seconds(pid)
    time.sleep(0.5)
    assert cpu_seconds(pid) - cpu0 < 0.2, "the idle P spins while holding a lease"
    wait_until(lambda: transfers() == 0, 5, "the idle P to free on expiry")
    assert time.monotonic() - t0 >= LEASE * 0.8
    assert sum(k.expired_requests for k in watch.stats) == 1
    assert watch.stats[-1].held_requests == 0
