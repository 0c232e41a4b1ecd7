"""The closing figures: kvloop against an anchor, same workloads, same sitting, medians.

    python -m kvloop.bench.figures --reps 3 --out-dir out/figures

Starts `kvloop serve` (the embedded model unless `--serve-args` says otherwise) with a trace
file, and the transformers anchor (`python -m kvloop.bench.hf_server`) unless `--anchor-url`
points at a running server (llama-server, vLLM...). Then, `--reps` times, for every case it
runs the workload against kvloop and right after against the anchor. It writes every run's
summary (`runs.jsonl`), a markdown table of medians (`figures.md`), and the schedule picture
of kvloop's first run of the case named by `--picture` (`schedule.png`, `schedule.html`).
A benchmark script, not a test: it prints figures and checks nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvloop.bench import hf_server
from kvloop.bench import workloads as w
from kvloop.bench.cli_args import HelpFormatter
from kvloop.bench.driver import BenchConfig, run_bench
from kvloop.bench.report import format_compare, summarize
from kvloop.front.launcher import ServeProcess, UrlProcess
from kvloop.front.sockets import announced_url


@dataclass(frozen=True)
class Case:
    name: str
    workload: w.Workload
    concurrency: int


FULL_COUNTS = (8, 32, 64, 64)


def cases(scale: float = 1.0, seed: int = 0,
          token_range: tuple[int, int] = w.DEFAULT_TOKEN_RANGE,
          counts: tuple[int, int, int, int] = FULL_COUNTS) -> list[Case]:
    """The workloads of docs/benchmarking.md#workloads-and-targets, `counts` requests each,
    times `scale`.

    Every case draws its prompts from its own seed (`seed` + its index), so no case and no
    repetition (pass a different `seed`) finds another's prompts in the prefix cache.
    """
    def n(k: int) -> int:
        return max(1, round(k * scale))
    tr, s = token_range, 10 * seed
    n1, n8, n32, nsp = counts
    return [
        Case("random 256/128 c=1", w.random_workload(n(n1), 256, 128, s, token_range=tr), 1),
        Case("random 256/128 c=8", w.random_workload(n(n8), 256, 128, s + 1, token_range=tr),
             8),
        Case("random 256/128 c=32",
             w.random_workload(n(n32), 256, 128, s + 2, token_range=tr), 32),
        Case("shared-prefix 8x1024+64, 64 out, c=16",
             w.shared_prefix_workload(8, 1024, 64, 64, n(nsp), s + 3, token_range=tr), 16),
    ]


KEYS = {  # figure -> how to read it from a summary
    "output tok/s": lambda s: s["output_throughput"],
    "total tok/s": lambda s: s["total_token_throughput"],
    "TTFT p50 ms": lambda s: (s["ttft_ms"] or {}).get("p50"),
    "TTFT p99 ms": lambda s: (s["ttft_ms"] or {}).get("p99"),
    "TPOT p50 ms": lambda s: (s["tpot_ms"] or {}).get("p50"),
    "cache %": lambda s: None if s["cache_share"] is None else 100 * s["cache_share"],
    "failed": lambda s: s["failed"],
    "client CPU %": lambda s: 100 * s["client_cpu_share"],
}


def _median(values: list[Any]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def median_table(runs: list[dict[str, Any]], labels: tuple[str, str]) -> str:
    """Markdown: one row per case and server, medians over repetitions, and the ratio row."""
    head = "| workload | server | reps | " + " | ".join(KEYS) + " |"
    lines = [head, "|" + "---|" * (len(KEYS) + 3)]
    for case in dict.fromkeys(r["case"] for r in runs):
        meds = {}
        for label in labels:
            mine = [r["summary"] for r in runs if r["case"] == case and r["server"] == label]
            meds[label] = {k: _median([f(s) for s in mine]) for k, f in KEYS.items()}
            cells = " | ".join(_fmt(meds[label][k]) for k in KEYS)
            lines.append(f"| {case} | {label} | {len(mine)} | {cells} |")
        a, b = (meds[label] for label in labels)
        ratio = " | ".join(_fmt(_ratio(a[k], b[k])) for k in KEYS)
        lines.append(f"| {case} | ratio {labels[0]}/{labels[1]} | | {ratio} |")
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _extract_steps(trace: Path, t0: float, t1: float, out: Path) -> int:
    """Copy the step records stamped within [t0, t1] (wall clock) to `out`."""
    n = 0
    with open(trace, encoding="utf-8") as src, open(out, "w", encoding="utf-8") as dst:
        for line in src:
            if line.strip() and t0 <= json.loads(line)["time"] <= t1:
                dst.write(line)
                n += 1
    return n


async def _run_case(case: Case, url: str, label: str,
                    args: argparse.Namespace) -> dict[str, Any]:
    cfg = BenchConfig(url, concurrency=case.concurrency, warmup=args.warmup, label=label,
                      progress=sys.stderr.isatty(), token_range=tuple(args.token_range))
    return summarize(await run_bench(case.workload, cfg))


def _picture(trace: Path, window: tuple[float, float], out_dir: Path, title: str) -> None:
    from kvloop.viz.html import render_html
    from kvloop.viz.png import render_png
    from kvloop.viz.schedule import format_summary, load_schedule

    steps = out_dir / "schedule_steps.jsonl"
    if _extract_steps(trace, *window, steps) == 0:
        print("no step records in the picture's window", file=sys.stderr)
        return
    data = load_schedule(str(steps))
    render_png(data, str(out_dir / "schedule.png"), title)
    render_html(data, str(out_dir / "schedule.html"), title)
    print(format_summary(data))


def pick_run(runs: list[dict[str, Any]], case: str, server: str,
             which: str = "median") -> dict[str, Any] | None:
    """The run of `case` on `server` with the median (or the highest) output throughput."""
    mine = sorted((r for r in runs if r["case"] == case and r["server"] == server),
                  key=lambda r: r["summary"]["output_throughput"])
    if not mine:
        return None
    return mine[-1] if which == "fastest" else mine[(len(mine) - 1) // 2]


def read_runs(out: Path) -> list[dict[str, Any]]:
    with open(out / "runs.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def draw_picture(out: Path, case: str, which: str = "median", server: str = "kvloop") -> None:
    """The schedule picture of one run of `case`, from `runs.jsonl` and the trace file."""
    run = pick_run(read_runs(out), case, server, which)
    if run is None:
        print(f"no {server} run of {case!r} in {out / 'runs.jsonl'}", file=sys.stderr)
        return
    s = run["summary"]
    title = (f"kvloop, {case}, repetition {run['rep'] + 1} ({which} output tok/s of the "
             f"repetitions; embedded SmolLM2-135M, 2 CPU cores)")
    _picture(out / "kvloop_steps.jsonl", (s["started_at"], s["started_at"] + s["duration_s"]),
             out, title)


def per_run_table(runs: list[dict[str, Any]], labels: tuple[str, str]) -> str:
    """Markdown: every repetition of every case, with the machine's load average."""
    lines = [f"| workload | rep | load (1 min) | {labels[0]} output tok/s | "
             f"{labels[1]} output tok/s | ratio | {labels[0]} TPOT p50 ms | "
             f"{labels[1]} TPOT p50 ms |", "|---|---|---|---|---|---|---|---|"]
    pairs: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for r in runs:
        pairs.setdefault((r["case"], r["rep"]), {})[r["server"]] = r
    for (case, rep), by in pairs.items():
        a, b = (by[label]["summary"] for label in labels)
        tpot = [(s["tpot_ms"] or {}).get("p50") for s in (a, b)]
        lines.append(f"| {case} | {rep + 1} | {by[labels[0]]['load_avg_1m']:.1f} | "
                     f"{_fmt(a['output_throughput'])} | {_fmt(b['output_throughput'])} | "
                     f"{_fmt(_ratio(a['output_throughput'], b['output_throughput']))} | "
                     f"{_fmt(tpot[0])} | {_fmt(tpot[1])} |")
    return "\n".join(lines)


