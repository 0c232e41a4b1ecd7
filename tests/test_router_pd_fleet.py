"""The P/D flow through the router with real workers (`kvloop serve --model sim`, prefill and
decode roles, KvloopConnector) on 127.0.0.1; routers run in-process on ephemeral ports.

One fleet of 2 prefill + 2 decode workers serves this module (leases of 15 s; simulated
transfers at 1.25e11 bytes/s, which the routers' cost model is told, with the workers'
--sim-speedup). Tests that break a worker start their own.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

from kvloop.front.prometheus_text import metric_value
from kvloop.router.config import IndexConfig, LivenessConfig, PDConfig, RouterConfig
from kvloop.router.fleet import Fleet, FleetConfig
from kvloop.router.pd import (
    ALWAYS,
    LOCAL_CHEAPER,
    NO_KV_TRANSFER_PARAMS,
    PREFILL_CONNECTION,
    PREFILL_HTTP_ERROR,
    REMOTE_CHEAPER,
)
from kvloop.router.registry import WRONG_EVENT_SOURCE, WorkerSpec
from kvloop.trust import FleetSecret

from .conftest import RouterThread, sdk, wait_until
from .test_router_fleet import ADMIN, random_ids, router_config

pytestmark = pytest.mark.processes   # a fleet of real workers; routers on threads

SPEEDUP = 40
BANDWIDTH = 1.25e11
SIM_ARGS = ("--sim-speedup", str(SPEEDUP), "--max-num-batched-tokens", "512")
LEASE_S = 15   # long enough for a loaded machine's router to hand P's answer to D in time
EXTRA = json.dumps({"kv_lease_duration": LEASE_S, "sim_bandwidth": BANDWIDTH})
BS = 16
SECRET = FleetSecret.generate()   # the fleets' and routers' (a P/D worker needs one)


def pd_fleet(num_prefill: int, num_decode: int, *extra: str,
             speedup: float = SPEEDUP) -> Fleet:
    args = ("--sim-speedup", str(speedup), *SIM_ARGS[2:], *extra)
    fleet = Fleet(FleetConfig(0, "sim", worker_args=args, num_prefill=num_prefill,
                              num_decode=num_decode, kv_connector_extra_config=EXTRA,
                              start_timeout_s=120, stop_timeout_s=10, echo_output=False,
                              fleet_secret=SECRET))
    fleet.start()
    return fleet


def pd_router(policy: str = "cost", **liveness: Any) -> RouterConfig:
    lv = {"window_s": 30.0, "poll_interval_s": 0.2, **liveness}
    return RouterConfig(liveness=LivenessConfig(**lv), index=IndexConfig(provisional_ttl_s=2.0),
                        pd=PDConfig(policy=policy, speedup=SPEEDUP,
                                    transfer_bandwidth=BANDWIDTH), fleet_secret=SECRET)


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    f = pd_fleet(2, 2)
    try:
        yield f
    finally:
        f.stop()


def metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


def fleet_sum(fleet: Fleet, name: str, **labels: str) -> float:
    return sum(metric_value(metrics(w.url), name, **labels) for w in fleet.workers)


def pd_decisions(rt: RouterThread, decision: str, reason: str) -> float:
    return metric_value(metrics(rt.url), "kvloop_router_pd_decisions_total",
                        decision=decision, reason=reason)


QUIET = ("kvloop:kv_held_requests", "kvloop:kv_loading_requests", "vllm:num_requests_running",
         "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def busy(fleet: Fleet) -> list[tuple[str, str, float]]:
    """(worker, series, value) of every request, lease or used block left on the fleet."""
    out = []
    for w in fleet.workers:
        text = metrics(w.url)
        out += [(w.url, name, metric_value(text, name)) for name in QUIET
                if metric_value(text, name) != 0]
    return out


def wait_quiet(fleet: Fleet, timeout: float) -> None:
    try:
        wait_until(lambda: not busy(fleet), timeout, "every worker to hold nothing")
    except AssertionError as e:
        raise AssertionError(f"{e}: {busy(fleet)}") from None


# --- X-Request-Id on both legs: a tap in front of the real workers -------------------------
class Tap:
    """A TCP relay in front of one real worker that notes every request's path and
    X-Request-Id on the way through (the worker answers as ever)."""

    HEAD = re.compile(rb"POST (\S+) HTTP/1\.1\r\n((?:[^\r\n]+\r\n)*)\r\n")

    def __init__(self, target_url: str):
        host, port = target_url.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.seen: list[tuple[str, str | None]] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False),
                             daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, note: bool) -> None:
        buf = b""
        try:
            while data := src.recv(65536):
                dst.sendall(data)
                if note:
                    buf = self._note(buf + data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _note(self, buf: bytes) -> bytes:
        while (m := self.HEAD.search(buf)) is not None:
            rid = re.search(rb"(?im)^x-request-id: *(\S+)\r$", m.group(2))
            self.seen.append((m.group(1).decode(), rid.group(1).decode() if rid else None))
            buf = buf[m.end():]
        return buf[-4096:]

    def close(self) -> None:
        self.sock.close()


def test_a_remote_prefill_through_the_router(fleet):
    """P's leg and D's leg of one request: the contract's bodies, one X-Request-Id, the
    KV blocks moved once, D's answer to the client, every figure counted."""
    specs = fleet.specs()
    taps = [Tap(specs[0].url), Tap(specs[2].url)]
    try:
        workers = [WorkerSpec(taps[0].url, "prefill"), WorkerSpec(taps[1].url, "decode")]
        sent0 = fleet_sum(fleet, "kvloop:kv_transfers_total", side="send")
        recv0 = fleet_sum(fleet, "kvloop:kv_transfers_total", side="recv")
        with RouterThread(pd_router(ALWAYS), workers) as rt:
            prompt = random_ids(random.Random(1), 100)
            r = httpx.post(rt.url + "/v1/completions", timeout=30, json={
                "prompt": prompt, "max_tokens": 5, "ignore_eos": True, "min_tokens": 3})
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["usage"]["completion_tokens"] == 5 and out["choices"][0]["text"]
            assert out["usage"]["prompt_tokens"] == 100
            assert pd_decisions(rt, "remote", ALWAYS) == 1
            text = metrics(rt.url)
            assert metric_value(text, "kvloop_router_pd_prefill_seconds_count") == 1
            assert metric_value(text, "kvloop_router_pd_fallbacks_total") == 0
            # what P's answer said about its KV (sim: the fingerprint of its modelled bytes)
            p = rt.router.registry.get(workers[0].name)
            assert p.kv_bytes_per_token is not None and p.kv_bytes_per_token > 0
            chat = sdk(rt.url).chat.completions.create(
                model="sim", messages=[{"role": "user", "content": "a long question " * 20}],
                max_tokens=3, extra_body={"ignore_eos": True})
            assert chat.usage.completion_tokens == 3
        assert fleet_sum(fleet, "kvloop:kv_transfers_total", side="send") == sent0 + 2
        assert fleet_sum(fleet, "kvloop:kv_transfers_total", side="recv") == recv0 + 2
        legs = [(path, rid) for tap in taps for path, rid in tap.seen
                if path.startswith("/v1/")]
        p_legs = [x for x in taps[0].seen if x[0].startswith("/v1/")]
        d_legs = [x for x in taps[1].seen if x[0].startswith("/v1/")]
        assert [x[0] for x in p_legs] == [x[0] for x in d_legs] == [
            "/v1/completions", "/v1/chat/completions"]
        assert all(rid for _, rid in legs)
        assert [x[1] for x in p_legs] == [x[1] for x in d_legs]   # one id per request
        assert p_legs[0][1] != p_legs[1][1]
    finally:
        for t in taps:
            t.close()


