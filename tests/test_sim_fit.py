"""`kvloop.bench.latency_fit` recovers the coefficients of a runner whose step times are known: the
simulated runner driven by a latency model (the real model is measured the same way)."""

from __future__ import annotations

import pytest

from kvloop.bench.latency_fit import aggregate, fit, measure, quality
from kvloop.sim.latency import LatencyModel, StepFeatures
from kvloop.sim.worker import SimWorkerRunner

TRUE = {"base_s": 0.006, "per_token_s": 4e-5, "per_seq_s": 3e-4, "per_ctx_token_s": 2e-6}


def test_fit_exact_on_noiseless_samples() -> None:
    feats = [StepFeatures(t, s, c) for t in (1, 8, 64, 512) for s in (1, 4) for c in (10, 900)]
    samples = [(f, LatencyModel(**TRUE).features_time(f)) for f in feats]
    got = fit(samples)
    for k, v in TRUE.items():
        assert got[k] == pytest.approx(v, rel=1e-6)
    assert quality(samples, got)["r2"] == pytest.approx(1.0)


def test_fit_clips_negative_coefficients() -> None:
    samples = [(StepFeatures(t, 1, t), 0.01 - 1e-6 * t) for t in (1, 100, 400)]
    assert all(v >= 0 for v in fit(samples).values())


def test_aggregate_takes_medians() -> None:
    f, g = StepFeatures(1, 1, 1), StepFeatures(2, 1, 2)
    assert sorted(aggregate([(f, 1.0), (g, 5.0), (f, 9.0), (f, 2.0)]),
                  key=lambda s: s[1]) == [(f, 2.0), (g, 5.0)]


@pytest.mark.slow   # times real steps
def test_measure_and_fit_a_timed_runner() -> None:
    """Sleep-based step times on a shared machine: loose bounds, but a broken measurement
    (wrong features, wrong timing) or fit lands far outside them."""
    runner = SimWorkerRunner(LatencyModel(**TRUE), num_gpu_blocks=1024, max_model_len=1024)
    samples = measure(runner, repeats=1)
    assert len(samples) > 80
    got = fit(aggregate(samples))
    assert quality(samples, got)["median_abs_rel_error"] < 0.3
    assert got["per_token_s"] == pytest.approx(TRUE["per_token_s"], rel=0.5)
    one_decode = LatencyModel(**got).features_time(StepFeatures(1, 1, 100))
    assert one_decode == pytest.approx(LatencyModel(**TRUE).features_time(
        StepFeatures(1, 1, 100)), rel=0.3)
