"""The schedule as a PNG (matplotlib, Agg backend; imported only when a PNG is asked for).

Three panels sharing the step axis:
    grid     one row per request, one column per step; a cell per (request, step) with tokens,
             coloured by kind (prefill, recompute hatched, decode, spec: a decode token and
             its drafts) and as tall as its token count (log scale); x = preempted,
             > = admitted with a prefix-cache hit, | = finished
    tokens   tokens scheduled per step, stacked by kind (draft tokens as "spec"), and the
             token budget
    time     step duration (ms) and KV blocks in use (% of the pool)
`render_png` returns what it drew, read back from the artists, so tests can check the
picture against the trace without looking at pixels.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

from kvloop.viz.schedule import KINDS, ScheduleData, cell_fraction, format_summary

COLORS = {"prefill": "#3b6fb6", "recompute": "#e07b22", "decode": "#2e9e57", "spec": "#8e44ad"}
HATCH = {"recompute": "////"}
LABELS = {"spec": "spec (decode + drafts)"}
MAX_ROW_LABELS = 48


@dataclass(frozen=True)
class DrawnCell:
    col: int
    row: int
    kind: str


@dataclass(frozen=True)
class RenderInfo:
    """The picture's content, read back from the drawn artists."""

    num_rows: int
    num_cols: int
    cells: list[DrawnCell]
    num_preemption_marks: int
    width_px: int
    height_px: int


def _rect(col: int, row: int, frac: float, gap: float) -> list[tuple[float, float]]:
    h = 0.9 * frac
    y0 = row + (1 - h) / 2
    return [(col + gap, y0), (col + 1 - gap, y0), (col + 1 - gap, y0 + h), (col + gap, y0 + h)]


def _draw_grid(ax: Any, data: ScheduleData) -> dict[str, Any]:
    from matplotlib.collections import PolyCollection

    ncols = len(data.columns)
    gap = 0.08 if ncols <= 300 else 0.0
    biggest = max((c.tokens for c in data.cells), default=1)
    polys: dict[str, list[list[tuple[float, float]]]] = {k: [] for k in KINDS}
    for c in data.cells:
        polys[c.kind].append(_rect(c.col, c.row, cell_fraction(c.tokens, biggest), gap))
    collections = {}
    for kind in KINDS:
        coll = PolyCollection(polys[kind], facecolors=COLORS[kind], edgecolors="none",
                              hatch=HATCH.get(kind), label=LABELS.get(kind, kind))
        if kind in HATCH:
            coll.set_edgecolor("#7a3a00")
            coll.set_linewidth(0.0)
        ax.add_collection(coll)
        collections[kind] = coll
    _draw_marks(ax, data)
    ax.set_xlim(0, max(ncols, 1))
    ax.set_ylim(max(len(data.request_ids), 1), 0)
    _row_labels(ax, data.request_ids)
    ax.set_ylabel("request")
    return collections


def _draw_marks(ax: Any, data: ScheduleData) -> None:
    size = 30 if len(data.columns) <= 300 else 12
    if data.preemptions:
        ax.scatter([m.col + 0.5 for m in data.preemptions],
                   [m.row + 0.5 for m in data.preemptions], marker="x", s=size * 1.5,
                   color="#d62728", linewidths=1.5, zorder=4, label="preempted", gid="preempt")
    hits = [m for m in data.admissions if m.value]
    if hits:
        ax.scatter([m.col for m in hits], [m.row + 0.5 for m in hits], marker=">", s=size,
                   color="#111111", zorder=4, label="prefix-cache hit")
    if data.finishes:
        ax.scatter([m.col + 1 for m in data.finishes], [m.row + 0.5 for m in data.finishes],
                   marker="|", s=size, color="#555555", zorder=3, label="finished")


