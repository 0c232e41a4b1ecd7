"""`python -m kvloop.bench.spec`, as a smoke test with tiny numbers on a tiny random model
(the figures themselves are for a quiet machine: docs/benchmarking.md)."""

from __future__ import annotations

import json

import pytest

from kvloop.bench import spec
from tests.test_model_tiny import tiny_hf_model, write_tiny_gguf


@pytest.mark.slow   # runs the benchmark
def test_the_benchmark_runs_every_case_and_reports_them(tmp_path, capsys) -> None:
    model = write_tiny_gguf(tiny_hf_model(seed=21), tmp_path / "t.gguf")
    out = tmp_path / "spec.json"
    spec.main(["--model", str(model), "--dtype", "float32", "--threads", "1", "--ks", "0,2",
               "--concurrency", "1,2", "--num-requests", "2", "--output-len", "4",
               "--input-len", "8", "--num-gpu-blocks-override", "64", "--json", str(out)])
    text = capsys.readouterr().out
    assert "workload" in text and text.count("\ncopy ") == 6 and text.count("\nrandom ") == 6
    assert text.count("\nchat ") == 6
    results = json.loads(out.read_text())["results"]
    assert [(r["workload"], r["concurrency"], r["method"], r["k"]) for r in results] == [
        (w, c, m, k) for w in ("copy", "chat", "random") for c in (1, 2)
        for m, k in (("-", 0), ("ngram", 2), ("suffix", 2))]
    for r in results:
        assert r["output_tokens"] == 8 and r["same_as_k0"] is True
        assert 0 <= r["accepted"] <= r["drafted"]
        assert r["passes"] == r["output_tokens"] - r["accepted"]
        assert r["k"] or r["drafted"] == 0


def test_bad_arguments_are_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        spec.parse_args(["--workloads", "copy,other"])
    assert "--workloads takes copy, chat, random" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        spec.parse_args(["--methods", "ngram,eagle"])
    assert "--methods takes ngram, suffix" in capsys.readouterr().err
