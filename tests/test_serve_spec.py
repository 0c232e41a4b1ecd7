"""`kvloop serve --speculative-config` on the simulator, n-gram and suffix: drafts proposed
and verified in the engine process, vLLM's counters on /metrics and its "SpecDecoding
metrics" log line, each response's own acceptance summary (`--per-request-spec-decode-metrics
summary`), draft tokens in the step trace, and the flag's errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvloop.config import SpeculativeConfig
from kvloop.front.launcher import ServeProcess
from kvloop.front.prometheus_text import metric_value
from kvloop.server import cli_args

from .conftest import post, serving, sse_events, wait_until
from .test_serve_cli import run_serve, serve_args

SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}'
SUFFIX = '{"method": "suffix", "num_speculative_tokens": 3}'
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
            "--max-model-len", "512", "--debug-check-invariants", "--trace-file", str(trace),
            "--per-request-spec-decode-metrics", "summary"],
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
    own = [r["metrics"]["speculative_decoding"] for r in (first, again)]
    assert [sum(o[key] for o in own) for key in (
        "num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens")] == [
            drafts, drafted, accepted]                 # the two requests are all there was
    for o in own:
        assert o["num_spec_tokens"] == 3 and len(o["acceptance_histogram"]) == 4
        assert sum(o["acceptance_histogram"]) == o["num_spec_steps"]
        assert [sum(col) for col in zip(*[row + [0] * (4 - len(row)) for row in o[
            "acceptance_histogram_by_draft_length"].values()], strict=True)] == \
            o["acceptance_histogram"]
        assert sum(j * n for j, n in enumerate(o["acceptance_histogram"])) == \
            o["num_accepted_draft_tokens"]
        assert o["mean_acceptance_length"] == 1 + o["num_accepted_draft_tokens"] / o[
            "num_spec_steps"]
    assert per_pos == sorted(per_pos, reverse=True) and sum(per_pos) == accepted
    wait_until(lambda: "SpecDecoding metrics: Mean acceptance length: " in server.log(), 10,
               "the SpecDecoding log line")
    works = [w for line in trace.read_text().splitlines()
             for w in json.loads(line)["scheduled"].values() if w["kind"] == "spec"]
    assert works and all(w["tokens"] == 1 + w["draft_tokens"] for w in works)
    assert sum(w["draft_tokens"] for w in works) == drafted


@pytest.mark.processes
def test_suffix_drafts_are_verified_and_counted(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A chat in an agent loop: the second turn's answer repeats the first's (greedy, the
    same question), drafted from the global tree; each answer reports its own figure."""
    import httpx

    with serving(tmp_path_factory, "serve_suffix", [
            "--model", "sim", "--sim-speedup", "50", "--speculative-config", SUFFIX,
            "--num-gpu-blocks-override", "128", "--max-model-len", "512",
            "--debug-check-invariants", "--per-request-spec-decode-metrics", "summary"]) as srv:
        body = {"model": "sim", "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": 40, "temperature": 0}
        first = post(srv, "/v1/chat/completions", body).json()
        again = post(srv, "/v1/chat/completions", body).json()
        assert again["choices"][0]["message"] == first["choices"][0]["message"]
        own = [r["metrics"]["speculative_decoding"] for r in (first, again)]
        assert own[1]["num_accepted_draft_tokens"] > own[0]["num_accepted_draft_tokens"]
        assert own[1]["num_spec_steps"] < 40 / 2      # most of its tokens came as drafts
        drafts, drafted, accepted, _ = counters(srv)
        assert (drafts, drafted, accepted) == tuple(
            sum(o[key] for o in own) for key in (
                "num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens"))
        assert "speculative decoding on: suffix, up to 3 draft tokens per step" in srv.log()
        n2 = post(srv, "/v1/chat/completions", {**body, "n": 2}).json()
        assert n2["metrics"] == {"speculative_decoding": None}     # vLLM's: n = 1 only
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=stream,
                          timeout=60) as r:
            events = sse_events(list(r.iter_lines()))
        assert events[-1] == "[DONE]" and events[-2]["choices"] == []
        streamed = events[-2]["metrics"]["speculative_decoding"]     # on the usage chunk
        assert streamed["num_spec_tokens"] == 3 and streamed["num_draft_tokens"] > 0
        assert all("metrics" not in e for e in events[:-2])


def test_the_flag_reaches_the_engine_config() -> None:
    cfg = cli_args.engine_config(serve_args("sim", "--speculative-config", SPEC))
    assert cfg.speculative == SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2,
                                                prompt_lookup_max=2)
    assert cli_args.engine_config(serve_args("sim")).speculative is None
    cfg = cli_args.engine_config(serve_args("sim", "--speculative-config", SUFFIX))
    assert cfg.speculative == SpeculativeConfig(num_speculative_tokens=3, method="suffix")


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