def _row_labels(ax: Any, ids: list[str]) -> None:
    stride = max(1, -(-len(ids) // MAX_ROW_LABELS))
    rows = list(range(0, len(ids), stride))
    ax.set_yticks([r + 0.5 for r in rows])
    ax.set_yticklabels([ids[r][-14:] for r in rows], fontsize=7)


def _draw_tokens(ax: Any, data: ScheduleData) -> None:
    edges = list(range(len(data.columns) + 1))
    bottom = [0.0] * len(data.columns)
    for kind in KINDS:
        vals = [c.tokens_by_kind.get(kind, 0) for c in data.columns]
        if not any(vals):
            continue
        top = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.stairs(top, edges, baseline=bottom, fill=True, color=COLORS[kind],
                  hatch=HATCH.get(kind))
        bottom = top
    ax.stairs([c.budget for c in data.columns], edges, color="black", linewidth=1.0,
              label="budget")
    ax.set_ylabel("tokens")
    ax.legend(loc="upper right", fontsize=7)


def _draw_time(ax: Any, data: ScheduleData) -> None:
    edges = list(range(len(data.columns) + 1))
    ax.stairs([c.duration_ms for c in data.columns], edges, color="#444444", fill=True,
              alpha=0.6)
    ax.set_ylabel("step ms")
    ax.set_xlabel("engine step (column)")
    if any(c.kv_blocks_total for c in data.columns):
        kv = ax.twinx()
        kv.stairs([100.0 * c.kv_blocks_used / c.kv_blocks_total if c.kv_blocks_total else 0.0
                   for c in data.columns], edges, color="#b03060", linewidth=1.0)
        kv.set_ylabel("KV use %", color="#b03060")
        kv.set_ylim(0, 105)


HEADER_IN = 0.95  # inches above the panels: title, summary, legend


def render_png(data: ScheduleData, path: str, title: str = "", dpi: int = 110) -> RenderInfo:
    """Draw `data` into a PNG at `path`; return what was drawn."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    grid_h = min(3.0 + 0.14 * len(data.request_ids), 24.0)
    fig_h = grid_h + 3.4 + HEADER_IN
    fig, (ax, ax_tok, ax_time) = plt.subplots(
        3, 1, sharex=True, figsize=(14, fig_h),
        gridspec_kw={"height_ratios": [grid_h, 1.9, 1.3]})
    try:
        collections = _draw_grid(ax, data)
        _draw_tokens(ax_tok, data)
        _draw_time(ax_time, data)
        summary = textwrap.fill(format_summary(data), 150)
        fig.suptitle(f"{title}\n{summary}" if title else summary, fontsize=9,
                     y=1 - 0.08 / fig_h, va="top")
        handles, labels = ax.get_legend_handles_labels()
        top = 1 - HEADER_IN / fig_h
        fig.legend(handles, labels, loc="lower right", ncol=len(labels), fontsize=7,
                   frameon=False, bbox_to_anchor=(0.94, top))
        fig.subplots_adjust(left=0.07, right=0.94, top=top, bottom=0.55 / fig_h,
                            hspace=0.25 * 8 / fig_h)
        fig.savefig(path, dpi=dpi)
        return _read_back(fig, ax, collections, len(data.columns))
    finally:
        plt.close(fig)


def _read_back(fig: Any, ax: Any, collections: dict[str, Any], ncols: int) -> RenderInfo:
    cells = []
    for kind, coll in collections.items():
        for path in coll.get_paths():
            (x0, y0), (x1, y1) = path.vertices.min(axis=0), path.vertices.max(axis=0)
            cells.append(DrawnCell(int((x0 + x1) / 2), int((y0 + y1) / 2), kind))
    preempt = sum(len(c.get_offsets()) for c in ax.collections if c.get_gid() == "preempt")
    w, h = fig.canvas.get_width_height()
    return RenderInfo(int(round(abs(ax.get_ylim()[0] - ax.get_ylim()[1]))),
                      int(round(ax.get_xlim()[1] - ax.get_xlim()[0])) if ncols else 0,
                      cells, preempt, w, h)
