"""`--max-num-batched-tokens auto` (kvloop.core.budget): the choice on fixed timing tables,
the simulator's modelled timings, and real steps of a tiny model that leave no state behind."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from kvloop import LLM, SamplingParams
from kvloop.config import AutoBudget, RunnerConfig, SchedulerConfig, SimSettings
from kvloop.core.budget import (
    DECODE_CONTEXT,
    attention_timings,
    budget_cap,
    candidate_sizes,
    choose_budget,
    keys_per_token,
    monotone_fit,
    non_chunked_budget,
    resolve_budget,
    step_timings,
    timings_until,
)
from kvloop.llm import engine_config
from kvloop.sim.latency import LatencyModel
from kvloop.sim.worker import make_sim_runner
from tests.test_model_tiny import tiny_hf_model, write_tiny_gguf

LINEAR = {b: 0.010 + 5e-5 * b for b in (256, 512, 1024, 2048, 4096, 8192)}   # 1024: 61.2 ms


# --- the choice -------------------------------------------------------------------------------
def test_a_linear_table_gives_the_largest_step_within_the_target() -> None:
    c = choose_budget(LINEAR, 0.1, 256, 8192)
    assert (c.budget, c.misses_target) == (1024, False)
    assert choose_budget(LINEAR, 0.1125, 256, 8192).budget == 2048    # t(2048): 112.4 ms
    assert choose_budget(list(LINEAR.items())[::-1], 0.1, 256, 8192).budget == 1024  # pairs
    assert c.describe() == (
        "max_num_batched_tokens auto: step time per token budget (measured) 256 -> 22.8 ms, "
        "512 -> 35.6 ms, 1024 -> 61.2 ms, 2048 -> 112.4 ms, 4096 -> 214.8 ms, 8192 -> 419.6 ms; "
        "chose 1024, the largest within the target TPOT 100 ms (2048 is over)")


def test_noise_is_fitted_monotone_before_the_comparison() -> None:
    assert monotone_fit([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    # a fast outlier at 1024 does not make it fit: pooled with 512 it is over the target
    assert choose_budget({256: 0.05, 512: 0.12, 1024: 0.09, 2048: 0.3}, 0.1, 256, 8192).budget \
        == 256
    # a slow outlier at 512 does not stop 1024 from fitting
    assert choose_budget({256: 0.05, 512: 0.09, 1024: 0.08, 2048: 0.2}, 0.1, 256, 8192).budget \
        == 1024


def test_a_target_below_the_floor_gives_the_floor_flagged() -> None:
    c = choose_budget({256: 0.2, 512: 0.4}, 0.1, 256, 8192)
    assert (c.budget, c.misses_target) == (256, True)
    assert c.describe().endswith("chose 256, the floor: even its step is over the target "
                                 "TPOT 100 ms")
    assert choose_budget({}, 0.1, 256, 100) == choose_budget([], 0.1, 256, 100)
    assert (choose_budget({}, 0.1, 256, 100).budget,
            choose_budget({}, 0.1, 256, 100).misses_target) == (256, False)   # nothing measured


def test_a_missed_default_target_gives_the_largest_near_the_least_time_per_token() -> None:
    # per token: 0.78, 0.70, 0.68, 0.73 ms; the fixed cost spread, then attention's
    steps = {256: 0.2, 512: 0.36, 1024: 0.7, 2048: 1.5}
    c = choose_budget(steps, 0.1, 256, 8192, for_throughput=True)
    assert (c.budget, c.misses_target, c.step_s) == (1024, True, 0.7)
    assert c.describe().endswith("chose 1024, the largest near the least time per token "
                                 "(0.68 ms here): even the floor's step is over the target "
                                 "TPOT 100 ms, so no budget meets it")
    assert choose_budget(steps, 0.1, 256, 600, for_throughput=True).budget == 600   # capped
    # within 5 % of the least the larger is taken (0.70 is 2.6 % over 0.68; 0.73, 7 %)
    assert choose_budget({256: 0.2, 512: 0.348, 1024: 0.7, 2048: 1.5}, 0.1, 256, 8192,
                         for_throughput=True).budget == 1024   # 512 now the least: 0.68
    assert choose_budget({256: 0.2, 512: 0.34, 1024: 0.74}, 0.1, 256, 8192,
                         for_throughput=True).budget == 512    # 1024 9 % over 0.66 (512)
    # the per-token times come from the monotone fit
    assert choose_budget({256: 0.2, 512: 0.19, 1024: 0.5}, 0.1, 256, 8192,
                         for_throughput=True).budget == 512   # fitted 0.195 at both
    # a target met is the same choice either way
    assert choose_budget(LINEAR, 0.1, 256, 8192, for_throughput=True) == dataclasses.replace(
        choose_budget(LINEAR, 0.1, 256, 8192), for_throughput=True)


def test_a_huge_target_gives_the_cap() -> None:
    assert choose_budget(LINEAR, 100.0, 256, 8192).budget == 8192
    c = choose_budget(LINEAR, 100.0, 256, 3000)       # timings beyond the cap do not count
    assert c.budget == 3000 and "the cap" in c.describe()
    assert choose_budget({256: 0.01}, 100.0, 512, 8192).budget == 512    # never below the floor


def test_without_chunked_prefill_the_budget_covers_the_context() -> None:
    c = non_chunked_budget(8192, 128)
    assert (c.budget, c.timings, c.misses_target) == (8192, (), False)
    assert non_chunked_budget(64, 128).budget == 128             # and every request's token
    assert c.describe() == (
        "max_num_batched_tokens auto: 8192 (no chunked prefill: a prompt must fit in one step, "
        "so the budget covers the context length 8192, vLLM's rule; nothing measured)")
    sim = make_sim_runner(RunnerConfig(sim=SimSettings()))
    sched = SchedulerConfig(max_num_batched_tokens=256, max_model_len=2000,
                            enable_chunked_prefill=False)
    assert resolve_budget(sched, AutoBudget(), sim, 16).max_num_batched_tokens == 2000


def test_candidates_floor_and_cap() -> None:
    assert candidate_sizes(256, 8192) == [256, 512, 1024, 2048, 4096, 8192]
    assert candidate_sizes(300, 2000) == [300, 512, 1024, 2000]
    assert candidate_sizes(256, 256) == [256] and candidate_sizes(256, 255) == []
    # the decode's 2 blocks (31 + 1 tokens of 16) and the null block leave 29 of 32
    assert budget_cap(8192, 32, 16) == 29 * 16 + 1
    assert budget_cap(1000, 4096, 16) == 1000 and budget_cap(10**6, 10**6, 16) == 8192
    with pytest.raises(ValueError, match="--target-tpot-ms must be > 0, got 0"):
        AutoBudget(target_tpot_ms=0)


def test_measuring_stops_over_the_target_and_before_the_time_limit() -> None:
    calls: list[int] = []

    def step(b: int) -> float:
        calls.append(b)
        return LINEAR[b]

    sizes = sorted(LINEAR)
    assert timings_until(step, sizes, 0.1, 10.0) == [(b, LINEAR[b]) for b in sizes[:4]]
    assert calls == [256, 512, 1024, 2048, 2048]    # the one over the target: timed twice
    noisy = iter([0.05, 0.3, 0.08, 0.2, 0.25])       # 512 is slow once, then within
    assert timings_until(lambda b: next(noisy), [256, 512, 1024], 0.1, 10.0) == [
        (256, 0.05), (512, 0.08), (1024, 0.2)]
    # spent 22.8 + 35.6 ms; 1024 is predicted at 71.2 ms (35.6 per 512): past 0.1 s, not run
    assert timings_until(LINEAR.__getitem__, sizes, 1.0, 0.1) == [(256, LINEAR[256]),
                                                                  (512, LINEAR[512])]
    assert timings_until(LINEAR.__getitem__, sizes, 1.0, 0.0) == [(256, LINEAR[256])]


def test_past_a_missed_target_measuring_stops_where_time_per_token_rises() -> None:
    # per token 0.78, 0.70, 0.68, 0.73 (7 % over the least), 0.98 ms
    steps = {256: 0.2, 512: 0.36, 1024: 0.7, 2048: 1.5, 4096: 4.0}
    calls: list[int] = []

    def step(b: int) -> float:
        calls.append(b)
        return steps[b]

    sizes = sorted(steps)
    assert timings_until(step, sizes, 0.1, 100.0, for_throughput=True) == [
        (b, steps[b]) for b in sizes[:4]]           # 2048 is 7 % slower per token
    assert calls == [256, 256, 512, 512, 1024, 1024, 2048, 2048]   # each over: timed twice
    assert timings_until(step, sizes, 0.1, 100.0) == [(256, 0.2)]   # the target the user set
    # the limit still holds: 0.4 + 0.72 spent, 1024 predicted at 0.72 s more
    assert timings_until(step, sizes, 0.1, 1.5, for_throughput=True) == [(256, 0.2), (512, 0.36)]
    # a floor within the target: the usual stop, for_throughput or not
    assert timings_until(LINEAR.__getitem__, sorted(LINEAR), 0.1, 10.0, for_throughput=True) == [
        (b, LINEAR[b]) for b in sorted(LINEAR)[:4]]


# --- the simulator: its latency model, no clock ----------------------------------------------
def test_the_simulator_budget_comes_from_its_latency_model(caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    runner = make_sim_runner(RunnerConfig(sim=SimSettings(speedup=50)))
    sizes = [256, 512, 1024, 2048]
    timings = step_timings(runner, sizes, 0.1, block_size=16)
    lat = LatencyModel.from_file(speedup=50)
    # each step: a fresh prompt of b - 1 tokens and a decode over DECODE_CONTEXT + 1
    expected = [(lat.base_s + lat.per_token_s * b + 2 * lat.per_seq_s
                 + lat.per_ctx_token_s * (b - 1 + DECODE_CONTEXT + 1)) / 50 for b in sizes]
    assert [b for b, _ in timings] == sizes
    assert [t for _, t in timings] == pytest.approx(expected, rel=1e-12)
    sched = SchedulerConfig(max_num_batched_tokens=256, max_model_len=1024)
    with caplog.at_level(logging.INFO, logger="kvloop.core.budget"):
        assert resolve_budget(sched, AutoBudget(10), runner, 16).max_num_batched_tokens == 512
        assert resolve_budget(sched, AutoBudget(), runner, 16).max_num_batched_tokens == 1024
    assert [r.getMessage() for r in caplog.records] == [
        "max_num_batched_tokens auto: step time per token budget (modelled) 128 -> 2.4 ms, "
        "256 -> 4.2 ms, 512 -> 7.9 ms, 1024 -> 15.4 ms; chose 512, the largest within the "
        "target TPOT 10 ms (1024 is over)",
        "max_num_batched_tokens auto: step time per token budget (modelled) 128 -> 2.4 ms, "
        "256 -> 4.2 ms, 512 -> 7.9 ms, 1024 -> 15.4 ms; chose 1024, the cap (the least of "
        "8192, the context length and the KV cache), within the target TPOT 100 ms"]
    slow = make_sim_runner(RunnerConfig(sim=SimSettings()))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvloop.core.budget"):
        # the default target, missed by this slow machine: the least time per token among
        # the steps the 2 s limit allows (128, 256, 512; 1024 would pass it), one INFO line
        assert resolve_budget(sched, AutoBudget(), slow, 16).max_num_batched_tokens == 512
        # a target the user set, missed: the floor, and a WARNING of what decodes will see
        assert resolve_budget(sched, AutoBudget(100), slow, 16).max_num_batched_tokens == 128
    default, asked = caplog.records
    assert default.levelno == logging.INFO and default.getMessage().endswith(
        "128 -> 117.6 ms, 256 -> 210.6 ms, 512 -> 396.4 ms; chose 512, the largest near the "
        "least time per token (0.77 ms here): even the floor's step is over the target TPOT "
        "100 ms, so no budget meets it")
    assert asked.levelno == logging.WARNING and "decodes will see about 118 ms per token" \
        in asked.getMessage()


def test_keys_per_token_from_a_fresh_and_a_late_step() -> None:
    # a step costs a * (n + keys / K) with a = 1 ms, K = 500: 127 fresh tokens attend
    # 127 * 64 keys, after 1,024 computed ones 127 * 1,024 more
    a, k, n, ctx = 1e-3, 500, 127, 1024
    fresh = a * (n + n * (n + 1) / 2 / k)
    late = fresh + a * n * ctx / k
    assert keys_per_token(n + 1, ctx, fresh, late) == k
    assert keys_per_token(n + 1, ctx, fresh, fresh) is None       # the context added nothing
    assert keys_per_token(n + 1, ctx, fresh, fresh * 0.9) is None  # noise: no extra time
    assert keys_per_token(n + 1, ctx, fresh, 1e9) == 1              # never below 1


def test_the_simulator_gets_no_attention_weight() -> None:
    runner = make_sim_runner(RunnerConfig(sim=SimSettings()))
    sched = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=64, max_model_len=4096)
    assert resolve_budget(sched, AutoBudget(), runner, 16).attention_keys_per_token is None


# --- a real model: real steps, nothing left behind --------------------------------------------
@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    model = tiny_hf_model(seed=5, max_position_embeddings=1024)
    return str(write_tiny_gguf(model, tmp_path_factory.mktemp("budget") / "t.gguf"))


def test_real_steps_leave_the_runner_as_they_found_it(tiny_gguf: str) -> None:
    from kvloop.model import load_runner

    runner = load_runner(RunnerConfig(model=tiny_gguf, dtype="float32", device="cpu",
                                      num_gpu_blocks_override=40, num_threads=1))
    try:
        rng_state = runner.sampler.generator.get_state()
        sizes = [16, 32, 64, 128]
        assert [b for b, _ in step_timings(runner, sizes, 1e9, block_size=16)] == sizes
        assert [b for b, _ in step_timings(runner, sizes, 1e-9, block_size=16)] == [16]
        assert [b for b, _ in step_timings(runner, sizes, 1e9, block_size=16,
                                           time_limit_s=0.0)] == [16]
        assert runner.requests == {} and runner._pending is None
        assert torch.equal(runner.sampler.generator.get_state(), rng_state)
        # written: the decode's blocks 1-2 and the prompt's; never the null block 0
        for kv in runner.kv_caches:
            assert not kv[:, :, 0].any() and kv[:, :, 1:11].abs().sum(dim=(0, 1, 3, 4)).all()
            assert not kv[:, :, 11:].any()
    finally:
        runner.shutdown()


def test_attention_timings_leave_the_runner_as_they_found_it(tiny_gguf: str) -> None:
    from kvloop.model import load_runner

    runner = load_runner(RunnerConfig(model=tiny_gguf, dtype="float32", device="cpu",
                                      num_gpu_blocks_override=40, num_threads=1))
    try:
        rng_state = runner.sampler.generator.get_state()
        fresh, late = attention_timings(runner, 32, 256, block_size=16)
        assert fresh > 0 and late > 0
        assert runner.requests == {} and runner._pending is None
        assert torch.equal(runner.sampler.generator.get_state(), rng_state)
        # the decode's blocks 1-2, the fresh prompts' 3-4, the late prompt's 256 + 3 * 31
        # tokens 5-26; nothing past them, never the null block 0
        for kv in runner.kv_caches:
            assert not kv[:, :, 0].any() and kv[:, :, 1:27].abs().sum(dim=(0, 1, 3, 4)).all()
            assert not kv[:, :, 27:].any()
    finally:
        runner.shutdown()


def test_llm_auto_measures_the_loaded_runner(tiny_gguf: str) -> None:
    llm = LLM(tiny_gguf, dtype="float32", device="cpu", num_gpu_blocks_override=40,
              num_threads=1, max_num_batched_tokens="auto", target_tpot_ms=1e6,
              check_invariants=True)
    try:
        sched = llm.engine.config.scheduler
        # the cap: 37 blocks of 16 beside the decode's 2 and the null block, plus one
        assert (sched.max_num_batched_tokens, sched.max_num_seqs) == (37 * 16 + 1, 256)
        assert llm.runner.requests == {}
        greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        (out,) = llm.generate({"prompt_token_ids": list(range(3, 40))}, greedy, use_tqdm=False)
        fixed = LLM.from_runner(llm.runner, llm.tokenizer,
                                engine_config(llm.runner.max_model_len, num_gpu_blocks=40),
                                40)
        (again,) = fixed.generate({"prompt_token_ids": list(range(3, 40))}, greedy,
                                  use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 5
        assert out.outputs[0].token_ids == again.outputs[0].token_ids
    finally:
        llm.shutdown()
    assert engine_config(1024, max_num_batched_tokens="auto").auto_budget == AutoBudget()
    assert engine_config(1024, max_num_batched_tokens="auto").scheduler.max_num_batched_tokens \
        == 256
    with pytest.raises(ValueError, match="max_num_batched_tokens must be a number of tokens "
                                         "or 'auto', got 'lots'"):
        engine_config(1024, max_num_batched_tokens="lots")