def merge(dirs: list[Path], out: Path, labels: tuple[str, str], quiet_load: float) -> None:
    """Pool the runs of several output folders (repetitions renumbered) and write tables."""
    runs: list[dict[str, Any]] = []
    for d in dirs:
        offset = 1 + max((r["rep"] for r in runs), default=-1)
        runs += [{**r, "rep": r["rep"] + offset} for r in read_runs(d)]
    order = {c: i for i, c in enumerate(dict.fromkeys(r["case"] for r in runs))}
    runs.sort(key=lambda r: (order[r["case"]], r["rep"]))
    quiet = [r for r in runs if r["load_avg_1m"] <= quiet_load]
    text = (f"All {1 + max(r['rep'] for r in runs)} repetitions, medians:\n\n"
            f"{median_table(runs, labels)}\n\nRepetitions run while the machine's 1-minute "
            f"load average was <= {quiet_load:g}, medians:\n\n{median_table(quiet, labels)}"
            f"\n\nEvery repetition:\n\n{per_run_table(runs, labels)}\n")
    out.mkdir(parents=True, exist_ok=True)
    (out / "figures.md").write_text(text)
    print(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvloop.bench.figures",
                                 description=__doc__.split("\n\n")[0],
                                                           formatter_class=HelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply request counts")
    ap.add_argument("--counts", type=int, nargs=4, default=list(FULL_COUNTS),
                    metavar=("C1", "C8", "C32", "SHARED"), help="requests of each case")
    ap.add_argument("--only", nargs="*", help="run only cases whose name starts with these")
    ap.add_argument("--out-dir", default="out/figures")
    ap.add_argument("--serve-args", default="", help="extra `kvloop serve` arguments")
    ap.add_argument("--anchor-url", help="a running anchor server (default: start hf_server)")
    ap.add_argument("--anchor-label", default="hf-transformers")
    ap.add_argument("--anchor-args", default="--dtype bf16", help="hf_server arguments")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--picture", default="random 256/128 c=8")
    ap.add_argument("--picture-only", action="store_true",
                    help="only redraw the picture from the files of an earlier run")
    ap.add_argument("--picture-run", choices=("median", "fastest"), default="median",
                    help="which repetition of --picture to draw")
    ap.add_argument("--merge", nargs="+", metavar="DIR",
                    help="only pool the runs.jsonl of earlier --out-dir folders into tables")
    ap.add_argument("--quiet-load", type=float, default=2.5,
                    help="--merge: also tabulate runs with a load average at most this")
    ap.add_argument("--token-range", type=int, nargs=2, default=list(w.DEFAULT_TOKEN_RANGE))
    args = ap.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        merge([Path(d) for d in args.merge], out, ("kvloop", args.anchor_label),
              args.quiet_load)
        return 0
    if args.picture_only:
        draw_picture(out, args.picture, args.picture_run)
        return 0
    def todo(rep: int) -> list[Case]:
        return [c for c in cases(args.scale, rep, tuple(args.token_range), tuple(args.counts))
                if not args.only or any(c.name.startswith(p) for p in args.only)]

    trace = out / "kvloop_steps.jsonl"
    if trace.exists():
        trace.unlink()
    py = sys.executable
    kv = ServeProcess(["--trace-file", str(trace), *shlex.split(args.serve_args)],
                      out / "kvloop_serve.log")
    anchor = None if args.anchor_url else UrlProcess(
        [py, "-m", "kvloop.bench.hf_server", "--port", "0", *shlex.split(args.anchor_args)],
        out / "anchor.log", announced_url(hf_server.ANNOUNCEMENT))
    labels = ("kvloop", args.anchor_label)
    runs: list[dict[str, Any]] = []
    try:
        kv.start(timeout_s=900)
        anchor_url = args.anchor_url or anchor.start(timeout_s=900).url  # type: ignore[union-attr]
        print(f"kvloop {kv.url}; anchor {anchor_url}", flush=True)
        for rep in range(args.reps):
            for case in todo(rep):
                a = asyncio.run(_run_case(case, kv.url, labels[0], args))
                b = asyncio.run(_run_case(case, anchor_url, labels[1], args))
                print(f"\n== rep {rep + 1}/{args.reps}: {case.name}\n{format_compare(a, b)}",
                      flush=True)
                load = os.getloadavg()[0]
                for label, s in zip(labels, (a, b), strict=True):
                    runs.append({"rep": rep, "case": case.name, "server": label,
                                 "load_avg_1m": load, "summary": s})
                with open(out / "runs.jsonl", "a", encoding="utf-8") as f:
                    for r in runs[-2:]:
                        f.write(json.dumps(r) + "\n")
    finally:
        kv.stop(timeout_s=30)
        if anchor is not None:
            anchor.stop(timeout_s=30)
    table = median_table(runs, labels)
    (out / "figures.md").write_text(table + "\n")
    print("\n" + table)
    draw_picture(out, args.picture, args.picture_run)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
