"""`kvloop serve --event-plane` workers and a router on the bus, with a real nats-server:
events by subject per role, discovery (join, leave, age-out), routing and indexing from the
bus, and the bus watch's alarm when a worker's events travel on another subject."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from kvloop.events.config import NatsPlaneConfig
from kvloop.events.nats_plane import H_WORKER
from kvloop.events.nats_subscriber import NatsEventPlane
from kvloop.front.launcher import ServeProcess
from kvloop.router.config import BusConfig, LivenessConfig, RouterConfig
from kvloop.router.registry import WRONG_SUBJECT

from .bus_helpers import NATS_PASSWORD, NATS_USER, nats_server, snapshot_view, url_of
from .conftest import RouterThread, lines_until, sdk, serving, wait_until

pytestmark = pytest.mark.processes

ROLES = {"both": "backend", "prefill": "prefill", "decode": "decode"}


@pytest.fixture(scope="module")
def nats(tmp_path_factory):
    with nats_server(tmp_path_factory.mktemp("nats")) as srv:
        yield srv


def worker_args(nats, role: str, *extra: str, namespace: str = "dynamo") -> list[str]:
    """A sim worker on the bus; prefix caching on for every role (a decode worker has it off
    by default and would publish no blocks), a KV connector for prefill and decode (without
    a fleet secret: these workers are unsigned on the bus, so the connector opts out)."""
    connector = ([] if role == "both" else
                 ["--kv-transfer-config", '{"kv_connector": "KvloopConnector", '
                  '"kv_role": "kv_both", "kv_connector_extra_config": '
                  '{"insecure_side_channel": true}}'])
    return ["--model", "sim", "--event-plane", url_of(nats), "--role", role,
            "--dyn-namespace", namespace, "--num-gpu-blocks-override", "64",
            "--enable-prefix-caching", *connector, *extra]


@pytest.fixture(scope="module")
def workers(nats, tmp_path_factory):
    """One worker per role, on the bus."""
    from contextlib import ExitStack

    with ExitStack() as stack:
        procs = {role: stack.enter_context(serving(tmp_path_factory, f"w-{role}",
                                                   worker_args(nats, role)))
                 for role in ROLES}
        yield procs
    for p in procs.values():
        assert NATS_PASSWORD not in p.log(), "a worker logged the NATS password"


def plane(nats, **kw) -> NatsEventPlane:
    return NatsEventPlane(NatsPlaneConfig(f"nats://{nats.host}:{nats.port}", user=NATS_USER,
                                          password=NATS_PASSWORD, **kw)).start()


def info(srv: ServeProcess) -> dict:
    return httpx.get(srv.url + "/kvloop/worker", timeout=10).json()


def bus_router(nats, component: str = "*", window: float = 30.0, ttl: float = 5.0,
               namespace: str = "dynamo") -> RouterConfig:
    cfg = NatsPlaneConfig(f"nats://{nats.host}:{nats.port}", namespace=namespace,
                          component=component, user=NATS_USER, password=NATS_PASSWORD)
    return RouterConfig(bus=BusConfig(plane=cfg, discover=True, discovery_ttl_s=ttl,
                                      probe_s=2.0, allow_unsigned=True),   # unsigned workers
                        liveness=LivenessConfig(window_s=window, poll_interval_s=0.2))


def prompt(i: int) -> list[int]:
    return [5, 6, 7, 8] * 12 + [100 + i] * 20


def test_each_role_publishes_on_its_component_subject(nats, workers):
    """--role both / prefill / decode -> namespace.dynamo.component.backend / prefill /
    decode.kv-events, each message naming its worker; /kvloop/worker says where."""
    seen: list[tuple[str, int]] = []
    p = plane(nats, component="*")
    try:
        p.subscribe("namespace.dynamo.component.*.kv-events",
                    lambda subject, data, h: seen.append((subject, int(h[H_WORKER]))))
        for i, (role, srv) in enumerate(workers.items()):
            ev = info(srv)["kv_events"]
            assert ev["subject"] == f"namespace.dynamo.component.{ROLES[role]}.kv-events"
            assert ev["endpoint"] == f"nats://***@{nats.host}:{nats.port}"   # redacted
            r = httpx.post(srv.url + "/v1/completions", timeout=30,
                           json={"model": "sim", "prompt": prompt(i), "max_tokens": 2})
            assert r.status_code == 200
            wid = ev["worker_id"]
            wait_until(lambda wid=wid: any(w == wid for _, w in seen), 10,
                       f"{role}'s events on the bus")
            assert {s for s, w in seen if w == wid} == {ev["subject"]}
    finally:
        p.stop()


def test_a_router_discovers_routes_and_indexes_from_the_bus(nats, workers):
    """No --worker: the router registers the announced workers with their roles, routes
    through them, and its index equals the union of their caches (checked against fresh
    snapshots of each worker's own mirror)."""
    ref = plane(nats, component="*")
    try:
        with RouterThread(bus_router(nats), []) as rt:
            reg = rt.router.registry
            wait_until(lambda: sum(w.up for w in reg.all()) == 3, 20, "three workers")
            assert sorted(w.role for w in reg.all()) == sorted(ROLES)
            client = sdk(rt.url)
            for i in range(4):
                out = client.completions.create(model="sim", prompt=prompt(i % 2),
                                                max_tokens=2)
                assert out.choices[0].text is not None

            def equal() -> bool:
                for srv in workers.values():
                    ev = info(srv)["kv_events"]
                    name = srv.url.split("//")[1]
                    view = snapshot_view(ref, ev["worker_id"], ev["subject"].split(".")[3])
                    if rt.router.index.hashes_of(name) != view.hashes():
                        return False
                return True
            wait_until(equal, 15, "the index to equal the workers' caches")
            assert all(not w.alarms for w in reg.all()), [w.alarms for w in reg.all()]
            assert rt.router.index.num_blocks() > 0
    finally:
        ref.stop()


def test_discovery_join_leave_and_age_out(nats, tmp_path):
    """A worker that stops withdraws (removed at once); one killed without a word ages out
    after the discovery TTL."""
    ttl = 2.0
    with RouterThread(bus_router(nats, ttl=ttl, namespace="joins"), []) as rt:
        a = ServeProcess(worker_args(nats, "both", namespace="joins"), tmp_path / "a.log"
                         ).start(timeout_s=60)
        b = ServeProcess(worker_args(nats, "both", namespace="joins"), tmp_path / "b.log",
                         new_session=True).start(timeout_s=60)
        try:
            reg, disc = rt.router.registry, rt.server.discovery
            assert disc is not None
            wait_until(lambda: sum(w.up for w in reg.all()) == 2, 20, "both workers")
            assert disc.joined == 2
            a.stop()
            wait_until(lambda: len(reg.all()) == 1, 5, "the stopped worker to be removed")
            assert disc.left == 1 and disc.aged_out == 0
            b.signal_group(signal.SIGKILL)      # no withdrawal
            t0 = time.monotonic()
            wait_until(lambda: not reg.all(), ttl + 5, "the killed worker to age out")
            assert disc.aged_out == 1 and time.monotonic() - t0 >= ttl - 1.5
        finally:
            a.kill()
            b.kill()


def test_the_switch_to_disaggregated_raises_wrong_subject_within_the_window(nats, tmp_path,
                                                                           free_port):
    """Dynamo's silent failure, reproduced: a router pinned to `backend` serves a worker that
    restarts disaggregated (`--role decode`: its events now on `...component.decode...`).
    Requests still succeed, but within the liveness window the router says where the
    events are and what to change."""
    window = 3.0
    port = free_port()
    args = ["--host", "127.0.0.1", "--port", str(port)]
    with RouterThread(bus_router(nats, component="backend", window=window,
                                 namespace="switch"), []) as rt:
        reg = rt.router.registry
        client = sdk(rt.url)
        with ServeProcess(worker_args(nats, "both", *args, namespace="switch"),
                          tmp_path / "agg.log"
                          ).start(timeout_s=60):
            wait_until(lambda: any(w.up for w in reg.all()), 20, "the aggregated worker")
            for i in range(3):
                client.completions.create(model="sim", prompt=prompt(i), max_tokens=2)
            (w,) = reg.all()
            wait_until(lambda: w.events.stored_blocks > 0, 10, "its events on backend")
            time.sleep(window)
            rt.router.check_liveness()
            assert not w.alarms
        with ServeProcess(worker_args(nats, "decode", *args, namespace="switch"),
                          tmp_path / "dis.log"
                          ).start(timeout_s=60):
            wait_until(lambda: any(x.up and x.role == "decode" for x in reg.all()), 20,
                       "the worker back as decode")
            (w,) = reg.all()
            client.completions.create(model="sim", prompt=prompt(9), max_tokens=2)
            sent = w.first_unsignalled_send
            assert sent is not None
            alarm = wait_until(lambda: w.alarms.get(WRONG_SUBJECT), window + 2,
                               "the wrong_subject alarm")
            assert alarm.since - sent <= window, "the alarm came after the liveness window"
            assert "`namespace.switch.component.decode.kv-events`" in alarm.message
            assert "`namespace.switch.component.backend.kv-events`" in alarm.message
            assert "--dyn-component decode" in alarm.message
            for i in range(2):   # every request still succeeds: only the alarm tells
                assert client.completions.create(model="sim", prompt=prompt(i),
                                                 max_tokens=2).choices
            health = httpx.get(rt.url + "/health").json()
            assert health["status"] == "degraded"
            assert any("wrong_subject" in r for r in health["reasons"])
            assert w.load_only   # no cache credit while its events are not heard


def test_kvloop_fleet_on_its_own_nats_server():
    """`kvloop fleet --event-plane nats`: a nats-server of its own, workers publishing on it,
    a router reading them there; one SIGTERM stops everything, the server too."""
    import re
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "kvloop", "fleet", "--workers", "2", "--port", "0",
           "--event-plane", "nats", "--", "--sim-speedup", "40",
           "--num-gpu-blocks-override", "64"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = lines_until(proc, "kvloop router on", 120)
        text = "\n".join(lines)
        nats_url = re.search(r"nats-server on (nats://\S+)", text).group(1)
        assert f"event plane {nats_url}: listening on namespace.dynamo.component.*.kv-events" \
            in text
        url = re.search(r"kvloop router on (http://\S+)", text).group(1)
        client = sdk(url)
        for i in range(3):
            client.completions.create(model="sim", prompt=prompt(i), max_tokens=2)
        wait_until(lambda: sum(w["events"]["stored_blocks"] for w in
                               httpx.get(url + "/workers").json().values()) > 0, 10,
                   "events through the fleet's nats-server")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        host, port = nats_url.removeprefix("nats://").split(":")
        import socket
        with pytest.raises(OSError):
            socket.create_connection((host, int(port)), timeout=1).close()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_draining_worker_withdraws_at_the_start_of_its_drain(nats, tmp_path):
    """SIGTERM with --shutdown-timeout: the worker withdraws at once (the router removes
    it), while the stream it holds goes on to its end."""
    with RouterThread(bus_router(nats, namespace="drains"), []) as rt:
        w = ServeProcess(worker_args(nats, "both", "--shutdown-timeout", "8",
                                     "--sim-speedup", "4", namespace="drains"),
                         tmp_path / "w.log").start(timeout_s=60)
        try:
            reg, disc = rt.router.registry, rt.server.discovery
            assert disc is not None
            wait_until(lambda: any(x.up for x in reg.all()), 20, "the worker to join")
            with httpx.stream("POST", w.url + "/v1/completions", timeout=60, json={
                    "prompt": prompt(1), "max_tokens": 600, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}) as r:
                chunks = r.iter_text()
                next(chunks)
                w.signal(signal.SIGTERM)
                wait_until(lambda: not reg.all(), 20, "the draining worker to be removed")
                assert w.alive() and disc.left == 1   # at its drain, not at its exit
                text = "".join(chunks)
            # the whole answer, by its usage chunk (one chunk may carry several tokens)
            assert '"length"' in text and '"completion_tokens":600' in text.replace(" ", "")
            assert w.wait(15) == 0
        finally:
            w.kill()
