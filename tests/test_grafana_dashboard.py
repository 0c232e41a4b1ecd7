"""docs/grafana/kvloop.json: every query names only metrics that kvloop exports (the API
server's, with a KV connector and speculative decoding, and the router's with flow control),
and the panels docs/tracing.md lists are there."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import generate_latest

from kvloop.router.config import RouterConfig
from kvloop.router.flow import FlowControl
from kvloop.router.router import Router
from kvloop.server.metrics import ServerMetrics

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "kvloop.json"
METRIC = re.compile(r"(?:vllm:|kvloop:|kvloop_)[A-Za-z0-9_:]+")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
            "gauge": ("",), "info": ("_info",), "summary": ("_sum", "_count", "")}


def _series_names(exposition: str) -> set[str]:
    out = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            if kind == "counter":   # its TYPE line names it with _total (no _created)
                name = name.removesuffix("_total")
            out.update(name + s for s in SUFFIXES[kind])
    return out


def exported() -> set[str]:
    server = ServerMetrics("m", 4096, kv_transfer=True, num_speculative_tokens=1)
    router = Router(RouterConfig())
    try:
        FlowControl(RouterConfig().flow, router.serving_pool, router.clock, router.metrics.prom)
        text = generate_latest(server.registry).decode() + router.metrics.render().decode()
    finally:
        router.shutdown()
    return _series_names(text)


def test_every_query_names_an_exported_metric():
    dash = json.loads(DASHBOARD.read_text())
    names = exported()
    assert "vllm:num_requests_waiting_by_reason" in names   # the parser sees the families
    used: dict[str, str] = {}
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        for t in panel["targets"]:
            found = METRIC.findall(t["expr"])
            assert found, (panel["title"], t["expr"])
            used.update((m, panel["title"]) for m in found)
    unknown = {m: title for m, title in used.items() if m not in names}
    assert not unknown, unknown


def test_the_panels_the_issue_asks_for_are_there():
    titles = " | ".join(p["title"] for p in json.loads(DASHBOARD.read_text())["panels"])
    for words in ("predicted vs workers reported", "Time to first token",
                  "Time per output token", "queue per priority band", "Alarms", "Tier hits",
                  "KV transfer time", "waiting requests by reason"):
        assert words in titles, words


def test_a_name_kvloop_does_not_export_is_caught():
    assert "vllm:no_such_metric" not in exported()
    assert METRIC.findall("rate(vllm:no_such_metric_total[5m])") == ["vllm:no_such_metric_total"]
