"""`kvloop replay` on vLLM's conformance traces equals vLLM's own step logs, plus traces of
our own that exercise other configurations (checked for invariants and self-consistency)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvloop.sim.replay import dump_steplog, replay

from .conftest import CONFORMANCE

TRACES = sorted((CONFORMANCE / "traces").glob("*.json"))


COMPARE_OPTS = argparse.Namespace(no_events=False, no_free_blocks=False, ignore_order=False,
                                  first=False)


@pytest.fixture(scope="module")
def comparer() -> ModuleType:
    """The shipped step-log comparer, loaded once and called in-process."""
    spec = importlib.util.spec_from_file_location("compare_steplogs",
                                                  CONFORMANCE / "compare_steplogs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _differences(comparer: ModuleType, expected: Path, trace: Path) -> list[str]:
    actual = json.loads(dump_steplog(replay(json.loads(trace.read_text()))))
    return list(comparer.compare(json.loads(expected.read_text()), actual, COMPARE_OPTS))


@pytest.mark.parametrize("trace", TRACES, ids=lambda p: p.stem)
def test_replay_matches_vllm(trace, comparer, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert _differences(comparer, CONFORMANCE / "expected" / trace.name, trace) == []


@pytest.mark.processes
def test_replay_cli_and_comparer_cli(tmp_path):
    """`kvloop replay` writes the step log the comparer's own command line calls equal."""
    trace, out = TRACES[0], tmp_path / TRACES[0].name
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONHASHSEED"}
    subprocess.run([sys.executable, "-m", "kvloop", "replay", str(trace), "--out", str(out)],
                   check=True, env=env)
    res = subprocess.run([sys.executable, str(CONFORMANCE / "compare_steplogs.py"),
                          str(CONFORMANCE / "expected" / trace.name), str(out)],
                         capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip().endswith("equal"), res.stdout


def _trace(config, requests):
    return {"name": "t", "config": config, "requests": requests}


def test_priority_trace_preempts_lowest_priority():
    reqs = [{"id": "lo", "arrival_step": 0, "prompt_token_ids": list(range(30)),
             "max_tokens": 20, "priority": 5},
            {"id": "hi", "arrival_step": 1, "prompt_token_ids": list(range(100, 132)),
             "max_tokens": 20, "priority": 0}]
    doc = replay(_trace({"num_gpu_blocks": 6, "policy": "priority",
                         "max_num_batched_tokens": 64}, reqs))
    assert doc["requests"]["lo"]["num_preemptions"] >= 1
    assert doc["requests"]["hi"]["num_preemptions"] == 0
    assert all(r["finish_reason"] == "length" for r in doc["requests"].values())


def test_watermark_delays_admission():
    reqs = [{"id": str(i), "arrival_step": 0, "prompt_token_ids": [i] * 40, "max_tokens": 4}
            for i in range(3)]
    plain = replay(_trace({"num_gpu_blocks": 12}, reqs))
    marked = replay(_trace({"num_gpu_blocks": 12, "watermark": 0.5}, reqs))
    admitted_step0 = [len(d["steps"][0]["admitted"]) for d in (plain, marked)]
    assert admitted_step0[0] > admitted_step0[1]


def test_dump_is_valid_json_and_cache_off_has_no_events():
    reqs = [{"id": "a", "prompt_token_ids": list(range(40)), "max_tokens": 3},
            {"id": "b", "prompt_token_ids": list(range(40)), "max_tokens": 3}]
    doc = replay(_trace({"enable_prefix_caching": False}, reqs))
    parsed = json.loads(dump_steplog(doc))
    assert parsed["num_steps"] == len(parsed["steps"])
    assert all(not s.get("kv_events") for s in parsed["steps"])
    assert all(a["prefix_hit_tokens"] == 0 for s in parsed["steps"]
               for a in s.get("admitted", []))


ORACLE = sorted((CONFORMANCE / "oracle" / "traces").glob("*.json"))


@pytest.mark.parametrize("trace", ORACLE, ids=lambda p: p.stem)
def test_random_traces_match_vllm(trace, comparer, monkeypatch):
    """Random traces (policies, pools, budgets, thresholds, watermark, chunking off, small
    max_model_len, EOS and stop ids) whose expected logs came from vLLM 0.33's scheduler."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert _differences(comparer, CONFORMANCE / "oracle" / "expected" / trace.name, trace) == []
