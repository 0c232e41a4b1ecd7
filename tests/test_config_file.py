"""`--config FILE` on serve, router and fleet (vLLM's meaning): keys are flag names, the
command line wins, unknown keys and wrong types are one-line errors naming the key."""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx
import pytest

from kvloop.cli import _expand_config, build_parser
from kvloop.front.launcher import ServeProcess

PARSER = build_parser()


def _args(tmp_path: Path, text: str, *argv: str) -> argparse.Namespace:
    path = tmp_path / "kvloop.yaml"
    path.write_text(text)
    return PARSER.parse_args(_expand_config([argv[0], "--config", str(path), *argv[1:]],
                                            PARSER))


def test_serve_keys_are_flag_names_in_either_spelling(tmp_path: Path) -> None:
    a = _args(tmp_path, "port: 8123\nmax_num_seqs: 3\nenable-prefix-caching: false\n"
                        "speculative-config: {method: ngram, num_speculative_tokens: 2}\n"
                        "served-model-name: [a, b]\nenable-kv-cache-events: true\n", "serve")
    assert (a.port, a.max_num_seqs, a.enable_prefix_caching) == (8123, 3, False)
    assert a.speculative_config == '{"method": "ngram", "num_speculative_tokens": 2}'
    assert a.served_model_name == ["a", "b"] and a.enable_kv_cache_events is True


def test_the_command_line_wins_over_the_file(tmp_path: Path) -> None:
    a = _args(tmp_path, "port: 8123\nmax-num-seqs: 3\n", "serve", "--port", "9")
    assert (a.port, a.max_num_seqs) == (9, 3)
    a = _args(tmp_path, "enable-prefix-caching: false\n", "serve", "--enable-prefix-caching")
    assert a.enable_prefix_caching is True


def test_router_appending_flags_take_lists(tmp_path: Path) -> None:
    a = _args(tmp_path, "worker: [http://127.0.0.1:8001, 'http://127.0.0.1:8002,decode']\n"
                        "flow-control: true\npolicy: round-robin\n", "router")
    assert a.worker == ["http://127.0.0.1:8001", "http://127.0.0.1:8002,decode"]
    assert a.flow_control is True and a.policy == "round-robin"


def test_fleet_worker_args_unless_the_command_line_has_its_own(tmp_path: Path) -> None:
    text = "workers: 2\nworker-args: [--model, sim, --sim-speedup, 10]\n"
    a = _args(tmp_path, text, "fleet")
    assert a.workers == 2 and a.worker_args == ["--", "--model", "sim", "--sim-speedup", "10"]
    a = _args(tmp_path, text, "fleet", "--", "--model", "sim")
    assert a.worker_args == ["--", "--model", "sim"]


@pytest.mark.parametrize("text, says", [
    ("bogus: 1\n", "unknown key 'bogus'"),
    ("enable-kv-cache-events: 3\n", "takes true or false"),
    ("- port\n", "a mapping of flag names"),
    ("port: [\n", "not YAML"),
    ("max-num-seqs: many\n", "invalid int value"),
])
def test_bad_files_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       text: str, says: str) -> None:
    with pytest.raises(SystemExit) as e:
        _args(tmp_path, text, "serve")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_a_missing_file_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        PARSER.parse_args(_expand_config(["router", "--config", "/nonexistent.yaml"], PARSER))
    assert "--config /nonexistent.yaml: No such file" in capsys.readouterr().err


@pytest.mark.processes
def test_a_server_runs_from_a_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "worker.yaml"
    cfg.write_text("model: sim\nsim-speedup: 100\nmax-model-len: 300\n"
                   "served-model-name: [from-file]\n")
    with ServeProcess(["--config", str(cfg), "--served-model-name", "from-cli"],
                      tmp_path / "serve.log").start(timeout_s=60) as srv:
        models = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [("from-cli", 300)]


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "docs" / "config")
                                        .glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_config_in_the_docs_parses(path: Path) -> None:
    """Each docs/config file names its command on its first line (`# kvloop CMD --config`)."""
    command = path.read_text().split()[2]
    a = PARSER.parse_args(_expand_config([command, "--config", str(path)], PARSER))
    assert a.command == command
