"""`kvloop trace`: the schedule grid, its PNG and its HTML page, checked against the trace."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvloop.cli import main as cli_main
from kvloop.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from kvloop.core.engine import EngineCore
from kvloop.core.request import SamplingParams
from kvloop.core.trace import TraceWriter
from kvloop.sim.runner import SimRunner
from kvloop.viz.html import DATA_ELEMENT_ID, page_html, render_html
from kvloop.viz.png import render_png
from kvloop.viz.schedule import build_schedule, cell_fraction, load_schedule, read_records

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--enable-logging=stderr",
                  "--v=0"]


def _record_run(path: Path, num_gpu_blocks: int = 14) -> None:
    """A real engine run with a small pool: chunked prefill, prefix hits and preemptions."""
    cfg = EngineConfig(cache=CacheConfig(num_gpu_blocks=num_gpu_blocks),
                       scheduler=SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=6))
    engine = EngineCore(cfg, SimRunner())
    shared = list(range(1000, 1032))
    for i in range(9):
        own = [2000 + 100 * i + k for k in range(8 + 9 * i % 40)]
        prompt = (shared + own) if i % 3 else own
        engine.add_request(engine.make_request(
            f"r{i}", prompt, SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True)))
    writer = TraceWriter(str(path))
    while engine.has_unfinished_requests():
        result = engine.step()
        if result.record is not None:
            writer.write(result.record)
    writer.close()


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "steps.jsonl"
    _record_run(path)
    return path


def _expected(trace_file: Path) -> tuple[list[dict], set[tuple[int, str, str]], list[str]]:
    records = [json.loads(line) for line in trace_file.read_text().splitlines()]
    cells = {(col, rid, work["kind"]) for col, rec in enumerate(records)
             for rid, work in rec["scheduled"].items()}
    ids: list[str] = []
    for rec in records:
        for rid in [*rec["admitted"], *rec["scheduled"], *rec["preempted"], *rec["finished"]]:
            if rid not in ids:
                ids.append(rid)
    return records, cells, ids


def test_the_recorded_run_has_every_feature_the_picture_shows(trace_file: Path) -> None:
    records, cells, ids = _expected(trace_file)
    kinds = {k for _, _, k in cells}
    assert {"prefill", "decode", "recompute"} <= kinds
    assert any(rec["preempted"] for rec in records)
    assert any(hit > 0 for rec in records for hit in rec["admitted"].values())
    assert len(ids) == 9


def test_schedule_grid_matches_the_trace(trace_file: Path) -> None:
    records, cells, ids = _expected(trace_file)
    data = load_schedule(str(trace_file))
    assert data.request_ids == ids
    assert [c.step for c in data.columns] == [r["step"] for r in records]
    assert {(c.col, data.request_ids[c.row], c.kind) for c in data.cells} == cells
    assert len(data.cells) == len(cells)
    assert data.summary()["preemptions"] == sum(len(r["preempted"]) for r in records)
    window = load_schedule(str(trace_file), slice(3, 7))
    assert [c.step for c in window.columns] == [r["step"] for r in records[3:7]]


def test_summary_figures_on_a_known_trace() -> None:
    def rec(step: int, sched: dict[str, tuple[int, str]], budget: int = 10,
            preempted: tuple[str, ...] = ()) -> str:
        return json.dumps({
            "step": step, "time": 0.0, "duration_s": 0.002, "budget": budget,
            "total_tokens": sum(n for n, _ in sched.values()),
            "scheduled": {r: {"tokens": n, "kind": k, "num_computed_before": 0}
                          for r, (n, k) in sched.items()},
            "preempted": list(preempted), "admitted": {}, "finished": {}})
    lines = [rec(0, {"a": (8, "prefill")}),
             rec(1, {"a": (1, "decode"), "b": (4, "prefill")}),
             rec(2, {"a": (1, "decode")}, preempted=("b",)),
             rec(3, {"b": (5, "recompute"), "a": (3, "spec")})]
    s = build_schedule(read_records(lines)).summary()
    assert s["steps"] == 4 and s["requests"] == 2
    assert s["mixed_step_share"] == pytest.approx(0.5)           # steps 1 and 3
    assert s["mean_budget_use"] == pytest.approx((0.8 + 0.5 + 0.1 + 0.8) / 4)
    assert s["preemptions"] == 1
    assert s["tokens_by_kind"] == {"prefill": 12, "recompute": 5, "decode": 2, "spec": 3}
    assert s["mean_step_ms"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="line 2"):
        read_records([lines[0], '{"no": "steps"}'])


def test_draft_tokens_are_their_own_kind(tmp_path: Path) -> None:
    """A speculative run (the simulator copying its prompt): each spec cell is 1 + k tokens,
    the drafts count as "spec" and the decode token as "decode", accepted drafts are kept,
    and both pictures carry them."""
    cfg = EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
                       speculative=SpeculativeConfig(num_speculative_tokens=4,
                                                     prompt_lookup_min=2))
    engine = EngineCore(cfg, SimRunner(copy_rate=1.0))
    phrase = list(range(700, 716))
    for i in range(3):
        engine.add_request(engine.make_request(
            f"s{i}", [i] + phrase + [99] + phrase[:3 + i],
            SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)))
    path = tmp_path / "spec.jsonl"
    writer = TraceWriter(str(path))
    while engine.has_unfinished_requests():
        writer.write(engine.step().record)
    writer.close()
    works = [w for line in path.read_text().splitlines()
             for w in json.loads(line)["scheduled"].values()]
    spec = [w for w in works if w["kind"] == "spec"]
    assert spec and all(w["tokens"] == 1 + w["draft_tokens"] for w in spec)
    assert all(0 <= w["accepted_tokens"] <= w["draft_tokens"] <= 4 for w in spec)
    assert all("draft_tokens" not in w for w in works if w["kind"] != "spec")
    data = load_schedule(str(path))
    s = data.summary()
    assert s["tokens_by_kind"]["spec"] == sum(w["draft_tokens"] for w in spec)
    assert s["tokens_by_kind"]["decode"] == (len(spec) + sum(
        w["tokens"] for w in works if w["kind"] == "decode"))
    assert s["accepted_draft_tokens"] == sum(w["accepted_tokens"] for w in spec) > 0
    info = render_png(data, str(tmp_path / "spec.png"), "spec")
    assert sum(c.kind == "spec" for c in info.cells) == len(spec)
    page = page_html(data, "spec")
    doc = json.loads(re.search(rf'id="{DATA_ELEMENT_ID}">(.*?)</script>', page, re.S).group(1))
    assert doc["fields"]["cells"][5:] == ["drafts", "accepted"]
    assert sorted((c[5], c[6]) for c in doc["cells"] if doc["kinds"][c[2]] == "spec") == \
        sorted((w["draft_tokens"], w["accepted_tokens"]) for w in spec)


def test_cell_height_grows_with_tokens() -> None:
    assert cell_fraction(1, 512) == pytest.approx(0.25)
    assert cell_fraction(512, 512) == pytest.approx(1.0)
    assert cell_fraction(1, 512) < cell_fraction(16, 512) < cell_fraction(200, 512)


def test_png_draws_one_cell_per_scheduled_request_step(trace_file: Path, tmp_path) -> None:
    records, cells, ids = _expected(trace_file)
    data = load_schedule(str(trace_file))
    out = tmp_path / "schedule.png"
    info = render_png(data, str(out), "test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (info.num_rows, info.num_cols) == (len(ids), len(records))
    drawn = {(c.col, ids[c.row], c.kind) for c in info.cells}
    assert len(info.cells) == len(cells) and drawn == cells
    assert info.num_preemption_marks == sum(len(r["preempted"]) for r in records)
    assert info.width_px > 1000 and info.height_px > 500


def test_html_embeds_the_schedule(trace_file: Path) -> None:
    records, cells, ids = _expected(trace_file)
    page = page_html(load_schedule(str(trace_file)), "t</script>")
    assert "http://" not in page and "https://" not in page      # self-contained
    m = re.search(rf'<script type="application/json" id="{DATA_ELEMENT_ID}">(.*?)</script>',
                  page, re.S)
    assert m is not None
    doc = json.loads(m.group(1))
    assert doc["request_ids"] == ids and len(doc["columns"]) == len(records)
    assert {(c[0], ids[c[1]], doc["kinds"][c[2]]) for c in doc["cells"]} == cells


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _open_in_chromium(page: Path, profile: Path) -> tuple[str, list[str]]:
    """Load `page#selftest` headless; return the DOM after scripts ran and console lines."""
    exe = _chromium()
    assert exe is not None
    proc = subprocess.run(
        [exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom",
         page.resolve().as_uri() + "#selftest"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    return proc.stdout, console


def _body_attrs(dom: str) -> dict[str, str]:
    m = re.search(r"<body([^>]*)>", dom, re.S)
    assert m is not None, dom[:500]
    return dict(re.findall(r'([\w-]+)="([^"]*)"', m.group(1)))


needs_chromium = pytest.mark.skipif(_chromium() is None,
                                    reason="chromium is not installed (make install-test)")


@pytest.mark.processes
@needs_chromium
def test_html_page_renders_in_headless_chromium(trace_file: Path, tmp_path) -> None:
    records, cells, ids = _expected(trace_file)
    page = tmp_path / "schedule.html"
    render_html(load_schedule(str(trace_file)), str(page), "schedule")
    dom, console = _open_in_chromium(page, tmp_path / "profile")
    assert console == []
    attrs = _body_attrs(dom)
    assert attrs["data-rows"] == str(len(ids))
    assert attrs["data-cols"] == str(len(records))
    assert attrs["data-cells-drawn"] == str(len(cells))
    first_rid, first = next(iter(records[0]["scheduled"].items()))
    hover = attrs["data-selftest-hover"]
    assert hover.startswith(f"request {first_rid}\n{first['kind']}: {first['tokens']} tokens")
    assert f"step {records[0]['step']} (column 0)" in hover
    assert attrs["data-selftest-zoom"] == "ok"


@pytest.mark.processes
@needs_chromium
def test_the_chromium_check_catches_script_errors(tmp_path) -> None:
    page = tmp_path / "broken.html"
    page.write_text("<html><body><script>undefinedFunction();</script></body></html>")
    _, console = _open_in_chromium(page, tmp_path / "profile")
    assert len(console) == 1 and "undefinedFunction" in console[0]


def test_cli_trace_writes_png_html_and_summary(trace_file: Path, tmp_path, capsys) -> None:
    png, page = tmp_path / "s.png", tmp_path / "s.html"
    assert cli_main(["trace", str(trace_file), "--out", str(png), "--html", str(page),
                     "--steps", "0:10"]) == 0
    out = capsys.readouterr().out
    assert png.stat().st_size > 1000 and page.stat().st_size > 1000
    assert re.search(r"^10 steps, \d+ requests; [\d.]+% of steps mixed", out, re.M)
    assert cli_main(["trace", str(tmp_path / "missing.jsonl")]) == 2
    assert cli_main(["trace", str(trace_file), "--steps", "x"]) == 2
