"""The engine's one assembly (kvloop.engine.build): what the engine process and `LLM` both
get from `build_engine`, over the simulated runner (docs/architecture.md, "One engine
assembly")."""

from __future__ import annotations

import dataclasses

import pytest

from kvloop.config import KVOffloadConfig, RunnerConfig, SchedulerConfig
from kvloop.engine.build import build_engine
from kvloop.kv_transfer import KvloopConnector
from kvloop.kv_transfer.multi import MultiConnector
from kvloop.kv_transfer.offloading import OffloadingConnector
from kvloop.llm import engine_config
from kvloop.sim.worker import SimWorkerRunner
from kvloop.trust import FleetSecret

from .test_pd_engine import kv_config

BS = 16


def test_the_runners_facts_win_and_the_length_fits_the_cache():
    """9 blocks (8 usable: 128 tokens) under a 4096-token model: the context is clamped, the
    blocks and the hash seed are the config's, and a template's LoRA setting stands."""
    template = engine_config(4096, num_gpu_blocks=1024)
    template = dataclasses.replace(template, scheduler=dataclasses.replace(
        template.scheduler, max_loras=2))
    built = build_engine(RunnerConfig(), template, runner=SimWorkerRunner(None, 9, 4096))
    try:
        cfg = built.config
        assert (cfg.scheduler.max_model_len, cfg.cache.num_gpu_blocks) == (128, 9)
        assert cfg.cache.hash_seed is not None                 # resolved (vLLM's rule)
        assert cfg.scheduler.max_loras == 2
        assert built.engine.structured_output is None     # the simulator: no grammar
        assert built.engine.connector is None and built.kv_transfer is None
    finally:
        built.engine.shutdown()


def test_without_chunked_prefill_the_length_fits_one_step_and_blocks_can_be_capped():
    template = engine_config(4096, max_num_batched_tokens=64, enable_chunked_prefill=False)
    built = build_engine(RunnerConfig(), template, runner=SimWorkerRunner(None, 40, 4096),
                         num_gpu_blocks=20, kv_events=True)
    try:
        assert built.config.scheduler.max_model_len == 64
        assert built.config.cache.num_gpu_blocks == 20
        assert built.config.cache.enable_kv_cache_events
    finally:
        built.engine.shutdown()


@pytest.mark.processes   # the P/D connector binds its side channel on 127.0.0.1
def test_pd_and_tiers_are_one_connector_list_pd_first():
    template = dataclasses.replace(engine_config(512), kv_transfer=kv_config("kv_both"),
                                   kv_offload=KVOffloadConfig(cpu_bytes=1 << 20),
                                   scheduler=SchedulerConfig(max_model_len=512))
    built = build_engine(RunnerConfig(), template, runner=SimWorkerRunner(None, 20, 512),
                         secret=FleetSecret.generate())
    try:
        connector = built.engine.connector
        assert isinstance(connector, MultiConnector)
        assert [type(c) for c in connector.connectors] == [KvloopConnector,
                                                           OffloadingConnector]
        assert built.kv_transfer is not None and built.kv_transfer.side_channel_port > 0
    finally:
        built.engine.shutdown()