def test_streaming_through_the_router_keeps_sse_and_the_reported_hit(fleet):
    with RouterThread(pd_router(ALWAYS), fleet.specs()) as rt:
        client = sdk(rt.url)
        prompt = random_ids(random.Random(2), 80)
        with httpx.stream("POST", rt.url + "/v1/completions", timeout=30, json={
                "prompt": prompt, "max_tokens": 4, "ignore_eos": True, "stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [ln for ln in r.iter_lines() if ln]
        # (fewer chunks than tokens when outputs queue behind a busy handler: merge_outputs)
        assert 2 <= len(events) <= 5 and events[-1] == "data: [DONE]"
        assert all(ln.startswith("data: {") for ln in events[:-1])
        chunks = list(client.completions.create(
            model="sim", prompt=prompt, max_tokens=3, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        assert 2 <= len(chunks) <= 4 and chunks[-1].choices == []
        # the repeat hits P's cache: D reports P's hit (its own is nothing, it caches nothing)
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (80 - 1) // BS * BS
        assert pd_decisions(rt, "remote", ALWAYS) == 2


def test_a_sessions_turns_keep_their_decode_worker(fleet):
    """Eight turns of one session (`x-session-id`), each on an unrelated prompt, with both
    decode workers idle between turns: every decode leg goes to the session's decode worker
    (without session affinity the prompts' own tie-breaks spread them over both)."""
    decoders = [w.url for w in fleet.specs() if w.role == "decode"]
    served = lambda: [metric_value(metrics(u), "vllm:request_success_total")  # noqa: E731
                      for u in decoders]
    rng = random.Random(11)
    with RouterThread(pd_router(), fleet.specs()) as rt:
        before = served()
        for _ in range(8):
            r = httpx.post(rt.url + "/v1/completions", headers={"x-session-id": "chat-42"},
                           json={"prompt": random_ids(rng, 64), "max_tokens": 2,
                                 "ignore_eos": True}, timeout=30)
            assert r.status_code == 200, r.text
        after = served()
    assert sorted(a - b for a, b in zip(after, before, strict=True)) == [0, 8]


def test_the_cost_model_decides_with_real_workers(fleet):
    """Idle decode workers: a short prompt stays local, a long uncached one too (P would take
    as long), the same long prompt once P caches it goes remote; all counted."""
    rng = random.Random(3)
    with RouterThread(pd_router("cost"), fleet.specs()) as rt:
        def send(prompt: list[int]) -> dict[str, Any]:
            r = httpx.post(rt.url + "/v1/completions", timeout=30,
                           json={"prompt": prompt, "max_tokens": 2, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()

        send(random_ids(rng, 48))
        assert pd_decisions(rt, "local", LOCAL_CHEAPER) == 1
        long_ = random_ids(rng, 2000)
        send(long_)
        assert pd_decisions(rt, "local", LOCAL_CHEAPER) == 2
        assert pd_decisions(rt, "remote", REMOTE_CHEAPER) == 0
        # put the prefix in a prefill worker's cache (and its index) with a remote request
        with RouterThread(pd_router(ALWAYS), fleet.specs()) as warm:
            r = httpx.post(warm.url + "/v1/completions", timeout=30,
                           json={"prompt": long_ + [1], "max_tokens": 1})
            assert r.status_code == 200
        p_names = {s.name for s in fleet.specs() if s.role == "prefill"}
        first = rt.router.block_hashes(long_)[0]
        wait_until(lambda: any(first in rt.router.index.hashes_of(n) for n in p_names), 10,
                   "the prefill worker's BlockStored events")
        out = send(long_ + [2])
        assert pd_decisions(rt, "remote", REMOTE_CHEAPER) == 1
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 2000 // BS * BS
        health = httpx.get(rt.url + "/health").json()
        assert health["status"] == "ok", health["reasons"]
        assert health["pd"]["decisions"] == {"local/local_cheaper": 2,
                                             "remote/remote_cheaper": 1}


def test_a_failed_prefill_leg_falls_back_to_decode_only_counted_and_visible(fleet, caplog):
    """The "prefill worker" is a kvloop router (no /kvloop/worker, so its connector is not
    known) in front of an aggregated worker: it answers without kv_transfer_params; emptied,
    it answers 503; stopped, it refuses connections. Each request is served decode-only by
    D, each fallback counted by reason, logged and shown in /health."""
    agg = Fleet(FleetConfig(1, "sim", ("both",), SIM_ARGS, start_timeout_s=120,
                            echo_output=False))
    agg.start()
    # the outer router's prefill legs carry kv_transfer_params: the inner router takes them
    # from a router of its fleet only (one fleet secret)
    secret = FleetSecret.generate()
    inner = RouterThread(replace(router_config(), fleet_secret=secret),
                         agg.specs()).__enter__()
    try:
        decode = [s for s in fleet.specs() if s.role == "decode"]
        p = WorkerSpec(inner.url, "prefill")
        body = {"prompt": [5] * 60, "max_tokens": 3, "ignore_eos": True}
        # a poller that does not look again: every request tries the prefill leg
        with RouterThread(replace(pd_router(ALWAYS, poll_interval_s=600),
                                  fleet_secret=secret), [p, *decode]) as rt:
            def fallbacks(reason: str) -> float:
                return metric_value(metrics(rt.url), "kvloop_router_pd_fallbacks_total",
                                    worker=p.name, reason=reason)

            def served() -> None:
                r = httpx.post(rt.url + "/v1/completions", json=body, timeout=30)
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] == 3

            served()
            assert fallbacks(NO_KV_TRANSFER_PARAMS) == 1
            assert "its answer has no kv_transfer_params" in caplog.text
            gone = httpx.request("DELETE", inner.url + "/workers", headers=ADMIN,
                                 json={"url": agg.specs()[0].url})
            assert gone.status_code == 200
            served()
            assert fallbacks(PREFILL_HTTP_ERROR) == 1
            health = httpx.get(rt.url + "/health").json()
            assert health["status"] == "degraded"
            assert any(f"prefill worker {p.name}: a prefill leg failed ({PREFILL_HTTP_ERROR}: "
                       "HTTP 503" in x for x in health["reasons"]), health["reasons"]
            assert health["pd"]["fallbacks"] == {f"{p.name}/{NO_KV_TRANSFER_PARAMS}": 1,
                                                 f"{p.name}/{PREFILL_HTTP_ERROR}": 1}
            inner.__exit__(None, None, None)
            served()
            assert fallbacks(PREFILL_CONNECTION) == 1
            assert not rt.router.registry.get(p.name).up      # and it is marked down
            assert f"prefill worker {p.name}: {PREFILL_CONNECTION}" in caplog.text
            assert all(w.in_flight() == 0 for w in rt.router.registry.all())
    finally:
        inner.__exit__(None, None, None)    # stopping a stopped router is a no-op
        agg.stop()


def _finished(url: str, reason: str) -> float:
    return metric_value(metrics(url), "vllm:request_success_total", finished_reason=reason)


def test_a_client_disconnect_cancels_both_legs(fleet):
    """Gone during the prefill leg: P aborts it and D never sees it. Gone during D's stream:
    D aborts it, and P holds nothing."""
    slow = pd_fleet(1, 0, speedup=0.2)   # a 2000-token prefill takes about 8 s there
    try:
        p = slow.workers[0]
        d_spec = [s for s in fleet.specs() if s.role == "decode"][0]
        with RouterThread(pd_router(ALWAYS), [slow.specs()[0], d_spec]) as rt:
            aborted = _finished(p.url, "abort")
            d_before = metric_value(metrics(d_spec.url), "vllm:request_success_total")
            body = {"prompt": random_ids(random.Random(4), 2000), "max_tokens": 4}
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(rt.url + "/v1/completions", json=body, timeout=0.5)
            wait_until(lambda: _finished(p.url, "abort") == aborted + 1, 20,
                       "the prefill worker to abort the prefill leg")
            assert metric_value(metrics(d_spec.url), "vllm:request_success_total") == d_before
            wait_until(lambda: all(w.in_flight() == 0 for w in rt.router.registry.all()), 5,
                       "the router to close both tickets")
            text = metrics(rt.url)
            assert metric_value(text, "kvloop_router_requests_total",
                                outcome="disconnected") == 2
            assert metric_value(metrics(p.url), "kvloop:kv_held_requests") == 0
        with RouterThread(pd_router(ALWAYS), fleet.specs()) as rt:
            d_urls = [s.url for s in fleet.specs() if s.role == "decode"]
            d_aborted = sum(_finished(u, "abort") for u in d_urls)
            body = {"prompt": [3] * 40, "max_tokens": 850, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", rt.url + "/v1/completions", json=body, timeout=30) as r:
                lines = r.iter_lines()
                while not next(lines).startswith("data: {"):
                    pass
            wait_until(lambda: sum(_finished(u, "abort") for u in d_urls) == d_aborted + 1,
                       10, "the decode worker to abort the stream")
            wait_quiet(fleet, 2 * LEASE_S)
    finally:
        slow.stop()


def test_wrong_event_wiring_raises_an_alarm_naming_the_role_and_worker(fleet):
    """The fails-open case: the router is told the prefill worker's events are at the decode
    worker's endpoint. It says so, names both, and routes the prefill role by load."""
    specs = fleet.specs()
    p, d = specs[0], specs[2]
    d_events = httpx.get(d.url + "/kvloop/worker").json()["kv_events"]
    wrong = WorkerSpec(p.url, "prefill", events_endpoint=d_events["endpoint"],
                       replay_endpoint=d_events["replay_endpoint"])
    with RouterThread(pd_router(ALWAYS), [wrong, d]) as rt:
        w = wait_until(lambda: rt.router.registry.get(p.name).alarms.get(WRONG_EVENT_SOURCE),
                       10, "the wrong_event_source alarm")
        assert f"prefill worker: the KV events it is subscribed to are worker {d.name}'s " \
               "(role decode" in w.detail
        health = httpx.get(rt.url + "/health").json()
        assert health["status"] == "degraded"
        assert any(r.startswith(f"worker {p.name}: wrong_event_source") for r in
                   health["reasons"])
        assert health["workers"][p.name]["routing"] == "load-only"
        r = httpx.post(rt.url + "/v1/completions", timeout=30,
                       json={"prompt": [9] * 64, "max_tokens": 2})
        assert r.status_code == 200
        assert pd_decisions(rt, "remote", ALWAYS) == 1
        assert metric_value(metrics(rt.url), "kvloop_router_worker_alarm", worker=p.name,
                            alarm=WRONG_EVENT_SOURCE) == 1


async def _soak(urls: list[str], n: int, seed: int) -> dict[str, int]:
    """`n` concurrent requests over `urls` (streamed or not); about a third cancelled by the
    client at a random moment. Returns how many ended each way."""
    rng = random.Random(seed)
    prefixes = [random_ids(rng, 128) for _ in range(4)]
    counts = {"ok": 0, "cancelled": 0}

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": prefixes[i % 4] + random_ids(rng, rng.randrange(1, 200)),
                "max_tokens": rng.randrange(1, 40), "ignore_eos": True,
                "stream": rng.random() < 0.5}
        url = urls[i % len(urls)] + "/v1/completions"

        async def go() -> None:
            if body["stream"]:
                async with client.stream("POST", url, json=body) as r:
                    assert r.status_code == 200, await r.aread()
                    async for _ in r.aiter_lines():
                        pass
            else:
                r = await client.post(url, json=body)
                assert r.status_code == 200, r.text
        if rng.random() < 0.35:
            try:
                await asyncio.wait_for(go(), rng.uniform(0.0, 0.4))
            except TimeoutError:
                counts["cancelled"] += 1
                return
        else:
            await go()
        counts["ok"] += 1

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(n))), 120)
    return counts


def test_soak_200_concurrent_requests_with_cancels_leave_nothing_held(fleet):
    """200 concurrent requests through 2 prefill + 2 decode workers (two routers: the cost
    model and always-remote), random client cancels: afterwards no worker holds a block, a
    lease or a loading request, and no router a ticket."""
    with RouterThread(pd_router("cost"), fleet.specs()) as cost, \
            RouterThread(pd_router(ALWAYS), fleet.specs()) as always:
        t0 = time.monotonic()
        counts = asyncio.run(_soak([cost.url, always.url], 200, seed=7))
        print(f"soak: {counts} in {time.monotonic() - t0:.1f}s")
        assert counts["ok"] + counts["cancelled"] == 200 and counts["cancelled"] >= 20
        # (a request cancelled before its router read it was never routed)
        text = metrics(always.url)
        assert metric_value(text, "kvloop_router_pd_decisions_total", decision="local") == 0
        assert metric_value(text, "kvloop_router_pd_decisions_total") >= 40
        assert metric_value(metrics(cost.url), "kvloop_router_pd_decisions_total") >= 40
        for rt in (cost, always):
            wait_until(lambda rt=rt: all(w.in_flight() == 0 for w in rt.router.registry.all()),
                       10, "the router's tickets to close")
        # cancelled after P answered and before D asked: P's lease frees those blocks
        wait_quiet(fleet, 3 * LEASE_S)
        held = fleet_sum(fleet, "kvloop:kv_held_requests")
        assert held == 0
        for rt in (cost, always):
            text = metrics(rt.url)
            assert metric_value(text, "kvloop_router_requests_total", outcome="worker_error") \
                == 0, text
        assert httpx.get(always.url + "/health").json()["status"] == "ok"


def test_openai_errors_from_the_prefill_leg_reach_the_client(fleet):
    """A request both workers would refuse: P's 400 goes back as P sent it, D never sees it."""
    import openai
    with RouterThread(pd_router(ALWAYS), fleet.specs()) as rt:
        client = sdk(rt.url)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="sim", prompt=[1] * 20, max_tokens=1,
                                      extra_body={"temperature": -1})
        assert all(w.in_flight() == 0 for w in rt.router.registry.all())


def test_real_model_output_through_p_and_d_equals_the_aggregated_output():
    """The embedded model on a prefill and a decode worker: the router's P/D answer (greedy)
    is the answer the decode worker gives alone, prefilling the prompt itself."""
    from kvloop.locate import find_model_path

    real = Fleet(FleetConfig(0, find_model_path(None), worker_args=("--max-model-len", "256"),
                             num_prefill=1, num_decode=1, kv_connector_extra_config=EXTRA,
                             start_timeout_s=300, echo_output=False, fleet_secret=SECRET))
    real.start()
    try:
        p, d = real.specs()
        body = {"prompt": "The capital of France is a city where", "max_tokens": 8,
                "temperature": 0, "return_token_ids": True}
        with RouterThread(pd_router(ALWAYS), real.specs()) as rt:
            sent = metric_value(metrics(p.url), "kvloop:kv_transfers_total", side="send")
            via_pd = httpx.post(rt.url + "/v1/completions", json=body, timeout=120)
            assert via_pd.status_code == 200, via_pd.text
            assert pd_decisions(rt, "remote", ALWAYS) == 1
            assert metric_value(metrics(rt.url), "kvloop_router_pd_fallbacks_total") == 0
        assert metric_value(metrics(p.url), "kvloop:kv_transfers_total", side="send") == sent + 1
        alone = httpx.post(d.url + "/v1/completions", json=body, timeout=120)
        assert alone.status_code == 200, alone.text
        ids = [r.json()["choices"][0]["token_ids"] for r in (via_pd, alone)]
        assert len(ids[0]) == 8 and ids[0] == ids[1]
        assert via_pd.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    finally:
        real.stop()
