"""schemathesis against a real `kvloop serve --model sim`: every request it derives from the
published `/openapi.json` (the schema's examples, its coverage cases, then random valid and
invalid bodies, for every operation) is answered below 500, with a status code, a content
type and a body (each event of a stream too) that the schema documents for that operation;
afterwards no request, block or traceback is left behind.

schemathesis runs as its own CLI in a subprocess (its pytest integration fails on pytest 9.2:
it reads a private attribute of the test item), bounded: a fixed seed, `MAX_EXAMPLES` random
cases per operation plus the deterministic example and coverage cases, no shrinking, one
worker, and a short context (`MAX_LEN`) with a fast simulated step, so that a huge
`max_tokens` costs a few cheap tokens.
Its HAR file (every request and answer) shows what the run reached.

Checks run: no 5xx; status codes, content types, bodies and headers as documented; a method
a path does not serve gets 405 with an `Allow` naming every method it does serve. Left out,
and why: `positive_data_acceptance` (the request schema gives types and shapes, not value
ranges: `n >= 1`, `top_p` in (0, 1], `logprobs <= --max-logprobs`, `stream_options` only with
`stream`, unsupported fields such as `logit_bias`... are checked by the server with vLLM's
messages, so a schema-valid body may get a 400), `negative_data_rejection` (pydantic's lax
mode takes `0` for `false` and `"1"` for 1, as vLLM's server does), and the checks about
authentication and resources (`ignored_auth`, `use_after_free`...: no API key on this server,
nothing is created or deleted).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvloop.front.launcher import ServeProcess

from .conftest import serving

pytestmark = pytest.mark.processes   # a real `kvloop serve` for the module

BLOCKS = 64
MAX_LEN = 128
MAX_EXAMPLES = 30
SEED = 11
CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_schema_conformance", "response_headers_conformance", "unsupported_method",
          "allow_header_conformance")


@dataclass
class Run:
    """One schemathesis run: its exit code and output, its JSON report, and every
    (method, path template, status, media type) of the answers it got."""

    returncode: int
    output: str = field(repr=False)
    report: dict[str, Any] = field(repr=False)
    answers: set[tuple[str, str, int, str]] = field(repr=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with serving(tmp_path_factory, "serve_schema", [
            "--model", "sim", "--sim-speedup", "2000", "--num-gpu-blocks-override",
            str(BLOCKS), "--max-model-len", str(MAX_LEN), "--debug-check-invariants",
            "--served-model-name", "sim", "alias"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def run(server: ServeProcess, tmp_path_factory: pytest.TempPathFactory) -> Run:
    work = tmp_path_factory.mktemp("schemathesis")
    config = work / "schemathesis.toml"
    config.write_text("[cache]\nenabled = false\n")
    har, report = work / "answers.har", work / "report.json"
    cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "--no-color",
           "run", server.url + "/openapi.json", "--checks", ",".join(CHECKS),
           "--phases", "examples,coverage,fuzzing", "--max-examples", str(MAX_EXAMPLES),
           "--seed", str(SEED), "--no-shrink", "--workers", "1", "--request-timeout", "30",
           "--output-sanitize", "false",
           "--generation-database", "none", "--report", "har,json",
           "--report-har-path", str(har), "--report-json-path", str(report)]
    proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=240)
    output = proc.stdout + proc.stderr
    assert report.exists(), output
    return Run(proc.returncode, output, json.loads(report.read_text()), _answers(har))


def _answers(har: Path) -> set[tuple[str, str, int, str]]:
    seen = set()
    for entry in json.loads(har.read_text())["log"]["entries"]:
        path = re.sub(r"^https?://[^/]+", "", entry["request"]["url"]).split("?")[0]
        if path.startswith("/v1/models/"):
            path = "/v1/models/{model_id}"
        media = entry["response"]["content"].get("mimeType", "").split(";")[0]
        seen.add((entry["request"]["method"], path, entry["response"]["status"], media))
    return seen


def test_every_answer_is_the_documented_one(run: Run) -> None:
    cases = run.report["test_cases"]
    assert run.returncode == 0, run.output[-8000:]
    assert cases["with_failures"] == cases["errored"] == 0, run.output[-8000:]
    assert run.report["failures"] == run.report["errors"] == [], run.output[-8000:]
    operations = run.report["operations"]
    assert operations["tested"] == operations["total"] >= 16, operations
    assert cases["generated"] >= 40 * operations["total"], cases


def test_the_run_reached_successes_errors_and_streams(run: Run) -> None:
    """What a run that cannot fail vacuously must have seen: JSON answers and event streams
    from both generation routes, a 200 and a 404 for a model id, and the 400 of each body."""
    want = {("POST", "/v1/completions", 200, "text/event-stream"),
            ("POST", "/v1/chat/completions", 200, "text/event-stream"),
            ("GET", "/v1/models/{model_id}", 200, "application/json"),
            ("GET", "/v1/models/{model_id}", 404, "application/json"),
            ("GET", "/metrics", 200, "text/plain"), ("GET", "/health", 200, "")}
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize",
                 "/detokenize"):
        want |= {("POST", path, 200, "application/json"), ("POST", path, 400, "application/json"),
                 ("POST", path, 404, "application/json")}
    # the Messages routes' bodies are deeper: random ones rarely pass to a wrong model (its
    # 404 is tests/test_serve_anthropic.py's)
    want.add(("POST", "/v1/messages", 200, "text/event-stream"))
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        want |= {("POST", path, 200, "application/json"), ("POST", path, 400, "application/json")}
    assert want <= run.answers, sorted(want - run.answers)
    assert not {a for a in run.answers if a[2] >= 500}, sorted(run.answers)


def test_nothing_is_left_behind(server: ServeProcess, run: Run) -> None:
    stats = server.wait_idle()
    assert stats["num_running_reqs"] == stats["num_waiting_reqs"] == 0, stats
    assert stats["num_requests"] == 0, stats
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert "Traceback" not in server.log() and "ERROR" not in server.log()
