"""Nothing the API server keeps per request outlives it (issue 37, low: one engine's RSS
grew 85 % in a five-minute soak). A real `kvloop serve --model sim` gets rounds of mixed
requests (`kvloop.bench.probe.mixed_requests`: completions with logprobs, prompt logprobs,
chat with n=2, embeddings, tokenize, streams the client leaves early); after each batch the
API server tracks no request (`/load`), the engine holds none and every KV block is free,
and the metrics page has exactly as many series as after the first batch (no per-request
label). The engine's own containers: tests/test_engine_bounded.py."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from kvloop.bench.probe import mixed_requests
from kvloop.front.launcher import ServeProcess

from .conftest import serving, wait_until

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with serving(tmp_path_factory, "serve_bounded", [
            "--model", "sim", "--sim-speedup", "50", "--served-model-name", "sim",
            "--max-model-len", "1024"]) as srv:
        yield srv


def settled(srv: ServeProcess) -> int:
    """Once nothing is in flight: the number of series on the metrics page."""
    wait_until(lambda: httpx.get(srv.url + "/load").json()["server_load"] == 0, 30,
               "the API server to track no request")
    stats = srv.wait_idle(30)
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
    page = httpx.get(srv.url + "/metrics").text
    return sum(1 for line in page.splitlines() if line and not line.startswith("#"))


def test_mixed_requests_leave_nothing_behind(server: ServeProcess) -> None:
    statuses: Counter[str] = Counter()
    sent = asyncio.run(mixed_requests(server.url, "sim", 10, statuses))
    series = settled(server)
    for _ in range(3):
        sent += asyncio.run(mixed_requests(server.url, "sim", 10, statuses))
        assert settled(server) == series
    assert sent == 240 and statuses == {"200": 200, "cut": 40}
