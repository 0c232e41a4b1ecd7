"""`kvloop bench` and `kvloop trace` against a real `kvloop serve --model sim` process, with
the benchmark's default token ids (the simulator speaks SmolLM2's vocabulary)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvloop.bench import workloads as w
from kvloop.bench.driver import BenchConfig, run_bench_sync
from kvloop.bench.report import summarize
from kvloop.front.launcher import ServeProcess
from kvloop.viz.png import render_png
from kvloop.viz.schedule import load_schedule

pytestmark = pytest.mark.processes   # a real `kvloop serve` for the module


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, Path]]:
    tmp = tmp_path_factory.mktemp("bench_sim")
    trace = tmp / "steps.jsonl"
    srv = ServeProcess(["--model", "sim", "--sim-speedup", "100", "--trace-file", str(trace)],
                       tmp / "serve.log")
    with srv.start():
        yield srv, trace


def test_shared_prefix_cache_share_from_a_real_server(sim) -> None:
    srv, trace = sim
    wl = w.shared_prefix_workload(num_groups=2, prefix_len=64, suffix_len=16, output_len=4,
                                  num_requests=6, seed=0)
    run = run_bench_sync(wl, BenchConfig(srv.url, concurrency=1, progress=False))
    s = summarize(run)
    assert (s["completed"], s["failed"]) == (6, 0), s["errors"]
    # 2 first requests miss; 4 reuse their group's 64-token prefix (4 full blocks)
    assert s["cached_tokens"] == 256
    assert s["cache_share"] == pytest.approx(256 / 480)
    assert s["output_tokens"] == 24 and run.stand_in_answers == 0
    assert all(r.ttft is not None and r.ttft > 0 for r in run.results)
    # the server's own record of those steps draws as one row per request
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    data = load_schedule(str(trace))
    assert len(data.request_ids) == 6 and len(data.columns) == len(records)
    assert data.summary()["prefix_hit_tokens"] == 256
    info = render_png(data, str(trace.with_suffix(".png")))
    assert (info.num_rows, info.num_cols) == (6, len(records))


def test_multi_turn_resends_real_answers_to_a_real_server(sim) -> None:
    srv, _ = sim
    wl = w.multi_turn_workload(num_conversations=2, num_turns=2, first_len=40, turn_len=8,
                               output_len=24, seed=1)
    run = run_bench_sync(wl, BenchConfig(srv.url, concurrency=2, progress=False))
    assert all(r.ok for r in run.results) and run.stand_in_answers == 0
    second = [r for r in run.results if r.turn == 1]
    # 40 prompt + 23 computed answer tokens -> 3 full blocks of the conversation are cached
    assert [r.cached_tokens for r in second] == [48, 48]
