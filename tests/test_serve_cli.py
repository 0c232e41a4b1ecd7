"""`kvloop serve`'s command line: vLLM's flags and what each does, `--help`, `--version`, and
the start-up errors (one line naming the fix, exit 2, before any engine starts)."""

from __future__ import annotations

import argparse
import logging
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import pytest

import kvloop
from kvloop.cli import build_parser, main
from kvloop.config import SIM_RUNNER_FACTORY, AutoBudget
from kvloop.front.launcher import ServeProcess
from kvloop.server import cli_args
from kvloop.wire import EngineStartConfig

ROOT = Path(__file__).resolve().parents[1]


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def run_serve(*argv: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvloop", "serve", *argv],
                          capture_output=True, text=True, timeout=timeout_s)


# --- --version, --help, unknown flags -----------------------------------------------------------
def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"{kvloop.__version__}\n"


def _help_entries(text: str) -> list[str]:
    """Each flag's (or MODEL's) help, its wrapped lines joined."""
    entries: list[str] = []
    for line in text.splitlines():
        if re.match(r"^  (-|MODEL)", line):
            entries.append(" ".join(line.split()))
        elif line.startswith("      ") and entries:
            entries[-1] += " " + " ".join(line.split())
    return entries


def test_serve_help_gives_every_default_and_names_only_files_that_exist(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    entries = _help_entries(text)
    assert len(entries) > 40 and entries[0].startswith("MODEL")
    assert [x for x in entries if "default" not in x] == ["-h, --help show this help message "
                                                          "and exit"]
    assert "--port PORT port to listen on; 0 picks a free one (the URL is printed) " \
           "(default: 8000)" in entries
    paths = set(re.findall(r"[\w./-]+\.(?:md|json|py|toml|gguf|txt|ya?ml)\b", text))
    assert {"docs/serving.md", "kvloop/sim/latency_smollm2_cpu.json"} <= paths
    assert [p for p in paths if not (ROOT / p).exists()] == []


def test_unknown_flag_prints_serves_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "sim", "--bogus", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.startswith("usage: kvloop serve ") and "[MODEL]" in err
    assert err.splitlines()[-1] == "kvloop serve: error: unrecognized arguments: --bogus 1"


# --- the model argument -------------------------------------------------------------------------
def test_positional_model_as_vllm_serve() -> None:
    serve, start, _ = cli_args.build_configs(serve_args("sim"))
    assert start.runner.factory == SIM_RUNNER_FACTORY and serve.served_model_names == ("sim",)
    assert cli_args.model_arg(serve_args("sim", "--model", "sim")) == "sim"
    assert cli_args.model_arg(serve_args("--model", "m.gguf")) == "m.gguf"
    assert cli_args.model_arg(serve_args()) is None
    with pytest.raises(ValueError, match="two models given: 'sim' and --model 'x.gguf'"):
        cli_args.build_configs(serve_args("sim", "--model", "x.gguf"))


ERRORS = [
    (["HuggingFaceTB/SmolLM2-135M-Instruct"],
     "'HuggingFaceTB/SmolLM2-135M-Instruct' is not a local path; it looks like a Hugging Face "
     "hub id, and kvloop downloads nothing: pass a local .gguf file or Hugging Face folder"),
    (["{tmp}/missing.gguf"], "model '{tmp}/missing.gguf' is neither a .gguf file nor a "
                             "Hugging Face folder"),
    (["--dtype", "float8"], "--dtype must be auto or one of float32, fp32, float, bfloat16, "
                            "bf16, float16, fp16, half, got 'float8'"),
    (["sim", "--dtype", "float8"], "--dtype must be auto or one of"),
    (["sim", "--device", "tpu"], "--device must be one of auto, cpu, cuda, cuda:N, got 'tpu'"),
    (["sim", "-tp", "2"], "--tensor-parallel-size 2: kvloop runs a model on one device; pass 1"),
    (["sim", "--gpu-memory-utilization", "1.5"],
     "--gpu-memory-utilization must be in (0, 1], got 1.5"),
    (["sim", "--model", "other"], "two models given: 'sim' and --model 'other'; pass one"),
    (["sim", "--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'],
     "kv_connector must be one of KvloopConnector, got 'NixlConnector'"),
]


@pytest.mark.processes
@pytest.mark.parametrize(("argv", "message"), ERRORS, ids=[" ".join(a) for a, _ in ERRORS])
def test_start_up_error_is_one_line_exit_2(tmp_path: Path, argv: list[str], message: str
                                          ) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    r = run_serve(*argv, "--port", "0")
    lines = (r.stdout + r.stderr).splitlines()
    assert r.returncode == 2, lines
    assert len(lines) == 1 and message.replace("{tmp}", str(tmp_path)) in lines[0], lines
    assert " ERROR api[" in lines[0]


@pytest.mark.processes
def test_debug_log_level_adds_the_traceback() -> None:
    r = run_serve("HuggingFaceTB/SmolLM2-135M-Instruct", "--port", "0", "--log-level", "debug")
    out = r.stdout + r.stderr
    assert r.returncode == 2
    assert "looks like a Hugging Face hub id" in out and "Traceback" in out
    assert "ModelNotFoundError" in out


@pytest.mark.processes
def test_port_in_use_fails_before_the_engine_starts(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # an engine started first would fail on the missing latency file (exit 1) instead
        r = run_serve("sim", "--port", str(port),
                      "--sim-latency-file", str(tmp_path / "missing.json"))
    lines = (r.stdout + r.stderr).splitlines()
    # the start-up line of the default sampling parameters, then the one error
    assert r.returncode == 2 and len(lines) <= 2, lines
    assert not any("Traceback" in line or "engine" in line for line in lines), lines
    assert lines[-1].endswith(f"cannot listen on 127.0.0.1:{port}: the port is in use; pass "
                              f"another --port (--port 0 picks a free one)")


# --- vLLM's flags -------------------------------------------------------------------------------
def test_default_ports_are_vllms_8000() -> None:
    assert serve_args().port == 8000
    assert build_parser().parse_args(["router"]).port == 8000
    assert build_parser().parse_args(["fleet", "--workers", "1"]).port == 8000


def test_chunked_prefill_flag_reaches_the_scheduler() -> None:
    on = cli_args.engine_config(serve_args("sim"))
    # auto by default: the engine process measures the budget; until then the floor
    assert on.auto_budget == AutoBudget() and not on.auto_budget.explicit    # default target
    assert on.auto_budget.target_s == 0.1
    assert on.scheduler.enable_chunked_prefill and on.scheduler.max_num_batched_tokens == 128
    # without chunked prefill auto covers the context (kvloop.core.budget.non_chunked_budget)
    off = cli_args.engine_config(serve_args("sim", "--no-enable-chunked-prefill"))
    assert not off.scheduler.enable_chunked_prefill and off.auto_budget is not None
    off = cli_args.engine_config(serve_args("sim", "--no-enable-chunked-prefill",
                                            "--max-num-batched-tokens", "64"))
    assert off.auto_budget is None
    assert off.scheduler.max_num_batched_tokens == 64 and off.scheduler.max_num_seqs == 64


def test_the_budget_flags() -> None:
    cfg = cli_args.engine_config(serve_args("sim", "--max-num-batched-tokens", "AUTO",
                                            "--target-tpot-ms", "40", "--max-num-seqs", "300"))
    assert cfg.auto_budget == AutoBudget(target_tpot_ms=40.0)
    assert (cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_num_seqs) == (300, 300)
    _, start, _ = cli_args.build_configs(serve_args("sim"))
    back = msgspec.json.decode(msgspec.json.encode(start), type=EngineStartConfig)
    assert back.engine.auto_budget == AutoBudget()
    with pytest.raises(ValueError, match=r"^--target-tpot-ms must be > 0, got 0.0$"):
        cli_args.build_configs(serve_args("sim", "--target-tpot-ms", "0"))
    with pytest.raises(SystemExit):
        serve_args("sim", "--max-num-batched-tokens", "lots")


@pytest.mark.parametrize(("argv", "expected"), [
    ([], True), (["--role", "prefill"], True), (["--role", "decode"], False),
    (["--role", "decode", "--enable-prefix-caching"], True),
    (["--no-enable-prefix-caching"], False),
])
def test_a_decode_worker_keeps_no_prefix_cache_unless_asked(argv: list[str], expected: bool
                                                            ) -> None:
    assert cli_args.engine_config(serve_args("sim", *argv)).cache.enable_prefix_caching \
        is expected


@pytest.mark.parametrize(("argv", "expected"), [   # off unless asked, as current vLLM
    ([], False), (["--enable-log-requests"], True), (["--no-enable-log-requests"], False),
    (["--disable-log-requests"], False), (["--enable-log-requests", "--disable-log-requests"],
                                          True),   # deprecated: a no-op with a warning
])
def test_log_requests_flags(argv: list[str], expected: bool) -> None:
    serve, _, _ = cli_args.build_configs(serve_args("sim", *argv))
    assert serve.log_requests is expected


def test_server_flags_reach_the_server_config() -> None:
    serve, start, _ = cli_args.build_configs(serve_args(
        "sim", "--max-log-len", "100", "--uvicorn-log-level", "WARNING",
        "--shutdown-timeout", "5", "--tensor-parallel-size", "1"))
    assert (serve.max_log_len, serve.uvicorn_log_level) == (100, "warning")
    assert serve.shutdown_timeout_s == 5 and start.shutdown_timeout_s == 5
    default, start, _ = cli_args.build_configs(serve_args("sim"))
    assert default.max_log_len is None and default.uvicorn_log_level == "info"
    assert default.shutdown_timeout_s == 0 and start.shutdown_timeout_s == 0
    with pytest.raises(ValueError, match="max_log_len must be >= 0"):
        cli_args.build_configs(serve_args("sim", "--max-log-len", "-1"))
    with pytest.raises(SystemExit):
        serve_args("sim", "--uvicorn-log-level", "loud")


def test_gpu_memory_utilization_reaches_the_real_runner_and_warns_for_sim(
        caplog: pytest.LogCaptureFixture) -> None:
    runner = cli_args.runner_config(serve_args("--gpu-memory-utilization", "0.5"), "m.gguf")
    assert runner.gpu_memory_utilization == 0.5
    assert cli_args.runner_config(serve_args(), "m.gguf").gpu_memory_utilization is None
    with caplog.at_level(logging.WARNING, logger="kvloop.server"):
        cli_args.build_configs(serve_args("sim", "--gpu-memory-utilization", "0.5"))
    assert [r.getMessage() for r in caplog.records] == [
        "--gpu-memory-utilization is ignored without a CUDA device (as vLLM's CPU backend "
        "ignores it); size the KV cache with --kv-cache-memory"]


def test_gpu_memory_utilization_sizes_the_kv_cache_on_cuda_only(
        caplog: pytest.LogCaptureFixture) -> None:
    torch = pytest.importorskip("torch")
    from kvloop.model import DEFAULT_KV_CACHE_MEMORY
    from kvloop.model.setup import CUDA_ACTIVATION_RESERVE, cuda_kv_budget, kv_cache_bytes

    gib = 1 << 30
    # vLLM's rule: utilization x total holds weights, activations and the KV cache
    assert cuda_kv_budget(100 * gib, 95 * gib, 0.5, 3 * gib) == \
        50 * gib - 3 * gib - CUDA_ACTIVATION_RESERVE
    with pytest.raises(ValueError, match="has 40.0 GiB free of 100.0 GiB, less than "
                                         "--gpu-memory-utilization 0.5 asks for"):
        cuda_kv_budget(100 * gib, 40 * gib, 0.5, 3 * gib)
    with pytest.raises(ValueError, match="leaves no room for the KV cache"):
        cuda_kv_budget(10 * gib, 10 * gib, 0.2, 1 * gib)
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="kvloop.model.setup"):
        assert kv_cache_bytes(cpu, None, None, 0) == DEFAULT_KV_CACHE_MEMORY
        assert caplog.records == []
        assert kv_cache_bytes(cpu, None, 0.5, 0) == DEFAULT_KV_CACHE_MEMORY
    assert [r.getMessage() for r in caplog.records] == [
        "--gpu-memory-utilization is ignored without a CUDA device (as vLLM's CPU backend "
        "ignores it); size the KV cache with --kv-cache-memory"]
    assert kv_cache_bytes(cpu, 123456, 0.5, 0) == 123456      # --kv-cache-memory wins


@pytest.mark.processes
def test_vllm_flags_on_a_running_server(tmp_path: Path) -> None:
    """Positional MODEL, -tp 1, --uvicorn-log-level, --gpu-memory-utilization (sim: warns) and
    --no-enable-chunked-prefill (the context is clamped to the step budget) on one server."""
    args = ["sim", "-tp", "1", "--uvicorn-log-level", "warning", "--gpu-memory-utilization",
            "0.8", "--no-enable-chunked-prefill", "--max-num-batched-tokens", "64",
            "--enable-log-requests", "--max-log-len", "10", "--sim-speedup", "50"]
    with ServeProcess(args, tmp_path / "serve.log").start() as srv:
        worker = httpx.get(srv.url + "/kvloop/worker").json()
        assert worker["model"] == "sim"
        assert (worker["max_num_batched_tokens"], worker["max_model_len"]) == (64, 64)
        ok = httpx.post(srv.url + "/v1/completions", json={"prompt": [5] * 60, "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        long = httpx.post(srv.url + "/v1/completions", json={"prompt": [5] * 64})
        assert long.status_code == 400 and "maximum context length is 64" in long.text
    log = srv.log()
    assert "INFO:     Started server process" not in log       # uvicorn at warning
    assert "size the KV cache with --kv-cache-memory" in log
    assert "max_model_len 8192 exceeds max_num_batched_tokens 64 without chunked prefill" in log
    assert "Traceback" not in log


@pytest.mark.processes
def test_an_engine_start_failure_is_one_line_without_traceback(tmp_path: Path) -> None:
    t = time.monotonic()
    r = run_serve("sim", "--port", "0", "--sim-latency-file", str(tmp_path / "missing.json"))
    out = r.stdout + r.stderr
    assert r.returncode == 1 and time.monotonic() - t < 30
    assert "engine core failed to start: " in out and "cannot read latency file" in out
    assert "Traceback" not in out
