"""`kvloop serve --speculative-config` on the simulator: drafts proposed and verified in the
engine process, vLLM's counters on /metrics and its "SpecDecoding metrics" log line, draft
tokens in the step trace, and the flag's errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvloop.config import SpeculativeConfig
from kvloop.front.launcher import ServeProcess
from kvloop.front.prometheus_text import metric_value
from kvloop.server import cli_args

from .conftest import post, serving, wait_until
from .test_serve_cli import run_serve, serve_args

SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}'
PROMPT = ("the quick brown fox jumps over the lazy dog while a small cat lies in the warm sun. "
          "the quick brown fox jumps over the lazy dog while a small cat")


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("spec_trace") / "steps.jsonl"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, trace: Path) -> Iterator[ServeProcess]:
    with serving(tmp_path_factory, "serve_spec", [
            "--model", "sim", "--sim-speedup", "50", "--sim-copy-rate", "1.0",
            "--speculative-config", SPEC, "--num-gpu-blocks-override", "128",
            "--max-model-len", "512", "--debug-check-invariants", "--trace-file", str(trace)],
            env={"VLLM_LOG_STATS_INTERVAL": "0.3"}) as srv:
        yield srv


def counters(srv: ServeProcess) -> tuple[float, float, float, list[float]]:
    import httpx

    text = httpx.get(srv.url + "/metrics", timeout=10).text
    labels = {"model_name": "sim", "engine": "0"}
    per_pos = [metric_value(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                            **labels, position=str(i)) for i in range(3)]
    return (metric_value(text, "vllm:spec_decode_num_drafts_total", **labels),
            metric_value(text, "vllm:spec_decode_num_draft_tokens_total", **labels),
            metric_value(text, "vllm:spec_decode_num_accepted_tokens_total", **labels), per_pos)


@pytest.mark.processes
def test_drafts_are_verified_and_counted(server: ServeProcess, trace: Path) -> None:
    body = {"model": "sim", "prompt": PROMPT, "max_tokens": 30, "temperature": 0}
    first = post(server, "/v1/completions", body).json()
    assert first["usage"]["completion_tokens"] == 30
    again = post(server, "/v1/completions", body).json()
    assert again["choices"][0]["text"] == first["choices"][0]["text"]   # greedy: same text
    drafts, drafted, accepted, per_pos = counters(server)
    assert drafts > 0 and 0 < accepted <= drafted <= 3 * drafts
    assert per_pos == sorted(per_pos, reverse=True) and sum(per_pos) == accepted
    wait_until(lambda: "SpecDecoding metrics: Mean acceptance length: " in server.log(), 10,
               "the SpecDecoding log line")
    works = [w for line in trace.read_text().splitlines()
             for w in json.loads(line)["scheduled"].values() if w["kind"] == "spec"]
    assert works and all(w["tokens"] == 1 + w["draft_tokens"] for w in works)
    assert sum(w["draft_tokens"] for w in works) == drafted


def test_the_flag_reaches_the_engine_config() -> None:
    cfg = cli_args.engine_config(serve_args("sim", "--speculative-config", SPEC))
    assert cfg.speculative == SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2,
                                                prompt_lookup_max=2)
    assert cli_args.engine_config(serve_args("sim")).speculative is None


@pytest.mark.processes
@pytest.mark.parametrize(("spec", "message"), [
    ('{"method": "eagle", "num_speculative_tokens": 2}',
     "speculative method 'eagle' is not supported; kvloop supports: ngram"),
    ("ngram", "--speculative-config is not JSON"),
])
def test_a_bad_flag_is_one_line_exit_2(spec: str, message: str) -> None:
    r = run_serve("sim", "--speculative-config", spec, "--port", "0")
    lines = (r.stdout + r.stderr).splitlines()
    assert r.returncode == 2 and len(lines) == 1 and message in lines[0], lines
