"""Tiers below the pool with real KV bytes (kvloop.kv_transfer.offloading + the model runner).

- A tiny random Llama (fp32): the bytes of blocks that went to the host tier and came back,
  into a cache zeroed in between, equal the bytes computed; greedy tokens equal.
- The embedded SmolLM2-135M (fp32, dense: `low_bit_max_tokens=0`): greedy output with the
  prompt's prefix served from each tier (host, disk, shared directory, redis) equals the output
  computed from scratch (the ids equal and logprobs within 1e-4, or a near-tie flip, as
  tests/test_pd_model.py accepts: the loaded run computes the last prompt token alone).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import torch

from kvloop import LLM
from kvloop.config import RunnerConfig
from kvloop.core.request import SamplingParams
from kvloop.kv_transfer.tiers import FileTier, HostTier, RedisTier, Tier
from kvloop.model import load_runner
from kvloop.model.runner import ModelRunner
from tests.bus_helpers import redis_server
from tests.test_model_tiny import tiny_hf_model, write_tiny_gguf
from tests.test_pd_model import TEXT, assert_same_greedy, share_weights
from tests.test_tiers_engine import Rig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> ModelRunner:
    path = write_tiny_gguf(tiny_hf_model(seed=7), tmp_path_factory.mktemp("tiers") / "t.gguf")
    return load_runner(RunnerConfig(model=str(path), dtype="float32", device="cpu",
                                    block_size=16, num_gpu_blocks_override=12,
                                    max_model_len=256, num_threads=1))


def zero_cache(runner: ModelRunner) -> None:
    with torch.inference_mode():
        for kv in runner.kv_caches:
            kv.zero_()


def evict_pool(rig: Rig, num_tokens: int) -> None:
    """A request whose prompt takes every block of the pool: nothing else stays cached."""
    filler = [(13 * i + 1) % 90 + 3 for i in range(num_tokens)]   # in every test vocabulary
    rig.run("filler", filler, 1)
    kept = set(rig.engine.make_request("f", filler, SamplingParams()).block_hashes)
    assert not set(rig.engine.block_pool.cached_hashes()) - kept


def block_bytes(rig: Rig, hashes: list[bytes]) -> list[bytes]:
    ids = []
    for h in hashes:
        block = rig.engine.block_pool.get_cached_block(h)
        assert block is not None
        ids.append(block.block_id)
    return [b"".join(bytes(f) for f in rig.store.read_blocks([i])) for i in ids]


def test_bytes_equal_after_a_round_trip_through_the_host_tier(tiny):
    runner = share_weights(tiny, 9)
    rig = Rig([HostTier(64 << 20)], runner=runner, store=runner.kv_block_store, blocks=9,
              block_size=16, max_model_len=256, compress=True)
    try:
        prompt = [(7 * i) % 90 + 3 for i in range(65)]     # 4 full blocks and one token
        rig.run("a1", prompt, 4)
        hashes = list(rig.engine.make_request("p", prompt, SamplingParams()).block_hashes[:4])
        before = block_bytes(rig, hashes)
        evict_pool(rig, 8 * 16)
        zero_cache(runner)
        out = rig.run("a2", prompt, 4)
        assert out.num_cached_tokens == 64
        assert block_bytes(rig, hashes) == before
        assert rig.tokens("a2") == rig.tokens("a1")
    finally:
        rig.close()


@pytest.mark.parametrize("tier", ["cpu", "disk", "shared-dir",
                                  pytest.param("redis", marks=pytest.mark.processes)])
def test_embedded_greedy_with_prefix_from_each_tier_equals_scratch(smollm_fp32_dense, tmp_path,
                                                                  tier):
    with ExitStack() as stack:
        made = stack.enter_context(a_tier(tier, tmp_path))
        cached = greedy_from_tier_equals_scratch(smollm_fp32_dense, made,
                                                 compress=tier == "cpu")
    assert cached == 48     # the 3 full blocks of the prompt came from the tier


@contextmanager
def a_tier(name: str, tmp_path: Path) -> Iterator[Tier]:
    if name == "redis":
        with redis_server(tmp_path) as srv:
            tier = RedisTier(f"redis://127.0.0.1:{srv.port}", 60, 1 << 28)
            yield tier
            tier.close()
        return
    yield {"cpu": lambda: HostTier(64 << 20),
           "disk": lambda: FileTier(str(tmp_path), 64 << 20, shared=False, key_prefix=""),
           "shared-dir": lambda: FileTier(str(tmp_path), 64 << 20, shared=True,
                                          key_prefix="")}[name]()


def greedy_from_tier_equals_scratch(smollm: LLM, tier: Tier, compress: bool) -> int:
    """Greedy output with the prefix loaded from `tier` equals it computed from scratch
    (asserted here); -> the tokens the loaded run found cached."""
    runner = share_weights(smollm.runner, 12)
    rig = Rig([tier], runner=runner, store=runner.kv_block_store, blocks=12,
              block_size=runner.block_size, max_model_len=runner.max_model_len,
              compress=compress)
    try:
        prompt = smollm.get_tokenizer().encode(TEXT)[:50]       # 3 full blocks of 16
        scratch = rig.run("scratch", prompt, 6, logprobs=2)
        assert scratch.num_cached_tokens == 0
        evict_pool(rig, 11 * 16 - 1)
        zero_cache(runner)
        loaded = rig.run("loaded", prompt, 6, logprobs=2)
        assert loaded.num_cached_tokens == 48
        assert_same_greedy([lp for o in rig.outputs["scratch"] for lp in o.new_logprobs or []],
                           [lp for o in rig.outputs["loaded"] for lp in o.new_logprobs or []])
        assert rig.connector.record_errors == {}
        return loaded.num_cached_tokens
    finally:
        rig.close()
