"""Reading a Prometheus text exposition (a `/metrics` page): the package's one parser.

The router reads each worker's load with it (`kvloop.router.proxy.parse_load`), the launcher
and the tests read counters with it. prometheus_client's own parser
(`text_string_to_metric_families`) builds every family of the page: about 18 ms for a
worker's 30 KB, inside the router's event loop, several times a second. This reads only the
series asked for, with one regular expression per name, in a fraction of a millisecond.

A sample line is `name{label="value",...} value [timestamp]` (label values escape `\\`, `"`
and newlines with a backslash); `#` lines (HELP, TYPE) and unparsable values are skipped.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator

_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(.)")


@functools.lru_cache(maxsize=256)
def _series(name: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(name)}(?:\{{(.*)\}})?[ \t]+(\S+)(?:[ \t]+\S+)?[ \t]*$",
                      re.M)


def _unescape(value: str) -> str:
    return _ESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def samples(text: str, name: str) -> Iterator[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of the series `name` (exactly that name: a counter's
    samples are `NAME_total`, a histogram's `NAME_bucket`, `NAME_sum`, `NAME_count`)."""
    for m in _series(name).finditer(text):
        try:
            value = float(m.group(2))
        except ValueError:
            continue
        labels = {k: _unescape(v) for k, v in _LABEL.findall(m.group(1) or "")}
        yield labels, value


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0.0 if none)."""
    return sum((value for have, value in samples(text, name)
                if all(have.get(k) == v for k, v in labels.items())), 0.0)
