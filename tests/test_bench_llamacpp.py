"""`python -m kvloop.bench.llamacpp`: its parsing, medians, run order, table and process-group
stopping. Nothing here builds or needs llama.cpp."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import pytest

from kvloop.bench import llamacpp as lc
from kvloop.bench import offline
from kvloop.front.launcher import UrlProcess, group_members

# The output of `llama-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -p 512 -n 128 -t 2 -r 1 -o json`
# as built by `python -m kvloop.bench.llamacpp build` (commit 0c1e570), on a busy machine,
# trimmed to the fields the parser reads and a few more of the 44 of each test.
LLAMA_BENCH_JSON = """[
  {"build_commit": "0c1e570", "build_number": 1, "cpu_info": "AMD EPYC",
   "model_type": "llama 256M Q4_1", "n_threads": 2, "type_k": "f16", "n_prompt": 512,
   "n_gen": 0, "avg_ns": 3856961994, "avg_ts": 132.746965, "stddev_ts": 0.0,
   "samples_ts": [132.747]},
  {"build_commit": "0c1e570", "build_number": 1, "cpu_info": "AMD EPYC",
   "model_type": "llama 256M Q4_1", "n_threads": 2, "type_k": "f16", "n_prompt": 0,
   "n_gen": 128, "avg_ns": 20446307580, "avg_ts": 6.260299, "stddev_ts": 0.0,
   "samples_ts": [6.2603]}
]"""


def test_llama_bench_json_gives_prefill_and_decode() -> None:
    got = lc.parse_llama_bench(LLAMA_BENCH_JSON)
    assert got["figures"] == {"prefill tok/s": 132.746965, "decode tok/s": 6.260299}
    assert got["build_commit"] == "0c1e570" and got["n_threads"] == 2


def test_llama_bench_json_without_both_tests_is_an_error() -> None:
    only_pp = json.dumps([t for t in json.loads(LLAMA_BENCH_JSON) if t["n_gen"] == 0])
    with pytest.raises(ValueError, match="one prompt test and one generation test"):
        lc.parse_llama_bench(only_pp)


def test_offline_json_round_trips_into_the_engine_figures(tmp_path: Path) -> None:
    args = argparse.Namespace(prefill_len=512, decode_tokens=128, repeats=1)
    out = tmp_path / "offline.json"
    offline.write_json(str(out), args, {"model": "m", "threads": 2},
                       [offline.Figures(prefill=900.0, decode=150.0, throughput=None)])
    got = lc.parse_offline(json.loads(out.read_text()))
    assert got["figures"] == {"prefill tok/s": 900.0, "decode tok/s": 150.0}
    assert got["setup"] == {"model": "m", "threads": 2, "prefill_len": 512,
                            "decode_tokens": 128, "repeats": 1}


def test_runs_alternate_between_the_servers_rep_by_rep() -> None:
    a, b = lc.Case("a", "A", ()), lc.Case("b", "B", ())
    assert [(rep, c.key, s) for rep, c, s in lc.alternate(2, [a, b])] == [
        (0, "a", "kvloop"), (0, "a", "llama.cpp"), (0, "b", "kvloop"), (0, "b", "llama.cpp"),
        (1, "a", "kvloop"), (1, "a", "llama.cpp"), (1, "b", "kvloop"), (1, "b", "llama.cpp")]


def _record(case: str, rep: int, server: str, **figures: float | None) -> lc.Record:
    return lc.Record("serving", case, rep, server, (1.0, 2.0, 3.0), dict(figures))


def test_medians_per_case_server_and_figure_skip_missing_values() -> None:
    records = [_record("c", 0, "kvloop", tps=10.0, ttft=None),
               _record("c", 1, "kvloop", tps=30.0, ttft=5.0),
               _record("c", 2, "kvloop", tps=20.0, ttft=7.0),
               _record("c", 0, "llama.cpp", tps=4.0, ttft=None)]
    assert lc.medians(records) == {"c": {"kvloop": {"tps": 20.0, "ttft": 6.0},
                                         "llama.cpp": {"tps": 4.0, "ttft": None}}}


def test_measured_notes_the_load_before_each_run_in_run_order() -> None:
    settings = lc.Settings(build_dir=Path("/nonexistent"), repeats=2)
    seen = []

    def run_one(rep: int, case: lc.Case, server: str) -> dict:
        seen.append((rep, case.key, server))
        return {"figures": {"x": float(len(seen))}, "note": server}

    recs = lc.measured(settings, run_one, [lc.ENGINE_CASE], "engine")
    assert [(r.rep, r.server, r.figures["x"], r.detail) for r in recs] == [
        (0, "kvloop", 1.0, {"note": "kvloop"}), (0, "llama.cpp", 2.0, {"note": "llama.cpp"}),
        (1, "kvloop", 3.0, {"note": "kvloop"}), (1, "llama.cpp", 4.0, {"note": "llama.cpp"})]
    assert all(len(r.load_avg) == 3 and r.phase == "engine" for r in recs)


def test_table_of_fixed_figures_has_ratios_targets_and_verdicts() -> None:
    meds = {
        "random c=1": {"kvloop": {"output tok/s": 80.0, "TPOT p50 ms": 8.0},
                       "llama.cpp": {"output tok/s": 60.0, "TPOT p50 ms": 16.0}},
        "random c=8": {"kvloop": {"output tok/s": 300.0, "TTFT p50 ms": 1000.0},
                       "llama.cpp": {"output tok/s": 100.0, "TTFT p50 ms": 4000.0}},
        "engine": {"kvloop": {"prefill tok/s": 1836.0, "decode tok/s": None},
                   "llama.cpp": {"prefill tok/s": 306.0, "decode tok/s": 122.0}},
    }
    titles = {"random c=1": "random 256/128 c=1", "random c=8": "random 256/128 c=8"}
    rows = lc.table_rows(meds, titles, lc.engine_lengths(quick=False))
    got = [(r["figure"], r["ratio"], r["target"], r["met"]) for r in rows]
    assert got == [
        ("random 256/128 c=1: output tok/s (build without AMX)", pytest.approx(80 / 60),
         ">= 1.25", True),
        ("random 256/128 c=8: output tok/s (build without AMX)", 3.0, ">= 3", True),
        ("random 256/128 c=8: TTFT p50 ms (build without AMX)", 0.25, "<= 0.2", False),
        ("random 256/128 c=1: TPOT p50 ms (build without AMX)", 0.5, "<= 0.8", True),
        ("engine single-stream decode tok/s (offline vs tg128, build without AMX)", None,
         ">= 1", None),
        ("engine prefill tok/s, 512 tokens (offline vs pp512, build without AMX)", 6.0,
         ">= 6", True),
    ]
    table = lc.format_table(rows).splitlines()
    assert table[0] == "| figure | kvloop | llama.cpp | ratio | target | met |"
    assert table[2] == ("| random 256/128 c=1: output tok/s (build without AMX) | 80 | 60 | "
                        "1.33 | >= 1.25 | yes |")


def test_single_stream_decode_is_held_to_the_amx_build_where_it_was_measured() -> None:
    """Issue 26: on a CPU with AMX, llama.cpp's best one-row decode is its AMX build's tg;
    the prefill and the served figures stay with the build without AMX (it serves)."""
    meds = {"engine": {"kvloop": {"prefill tok/s": 1800.0, "decode tok/s": 240.0},
                       "llama.cpp": {"prefill tok/s": 300.0, "decode tok/s": 110.0},
                       "llama.cpp AMX": {"prefill tok/s": None, "decode tok/s": 240.0}}}
    rows = lc.table_rows(meds, {}, lc.engine_lengths(quick=False))
    assert [(r["figure"], r["llama.cpp"], r["ratio"], r["met"]) for r in rows] == [
        ("engine single-stream decode tok/s (offline vs tg128, AMX build)", 240.0, 1.0, True),
        ("engine prefill tok/s, 512 tokens (offline vs pp512, build without AMX)", 300.0, 6.0,
         True)]
    amx = lc.BuildPaths(Path("/b"), amx=True)
    cmd = lc.llama_bench_cmd(amx, "m.gguf", lc.engine_lengths(quick=False), 2)
    assert cmd[:5] == ["/b/llama_cpp_python-0.3.36/vendor/llama.cpp/build-amx/bin/llama-bench",
                       "-m", "m.gguf", "-p", "0"]       # tg only: its prompt path dies
    assert not any("-mno-amx" in f for f in amx.cmake_flags) and amx.binaries == (
        "llama-bench",)
    tg_only = json.dumps([{"n_prompt": 0, "n_gen": 128, "avg_ts": 240.0}])
    assert lc.parse_llama_bench(tg_only, with_prefill=False)["figures"] == {
        "prefill tok/s": None, "decode tok/s": 240.0}
    assert list(lc.alternate(1, [lc.ENGINE_CASE], ("kvloop", "llama.cpp", "llama.cpp AMX"))
                ) == [(0, lc.ENGINE_CASE, s) for s in ("kvloop", "llama.cpp", "llama.cpp AMX")]


def test_contention_runs_quiet_then_busy_and_compares_the_shares_kept() -> None:
    seeds = [lc.contention_seed(rep, condition) for rep, condition, _ in lc.contention_order(3)]
    assert len(set(seeds)) == 6 and len(seeds) == 12   # both servers share a run's prompts
    assert list(lc.contention_order(2)) == [
        (rep, cond, server) for rep in (0, 1) for cond in ("quiet", "busy")
        for server in ("kvloop", "llama.cpp")]
    meds = {"contention quiet": {"kvloop": {"output tok/s": 100.0},
                                 "llama.cpp": {"output tok/s": 60.0}},
            "contention busy": {"kvloop": {"output tok/s": 90.0},
                                "llama.cpp": {"output tok/s": 30.0}}}
    rows = lc.contention_rows(meds)
    assert [(r["server"], r["share"], r["met"]) for r in rows] == [
        ("kvloop", 0.9, True), ("llama.cpp", 0.5, None)]
    meds["contention busy"]["kvloop"]["output tok/s"] = 40.0      # 40% < llama's 50%
    assert lc.contention_rows(meds)[0]["met"] is False
    del meds["contention busy"]["llama.cpp"]                      # llama never measured
    assert lc.contention_rows(meds)[0]["met"] is None
    table = lc.format_contention(rows).splitlines()
    assert table[2] == "| kvloop | 100 | 90 | 90% | yes |"
    case = lc.contention_case(quick=False)
    assert case.bench_args[:6] == ("--workload", "random", "--num-requests", "16",
                                   "--concurrency", "8")


@pytest.mark.processes
def test_the_busy_core_is_a_process_that_ends_with_the_block() -> None:
    with lc.busy_core() as proc:
        assert proc.args[-1] == lc.SPIN_LOOP and proc.poll() is None
    assert proc.poll() is not None


def test_load_table_lists_every_run() -> None:
    text = lc.format_loads([_record("random c=1", 0, "kvloop", tps=1.0)])
    assert text.splitlines()[2] == "| serving | 1 | random c=1 | kvloop | 1.00 | 2.00 | 3.00 |"


@pytest.mark.parametrize("quick", [False, True])
def test_every_case_parses_as_kvloop_bench_arguments(quick: bool) -> None:
    from kvloop.bench.cli_args import build_workload

    cases = lc.serving_cases(quick, scale=0.5)
    assert [c.key for c in cases] == ["random c=1", "random c=8", "random c=32",
                                      "shared-prefix c=16", "multi-turn c=4"]
    assert {r.case for r in lc.ROWS} - {"engine"} == {c.key for c in cases}
    for case in cases:
        ns = lc.bench_namespace(case, seed=7)
        assert ns.seed == 7 and ns.concurrency == int(case.key.split("c=")[1])
        assert build_workload(ns).num_requests >= 1
    full = {c.key: lc.bench_namespace(c, 0) for c in lc.serving_cases(False)}
    assert (full["random c=32"].num_requests, full["random c=32"].input_len,
            full["random c=32"].output_len) == (64, 256, 128)
    sp = full["shared-prefix c=16"]
    assert (sp.num_groups, sp.prefix_len, sp.suffix_len, sp.output_len) == (8, 1024, 64, 64)
    mt = full["multi-turn c=4"]
    assert (mt.num_requests, mt.num_turns, mt.input_len, mt.turn_len, mt.output_len) == (
        16, 4, 256, 64, 64)


def test_settings_refuse_what_cannot_run() -> None:
    with pytest.raises(ValueError, match="repeats"):
        lc.Settings(build_dir=Path("x"), repeats=0)
    with pytest.raises(ValueError, match=r"\.gguf"):
        lc.Settings(build_dir=Path("x"), model="/models/some-hf-folder")
    quick = lc.settings_from(lc.parse_args(["run", "--quick", "--repeats", "5"]))
    assert quick.repeats == 1 and quick.warmup == 1 and quick.quick


def test_the_commit_is_read_from_the_vendored_submodule(tmp_path: Path) -> None:
    paths = lc.BuildPaths(tmp_path)
    gitdir = tmp_path / f"llama_cpp_python-{lc.LLAMA_CPP_PYTHON}" / ".git" / "modules" / "v"
    gitdir.mkdir(parents=True)
    (gitdir / "HEAD").write_text("0c1e57098bba43ac29e6e3b677cdceebdd22334f\n")
    paths.source.mkdir(parents=True)
    (paths.source / ".git").write_text("gitdir: ../../.git/modules/v\n")
    assert lc.vendored_commit(paths.source) == "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
    assert not paths.built()


def test_binaries_built_with_other_flags_are_rebuilt(tmp_path: Path) -> None:
    """`built` only when the binaries exist and `cmake-flags.txt` holds today's
    CMAKE_FLAGS (which turn llama.cpp's AMX kernels off: they die of SIGILL here)."""
    paths = lc.BuildPaths(tmp_path)
    paths.bin_dir.mkdir(parents=True)
    for name in lc.BINARIES:
        paths.binary(name).write_text("")
    assert not paths.built()                         # no record of the flags: an old build
    paths.flags_file.write_text("-DGGML_NATIVE=ON")
    assert not paths.built()
    paths.flags_file.write_text("\n".join(lc.CMAKE_FLAGS))
    assert paths.built()
    assert any("-mno-amx-tile" in f for f in lc.CMAKE_FLAGS)


# A "server" that announces a URL, then starts a child that ignores SIGTERM.
_STUBBORN = ("import subprocess, sys, time\n"
             "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
             "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); "
             "time.sleep(60)'], stdout=subprocess.PIPE)\n"
             "child.stdout.readline()\n"   # it ignores SIGTERM from here on
             "print('listening on http://127.0.0.1:1', flush=True)\n"
             "time.sleep(60)\n")


@pytest.mark.processes
def test_stop_group_terms_then_kills_the_whole_group(tmp_path: Path) -> None:
    proc = UrlProcess([sys.executable, "-c", _STUBBORN], tmp_path / "log",
                      lc.LLAMA_LISTENING, new_session=True, name="stubborn")
    proc.start(timeout_s=30)
    assert proc.url == "http://127.0.0.1:1"
    assert len(group_members(proc.pid)) == 2
    t0 = time.monotonic()
    lc.stop_group(proc, timeout_s=1.0)
    assert 1.0 <= time.monotonic() - t0 < 10
    assert not proc.alive()
    assert group_members(proc.pid) == []   # the SIGTERM-ignoring child is gone too
    assert proc.proc is not None and proc.proc.returncode == -signal.SIGTERM


@pytest.mark.processes
def test_one_case_runs_as_kvloop_bench_runs_it() -> None:
    from tests.test_bench_fakeserver import FakeServer

    case = lc.serving_cases(quick=True)[3]   # shared-prefix 4 x 256 + 16, 16 out, c=16
    settings = lc.Settings(build_dir=Path("x"), warmup=1)
    with FakeServer() as server:
        got = lc.bench_once(case, 5, server.url, "kvloop", settings)
    s = got["summary"]
    assert (s["completed"], s["failed"], s["output_tokens"]) == (16, 0, 16 * 16)
    assert got["expected_output_tokens"] == 256 and s["concurrency"] == 16
    assert s["workload_params"] == {"num_groups": 4, "prefix_len": 256, "suffix_len": 16,
                                    "output_len": 16, "num_requests": 16, "seed": 5}
    assert got["figures"] == {"output tok/s": s["output_throughput"],
                              "TTFT p50 ms": s["ttft_ms"]["p50"],
                              "TPOT p50 ms": s["tpot_ms"]["p50"]}
    assert len(server.prompts) == 1 + 16   # the warm-up request, then the case
