"""The LoRA flags and the path confinement of `kvloop serve` (kvloop/server/lora.py), in
process: vLLM's two --lora-modules forms, names, flags that need --enable-lora, and
--lora-allowed-dirs against `..` and symlinks."""

from __future__ import annotations

import argparse
import os

import pytest

from kvloop.cli import build_parser
from kvloop.server.cli_args import build_configs
from kvloop.server.lora import LoRAModule, LoRAServe, check_name, parse_lora_module


def test_lora_modules_take_both_of_vllms_forms() -> None:
    assert parse_lora_module("sql=/a/b") == LoRAModule("sql", "/a/b")
    assert parse_lora_module('{"name": "m", "path": "/p", "base_model_name": "base"}') == \
        LoRAModule("m", "/p", "base")
    for bad in ("noequals", "x=", '{"name": "m"}', "bad name=/p", "{not json"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lora_module(bad)
    for bad in ("", "a" * 129, "-x", "a b", "a\nb", "a,b", 'a"b'):
        with pytest.raises(ValueError):
            check_name(bad)


def test_flags_build_the_runner_engine_and_server_settings(tmp_path) -> None:
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (tmp_path / name).write_text("{}")
    args = build_parser().parse_args([
        "serve", "--model", "sim", "--enable-lora", "--lora-modules", f"a={tmp_path}",
        "--max-loras", "3", "--max-lora-rank", "32", "--max-cpu-loras", "5",
        "--lora-allowed-dirs", str(tmp_path)])
    serve, start, _ = build_configs(args)
    lora = start.runner.lora
    assert lora is not None and (lora.max_loras, lora.max_lora_rank, lora.cpu_loras) == (3, 32, 5)
    assert start.engine.scheduler.max_loras == 3
    assert serve.lora == LoRAServe((LoRAModule("a", str(tmp_path)),), (str(tmp_path),))
    for bad in (["--lora-modules", "a=/p"],                          # needs --enable-lora
                ["--enable-lora", "--lora-modules", "sim=/p"],       # the base model's name
                ["--enable-lora", "--lora-modules", "a=/p", "a=/q"],  # twice
                ["--enable-lora", "--max-cpu-loras", "0"]):
        with pytest.raises(ValueError):
            build_configs(build_parser().parse_args(["serve", "--model", "sim", *bad]))


def test_a_start_up_adapter_folder_is_checked_before_the_model_loads(tmp_path) -> None:
    """The README's LoRA line with no folder fails in the flags, not after a model load."""
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "adapter_config.json").write_text("{}")
    for path, says in ((tmp_path / "none", "is not a directory"),
                       (tmp_path / "half", "no adapter_model.safetensors in")):
        with pytest.raises(ValueError, match=says):
            build_configs(build_parser().parse_args(
                ["serve", "--model", "sim", "--enable-lora", "--lora-modules", f"x={path}"]))


def test_allowed_dirs_confine_paths_through_dots_and_symlinks(tmp_path) -> None:
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    (allowed / "a").mkdir(parents=True)
    outside.mkdir()
    os.symlink(outside, allowed / "link")
    (allowed / "file").write_text("x")
    serve = LoRAServe(allowed_dirs=(str(allowed),))
    assert serve.allowed_path(str(allowed / "a")) == str((allowed / "a").resolve())
    for path in (str(outside), str(allowed / ".." / "outside"), str(allowed / "link"),
                 str(allowed / "file"), str(allowed / "missing"), "/", "a\x00b",
                 str(tmp_path / "allowed-not")):
        assert serve.allowed_path(path) is None, path
    assert LoRAServe().allowed_path(str(allowed / "a")) is None


@pytest.mark.slow
def test_the_adapter_recipe_writes_a_folder_the_runner_reads(tmp_path) -> None:
    """docs/serving.md's recipe: `python -m kvloop.bench.lora --write-adapter DIR` makes a
    folder that passes the start-up check and the runner's reader."""
    from kvloop.bench.lora import main
    from kvloop.model.loader import load_model
    from kvloop.model.lora import read_peft_adapter

    assert main(["--write-adapter", str(tmp_path / "demo"), "--rank", "4"]) == 0
    build_configs(build_parser().parse_args(
        ["serve", "--model", "sim", "--enable-lora", "--lora-modules", f"demo={tmp_path}/demo"]))
    adapter = read_peft_adapter("demo", str(tmp_path / "demo"), load_model(None).config, 16)
    assert adapter.rank == 4
