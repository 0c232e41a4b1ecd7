"""Frozen configuration of the router's flow control (`kvloop/router/flow.py`) and the
objectives file that maps `x-gateway-inference-objective` names to priorities.

Priorities follow GAIE's InferenceObjective: higher is served first, 0 is the default, a
negative priority is sheddable (refused with 429 while the fleet is saturated, never
queued). The objectives file is JSON:

    {"objectives": [{"name": "chat", "priority": 10},
                    {"name": "batch", "priority": -1, "queue_timeout_s": 5}]}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_OBJECTIVES = 1024
MAX_NAME_CHARS = 256
PRIORITY_RANGE = (-(2**31), 2**31 - 1)   # InferenceObjective.spec.priority is an int32


@dataclass(frozen=True)
class Objective:
    """One named objective: its priority band and, optionally, its own queue timeout."""

    name: str
    priority: int = 0
    queue_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > MAX_NAME_CHARS:
            raise ValueError(f"objective name must have 1-{MAX_NAME_CHARS} characters")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) or \
                not PRIORITY_RANGE[0] <= self.priority <= PRIORITY_RANGE[1]:
            raise ValueError(f"objective {self.name!r}: priority must be an int32, "
                             f"got {self.priority!r}")
        t = self.queue_timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                              or not t > 0):
            raise ValueError(f"objective {self.name!r}: queue_timeout_s must be > 0")


@dataclass(frozen=True)
class FlowConfig:
    """Flow control at the router (off unless `enabled`).

    A worker is saturated when its figures are older than `staleness_s`, its KV usage is at
    least `kv_usage_threshold`, or the requests waiting in its engine reach `max_waiting`
    (its own report, or what the router sent beyond its `max_num_seqs`). While every worker
    is saturated, requests wait at the router: at most `max_queue` of them, each at most its
    objective's queue timeout or `queue_timeout_s`, and their bodies at most
    `max_queue_bytes` in all. Refusals carry `Retry-After: retry_after_s`.

    The fairness header, and an objective or `priority` above the default band, are a
    trusted front's to set: a caller presenting the fleet token or the admin key, or every
    caller with `trusted_front` (a gateway that sets them stands in front and no client
    reaches the router itself). Anyone else is the tenant of its API key, in the default
    band or below (an objective that lowers it counts).
    """

    enabled: bool = False
    max_waiting: int = 2
    kv_usage_threshold: float = 0.95
    staleness_s: float = 2.0
    max_queue: int = 1024
    queue_timeout_s: float = 30.0
    retry_after_s: int = 1
    objectives: tuple[Objective, ...] = ()
    max_queue_bytes: int = 128 * 1024 * 1024
    trusted_front: bool = False

    def __post_init__(self) -> None:
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if not 0.0 < self.kv_usage_threshold <= 1.0:
            raise ValueError("kv_usage_threshold must be in (0, 1]")
        if not self.staleness_s > 0:
            raise ValueError("staleness_s must be > 0")
        if self.max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        if self.max_queue_bytes < 0:
            raise ValueError("max_queue_bytes must be >= 0")
        if not self.queue_timeout_s > 0:
            raise ValueError("queue_timeout_s must be > 0")
        if self.retry_after_s < 0:
            raise ValueError("retry_after_s must be >= 0")
        names = [o.name for o in self.objectives]
        if len(set(names)) != len(names):
            raise ValueError("objective names must be unique")
        if len(names) > MAX_OBJECTIVES:
            raise ValueError(f"at most {MAX_OBJECTIVES} objectives")

    def objective(self, name: str | None) -> Objective | None:
        """The objective called `name` (None: none, or not configured)."""
        return next((o for o in self.objectives if o.name == name), None)


def load_objectives(path: str | Path) -> tuple[Objective, ...]:
    """The objectives of a JSON objectives file (raises ValueError naming the problem)."""
    try:
        data: Any = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"objectives file {path}: {e}") from None
    items = data.get("objectives") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise ValueError(f"objectives file {path}: need {{\"objectives\": [...]}}")
    out = []
    for item in items:
        if not isinstance(item, dict) or set(item) - {"name", "priority", "queue_timeout_s"}:
            raise ValueError(f"objectives file {path}: each objective is an object with "
                             f"name, priority and optional queue_timeout_s, got {item!r}")
        out.append(Objective(str(item.get("name", "")), item.get("priority", 0),
                             item.get("queue_timeout_s")))
    return tuple(out)
