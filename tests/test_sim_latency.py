"""The simulated worker: latency model, its features, the sim runner's tokens, and a real
`kvloop serve --model sim` whose step times (from its trace file) follow the latency file
divided by --sim-speedup."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from kvloop.config import CacheConfig, EngineConfig, RunnerConfig, SchedulerConfig, SimSettings
from kvloop.core.engine import EngineCore
from kvloop.core.request import SamplingParams
from kvloop.front.launcher import ServeProcess
from kvloop.sim.byte_vocab import PRINTABLE_IDS
from kvloop.sim.latency import (
    DEFAULT_LATENCY_FILE,
    LatencyModel,
    StepFeatures,
    load_latency_file,
)
from kvloop.sim.runner import SimRunner
from kvloop.sim.worker import SimWorkerRunner, make_sim_runner

NO_LATENCY = RunnerConfig(sim=SimSettings(model_latency=False))
COEFFS = {"base_s": 0.2, "per_token_s": 0.001, "per_seq_s": 0.01, "per_ctx_token_s": 0.0001}


def _engine(runner: object, blocks: int = 64) -> EngineCore:
    cfg = EngineConfig(cache=CacheConfig(num_gpu_blocks=blocks),
                       scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8,
                                                 max_model_len=512), check_invariants=True)
    return EngineCore(cfg, runner)  # type: ignore[arg-type]


def test_latency_model_arithmetic() -> None:
    m = LatencyModel(**COEFFS)
    f = StepFeatures(num_tokens=10, num_seqs=2, context_tokens=100)
    assert m.features_time(f) == pytest.approx(0.2 + 0.01 + 0.02 + 0.01)
    assert LatencyModel(**COEFFS, speedup=4).features_time(f) == pytest.approx(0.24 / 4)
    assert m.features_time(StepFeatures(0, 0, 0)) == 0.0
    with pytest.raises(ValueError, match="per_seq_s"):
        LatencyModel(0.1, 0.1, -1.0, 0.0)
    with pytest.raises(ValueError, match="speedup"):
        LatencyModel(**COEFFS, speedup=0)


def test_step_features_from_scheduler_output() -> None:
    eng = _engine(SimRunner())
    for rid, n in (("a", 20), ("b", 10)):
        eng.add_request(eng.make_request(rid, list(range(n)), SamplingParams(max_tokens=3)))
    first = eng.step().scheduler_output
    second = eng.step().scheduler_output
    assert first is not None and second is not None
    assert StepFeatures.of(first) == StepFeatures(num_tokens=30, num_seqs=2, context_tokens=30)
    assert StepFeatures.of(second) == StepFeatures(num_tokens=2, num_seqs=2, context_tokens=32)


def test_latency_files(tmp_path: Path) -> None:
    data = load_latency_file()
    assert set(data["coefficients"]) >= set(COEFFS) and DEFAULT_LATENCY_FILE.is_file()
    assert LatencyModel.from_file().base_s > 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"coefficients": {"base_s": 1}}))
    with pytest.raises(ValueError, match="lacks numeric coefficients"):
        load_latency_file(bad)
    with pytest.raises(ValueError, match="cannot read"):
        load_latency_file(tmp_path / "missing.json")


def _outputs(runner: SimWorkerRunner, prompt: list[int], params: SamplingParams,
             rid: str) -> list[int]:
    eng = _engine(runner)
    eng.add_request(eng.make_request(rid, prompt, params))
    tokens: list[int] = []
    while eng.has_unfinished_requests():
        for o in eng.step().outputs:
            tokens += o.new_token_ids
    return tokens


def test_sim_tokens_depend_on_content_not_id() -> None:
    r = make_sim_runner(NO_LATENCY)
    greedy = SamplingParams(max_tokens=8, temperature=0)
    a = _outputs(r, [1, 2, 3], greedy, "x")
    assert a == _outputs(r, [1, 2, 3], greedy, "y") != _outputs(r, [1, 2, 4], greedy, "z")
    assert all(t in PRINTABLE_IDS for t in a) and len(a) == 8
    seeded = SamplingParams(max_tokens=8, seed=5)
    assert _outputs(r, [1], seeded, "p") == _outputs(r, [1], seeded, "q")
    assert _outputs(r, [1], SamplingParams(max_tokens=8), "p") != \
        _outputs(r, [1], SamplingParams(max_tokens=8), "q")


def test_sim_logprobs() -> None:
    eng = _engine(make_sim_runner(NO_LATENCY))
    eng.add_request(eng.make_request("r", [5, 6], SamplingParams(max_tokens=2, logprobs=3)))
    out = eng.step().outputs[0]
    (lp,) = out.new_logprobs or []
    assert lp.token_id == out.new_token_ids[0] and lp.top_token_ids[0] == lp.token_id
    assert len(lp.top_logprobs) == 3 and lp.top_logprobs == sorted(lp.top_logprobs,
                                                                    reverse=True)


def _serve_and_trace(tmp_path: Path, speedup: float) -> list[dict[str, object]]:
    latency = tmp_path / "latency.json"
    latency.write_text(json.dumps({"coefficients": COEFFS}))
    trace = tmp_path / f"trace{speedup}.jsonl"
    args = ["--model", "sim", "--sim-latency-file", str(latency), "--sim-speedup",
            str(speedup), "--trace-file", str(trace), "--max-num-batched-tokens", "32",
            "--max-num-seqs", "4"]
    with ServeProcess(args, tmp_path / f"serve{speedup}.log").start() as srv:
        r = httpx.post(srv.url + "/v1/completions",
                       json={"prompt": list(range(3000, 3040)), "max_tokens": 3}, timeout=60)
        assert r.status_code == 200
    return [json.loads(line) for line in trace.read_text().splitlines()]


@pytest.mark.processes
@pytest.mark.parametrize("speedup", [4.0, 20.0])
def test_step_times_follow_latency_file_and_speedup(tmp_path: Path, speedup: float) -> None:
    records = _serve_and_trace(tmp_path, speedup)
    model = LatencyModel(**COEFFS, speedup=speedup)
    # a 40-token prompt in 32-token chunks: chunk, chunk + first token, then 2 decodes
    assert [r["total_tokens"] for r in records] == [32, 8, 1, 1]
    for rec in records:
        work = rec["scheduled"].values()  # type: ignore[attr-defined]
        f = StepFeatures(num_tokens=rec["total_tokens"],  # type: ignore[arg-type]
                         num_seqs=len(work),
                         context_tokens=sum(w["num_computed_before"] + w["tokens"]
                                            for w in work))
        modelled = model.features_time(f)
        # at least the modelled time, and less than the unsped model's (at least 0.15 s
        # more: a margin a loaded machine's late wake-ups stay within)
        assert modelled <= rec["duration_s"], (rec, modelled)  # type: ignore[operator]
        assert rec["duration_s"] < LatencyModel(**COEFFS).features_time(f)  # type: ignore
