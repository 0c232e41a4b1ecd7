"""What one HTTP connection may cost a front (the API server and the router): the limits and
their flags. `kvloop.front.guard` enforces them.

- Request bodies: at most `max_request_body_bytes` (413 beyond), never buffered past it.
- A request's headers must arrive whole within `header_timeout_s` of the connection opening
  (or of the first byte of a later request on a kept-alive connection); its body may pause at
  most `body_timeout_s` between two reads. Past either: 408, and the connection is closed.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class HttpLimits:
    """Body size and read timeouts of one front (see the module docstring)."""

    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_request_body_bytes < 0:
            raise ValueError("--max-request-body-bytes must be >= 0")
        if self.header_timeout_s <= 0 or self.body_timeout_s <= 0:
            raise ValueError("--http-header-timeout and --http-body-timeout must be > 0")


# --- flags ---------------------------------------------------------------------------------------
def add_limit_args(g: argparse._ArgumentGroup) -> None:
    """--max-request-body-bytes, --http-header-timeout, --http-body-timeout."""
    d = HttpLimits()
    g.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes,
                   metavar="N", help="larger request bodies get 413 (default "
                                     f"{d.max_request_body_bytes}, 32 MiB)")
    g.add_argument("--http-header-timeout", type=float, default=d.header_timeout_s,
                   metavar="S", help="seconds a request's headers may take to arrive "
                                     f"(default {d.header_timeout_s:g})")
    g.add_argument("--http-body-timeout", type=float, default=d.body_timeout_s, metavar="S",
                   help="seconds a request body may pause between two reads "
                        f"(default {d.body_timeout_s:g})")


def http_limits(args: argparse.Namespace) -> HttpLimits:
    """Raises ValueError for a negative size or a non-positive timeout."""
    return HttpLimits(args.max_request_body_bytes, args.http_header_timeout,
                      args.http_body_timeout)
