"""Command line: `kvloop serve | router | fleet | bench | trace | replay | events`.

Each subcommand's module is imported only when that subcommand runs, so `kvloop replay`
never loads torch. Nothing imports this module.

`--config FILE` (vLLM's meaning) on any subcommand: a YAML mapping whose keys are that
subcommand's flag names (`max-num-seqs` or `max_num_seqs`), read as if they were written on
the command line before the flags that are: a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import kvloop


def _cmd_replay(args: argparse.Namespace) -> int:
    from kvloop.sim.replay import dump_steplog, replay

    with open(args.trace, encoding="utf-8") as f:
        trace = json.load(f)
    steps = replay(trace)
    text = dump_steplog(steps)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"kvloop replay: {len(steps['steps'])} steps of {args.trace} written to "
              f"{args.out}",
              file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _add_replay(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="run a scheduler conformance trace, write its step log")
    p.add_argument("trace", help="trace JSON (format: tests/data/conformance/README.md)")
    p.add_argument("--out", help="step log path (default: stdout)")
    p.set_defaults(func=_cmd_replay)


# Subcommands register themselves here: (name, adder). Other modules add theirs.
_SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_replay]


def _optional_subcommands() -> list[Callable[[argparse._SubParsersAction], None]]:
    """Subcommands defined by other packages' `cli_args` modules (imported lazily)."""
    adders = []
    for mod in ("kvloop.server.cli_args", "kvloop.events.cli_args", "kvloop.bench.cli_args",
                "kvloop.router.cli_args"):
        try:
            m = __import__(mod, fromlist=["register"])
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
            continue
        adders.append(m.register)
    return adders


def build_parser() -> argparse.ArgumentParser:
    """The `kvloop` parser; each subcommand's parser is its namespace's `command_parser`."""
    ap = argparse.ArgumentParser(prog="kvloop", description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", action="version", version=kvloop.__version__)
    sub = ap.add_subparsers(dest="command", required=True)
    for add in _SUBCOMMANDS + _optional_subcommands():
        add(sub)
    for parser in sub.choices.values():
        parser.set_defaults(command_parser=parser)
        parser.add_argument(CONFIG_FLAG, metavar="FILE", help=argparse.SUPPRESS
                            if parser.prog.endswith(" replay") else
                            "YAML file of this command's flags (keys are flag names); flags "
                            "on the command line win (default: none)")
    return ap


CONFIG_FLAG = "--config"
CONFIG_MAX_BYTES = 1 << 20   # a config file is a page of flags, never a data file


def _config_path(argv: list[str]) -> tuple[str | None, list[str]]:
    """The `--config FILE` (or `--config=FILE`) in `argv` before any `--`, and `argv`
    without it."""
    rest: list[str] = []
    path = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return path, rest + argv[i:]
        if arg == CONFIG_FLAG and i + 1 < len(argv):
            path, i = argv[i + 1], i + 2
            continue
        if arg.startswith(CONFIG_FLAG + "="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return path, rest


def _read_config(path: str, parser: argparse.ArgumentParser) -> dict[str, object]:
    import yaml

    try:
        with open(path, "rb") as f:
            raw = f.read(CONFIG_MAX_BYTES + 1)
    except OSError as e:
        parser.error(f"--config {path}: {e.strerror or e}")
    if len(raw) > CONFIG_MAX_BYTES:
        parser.error(f"--config {path}: over {CONFIG_MAX_BYTES} bytes")
    try:
        data = yaml.safe_load(raw) or {}
    except yaml.YAMLError as e:
        parser.error(f"--config {path}: not YAML: {str(e).splitlines()[0]}")
    if not isinstance(data, dict):
        parser.error(f"--config {path}: a mapping of flag names to values, got "
                     f"{type(data).__name__}")
    return {str(k): v for k, v in data.items()}


def _flag_value(v: object) -> str:
    """A config value as the command line would spell it (JSON for mappings)."""
    if isinstance(v, dict):
        return json.dumps(v)
    return str(v)


def config_args(data: dict[str, object], parser: argparse.ArgumentParser
                ) -> tuple[list[str], list[str]]:
    """The flags (`--name value` ...) a config mapping stands for, and the words after `--`
    (fleet's `worker-args`: what it passes to every worker), checked against `parser` (the
    subcommand's): an unknown key is an error naming it. A boolean flag is written when true
    (`--no-name` when false, where the flag has that form); a list repeats a flag that
    appends, or gives a flag its several values; a mapping is written as JSON (the JSON
    flags: `--speculative-config`, `--kv-transfer-config` ...)."""
    by_flag = {o: a for a in parser._actions for o in a.option_strings}
    remainder = next((a for a in parser._actions if a.nargs == argparse.REMAINDER), None)
    flags: list[str] = []
    words: list[str] = []
    for key, value in data.items():
        name = key.replace("_", "-")
        action = by_flag.get("--" + name)
        if action is None and remainder is not None and key.replace("-", "_") == remainder.dest:
            words += [_flag_value(v) for v in (value if isinstance(value, list) else [value])]
            continue
        if action is None or name in ("config", "help"):
            parser.error(f"--config: unknown key {key!r} (keys are this command's flag names)")
        flags += _flag_words("--" + name, action, value, parser)
    return flags, words


def _flag_words(flag: str, action: argparse.Action, value: object,
                parser: argparse.ArgumentParser) -> list[str]:
    if action.nargs == 0:   # store_true / store_false / BooleanOptionalAction
        if not isinstance(value, bool):
            parser.error(f"--config: {flag[2:]} takes true or false, got {value!r}")
        if value:
            return [flag]
        negative = "--no-" + flag[2:]
        return [negative] if negative in action.option_strings else []
    if isinstance(value, list):
        if isinstance(action, argparse._AppendAction):
            return [w for v in value for w in (flag, _flag_value(v))]
        return [flag, *(_flag_value(v) for v in value)]
    if value is None:
        return []
    return [flag, _flag_value(value)]


def _expand_config(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`argv` with its `--config FILE` replaced by the file's flags, placed right after the
    subcommand so that flags written on the command line come later and win."""
    path, rest = _config_path(argv)
    if path is None:
        return argv
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    at = next((i for i, a in enumerate(rest) if sub is not None and a in sub.choices), None)
    if sub is None or at is None:
        parser.error("--config goes after a subcommand: kvloop serve --config FILE")
    command = sub.choices[rest[at]]
    flags, remainder = config_args(_read_config(path, command), command)
    head, tail = rest[:at + 1], rest[at + 1:]
    if remainder and "--" not in tail:    # the command line's own `-- ...` wins
        tail = [*tail, "--", *remainder]
    return head + flags + tail


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = _expand_config(sys.argv[1:] if argv is None else list(argv), parser)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage, not kvloop's (argparse would print the latter)
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return int(args.func(args) or 0)
