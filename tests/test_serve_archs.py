"""`kvloop serve DIR` on a tiny Qwen3 folder and a tiny Qwen3-MoE folder: a completion
equals transformers' greedy tokens, and /metrics exposes the same `vllm:` families for the
mixture of experts as for the dense model (experts add no metric and change none); behind
the router, a Qwen3-MoE worker's reported prefix hits are the ones the router predicted."""

from __future__ import annotations

import re
from typing import Any

import httpx
import numpy as np
import pytest

from tests.arch_helpers import arch_model, reference_greedy, write_arch_folder
from tests.test_model_tiny import TINY_VOCAB

from .conftest import serving

pytestmark = pytest.mark.processes


def _serve_and_complete(tmp_path_factory: pytest.TempPathFactory, arch: str,
                        hf: Any = None, prompt_len: int = 9) -> set[str]:
    """Serve a tiny `arch` folder (`hf`, or arch_helpers' model of `arch`), check one greedy
    completion of a `prompt_len`-token prompt; -> its vllm: families."""
    hf = arch_model(arch, seed=9) if hf is None else hf
    folder = write_arch_folder(hf, tmp_path_factory.mktemp(arch) / arch)
    prompt = np.random.default_rng(3).integers(3, TINY_VOCAB, prompt_len).tolist()
    expected, _ = reference_greedy(hf, prompt, 5)
    with serving(tmp_path_factory, f"serve_{arch}", [
            "--model", str(folder), "--dtype", "float32", "--device", "cpu",
            "--num-threads", "1", "--block-size", "4", "--num-gpu-blocks-override", "64"],
            timeout_s=120) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={
            "model": arch, "prompt": prompt, "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == expected
        assert choice["finish_reason"] == "length"
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
    return set(re.findall(r"^# TYPE (vllm:\w+)", metrics, flags=re.MULTILINE))


def test_serve_answers_for_qwen3_and_qwen3_moe_with_the_same_metrics(tmp_path_factory):
    dense = _serve_and_complete(tmp_path_factory, "qwen3")
    moe = _serve_and_complete(tmp_path_factory, "qwen3moe")
    assert "vllm:generation_tokens" in dense or "vllm:generation_tokens_total" in dense, dense
    assert len(dense) > 10 and moe == dense


def test_serve_answers_for_phi3_and_a_sliding_window_gemma3(tmp_path_factory):
    """Phi-3 (fused rows, LongRoPE) and Gemma 3 (sliding-window and global layers: two
    KV-cache groups, a 20-token prompt past its 8-token window) through `kvloop serve DIR`."""
    from tests.test_model_sliding import tiny_sliding_model

    assert _serve_and_complete(tmp_path_factory, "phi3")
    assert _serve_and_complete(tmp_path_factory, "gemma3",
                               hf=tiny_sliding_model("gemma3", seed=9), prompt_len=20)


def test_the_router_predicts_the_hits_a_qwen3_moe_worker_reports(tmp_path):
    """A mixture of experts changes nothing the router sees: in front of a real Qwen3-MoE
    worker, a repeated prompt's predicted cached tokens equal the worker's reported ones."""
    from kvloop.front.prometheus_text import metric_value
    from kvloop.router.fleet import Fleet, FleetConfig

    from .conftest import RouterThread, wait_until
    from .test_router_fleet import ADMIN_KEY, router_config

    series = ("kvloop_router_predicted_hit_tokens_total",
              "kvloop_router_actual_hit_tokens_total")
    folder = write_arch_folder(arch_model("qwen3moe", seed=5), tmp_path / "moe")
    fleet = Fleet(FleetConfig(1, str(folder), ("both",), (
        "--dtype", "float32", "--device", "cpu", "--num-threads", "1", "--block-size", "4",
        "--num-gpu-blocks-override", "64", "--admin-api-key", ADMIN_KEY),
        start_timeout_s=120, echo_output=False))
    fleet.start()
    try:
        with RouterThread(router_config(), fleet.specs()) as rt:
            wait_until(lambda: all(w.description is not None
                                   for w in rt.router.registry.all()), 30, "the worker")
            prompt = np.random.default_rng(8).integers(3, TINY_VOCAB, 18).tolist()
            hits = []
            for _ in range(2):
                before = httpx.get(rt.url + "/metrics", timeout=30).text
                r = httpx.post(rt.url + "/v1/completions", json={
                    "model": "moe", "prompt": prompt, "max_tokens": 2, "ignore_eos": True},
                    timeout=60)
                assert r.status_code == 200, r.text
                cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                after = httpx.get(rt.url + "/metrics", timeout=30).text
                predicted, actual = (metric_value(after, n) - metric_value(before, n)
                                     for n in series)
                assert predicted == actual == cached
                hits.append(cached)
            assert hits == [0, 16]               # the repeat hits its 4 full blocks of 4
    finally:
        fleet.stop()


def test_another_architecture_is_a_one_line_start_up_error(tmp_path):
    """`kvloop serve` on a folder of an architecture kvloop does not run: one line naming
    what it runs, exit code 2, before the engine process starts."""
    import json

    from .test_serve_cli import run_serve

    folder = write_arch_folder(arch_model("qwen3"), tmp_path / "neox")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox")
    (folder / "config.json").write_text(json.dumps(cfg))
    r = run_serve(str(folder), "--port", "0", "--device", "cpu")
    lines = (r.stdout + r.stderr).splitlines()
    assert r.returncode == 2, lines
    assert len(lines) == 1 and " ERROR api[" in lines[0], lines
    assert "unsupported model: architectures=['GPTNeoXForCausalLM']" in lines[0]
    assert "Qwen3MoeForCausalLM" in lines[0] and "GGUF llama" in lines[0]
