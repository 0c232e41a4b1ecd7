"""`--help` pages that show every flag's default: `kvloop serve`'s and the benchmarks'."""

from __future__ import annotations

import argparse
import copy


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default in `--help`: argparse's "(default: X)" unless the help already
    says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text:
            return text
        return super()._get_help_string(action)


class BenchHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The benchmarks' `--help`: each flag's default (also a flag without help text, which
    argparse would print bare; none for a default of None, whose help says what then), the
    description as written."""

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and action.option_strings \
                and action.default not in (None, argparse.SUPPRESS):
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)
