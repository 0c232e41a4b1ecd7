"""Drain through the router, with real simulated workers: stopping a worker costs clients nothing.

- SIGTERM with `--shutdown-timeout` to a worker holding a long stream: it says it drains
  (/metrics gauge, 503 with `x-kvloop-draining`), finishes the stream, and a back-to-back
  client through the router gets only 200s: refusals are routed again (a router that polls
  rarely, so the refusal path is what saves them) and the worker is left alone;
- a rolling restart of 4 workers under continuous load (each drained, stopped, restarted on
  its port): no failed request, the router sees each drain, no block
  leaked, the router's index equal to the workers' caches afterwards;
- a stream that outlives its worker's shutdown timeout migrates (`--migration-limit`).
"""

from __future__ import annotations

import asyncio
import functools
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace

import httpx
import pytest

from kvloop.front.drain import DRAINING_HEADER, DRAINING_METRIC
from kvloop.front.launcher import UrlProcess
from kvloop.front.prometheus_text import metric_value
from kvloop.router.fleet import Fleet, FleetConfig
from tests.conftest import RouterThread, sse_json, wait_until
from tests.test_router_faults import _hold, _settled, _stats
from tests.test_router_fleet import SIM_ARGS, router_config

pytestmark = pytest.mark.processes   # fleets of real workers; routers on threads

DRAIN_ARGS = ("--shutdown-timeout", "8")
LONG_TOKENS = 1000   # seconds: b still drains when the router sends it a request


@pytest.fixture
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    n, *extra = request.param
    f = Fleet(FleetConfig(n, "sim", ("both",), SIM_ARGS + DRAIN_ARGS + tuple(extra),
                          start_timeout_s=120, stop_timeout_s=10, echo_output=False))
    try:
        f.start()
        yield f
    finally:
        f.stop()


class Load:
    """`concurrency` clients sending short completions back to back through `url` until
    stopped; every answer's status (or exception name) counted."""

    def __init__(self, url: str, concurrency: int):
        self.url, self.concurrency = url, concurrency
        self.outcomes: Counter[str] = Counter()
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive()

    async def _run(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as client:
            await asyncio.gather(*(self._client(client, c) for c in range(self.concurrency)))

    async def _client(self, client: httpx.AsyncClient, c: int) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            body = {"prompt": [1000 + c * 997 + i * 13 + k for k in range(40)],
                    "max_tokens": 8, "ignore_eos": True, "stream": i % 2 == 0}
            try:
                r = await client.post("/v1/completions", json=body)
                ok = r.status_code == 200 and (b"error" not in r.content)
                self.outcomes[str(r.status_code)] += 1
                if not ok:
                    self.failures.append(f"{r.status_code} {r.text[:300]}")
            except httpx.HTTPError as e:
                self.outcomes[type(e).__name__] += 1
                self.failures.append(repr(e))


def _long_stream(url: str, max_tokens: int, out: list[int]) -> None:
    """A stream sent straight to a worker; `out` gets its status and its token count (its
    usage chunk's: a busy handler may stream several tokens in one chunk)."""
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
            "prompt": [7] * 40, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}) as r:
        out.append(r.status_code)
        chunks = sse_json(r.iter_lines())
    out.append(next(c["usage"]["completion_tokens"] for c in reversed(chunks) if c["usage"]))


@pytest.mark.parametrize("fleet", [(2, "--sim-speedup", "4", "--shutdown-timeout", "60")],
                         indirect=True)   # a grace the stream never outlives, however loaded
