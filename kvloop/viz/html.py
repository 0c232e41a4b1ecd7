"""The schedule as one self-contained HTML page: canvas drawing, zoom, pan, hover numbers.

No network: the data is embedded as JSON (`<script type="application/json"
id="kvloop-schedule">`) and the drawing code is inline. Mouse wheel zooms the step axis
around the cursor (shift + wheel: the request axis), drag pans, double-click resets, and
hovering a cell shows its numbers. After drawing, the page writes what it drew into
`<body data-rows data-cols data-cells-drawn>`; with `#selftest` in the URL it also hovers
the first cell and zooms once and records the outcome (`data-selftest-*`), so a headless
browser can check the page without a human.
"""

from __future__ import annotations

import html
import json
from typing import Any

from kvloop.viz.png import COLORS
from kvloop.viz.schedule import KINDS, ScheduleData, format_summary

DATA_ELEMENT_ID = "kvloop-schedule"


def schedule_payload(data: ScheduleData, title: str) -> dict[str, Any]:
    """The JSON the page draws from (compact arrays; column order documented by `fields`)."""
    kind_index = {k: i for i, k in enumerate(KINDS)}
    return {
        "title": title,
        "summary": format_summary(data),
        "kinds": list(KINDS),
        "colors": [COLORS[k] for k in KINDS],
        "request_ids": data.request_ids,
        "fields": {
            "columns": ["step", "duration_ms", "budget", "total_tokens", "kv_blocks_used",
                        "kv_blocks_total", *[f"tokens_{k}" for k in KINDS]],
            "cells": ["col", "row", "kind", "tokens", "computed_before", "drafts",
                      "accepted"],
        },
        "columns": [[c.step, round(c.duration_ms, 3), c.budget, c.total_tokens,
                     c.kv_blocks_used, c.kv_blocks_total,
                     *[c.tokens_by_kind.get(k, 0) for k in KINDS]] for c in data.columns],
        "cells": [[c.col, c.row, kind_index[c.kind], c.tokens, c.computed_before, c.drafts,
                   c.accepted] for c in data.cells],
        "admissions": [[m.col, m.row, m.value] for m in data.admissions],
        "preemptions": [[m.col, m.row] for m in data.preemptions],
        "finishes": [[m.col, m.row, m.value] for m in data.finishes],
    }


def page_html(data: ScheduleData, title: str = "") -> str:
    payload = json.dumps(schedule_payload(data, title), separators=(",", ":"))
    payload = payload.replace("</", "<\\/")  # never close the script element early
    return (_PAGE.replace("@@TITLE@@", html.escape(title or "kvloop schedule"))
            .replace("@@DATA_ID@@", DATA_ELEMENT_ID)
            .replace("@@DATA@@", payload)
            .replace("@@SCRIPT@@", _SCRIPT))


def render_html(data: ScheduleData, path: str, title: str = "") -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(page_html(data, title))


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>@@TITLE@@</title>
<style>
body { font: 13px system-ui, sans-serif; margin: 12px; color: #222; }
h1 { font-size: 16px; margin: 0 0 4px 0; }
#summary { color: #444; margin-bottom: 6px; }
#legend span { display: inline-block; margin-right: 14px; }
#legend i { display: inline-block; width: 12px; height: 12px; vertical-align: -2px;
            margin-right: 4px; }
.panel { position: relative; border: 1px solid #ccc; margin-top: 6px; }
canvas { display: block; width: 100%; cursor: crosshair; }
#tip { position: fixed; pointer-events: none; background: rgba(255,255,255,0.96);
       border: 1px solid #888; padding: 4px 6px; font: 12px monospace; white-space: pre;
       display: none; z-index: 10; }
