"""Step-time model of a simulated worker: how long one engine step of the real model takes.

    step_s = base_s
           + per_token_s     * tokens scheduled (prefill chunks, decode tokens, drafts)
           + per_seq_s       * sequences in the batch
           + per_ctx_token_s * context read (for each sequence: tokens already computed plus
                                             the tokens of this step, i.e. the KV it attends)

The coefficients live in a JSON file (`latency_smollm2_cpu.json` next to this module), fitted
on this machine by `python -m kvloop.bench.latency_fit`. `speedup` divides every modelled
time, so tests and fleet experiments run a simulated worker N times faster than the model
it imitates.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvloop.core.outputs import SchedulerOutput

DEFAULT_LATENCY_FILE = Path(__file__).with_name("latency_smollm2_cpu.json")
COEFFICIENTS = ("base_s", "per_token_s", "per_seq_s", "per_ctx_token_s")


@dataclass(frozen=True)
class StepFeatures:
    """What the step time depends on, read off one `SchedulerOutput`."""

    num_tokens: int
    num_seqs: int
    context_tokens: int

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepFeatures:
        before = {d.req_id: d.num_computed_tokens for d in out.scheduled_new_reqs}
        before.update((d.req_id, d.num_computed_tokens) for d in out.scheduled_cached_reqs)
        context = sum(before.get(rid, 0) + n for rid, n in out.num_scheduled_tokens.items())
        return cls(out.total_num_scheduled_tokens, len(out.num_scheduled_tokens), context)


@dataclass(frozen=True)
class LatencyModel:
    """A linear step-time model; `speedup` divides every time it returns."""

    base_s: float
    per_token_s: float
    per_seq_s: float
    per_ctx_token_s: float
    speedup: float = 1.0

    def __post_init__(self) -> None:
        for name in COEFFICIENTS:
            if getattr(self, name) < 0:
                raise ValueError(f"latency coefficient {name} must be >= 0, "
                                 f"got {getattr(self, name)}")
        if self.speedup <= 0:
            raise ValueError(f"speedup must be > 0, got {self.speedup}")

    @classmethod
    def from_file(cls, path: str | Path | None = None, speedup: float = 1.0) -> LatencyModel:
        """Read the coefficients of a latency file (default: the fitted SmolLM2 CPU file)."""
        data = load_latency_file(path)
        return cls(speedup=speedup, **{k: float(data["coefficients"][k]) for k in COEFFICIENTS})

    def features_time(self, f: StepFeatures) -> float:
        """Modelled seconds of a step with these features (0 for an empty step)."""
        if f.num_tokens == 0:
            return 0.0
        t = (self.base_s + self.per_token_s * f.num_tokens + self.per_seq_s * f.num_seqs
             + self.per_ctx_token_s * f.context_tokens)
        return t / self.speedup

    def step_time(self, out: SchedulerOutput) -> float:
        """Modelled seconds of the step `out` describes."""
        return self.features_time(StepFeatures.of(out))


def load_latency_file(path: str | Path | None = None) -> dict[str, Any]:
    """Parse and check a latency file; raises ValueError naming what is wrong."""
    p = Path(path) if path is not None else DEFAULT_LATENCY_FILE
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read latency file {p}: {e}") from e
    coeffs = data.get("coefficients") if isinstance(data, dict) else None
    if not isinstance(coeffs, dict):
        raise ValueError(f"latency file {p} has no 'coefficients' object")
    missing = [k for k in COEFFICIENTS if not isinstance(coeffs.get(k), int | float)]
    if missing:
        raise ValueError(f"latency file {p} lacks numeric coefficients {missing}")
    return data
