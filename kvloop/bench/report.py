"""Figures from a benchmark run: percentiles, throughput, cache share, tables, JSON.

Definitions (per successful request; times in milliseconds in the summary):
    TTFT   first content-bearing event - request sent
    TPOT   (last event - first event) / (output tokens - 1), requests with >= 2 tokens
    ITL    every gap between successive content-bearing events
    e2e    response complete - request sent
    cache share   sum(usage.prompt_tokens_details.cached_tokens) / sum(prompt tokens)
Throughput divides by the wall time of the measured phase (warm-up excluded).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from kvloop.bench.driver import BenchRun

PERCENTILES = (50, 90, 99)
MAX_ERRORS_LISTED = 5


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks.

    Same definition as numpy's default: position (n - 1) * q / 100 in the sorted values.
    """
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def distribution(values: Sequence[float], scale: float = 1.0) -> dict[str, float] | None:
    """mean and percentiles of `values * scale`; None when there are no values."""
    if not values:
        return None
    out = {"mean": scale * sum(values) / len(values)}
    for q in PERCENTILES:
        out[f"p{q}"] = scale * percentile(values, q)
    return out


def summarize(run: BenchRun) -> dict[str, Any]:
    """The run's figures as a JSON-ready dict."""
    ok = [r for r in run.results if r.ok]
    failed = [r for r in run.results if not r.ok]
    prompt_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len
                        for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    with_cache = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in with_cache)
    dur = run.duration_s or float("nan")
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    return {
        "label": run.label, "url": run.url, "model": run.model,
        "workload": run.workload, "workload_params": run.workload_params,
        "mode": run.mode, "concurrency": run.concurrency,
        "completed": len(ok), "failed": len(failed),
        "errors": sorted({r.error or "" for r in failed})[:MAX_ERRORS_LISTED],
        "duration_s": run.duration_s, "started_at": run.started_at,
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "cached_tokens": cached if with_cache else None,
        "cache_share": (cached / prompt_tokens) if with_cache and prompt_tokens else None,
        "request_throughput": len(ok) / dur,
        "output_throughput": output_tokens / dur,
        "total_token_throughput": (prompt_tokens + output_tokens) / dur,
        "ttft_ms": distribution(ttfts, 1000.0),
        "tpot_ms": distribution(tpots, 1000.0),
        "itl_ms": distribution([g for r in ok for g in r.itls()], 1000.0),
        "e2e_ms": distribution([r.e2e for r in ok], 1000.0),
        "client_cpu_s": run.client_cpu_s,
        "client_cpu_share": run.client_cpu_s / dur,
        "client_cpu_ms_per_request": 1000.0 * run.client_cpu_s / max(1, len(run.results)),
        "stand_in_answers": run.stand_in_answers,
    }


# --- tables -----------------------------------------------------------------------------------

def _rows(s: dict[str, Any]) -> list[tuple[str, float | None, str]]:
    """(name, value, format) rows of one summary, in display order."""
    rows: list[tuple[str, float | None, str]] = [
        ("completed requests", s["completed"], "d"),
        ("failed requests", s["failed"], "d"),
        ("duration (s)", s["duration_s"], ".2f"),
        ("request throughput (req/s)", s["request_throughput"], ".3f"),
        ("output throughput (tok/s)", s["output_throughput"], ".1f"),
        ("total throughput (tok/s)", s["total_token_throughput"], ".1f"),
        ("prompt tokens", s["prompt_tokens"], "d"),
        ("output tokens", s["output_tokens"], "d"),
        ("prompt tokens from cache (%)",
         None if s["cache_share"] is None else 100.0 * s["cache_share"], ".1f"),
    ]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                      ("e2e_ms", "e2e")):
        d = s[key] or {}
        for stat in ("mean", *(f"p{q}" for q in PERCENTILES)):
            rows.append((f"{name} {stat} (ms)", d.get(stat), ".1f"))
    rows += [("client CPU (s)", s["client_cpu_s"], ".2f"),
             ("client CPU (% of one core)", 100.0 * s["client_cpu_share"], ".1f"),
             ("client CPU per request (ms)", s["client_cpu_ms_per_request"], ".2f")]
    return rows


def _fmt(value: float | None, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(int(value) if fmt == "d" else value, fmt)


def _header(s: dict[str, Any]) -> str:
    loop = (f"closed loop, concurrency {s['concurrency']}" if s["mode"] == "closed"
            else f"open loop, cap {s['concurrency'] or 'none'}")
    params = ", ".join(f"{k}={v}" for k, v in s["workload_params"].items())
    return f"workload {s['workload']} ({params}); {loop}"


def format_table(s: dict[str, Any]) -> str:
    """A readable two-column table of one run."""
    rows = _rows(s)
    width = max(len(name) for name, _, _ in rows)
    lines = [_header(s), f"server {s['url']} (model {s['model'] or '-'})", ""]
    lines += [f"{name:<{width}}  {_fmt(v, f):>12}" for name, v, f in rows]
    lines += _notes(s)
    return "\n".join(lines)


def _notes(s: dict[str, Any]) -> list[str]:
    notes = [f"error: {e}" for e in s["errors"]]
    if s["stand_in_answers"]:
        notes.append(f"note: {s['stand_in_answers']} answers were not returned as token ids "
                     "(return_token_ids); stand-in tokens were resent in their place")
    return notes


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def format_compare(a: dict[str, Any], b: dict[str, Any]) -> str:
    """Both runs side by side with the ratio first / second."""
    rows_a, rows_b = _rows(a), _rows(b)
    width = max(len(name) for name, _, _ in rows_a)
    la, lb = a["label"][:24], b["label"][:24]
    lines = [_header(a), f"A = {a['url']} (model {a['model'] or '-'})",
             f"B = {b['url']} (model {b['model'] or '-'})", "",
             f"{'':<{width}}  {'A ' + la:>26}  {'B ' + lb:>26}  {'A/B':>7}"]
    for (name, va, f), (_, vb, _) in zip(rows_a, rows_b, strict=True):
        r = ratio(va, vb)
        lines.append(f"{name:<{width}}  {_fmt(va, f):>26}  {_fmt(vb, f):>26}  "
                     f"{_fmt(r, '.2f'):>7}")
    lines += [f"A {n}" for n in _notes(a)] + [f"B {n}" for n in _notes(b)]
    return "\n".join(lines)


def write_json(path: str, summaries: list[dict[str, Any]]) -> None:
    """One summary, or a {"runs": [...], "ratios": {...}} document for a comparison."""
    doc: dict[str, Any] = summaries[0] if len(summaries) == 1 else {
        "runs": summaries, "ratios": compare_ratios(summaries[0], summaries[1])}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, sort_keys=False)
        f.write("\n")


def compare_ratios(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    """first / second for every figure of the table."""
    return {name: ratio(va, vb) for (name, va, _), (_, vb, _) in
            zip(_rows(a), _rows(b), strict=True)}
