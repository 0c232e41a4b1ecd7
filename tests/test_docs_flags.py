"""Every `--flag` that docs/*.md and README.md name exists in a real kvloop parser: a `kvloop`
subcommand's (kvloop.cli.build_parser(), walked through every subparser) or that of a
`python -m kvloop.X` tool the docs name (or of Ray's `ray start`, which docs/deploy.md runs).
`--kv-events-*` (a trailing `-*`) names a family: some flag must start with it. A line running
`lm_eval` names lm-evaluation-harness's own flags, checked against its parser.

The flags are gathered once for the module (`known`). Ray's `ray start` is read from Ray's
source, not imported: importing Ray's CLI imports Ray Serve (1-1.5 s of CPU), reading takes
0.02 s; `make test` checks the reading against the click command.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TypeGuard

import pytest

from kvloop.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
TOOL = re.compile(r"python -m (kvloop(?:\.\w+)+)")


def parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    """The long options of `parser` and of all its subparsers, recursively."""
    flags: set[str] = set()
    for action in parser._actions:
        flags.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= parser_flags(sub)
    return flags


class _Built(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__("parser built")
        self.parser = parser


def tool_parser(module: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The parser that `python -m module` builds: its main() is stopped at parse_args."""
    def stop(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Built(self)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", stop)
        with pytest.raises(_Built) as built:
            importlib.import_module(module).main([])
    return built.value.parser


def _has_parser(module: str) -> bool:
    spec = importlib.util.find_spec(module)
    return (spec is not None and spec.origin is not None
            and "ArgumentParser(" in Path(spec.origin).read_text())


def _docs_text() -> dict[Path, str]:
    return {p: p.read_text() for p in DOCS}


def known_flags(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    flags = parser_flags(build_parser())
    tools = {m for text in _docs_text().values() for m in TOOL.findall(text)}
    for module in sorted(tools):
        if _has_parser(module):
            flags |= parser_flags(tool_parser(module, monkeypatch))
    if any(RAY_START in text for text in _docs_text().values()):
        flags |= ray_start_flags()
    return flags


@pytest.fixture(scope="module")
def known() -> Iterator[set[str]]:
    """`known_flags()`, gathered once for the module's tests."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield known_flags(monkeypatch)


RAY_START = "ray start"   # docs/deploy.md starts a Ray cluster for `kvloop fleet --ray`


def ray_start_flags() -> set[str]:
    """The long options of Ray's own `ray start` (a click command; the ray extra), read from
    Ray's source: the `click.option`s that decorate `start` in the module ray.scripts.scripts,
    and those its `add_click_logging_options` decorator adds (`CLICK_LOGGING_OPTIONS` of
    ray.autoscaler._private.cli_logger). A click option's name is a string argument:
    "--name", or "--name/--no-name" for a boolean pair."""
    spec = importlib.util.find_spec("ray")   # finds the package without importing it
    assert spec is not None and spec.origin is not None, "ray (in the test extra) is missing"
    ray = Path(spec.origin).parent
    start = next(node for node in ast.parse((ray / "scripts" / "scripts.py").read_text()).body
                 if isinstance(node, ast.FunctionDef) and node.name == "start")
    options = [d for d in start.decorator_list if _is_click_option(d)]
    if any(isinstance(d, ast.Name) and d.id == "add_click_logging_options"
           for d in start.decorator_list):
        logger = ast.parse((ray / "autoscaler" / "_private" / "cli_logger.py").read_text())
        options += [n for n in ast.walk(logger) if _is_click_option(n)]
    return {name for option in options for arg in option.args
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            for name in arg.value.split("/") if name.startswith("--")}


def _is_click_option(node: ast.AST) -> TypeGuard[ast.Call]:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "option" and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "click")


def ray_start_command_flags() -> set[str]:
    """The long options of `ray start` as its click command has them (importing Ray's CLI)."""
    with warnings.catch_warnings():   # Ray's CLI imports Ray Serve, which warns of pydantic
        warnings.simplefilter("ignore")
        from ray.scripts.scripts import start

    return {o for param in start.params for o in (*param.opts, *param.secondary_opts)
            if o.startswith("--")}


LM_EVAL = re.compile(r"(?:^|[\s/])lm_eval --")


def lm_eval_flags() -> set[str]:
    """lm-evaluation-harness's `run` flags (docs/serving.md's recipe runs it)."""
    lm_cli = pytest.importorskip("lm_eval._cli")
    return parser_flags(lm_cli.HarnessCLI()._parser)


def _documented(flag: str, line: str, end: int, known: set[str]) -> bool:
    if flag.endswith("-") and line[end:end + 1] == "*":
        return any(k.startswith(flag) for k in known)
    return flag in known


def test_every_documented_flag_exists(known: set[str]) -> None:
    missing = []
    for path, text in _docs_text().items():
        for number, line in enumerate(text.splitlines(), 1):
            if LM_EVAL.search(line):   # another program's command line: its own flags
                missing += [f"{path.relative_to(ROOT)}:{number}: {f}"
                            for f in re.findall(r"(?<![\w-])--[a-z][\w-]*", line)
                            if f not in lm_eval_flags()]
                continue
            for m in FLAG.finditer(line):
                if not _documented(m.group(), line, m.end(), known):
                    missing.append(f"{path.relative_to(ROOT)}:{number}: {m.group()}")
    assert not missing, "flags named in the docs that no kvloop parser has:\n" + \
        "\n".join(missing)


def test_the_check_sees_every_kind_of_flag(known: set[str]) -> None:
    """The walk reaches nested subcommands, negated booleans and the docs' tools."""
    assert {"--kv-events-heartbeat", "--no-kv-events-heartbeat", "--idle-warn",
            "--disable-log-requests", "--max-log-len", "--disable-log-stats"} <= known
    assert {"--reps", "--anchor-url", "--decisions"} <= known     # bench.figures, bench.router
    assert {"--head", "--num-cpus", "--include-dashboard"} <= known   # ray start
    assert "--no-such-flag" not in known
    assert _documented("--kv-events-", "--kv-events-* flags", len("--kv-events-"), known)
    assert not _documented("--kv-eventz-", "--kv-eventz-*", len("--kv-eventz-"), known)


@pytest.mark.slow   # imports Ray's CLI (over a second)
def test_ray_start_as_read_from_its_source_is_its_click_command() -> None:
    """What `ray_start_flags` reads from Ray's source is every long option of the `ray start`
    command itself, no more and no fewer."""
    assert ray_start_flags() == ray_start_command_flags()
