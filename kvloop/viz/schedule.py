"""The schedule of a recorded run, as the grid the pictures draw.

Input: a JSONL file of `kvloop.core.trace.StepRecord`s (one line per engine step). Output:
`ScheduleData`, one column per record and one row per request (in order of first
appearance), a cell wherever a request got tokens in a step, and marks for admissions with
prefix-cache hits, preemptions and finishes. The PNG and the HTML renderers draw exactly this
object, and tests check them against it. Pure Python: no matplotlib here.

Speculative decoding: a request verifying drafts is a "spec" cell of 1 + k tokens (its
decode token and k drafts, with how many were accepted); in a column's tokens by kind the
drafts are their own kind ("spec") and the decode token counts as "decode". A record that
does not say how many drafts a spec cell had (older traces) counts all its tokens as drafts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

KINDS = ("prefill", "recompute", "decode", "spec")
PROMPT_KINDS = ("prefill", "recompute")
DECODE_KINDS = ("decode", "spec")


@dataclass(frozen=True)
class Cell:
    """Request `row` got `tokens` tokens of `kind` in step column `col` (`drafts` of them
    speculative, `accepted` of those accepted; None: not known)."""

    col: int
    row: int
    kind: str
    tokens: int
    computed_before: int
    drafts: int = 0
    accepted: int | None = None


@dataclass(frozen=True)
class Mark:
    """An event at (col, row): cached tokens of an admission, or a finish reason."""

    col: int
    row: int
    value: int | str | None = None


@dataclass(frozen=True)
class Column:
    """One engine step."""

    step: int
    time: float
    duration_ms: float
    budget: int
    total_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    tokens_by_kind: dict[str, int]

    @property
    def mixed(self) -> bool:
        """Prompt chunks and decode tokens in the same step."""
        kinds = self.tokens_by_kind
        return (any(kinds.get(k) for k in PROMPT_KINDS)
                and any(kinds.get(k) for k in DECODE_KINDS))


@dataclass
class ScheduleData:
    columns: list[Column] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    cells: list[Cell] = field(default_factory=list)
    admissions: list[Mark] = field(default_factory=list)
    preemptions: list[Mark] = field(default_factory=list)
    finishes: list[Mark] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        cols = self.columns
        n = len(cols)
        by_kind = {k: sum(c.tokens_by_kind.get(k, 0) for c in cols) for k in KINDS}
        budget_use = [c.total_tokens / c.budget for c in cols if c.budget > 0]
        drafted = sum(c.drafts for c in self.cells if c.accepted is not None)
        accepted = sum(c.accepted or 0 for c in self.cells)
        return {
            "steps": n,
            "requests": len(self.request_ids),
            "mixed_step_share": (sum(c.mixed for c in cols) / n) if n else 0.0,
            "mean_budget_use": (sum(budget_use) / len(budget_use)) if budget_use else 0.0,
            "preemptions": len(self.preemptions),
            "prefix_hit_tokens": sum(int(m.value or 0) for m in self.admissions),
            "tokens_by_kind": by_kind,
            "accepted_draft_tokens": accepted,
            "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_step_ms": (sum(c.duration_ms for c in cols) / n) if n else 0.0,
        }


def cell_fraction(tokens: int, max_tokens: int) -> float:
    """Height of a cell within its row: 0.25 for one token, 1.0 for the largest (log scale)."""
    if max_tokens <= 1:
        return 1.0
    return 0.25 + 0.75 * math.log1p(max(tokens, 1) - 1) / math.log1p(max_tokens - 1)


def parse_steps(spec: str | None) -> slice | None:
    """`A:B` (either side optional) as a slice over record positions; None for all."""
    if spec is None:
        return None
    a, sep, b = spec.partition(":")
    if not sep:
        raise ValueError(f"--steps expects A:B, got {spec!r}")
    try:
        return slice(int(a) if a else None, int(b) if b else None)
    except ValueError:
        raise ValueError(f"--steps expects integers A:B, got {spec!r}") from None


def read_records(lines: Iterable[str]) -> list[dict[str, Any]]:
    """Parse JSONL step records; raises ValueError naming the bad line."""
    records = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"trace line {lineno}: not JSON ({e})") from None
        if not isinstance(rec, dict) or "scheduled" not in rec or "step" not in rec:
            raise ValueError(f"trace line {lineno}: not a step record (needs 'step' and "
                             "'scheduled')")
        records.append(rec)
    return records


class _Rows:
    """Request id -> row, in order of first appearance."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self._index: dict[str, int] = {}

    def __call__(self, rid: str) -> int:
        row = self._index.get(rid)
        if row is None:
            row = self._index[rid] = len(self.ids)
            self.ids.append(rid)
        return row


def _add_record(data: ScheduleData, rows: _Rows, col: int, rec: dict[str, Any]) -> None:
    by_kind: dict[str, int] = {}
    for rid, hit in (rec.get("admitted") or {}).items():
        data.admissions.append(Mark(col, rows(rid), int(hit)))
    for rid, work in rec["scheduled"].items():
        kind = work.get("kind", "prefill")
        if kind not in KINDS:
            raise ValueError(f"step {rec['step']}: unknown kind {kind!r}")
        tokens = int(work["tokens"])
        drafts = int(work.get("draft_tokens", tokens if kind == "spec" else 0))
        accepted = work.get("accepted_tokens")
        data.cells.append(Cell(col, rows(rid), kind, tokens,
                               int(work.get("num_computed_before", 0)), drafts,
                               None if accepted is None else int(accepted)))
        if drafts:
            by_kind["spec"] = by_kind.get("spec", 0) + drafts
        if tokens - drafts:
            plain = "decode" if kind == "spec" else kind
            by_kind[plain] = by_kind.get(plain, 0) + tokens - drafts
    for rid in rec.get("preempted") or []:
        data.preemptions.append(Mark(col, rows(rid)))
    for rid, reason in (rec.get("finished") or {}).items():
        data.finishes.append(Mark(col, rows(rid), reason))
    data.columns.append(Column(
        int(rec["step"]), float(rec.get("time", 0.0)), 1000.0 * float(rec.get("duration_s", 0)),
        int(rec.get("budget", 0)), int(rec.get("total_tokens", sum(by_kind.values()))),
        int(rec.get("kv_blocks_used", 0)), int(rec.get("kv_blocks_total", 0)), by_kind))


def build_schedule(records: list[dict[str, Any]], window: slice | None = None) -> ScheduleData:
    """The grid of `records[window]`."""
    data = ScheduleData()
    rows = _Rows()
    for col, rec in enumerate(records[window] if window else records):
        _add_record(data, rows, col, rec)
    data.request_ids = rows.ids
    return data


def load_schedule(path: str, window: slice | None = None) -> ScheduleData:
    with open(path, encoding="utf-8") as f:
        records = read_records(f)
    if not records:
        raise ValueError(f"{path}: no step records")
    return build_schedule(records, window)


def format_summary(data: ScheduleData) -> str:
    s = data.summary()
    k = s["tokens_by_kind"]
    return (f"{s['steps']} steps, {s['requests']} requests; "
            f"{100 * s['mixed_step_share']:.1f}% of steps mixed prompt chunks with decode "
            f"tokens; mean budget use {100 * s['mean_budget_use']:.1f}%; "
            f"{s['preemptions']} preemptions; tokens: prefill {k['prefill']}, recompute "
            f"{k['recompute']}, decode {k['decode']}, spec drafts {k['spec']} "
            f"({s['accepted_draft_tokens']} accepted); prefix-cache hits "
            f"{s['prefix_hit_tokens']} tokens; mean step {s['mean_step_ms']:.1f} ms")
