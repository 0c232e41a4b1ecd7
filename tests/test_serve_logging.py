"""What `kvloop serve` logs, as vLLM: one "Received request" line per prompt (off unless
--enable-log-requests; cut by --max-log-len) and, every $VLLM_LOG_STATS_INTERVAL seconds
while busy, the stats line (off with --disable-log-stats). Read from the server's real log."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvloop.cli import build_parser
from kvloop.front.byte_tokenizer import ByteTokenizer
from kvloop.front.launcher import ServeProcess
from kvloop.server import cli_args
from kvloop.server.config import ServeConfig, log_stats_interval
from kvloop.server.logs import log_request

from .conftest import serving, wait_until

INTERVAL_S = 0.3
FAST_STATS = {"VLLM_LOG_STATS_INTERVAL": str(INTERVAL_S)}
STATS_LINE = re.compile(
    r"INFO api\[\d+\] Engine 000: Avg prompt throughput: \d+\.\d tokens/s, Avg generation "
    r"throughput: \d+\.\d tokens/s, Running: (\d+) reqs, Waiting: (\d+) reqs, "
    r"(?:Preemptions: \d+, )?GPU KV cache usage: \d+\.\d%, Prefix cache hit rate: \d+\.\d%$",
    re.M)
SIM = ["--model", "sim", "--sim-model", "bytes", "--sim-speedup", "5", "--max-model-len", "512"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with serving(tmp_path_factory, "serve_logging", [*SIM, "--enable-log-requests",
                                                     "--max-log-len", "5"],
                 env=FAST_STATS) as srv:
        yield srv


def _received(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if " Received request " in ln]


def _stats_lines(srv: ServeProcess) -> list[re.Match[str]]:
    return list(STATS_LINE.finditer(srv.log()))


# --- request lines -----------------------------------------------------------------------------
@pytest.mark.processes
def test_one_line_per_request_cut_to_max_log_len(server: ServeProcess) -> None:
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"prompt": "hello world", "max_tokens": 3, "seed": 7})
    rid = r.json()["id"]
    mine = [ln for ln in _received(server.log()) if rid in ln]
    assert len(mine) == 1, mine
    m = re.search(rf"INFO api\[\d+\] Received request {rid}-0: prompt: 'hello', params: "
                  r"SamplingParams\((.*)\), prompt_token_ids: \[104, 101, 108, 108, 111\]\.$",
                  mine[0])
    assert m is not None, mine[0]
    assert m.group(1).startswith("n=1, max_tokens=3, ") and "seed=7" in m.group(1)


@pytest.mark.processes
def test_a_line_per_prompt_and_the_templated_chat(server: ServeProcess) -> None:
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"prompt": ["first", "second"], "max_tokens": 2, "n": 2})
    rid = r.json()["id"]
    mine = [ln for ln in _received(server.log()) if rid in ln]
    heads = [re.findall(r"Received request (\S+): prompt: ('\w+')", ln) for ln in mine]
    assert heads == [[(f"{rid}-0", "'first'")], [(f"{rid}-1", "'secon'")]]
    assert all("SamplingParams(n=2, max_tokens=2," in ln for ln in mine)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    (line,) = [ln for ln in _received(server.log()) if r.json()["id"] in ln]
    assert "prompt: '<|im_', " in line and "prompt_token_ids: [60, 124, 105, 109, 95]." in line


@pytest.mark.processes
def test_refused_requests_are_not_logged(server: ServeProcess) -> None:
    before = len(_received(server.log()))
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 10 ** 6})
    assert r.status_code == 400
    assert len(_received(server.log())) == before


def test_without_max_log_len_the_whole_prompt(caplog: pytest.LogCaptureFixture) -> None:
    tok = ByteTokenizer()
    with caplog.at_level(logging.INFO, logger="kvloop.server"):
        log_request(ServeConfig(("sim",), log_requests=True), tok, "cmpl-1-0",
                    tok.encode("a 'quoted' prompt"), "P")
        log_request(ServeConfig(("sim",), log_requests=False), tok, "cmpl-2-0", [97], "P")
    ids = list(b"a 'quoted' prompt")
    assert caplog.messages == [f"Received request cmpl-1-0: prompt: \"a 'quoted' prompt\", "
                               f"params: P, prompt_token_ids: {ids}."]


# --- stats lines -------------------------------------------------------------------------------
def _quiet_for(srv: ServeProcess, seconds: float) -> bool:
    """No stats line is added for `seconds` (after the one that may follow the last work)."""
    time.sleep(2 * INTERVAL_S)
    before = len(_stats_lines(srv))
    time.sleep(seconds)
    return len(_stats_lines(srv)) == before


@pytest.mark.processes
def test_stats_line_while_busy_never_while_idle(server: ServeProcess) -> None:
    server.wait_idle()
    assert _quiet_for(server, 4 * INTERVAL_S)
    before = len(_stats_lines(server))
    done = threading.Thread(target=lambda: httpx.post(
        server.url + "/v1/completions", json={"prompt": "busy", "max_tokens": 300},
        timeout=60))
    done.start()
    try:
        wait_until(lambda: any(m.group(1) == "1" for m in _stats_lines(server)[before:]), 15,
                   "a stats line with one running request")
    finally:
        done.join(60)
    server.wait_idle()
    assert _quiet_for(server, 4 * INTERVAL_S)
    busy = _stats_lines(server)[before:]
    assert busy[-1].group(1, 2) == ("0", "0")     # the line that shows the work ended
    rates = [float(r) for m in busy for r in re.findall(r"generation throughput: ([\d.]+)",
                                                         m.group(0))]
    assert len(rates) == len(busy) and max(rates) > 0


@pytest.mark.processes
def test_disabled_request_and_stats_lines(tmp_path_factory: pytest.TempPathFactory) -> None:
    with serving(tmp_path_factory, "serve_quiet", [*SIM, "--disable-log-requests",
                                                   "--disable-log-stats"],
                 env=FAST_STATS) as quiet:
        r = httpx.post(quiet.url + "/v1/completions", json={"prompt": "shh", "max_tokens": 100},
                       timeout=60)
        assert r.status_code == 200
        time.sleep(3 * INTERVAL_S)
        log = quiet.log()
    assert not _received(log) and not STATS_LINE.search(log) and "Avg prompt" not in log
    assert "--disable-log-requests is deprecated" in log   # vLLM's flag, now a no-op


# --- flags and the interval --------------------------------------------------------------------
def test_flags_reach_the_config() -> None:
    def serve_config(*flags: str) -> ServeConfig:
        return cli_args.build_configs(build_parser().parse_args(
            ["serve", "--model", "sim", *flags]))[0]

    cfg = serve_config()
    assert (cfg.log_requests, cfg.max_log_len, cfg.log_stats) == (False, None, True)
    assert serve_config("--enable-log-requests").log_requests is True
    cfg = serve_config("--disable-log-requests", "--max-log-len", "9", "--disable-log-stats")
    assert (cfg.log_requests, cfg.max_log_len, cfg.log_stats) == (False, 9, False)
    with pytest.raises(ValueError, match="max_log_len"):
        serve_config("--max-log-len", "-1")


@pytest.mark.processes
def test_log_stats_interval_reads_vllms_variable(tmp_path: Path) -> None:
    assert log_stats_interval({}) == 10.0
    assert log_stats_interval({"VLLM_LOG_STATS_INTERVAL": "2.5"}) == 2.5
    assert log_stats_interval({"VLLM_LOG_STATS_INTERVAL": "0"}) == 10.0
    assert log_stats_interval({"VLLM_LOG_STATS_INTERVAL": "-3"}) == 10.0
    with pytest.raises(ValueError, match="VLLM_LOG_STATS_INTERVAL must be a number"):
        log_stats_interval({"VLLM_LOG_STATS_INTERVAL": "often"})
    bad = subprocess.run([sys.executable, "-m", "kvloop", "serve", "--model", "sim", "--port", "0"],
                         env={**os.environ, "VLLM_LOG_STATS_INTERVAL": "often"},
                         capture_output=True, text=True, timeout=60, cwd=tmp_path,
                         check=False)
    assert bad.returncode == 2 and "VLLM_LOG_STATS_INTERVAL must be a number" in bad.stderr
