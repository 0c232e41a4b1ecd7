"""Drain, the facts a worker states and a router reads.

A worker told to stop with a grace period (SIGTERM to `kvloop serve --shutdown-timeout S`)
drains: it refuses new requests and finishes those it holds (kvloop/server/serve.py). It says
so twice, so that no router keeps sending it work:

- its /metrics gauge `DRAINING_METRIC` is 1 from the first moment of the drain (a router
  reads it at each poll and routes nothing more there: within one poll interval);
- every request it refuses meanwhile is answered 503 with the header `DRAINING_HEADER`:
  nothing of that request ran, so a router may send it to another worker as it is (a 503
  without the header, the admission limit's say, is the worker's answer and is passed on).

Owner: nothing here holds state; the worker's `EngineClient` owns the draining flag.
"""

from __future__ import annotations

from collections.abc import Mapping

DRAINING_METRIC = "kvloop:server_draining"
DRAINING_HEADER = "x-kvloop-draining"
DRAINING_HEADERS = {DRAINING_HEADER: "1"}


def refused_by_drain(status_code: int, headers: Mapping[str, str]) -> bool:
    """Was this answer a draining worker's refusal (nothing ran: safe to send elsewhere)?"""
    return status_code == 503 and headers.get(DRAINING_HEADER) == "1"
