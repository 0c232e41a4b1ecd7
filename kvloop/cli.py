"""Command line: `kvloop serve | router | fleet | bench | trace | replay | events`.

Each subcommand's module is imported only when that subcommand runs, so `kvloop replay`
never loads torch. Nothing imports this module.
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
    text = dump_steplog(replay(trace))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
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
    return ap


def main(argv: list[str] | None = None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # the subcommand's usage, not kvloop's (argparse would print the latter)
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return int(args.func(args) or 0)