#help { color: #666; font-size: 12px; }
button { font-size: 12px; }
</style>
</head>
<body>
<h1>@@TITLE@@</h1>
<div id="summary"></div>
<div id="legend"></div>
<div id="help">wheel: zoom steps &middot; shift+wheel: zoom requests &middot; drag: pan
&middot; double-click: reset <button id="reset">reset</button></div>
<div class="panel"><canvas id="grid"></canvas></div>
<div class="panel"><canvas id="tokens" height="140"></canvas></div>
<div class="panel"><canvas id="time" height="100"></canvas></div>
<div id="tip"></div>
<script type="application/json" id="@@DATA_ID@@">@@DATA@@</script>
<script>
@@SCRIPT@@
</script>
</body>
</html>
"""

_SCRIPT = r"""
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("kvloop-schedule").textContent);
  const NROWS = D.request_ids.length, NCOLS = D.columns.length;
  const LABEL_W = 110;
  const GRID_ROW_PX = Math.max(6, Math.min(18, Math.floor(600 / Math.max(NROWS, 1))));
  const byCol = [], cellAt = new Map(), marks = new Map();
  let maxTokens = 1;
  for (let i = 0; i < NCOLS; i++) byCol.push([]);
  D.cells.forEach(function (c, i) {
    byCol[c[0]].push(i);
    cellAt.set(c[0] * NROWS + c[1], i);
    if (c[3] > maxTokens) maxTokens = c[3];
  });
  function addMark(list, text) {
    list.forEach(function (m) {
      const key = m[0] * NROWS + m[1];
      marks.set(key, (marks.has(key) ? marks.get(key) + "\n" : "") + text(m));
    });
  }
  addMark(D.admissions, function (m) {
    return m[2] ? "admitted, prefix-cache hit " + m[2] + " tokens"
                : "admitted (no prefix-cache hit)";
  });
  addMark(D.preemptions, function () { return "PREEMPTED (blocks freed, will recompute)"; });
  addMark(D.finishes, function (m) { return "finished: " + m[2]; });

  const view = { x0: 0, x1: Math.max(NCOLS, 1), y0: 0, y1: Math.max(NROWS, 1) };
  const grid = document.getElementById("grid"), tokens = document.getElementById("tokens");
  const time = document.getElementById("time"), tip = document.getElementById("tip");
  grid.height = Math.max(NROWS, 1) * GRID_ROW_PX + 20;
  let cellsDrawn = 0;

  function frac(t) {
    if (maxTokens <= 1) return 1;
    return 0.25 + 0.75 * Math.log1p(Math.max(t, 1) - 1) / Math.log1p(maxTokens - 1);
  }
  function setup(cv) {
    const dpr = window.devicePixelRatio || 1, w = cv.clientWidth || 800;
    const h = cv.getAttribute("height") * 1;
    if (cv.width !== Math.round(w * dpr)) {
      cv.width = Math.round(w * dpr); cv.height = Math.round(h * dpr);
    }
    cv.style.height = h + "px";
    const ctx = cv.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    return { ctx: ctx, w: w, h: h };
  }
  function xOf(col, w) { return LABEL_W + (col - view.x0) / (view.x1 - view.x0) * (w - LABEL_W); }
  function colAt(px, w) { return view.x0 + (px - LABEL_W) / (w - LABEL_W) * (view.x1 - view.x0); }
  function visibleCols() {
    return [Math.max(0, Math.floor(view.x0)), Math.min(NCOLS, Math.ceil(view.x1))];
  }

  function drawGrid() {
    const s = setup(grid), ctx = s.ctx, h = s.h - 20;
    const rowH = h / (view.y1 - view.y0);
    const yOf = function (row) { return (row - view.y0) * rowH; };
    const vc = visibleCols();
    cellsDrawn = 0;
    for (let col = vc[0]; col < vc[1]; col++) {
      const xa = xOf(col, s.w), xb = xOf(col + 1, s.w);
      const gap = (xb - xa) > 4 ? 1 : 0;
      byCol[col].forEach(function (i) {
        const c = D.cells[i];
        if (c[1] + 1 < view.y0 || c[1] > view.y1) return;
        const f = 0.9 * frac(c[3]), y = yOf(c[1] + (1 - f) / 2);
        ctx.fillStyle = D.colors[c[2]];
        ctx.fillRect(xa + gap, y, Math.max(xb - xa - 2 * gap, 0.5), Math.max(f * rowH, 0.5));
        if (D.kinds[c[2]] === "recompute") {
          ctx.strokeStyle = "#7a3a00"; ctx.lineWidth = 1;
          ctx.beginPath(); ctx.moveTo(xa, y + f * rowH); ctx.lineTo(xb, y); ctx.stroke();
        }
        cellsDrawn++;
      });
    }
    ctx.fillStyle = "#d62728";
    D.preemptions.forEach(function (m) {
      const x = (xOf(m[0], s.w) + xOf(m[0] + 1, s.w)) / 2, y = yOf(m[1] + 0.5);
      if (x < LABEL_W || x > s.w) return;
      ctx.font = "bold " + Math.max(9, Math.min(14, rowH)) + "px sans-serif";
      ctx.textAlign = "center"; ctx.textBaseline = "middle"; ctx.fillText("\u00d7", x, y);
    });
    ctx.fillStyle = "#111";
    D.admissions.forEach(function (m) {
      if (!m[2]) return;
      const x = xOf(m[0], s.w), y = yOf(m[1] + 0.5), r = Math.max(3, Math.min(6, rowH / 3));
      if (x < LABEL_W || x > s.w) return;
      ctx.beginPath(); ctx.moveTo(x - r, y - r); ctx.lineTo(x + r * 0.6, y);
      ctx.lineTo(x - r, y + r);
      ctx.closePath(); ctx.fill();
    });
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, LABEL_W - 2, h);
    ctx.fillStyle = "#333"; ctx.font = "10px monospace"; ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    const stride = Math.max(1, Math.ceil(12 / rowH));
    for (let r = Math.max(0, Math.floor(view.y0)); r < Math.min(NROWS, view.y1); r += stride) {
      ctx.fillText(D.request_ids[r].slice(-16), LABEL_W - 6, yOf(r + 0.5));
    }
    axis(ctx, s.w, h);
  }
  function axis(ctx, w, y) {
    ctx.fillStyle = "#333"; ctx.font = "10px sans-serif"; ctx.textAlign = "center";
    ctx.textBaseline = "top";
    const span = view.x1 - view.x0;
    const step = Math.pow(10, Math.floor(Math.log10(Math.max(span / 8, 1))));
    const tick = step * ((span / step > 40) ? 5 : (span / step > 16 ? 2 : 1));
    for (let c = Math.ceil(view.x0 / tick) * tick; c < view.x1; c += tick) {
      ctx.fillText(String(c), xOf(c + 0.5, w), y + 4);
    }
  }
  function drawSeries(cv, values, colors, line, label) {
    const s = setup(cv), ctx = s.ctx, h = s.h - 4, vc = visibleCols();
    let top = 1;
    for (let col = vc[0]; col < vc[1]; col++) {
      const sum = values[col].reduce(function (a, b) { return a + b; }, 0);
      top = Math.max(top, sum, line ? line[col] : 0);
    }
    for (let col = vc[0]; col < vc[1]; col++) {
      const xa = xOf(col, s.w), xb = xOf(col + 1, s.w);
      let y = h;
      values[col].forEach(function (v, k) {
        const hh = v / top * (h - 14);
        ctx.fillStyle = colors[k]; ctx.fillRect(xa, y - hh, Math.max(xb - xa, 0.5), hh); y -= hh;
      });
      if (line) {
        const ly = h - line[col] / top * (h - 14);
        ctx.strokeStyle = "#000"; ctx.lineWidth = 1;
        ctx.beginPath(); ctx.moveTo(xa, ly); ctx.lineTo(xb, ly); ctx.stroke();
      }
    }
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, LABEL_W - 2, s.h);
    ctx.fillStyle = "#333"; ctx.font = "10px sans-serif"; ctx.textAlign = "right";
    ctx.textBaseline = "top"; ctx.fillText(label, LABEL_W - 6, 2);
    ctx.fillText("max " + (top >= 10 ? Math.round(top) : top.toPrecision(2)), LABEL_W - 6, 16);
  }
  function draw() {
    drawGrid();
    drawSeries(tokens, D.columns.map(function (c) { return c.slice(6); }), D.colors,
               D.columns.map(function (c) { return c[2]; }), "tokens / budget");
    drawSeries(time, D.columns.map(function (c) { return [c[1]]; }), ["#777"], null, "step ms");
  }

  function columnText(col) {
    const c = D.columns[col];
    return "step " + c[0] + " (column " + col + ")\ntokens " + c[3] + " / budget " + c[2] +
      "\nstep time " + c[1].toFixed(2) + " ms\nKV blocks " + c[4] + " / " + c[5];
  }
  function hoverText(cv, mx, my) {
    const w = cv.clientWidth || 800;
    if (mx < LABEL_W) return null;
    const col = Math.floor(colAt(mx, w));
    if (col < 0 || col >= NCOLS) return null;
    if (cv !== grid) return columnText(col);
    const row = Math.floor(view.y0 + my / (cv.getAttribute("height") - 20) * (view.y1 - view.y0));
    if (row < 0 || row >= NROWS) return null;
    const key = col * NROWS + row, lines = ["request " + D.request_ids[row]];
    if (cellAt.has(key)) {
      const c = D.cells[cellAt.get(key)];
      lines.push(D.kinds[c[2]] + ": " + c[3] + " tokens (computed before: " + c[4] + ")");
      if (c[5]) lines.push("drafts: " + c[5] + (c[6] === null ? "" : ", accepted: " + c[6]));
    }
    if (marks.has(key)) lines.push(marks.get(key));
    if (lines.length === 1) lines.push("(nothing this step)");
    return lines.join("\n") + "\n" + columnText(col);
  }
  function showTip(cv, ev) {
    const r = cv.getBoundingClientRect();
    const text = hoverText(cv, ev.clientX - r.left, ev.clientY - r.top);
    if (text === null) { tip.style.display = "none"; return; }
    tip.textContent = text; tip.style.display = "block";
    tip.style.left = (ev.clientX + 14) + "px"; tip.style.top = (ev.clientY + 14) + "px";
  }
  function clampView() {
    const spanX = Math.min(Math.max(view.x1 - view.x0, 1), Math.max(NCOLS, 1));
    view.x0 = Math.min(Math.max(view.x0, 0), Math.max(NCOLS, 1) - spanX); view.x1 = view.x0 + spanX;
    const spanY = Math.min(Math.max(view.y1 - view.y0, 1), Math.max(NROWS, 1));
    view.y0 = Math.min(Math.max(view.y0, 0), Math.max(NROWS, 1) - spanY); view.y1 = view.y0 + spanY;
  }
  function zoom(cv, ev) {
    ev.preventDefault();
    const r = cv.getBoundingClientRect(), f = ev.deltaY < 0 ? 0.8 : 1.25;
    if (ev.shiftKey && cv === grid) {
      const frac = (ev.clientY - r.top) / (cv.getAttribute("height") - 20);
      const at = view.y0 + frac * (view.y1 - view.y0);
      view.y0 = at - (at - view.y0) * f; view.y1 = at + (view.y1 - at) * f;
    } else {
      const at = colAt(ev.clientX - r.left, cv.clientWidth || 800);
      view.x0 = at - (at - view.x0) * f; view.x1 = at + (view.x1 - at) * f;
    }
    clampView(); draw();
  }
  let drag = null;
  [grid, tokens, time].forEach(function (cv) {
    cv.addEventListener("wheel", function (ev) { zoom(cv, ev); }, { passive: false });
    cv.addEventListener("mousemove", function (ev) {
      if (drag) {
        const w = cv.clientWidth || 800;
        const dx = (ev.clientX - drag.x) / (w - LABEL_W) * (drag.v.x1 - drag.v.x0);
        view.x0 = drag.v.x0 - dx; view.x1 = drag.v.x1 - dx;
        if (cv === grid) {
          const hy = cv.getAttribute("height") - 20;
          const dy = (ev.clientY - drag.y) / hy * (drag.v.y1 - drag.v.y0);
          view.y0 = drag.v.y0 - dy; view.y1 = drag.v.y1 - dy;
        }
        clampView(); draw();
      }
      showTip(cv, ev);
    });
    cv.addEventListener("mousedown", function (ev) {
      drag = { x: ev.clientX, y: ev.clientY, v: Object.assign({}, view) };
    });
    cv.addEventListener("mouseleave", function () { tip.style.display = "none"; });
    cv.addEventListener("dblclick", reset);
  });
  window.addEventListener("mouseup", function () { drag = null; });
  window.addEventListener("resize", draw);
  document.getElementById("reset").addEventListener("click", reset);
  function reset() {
    view.x0 = 0; view.x1 = Math.max(NCOLS, 1); view.y0 = 0; view.y1 = Math.max(NROWS, 1); draw();
  }

  document.getElementById("summary").textContent = D.summary;
  const legend = document.getElementById("legend");
  D.kinds.forEach(function (k, i) {
    const span = document.createElement("span"), sw = document.createElement("i");
    sw.style.background = D.colors[i]; span.appendChild(sw);
    span.appendChild(document.createTextNode(k)); legend.appendChild(span);
  });
  const px = document.createElement("span");
  px.textContent = "\u00d7 preempted"; px.style.color = "#d62728"; legend.appendChild(px);
  const hit = document.createElement("span");
  hit.textContent = "\u25b6 admitted with a prefix-cache hit"; legend.appendChild(hit);

  draw();
  const body = document.body;
  body.dataset.rows = String(NROWS);
  body.dataset.cols = String(NCOLS);
  body.dataset.cellsDrawn = String(cellsDrawn);

  if (location.hash === "#selftest") selftest();
  function selftest() {
    if (D.cells.length) {
      const c = D.cells[0], r = grid.getBoundingClientRect(), w = grid.clientWidth || 800;
      const rowH = (grid.getAttribute("height") - 20) / (view.y1 - view.y0);
      const ev = new MouseEvent("mousemove", {
        clientX: r.left + (xOf(c[0], w) + xOf(c[0] + 1, w)) / 2,
        clientY: r.top + (c[1] + 0.5 - view.y0) * rowH, bubbles: true });
      grid.dispatchEvent(ev);
      body.dataset.selftestHover = tip.textContent;
    }
    const before = view.x1 - view.x0, r = grid.getBoundingClientRect();
    grid.dispatchEvent(new WheelEvent("wheel", {
      deltaY: -100, clientX: r.left + (grid.clientWidth + LABEL_W) / 2, clientY: r.top + 5,
      bubbles: true, cancelable: true }));
    body.dataset.selftestZoom = (view.x1 - view.x0 < before || before <= 1) ? "ok" : "no-zoom";
    reset();
  }
})();
"""