def test_a_draining_worker_is_left_alone_and_its_refusals_go_elsewhere(fleet):
    a, b = fleet.specs()
    # only the refusal path can save them; round-robin: the second request goes to b
    # whatever the router's stale view of its load (kv-aware would send it none)
    slow_poll = router_config("round-robin", poll_interval_s=30.0)
    with RouterThread(slow_poll, [a, b]) as rt:
        out: list[int] = []
        long = threading.Thread(target=_long_stream, args=(b.url, LONG_TOKENS, out))
        long.start()
        wait_until(lambda: out, 10, "the long stream to start")
        fleet.workers[1].signal(signal.SIGTERM)
        wait_until(lambda: metric_value(httpx.get(b.url + "/metrics").text,
                                        DRAINING_METRIC) == 1, 5, "the drain gauge")
        refused = httpx.post(b.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert refused.status_code == 503 and refused.headers[DRAINING_HEADER] == "1"
        assert httpx.get(b.url + "/health").status_code == 503
        for i in range(2):   # round-robin: one of them goes to b, is refused, goes to a
            r = httpx.post(rt.url + "/v1/completions", timeout=60,
                           json={"prompt": [100 + i] * 40, "max_tokens": 4})
            assert r.status_code == 200, r.text
        assert long.is_alive(), "the stream ended first: b refused nothing while it drained"
        assert _forwarded(rt, b.name, "draining") == 1
        with Load(rt.url, 1) as load:   # until the stream ended and the counts are met
            wait_until(lambda: not long.is_alive() and load.outcomes["200"] > 5, 90,
                       "the long stream to end and 6 answers")
        long.join()
        assert out == [200, LONG_TOKENS]   # the drained worker finished what it held
        assert load.failures == [], load.outcomes
        assert _forwarded(rt, b.name) == 1   # then left alone
        assert fleet.workers[1].wait(15) == 0


def _forwarded(rt: RouterThread, worker: str, outcome: str | None = None) -> float:
    """Requests the router forwarded to `worker` (with `outcome`: "draining" is a refusal
    by a draining worker, routed again)."""
    labels = {"worker": worker} | ({"outcome": outcome} if outcome else {})
    return metric_value(httpx.get(rt.url + "/metrics").text, "kvloop_router_requests_total",
                        **labels)


def _restart(fleet: Fleet, i: int) -> UrlProcess:
    """Worker `i` again, on the port it had (held from the moment the old one lets it go)."""
    port = int(fleet.workers[i].url.rsplit(":", 1)[1])
    with wait_until(lambda: _hold(port), 10, f"port {port} to be let go"):
        fleet.workers[i] = fleet.worker(i, "--port", str(port))
        fleet.workers[i].start(60)
    return fleet.workers[i]


def _roll(rt: RouterThread, fleet: Fleet, load: Load, i: int) -> None:
    """Drain worker `i` (the router sees it: polled, or refused), let it stop, restart it;
    back once it is registered with its new epoch and requests go on."""
    w = rt.router.registry.get(fleet.specs()[i].name)
    assert w is not None and w.description is not None
    old_epoch, served = w.description.epoch, load.outcomes["200"]
    fleet.workers[i].signal(signal.SIGTERM)
    wait_until(lambda: w.load.draining or not w.up, 10, "the router to see the drain")
    assert fleet.workers[i].wait(20) == 0
    _restart(fleet, i)
    wait_until(lambda: w.up and w.description is not None
               and w.description.epoch != old_epoch, 10, f"worker {i} to be back")
    wait_until(lambda: load.outcomes["200"] > served + 20, 20, "requests to go on")


def _idle(url: str) -> bool:
    stats = _stats(url)
    return stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize("fleet", [(4,)], indirect=True)
def test_rolling_restart_under_load_fails_nothing_and_leaks_nothing(fleet):
    specs = fleet.specs()
    with RouterThread(router_config(), specs) as rt, Load(rt.url, 4) as load:
        time.sleep(1)
        for i in range(len(specs)):
            _roll(rt, fleet, load, i)
        last = specs[-1].name
        wait_until(lambda: rt.router.index.worker_blocks(last) > 0, 10,
                   "the last restarted worker to be indexed")
    assert load.failures == [], (load.failures[:5], load.outcomes)
    for url in (s.url for s in specs):   # every request finished: every block is free
        wait_until(functools.partial(_idle, url), 10, f"{url} to hold no block")
    with RouterThread(router_config(), specs) as check:   # the same router index, fresh
        wait_until(lambda: _settled(check, specs), 10, "the index to equal the caches")


@pytest.mark.parametrize("fleet", [(2, "--sim-speedup", "4", "--shutdown-timeout", "1")],
                         indirect=True)
def test_a_stream_outliving_its_workers_shutdown_timeout_migrates(fleet):
    """The worker's grace (1 s) ends before the stream (600 tokens, about 5 s): its
    `finish_reason: "abort"` moves the stream on, and the client gets the whole answer."""
    cfg = replace(router_config(), migration_limit=1)
    with RouterThread(cfg, fleet.specs()) as rt:
        with httpx.stream("POST", rt.url + "/v1/completions", timeout=60, json={
                "prompt": [7] * 40, "max_tokens": 600, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            lines = r.iter_lines()
            first = next(lines)
            w = next(w for w in rt.router.registry.all() if w.in_flight())
            i = next(i for i, p in enumerate(fleet.workers) if p.url == w.spec.url)
            fleet.workers[i].signal(signal.SIGTERM)
            payloads = sse_json([first, *lines])
        finishes = [c["finish_reason"] for p in payloads for c in p["choices"]
                    if c["finish_reason"]]
        assert finishes == ["length"] and payloads[-1]["usage"]["completion_tokens"] == 600
        assert len({p["id"] for p in payloads}) == 1
        assert fleet.workers[i].wait(15) == 0
        text = httpx.get(rt.url + "/metrics").text
        assert metric_value(text, "kvloop_router_migrations_total", worker=w.name,
                            outcome="migrated") == 1
