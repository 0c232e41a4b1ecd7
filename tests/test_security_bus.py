"""Identity on the bus (issue 25, items 1, 4 and 8), each attack run as the probe notes ran it
and asserted to fail: a rogue or forged announcement or withdrawal from a client holding the
NATS credentials but not the fleet secret, a genuine message replayed, an anonymous client
on `kvloop fleet`'s nats-server, secrets on command lines, and a 30 s NATS outage under
traffic (no healthy worker may go offline).

Real processes throughout: nats-server, `kvloop serve --model sim` workers holding the fleet
secret (from their environment), routers on threads or `kvloop fleet`, nats-py and httpx
clients, and a tiny HTTP server posing as the rogue worker."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from kvloop.events.cli_args import NATS_CREDENTIAL_ENV, event_plane_from_args
from kvloop.events.config import NatsPlaneConfig
from kvloop.events.nats_plane import (
    H_EPOCH,
    H_SEQ,
    H_WORKER,
    MessageGate,
    Refusals,
    connect_options,
    discovery_subject,
    first_connect,
    signed_headers,
)
from kvloop.events.nats_subscriber import NatsEventPlane
from kvloop.events.types import BlockStored, KVEventBatch
from kvloop.front.auth import AuthConfig
from kvloop.front.launcher import ServeProcess
from kvloop.router.cli_args import WORKER_API_KEY_ENV, router_config
from kvloop.router.config import BusConfig, LivenessConfig, RouterConfig
from kvloop.router.fleet import FleetConfig
from kvloop.router.registry import WorkerSpec
from kvloop.trust import FLEET_SECRET_ENV, FleetSecret, sign_message
from kvloop.wire import WorkerAnnouncement

from .bus_helpers import NATS_PASSWORD, NATS_USER, nats_server, snapshot_view
from .conftest import RouterThread, alive, bearer, lines_until, wait_until

SECRET = FleetSecret(b"the-fleet-secret-of-these-tests-0123456789")
ROUTER_KEY = "router-key-of-these-tests"
FORGED = "FORGED BY THE ROGUE"
_ANN = msgspec.json.Decoder(WorkerAnnouncement)


# --- helpers ----------------------------------------------------------------------------------
class RogueWorker:
    """A tiny HTTP server posing as a worker: it answers /kvloop/worker with `info` (a real
    worker's, copied; None: 404), /health ok, and completions with forged text; it records every
    request (method, path, headers with lower-case names)."""

    def __init__(self, info: bytes | None):
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        rogue = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                rogue.requests.append((self.command, self.path,
                                       {k.lower(): v for k, v in self.headers.items()}))
                n = int(self.headers.get("content-length") or 0)
                self.rfile.read(n)
                if info is None and self.path.startswith("/kvloop/worker"):
                    self.send_error(404)   # no kvloop worker: no facts to check
                    return
                body = (info if info is not None and self.path.startswith("/kvloop/worker") else
                        json.dumps({"id": "x", "object": "text_completion", "created": 0,
                                    "model": "sim", "choices": [{
                                        "index": 0, "text": FORGED, "finish_reason": "length",
                                        "logprobs": None}],
                                    "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                              "total_tokens": 2}}).encode())
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> RogueWorker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def plane_config(nats: Any, **kw: Any) -> NatsPlaneConfig:
    return NatsPlaneConfig(f"nats://{nats.host}:{nats.port}", user=NATS_USER,
                           password=NATS_PASSWORD, **kw)


def publish(nats: Any, messages: list[tuple[str, bytes, dict[str, str]]]) -> None:
    """Publish `messages` as a client holding the NATS credentials (not the fleet secret)."""
    async def run() -> None:
        nc = await first_connect(connect_options(plane_config(nats), "attacker"), 5.0)
        for subject, payload, hdrs in messages:
            await nc.publish(subject, payload, headers=hdrs or None)
        await nc.flush()
        await nc.close()
    asyncio.run(run())


class Capture:
    """Every message on the discovery subject, as an eavesdropper with credentials sees it."""

    def __init__(self, nats: Any):
        self.messages: list[tuple[str, bytes, dict[str, str]]] = []
        self.plane = NatsEventPlane(plane_config(nats), name="eavesdropper").start()
        self.plane.subscribe(discovery_subject("dynamo"),
                             lambda s, d, h: self.messages.append((s, d, h)))

    def of(self, url: str, withdrawn: bool) -> tuple[str, bytes, dict[str, str]]:
        """The last captured announcement (or withdrawal) of `url`."""
        found = [m for m in self.messages
                 if _ANN.decode(m[1]).url == url and _ANN.decode(m[1]).withdrawn == withdrawn]
        assert found, f"no {'withdrawal' if withdrawn else 'announcement'} of {url} captured"
        return found[-1]

    def stop(self) -> None:
        self.plane.stop()


def signed_worker(nats: Any, log: Path, *extra: str) -> ServeProcess:
    """A sim worker on the bus, holding the fleet secret and the NATS credentials, both from
    its environment (nothing secret on its command line)."""
    env = {FLEET_SECRET_ENV: SECRET.to_text(), NATS_CREDENTIAL_ENV["nats_user"]: NATS_USER,
           NATS_CREDENTIAL_ENV["nats_password"]: NATS_PASSWORD}
    return ServeProcess(["--model", "sim", "--event-plane", f"nats://{nats.host}:{nats.port}",
                         "--num-gpu-blocks-override", "64", "--sim-speedup", "40",
                         "--enable-prefix-caching", *extra], log, env)


def discovering_router(nats: Any, ttl: float = 2.0, window: float = 30.0) -> RouterThread:
    """A router that discovers workers, holds the fleet secret and requires ROUTER_KEY (and
    has no worker key: the workers of these tests require none)."""
    return RouterThread(RouterConfig(
        bus=BusConfig(plane=plane_config(nats, component="*"), discover=True,
                      discovery_ttl_s=ttl, probe_s=1.0),
        liveness=LivenessConfig(window_s=window, poll_interval_s=0.2),
        auth=AuthConfig((ROUTER_KEY,)), fleet_secret=SECRET), [])


def names(rt: RouterThread) -> set[str]:
    return {w.name for w in rt.router.registry.all()}


def complete(rt: RouterThread, i: int) -> httpx.Response:
    return httpx.post(rt.url + "/v1/completions", headers=bearer(ROUTER_KEY), timeout=30,
                      json={"model": "sim", "prompt": [5, 6, 7, 8] * 8 + [100 + i] * 20,
                            "max_tokens": 2})


def name_of(srv: ServeProcess) -> str:
    return WorkerSpec(srv.url).name


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, grandchildren...)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def environ_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = f.read().split(b"\0")
    return dict(i.decode(errors="replace").split("=", 1) for i in items if b"=" in i)


# --- in-process rules (no servers) ------------------------------------------------------------
def test_a_gate_admits_a_members_message_once_and_nothing_else() -> None:
    refusals = Refusals()
    gate = MessageGate(SECRET, refusals)
    subject, payload = "namespace.dynamo.kvloop.workers", b'{"url": "x"}'
    genuine = sign_message(SECRET, subject, payload)
    assert gate.admits(subject, payload, genuine)
    assert not gate.admits(subject, payload, genuine)                        # replayed
    assert not gate.admits(subject, payload, {})                             # unsigned
    assert not gate.admits(subject, payload, sign_message(FleetSecret.generate(), subject,
                                                          payload))          # wrong key
    assert not gate.admits(subject, b'{"url": "y"}', sign_message(SECRET, subject, payload))
    assert not gate.admits(subject, payload,
                           sign_message(SECRET, subject, payload, now=time.time() - 600))
    assert refusals.counts == {"replayed": 1, "unsigned": 1, "bad signature": 2, "stale": 1}
    assert MessageGate(None, refusals).admits(subject, payload, {})   # no secret: all
    assert signed_headers(None, subject, payload, {"a": "b"}) == {"a": "b"}


def test_refusals_are_logged_at_a_bounded_rate(caplog: pytest.LogCaptureFixture) -> None:
    refusals = Refusals()
    with caplog.at_level(logging.WARNING, logger="kvloop.events.nats_plane"):
        for _ in range(1000):
            refusals.note("s", "unsigned")
    assert refusals.total == 1000 and len(caplog.records) == 1


def _router_args(*argv: str) -> argparse.Namespace:
    from kvloop.cli import build_parser

    return build_parser().parse_args(["router", *argv])


def test_a_router_on_the_bus_needs_the_secret_or_the_insecure_flag(monkeypatch) -> None:
    for var in ("KVLOOP_FLEET_SECRET", "KVLOOP_FLEET_SECRET_FILE", WORKER_API_KEY_ENV):
        monkeypatch.delenv(var, raising=False)
    for flags in (["--discover", "nats://127.0.0.1:4222"],
                  ["--event-plane", "nats://127.0.0.1:4222"]):
        with pytest.raises(ValueError, match="needs the fleet secret.*--allow-unsigned-bus"):
            router_config(_router_args(*flags))
        cfg = router_config(_router_args(*flags, "--allow-unsigned-bus"))
        assert cfg.bus is not None and cfg.bus.allow_unsigned
    monkeypatch.setenv("KVLOOP_FLEET_SECRET", SECRET.to_text())
    assert router_config(_router_args("--discover", "nats://h:4222")).fleet_secret is not None


def test_the_router_never_presents_its_own_key_to_workers(monkeypatch) -> None:
    monkeypatch.delenv(WORKER_API_KEY_ENV, raising=False)
    cfg = router_config(_router_args("--api-key", "r1", "--admin-api-key", "adm"))
    assert cfg.worker_api_key is None
    monkeypatch.setenv(WORKER_API_KEY_ENV, "w-from-env")
    assert router_config(_router_args("--api-key", "r1")).worker_api_key == "w-from-env"


def test_nats_credentials_come_from_the_environment_and_never_reach_a_command_line() -> None:
    ns = argparse.Namespace(event_plane="nats://127.0.0.1:4222", dyn_namespace=None,
                            dyn_component=None, event_plane_format="vllm", nats_user=None,
                            nats_password=None, nats_token=None, nats_tls_ca=None)
    env = {"KVLOOP_NATS_USER": "u", "KVLOOP_NATS_PASSWORD": "pw-from-env"}
    plane = event_plane_from_args(ns, "backend", env)
    assert plane is not None and (plane.user, plane.password) == ("u", "pw-from-env")
    fleet = FleetConfig(2, event_plane=plane, fleet_secret=SECRET, worker_api_key="wk")
    argv = " ".join(fleet.argv(0))
    for secret in ("pw-from-env", SECRET.to_text(), "wk"):
        assert secret not in argv
    assert fleet.env() == {FLEET_SECRET_ENV: SECRET.to_text(), "VLLM_API_KEY": "wk",
                           "KVLOOP_NATS_USER": "u", "KVLOOP_NATS_PASSWORD": "pw-from-env"}
    with pytest.raises(ValueError, match="not in the --event-plane URL"):
        FleetConfig(1, event_plane=NatsPlaneConfig("nats://u:pw@127.0.0.1:4222"))


# --- real servers -----------------------------------------------------------------------------
@pytest.mark.processes
def test_a_router_passes_none_of_its_own_keys_to_a_worker() -> None:
    """Clients present the router's key (or its admin key); what reaches the worker (a
    recording server) carries no Authorization at all without --worker-api-key, and only the
    worker key with it."""
    auth = AuthConfig((ROUTER_KEY,), "router-admin-key")
    for worker_key in (None, "the-worker-key"):
        with RogueWorker(None) as w, RouterThread(
                RouterConfig(auth=auth, worker_api_key=worker_key), [WorkerSpec(w.url)]) as rt:
            for key in (ROUTER_KEY, "router-admin-key"):
                r = httpx.post(rt.url + "/v1/completions", headers=bearer(key), timeout=30,
                               json={"model": "sim", "prompt": [5] * 20, "max_tokens": 1})
                assert r.status_code == 200 and FORGED in r.text, r.text
            wait_until(lambda w=w: any(p == "/metrics" for _, p, _ in w.requests), 10,
                       "a poll")
            sent = {h.get("authorization") for _, _, h in w.requests}
            assert sent == {None if worker_key is None else f"Bearer {worker_key}"}, sent


@pytest.fixture(scope="module")
def nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with nats_server(tmp_path_factory.mktemp("nats")) as srv:
        yield srv


@pytest.fixture(scope="module")
def worker(nats: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with signed_worker(nats, tmp_path_factory.mktemp("w") / "w.log").start(60) as w:
        yield w


@pytest.mark.processes
def test_the_fleet_nats_server_refuses_strangers_and_no_secret_is_on_a_command_line() -> None:
    """`kvloop fleet --event-plane nats --api-key K`: an anonymous NATS client cannot even
    connect; the generated NATS password, the fleet secret and the generated worker key are
    in the children's environment and on no child's command line; the workers refuse the
    router's key K (the router never presents it), and accept the worker key it presents."""
    cmd = [sys.executable, "-m", "kvloop", "fleet", "--workers", "1", "--port", "0",
           "--event-plane", "nats", "--api-key", "fleet-router-key", "--",
           "--sim-speedup", "40"]
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("KVLOOP_", "VLLM_API_KEY"))}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=clean)
    try:
        lines = lines_until(proc, "kvloop router on", 90)
        text = "\n".join(lines)
        nats_url = re.search(r"nats-server on (nats://\S+)", text).group(1)   # type: ignore
        router = re.search(r"kvloop router on (http://\S+)", text).group(1)  # type: ignore

        anonymous = NatsPlaneConfig(nats_url, connect_timeout_s=2.0)
        with pytest.raises(OSError, match="(?i)authorization"):
            asyncio.run(first_connect(connect_options(anonymous, "stranger"), 2.0))

        kids = descendants(proc.pid)
        serve = [p for p in kids if b"\0serve\0" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert serve, "no worker process found"
        env = environ_of(serve[0])
        secrets_ = {k: env.get(k) for k in ("KVLOOP_NATS_PASSWORD", FLEET_SECRET_ENV,
                                            "VLLM_API_KEY")}
        assert all(v and len(v) >= 16 for v in secrets_.values()), secrets_.keys()
        for pid in kids:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            for name, value in secrets_.items():
                assert value not in cmdline, f"{name} on the command line of {pid}"
            assert "fleet-router-key" not in cmdline
        member = NatsPlaneConfig(nats_url, user=env["KVLOOP_NATS_USER"],
                                 password=env["KVLOOP_NATS_PASSWORD"])

        async def member_connects() -> None:
            nc = await first_connect(connect_options(member, "member"), 5.0)
            await nc.close()
        asyncio.run(member_connects())

        r = httpx.post(router + "/v1/completions", headers=bearer("fleet-router-key"),
                       json={"prompt": [5] * 20, "max_tokens": 1}, timeout=30)
        assert r.status_code == 200, r.text
        (w,) = httpx.get(router + "/workers", headers=bearer("fleet-router-key")).json().values()
        assert httpx.get(w["url"] + "/v1/models",
                         headers=bearer("fleet-router-key")).status_code == 401
        assert httpx.get(w["url"] + "/v1/models",
                         headers=bearer(env["VLLM_API_KEY"])).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.processes
def test_a_fleet_killed_with_sigkill_leaves_no_nats_server_behind(tmp_path: Path) -> None:
    """Its nats-server (holding the fleet's NATS credentials) gets the parent-death signal."""
    cmd = [sys.executable, "-m", "kvloop", "fleet", "--workers", "1", "--port", "0",
           "--event-plane", "nats", "--", "--model", "sim"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            found = re.search(r"nats-server on nats://[^:]+:(\d+)", line)
            if found:
                port = int(found.group(1))
                break
        else:
            raise AssertionError("the fleet started no nats-server")
        server = [p for p in descendants(proc.pid)
                  if b"nats-server" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert server, "the nats-server is not the fleet's child"
        proc.kill()
        proc.wait(10)
        wait_until(lambda: not any(alive(p) for p in server), 10, "the nats-server's end")
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.processes
def test_rogue_announcements_are_never_registered_nor_sent_anything(nats: Any,
                                                                    worker: ServeProcess) -> None:
    """A client with the NATS credentials but not the fleet secret announces a rogue URL
    (unsigned, signed with its own key, and with a genuine signature lifted onto its payload)
    while users send requests: the router never registers it and never sends it anything."""
    capture = Capture(nats)
    try:
        with discovering_router(nats) as rt:
            wait_until(lambda: names(rt) == {name_of(worker)}, 20, "the real worker")
            info = httpx.get(worker.url + "/kvloop/worker").content
            with RogueWorker(info) as rogue:
                subject, real_payload, real_headers = wait_until(
                    lambda: capture.messages and capture.messages[-1], 5, "an announcement")
                ann = msgspec.json.encode(msgspec.structs.replace(
                    _ANN.decode(real_payload), url=rogue.url))
                forged = [(subject, ann, {}),
                          (subject, ann, sign_message(FleetSecret.generate(), subject, ann)),
                          (subject, ann, real_headers)]
                for i in range(10):
                    publish(nats, forged)
                    r = complete(rt, i)
                    assert r.status_code == 200, r.text
                    assert FORGED not in r.text
                time.sleep(1.0)
                assert names(rt) == {name_of(worker)}
                assert rogue.requests == [], rogue.requests
            bus = httpx.get(rt.url + "/health").json()["bus"]
            assert bus["signed_only"] is True
            assert bus["by_reason"].get("unsigned", 0) >= 10
            assert bus["by_reason"].get("bad signature", 0) >= 20
            assert rt.server.discovery is not None and rt.server.discovery.joined == 1
    finally:
        capture.stop()


@pytest.mark.processes
def test_forged_withdrawals_do_not_remove_a_worker(nats: Any, worker: ServeProcess) -> None:
    capture = Capture(nats)
    try:
        with discovering_router(nats) as rt:
            name = name_of(worker)
            wait_until(lambda: names(rt) == {name}, 20, "the real worker")
            subject, payload, real_headers = wait_until(
                lambda: capture.messages and capture.messages[-1], 5, "an announcement")
            withdrawal = msgspec.json.encode(msgspec.structs.replace(
                _ANN.decode(payload), withdrawn=True))
            publish(nats, [(subject, withdrawal, {}),
                           (subject, withdrawal, real_headers),
                           (subject, withdrawal,
                            sign_message(FleetSecret.generate(), subject, withdrawal))])
            time.sleep(1.0)
            assert names(rt) == {name}
            for i in range(5):
                assert complete(rt, i).status_code == 200
            assert rt.server.discovery is not None and rt.server.discovery.left == 0
            refused = rt.router.health()[1]["bus"]["by_reason"]
            assert refused.get("unsigned") == 1 and refused.get("bad signature") == 2
    finally:
        capture.stop()


@pytest.mark.processes
def test_forged_kv_events_never_reach_the_index(nats: Any, worker: ServeProcess) -> None:
    """A client with the NATS credentials publishes KV events in the real worker's name (its
    worker id, epoch and next sequence numbers: a block it never cached), unsigned and signed
    with its own key: the router's index never holds the forged block, and still equals the
    worker's cache."""
    seen: list[dict[str, str]] = []
    eavesdropper = NatsEventPlane(plane_config(nats, component="*"), name="eavesdropper").start()
    eavesdropper.subscribe("namespace.dynamo.component.*.kv-events",
                           lambda s, d, h: seen.append(h))
    ref = NatsEventPlane(plane_config(nats, component="*"), secret=SECRET).start()
    try:
        with discovering_router(nats) as rt:
            name = name_of(worker)
            wait_until(lambda: names(rt) == {name}, 20, "the real worker")
            assert complete(rt, 77).status_code == 200
            last = wait_until(lambda: seen and seen[-1], 10, "a genuine data message")
            forged_hash = 0x5EED_F00D_DEAD_BEEF
            batch = msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=[BlockStored(
                block_hashes=[forged_hash], parent_block_hash=None, token_ids=[1] * 16,
                block_size=16, lora_id=None, medium="GPU", lora_name=None)]))
            subject = "namespace.dynamo.component.backend.kv-events"
            messages = []
            for i in range(1, 4):
                hdrs = {H_WORKER: last[H_WORKER], H_EPOCH: last[H_EPOCH],
                        H_SEQ: str(int(last[H_SEQ]) + i)}
                messages += [(subject, batch, hdrs),
                             (subject, batch, {**hdrs, **sign_message(
                                 FleetSecret.generate(), subject, batch)})]
            publish(nats, messages)
            assert complete(rt, 78).status_code == 200
            wid = int(last[H_WORKER])

            def index_equals_cache() -> bool:
                mine = rt.router.index.hashes_of(name)
                return bool(mine) and mine == snapshot_view(ref, wid, "backend").hashes()
            wait_until(index_equals_cache, 15, "the index to equal the worker's cache")
            assert forged_hash not in rt.router.index.hashes_of(name)
            refused = rt.router.health()[1]["bus"]["by_reason"]
            assert refused.get("unsigned", 0) >= 3 and refused.get("bad signature", 0) >= 3
    finally:
        ref.stop()
        eavesdropper.stop()


@pytest.mark.processes
def test_replayed_announcements_and_withdrawals_are_refused(nats: Any, worker: ServeProcess,
                                                            tmp_path: Path,
                                                            free_port: Any) -> None:
    """Genuine messages captured off the bus and published again: a stopped worker's last
    announcement does not bring it back, and its earlier withdrawal does not remove it once
    it runs again."""
    port = free_port()
    capture = Capture(nats)
    try:
        with discovering_router(nats) as rt:
            b = signed_worker(nats, tmp_path / "b1.log", "--port", str(port)).start(60)
            b_name = name_of(b)
            wait_until(lambda: b_name in names(rt), 20, "worker b")
            b.stop()
            wait_until(lambda: b_name not in names(rt), 10, "b's withdrawal")
            announcement = capture.of(b.url, withdrawn=False)
            withdrawal = capture.of(b.url, withdrawn=True)
            publish(nats, [announcement])
            time.sleep(1.0)
            assert b_name not in names(rt), "a replayed announcement brought b back"
            with signed_worker(nats, tmp_path / "b2.log", "--port", str(port)).start(60):
                wait_until(lambda: b_name in names(rt), 20, "b back")
                publish(nats, [withdrawal])
                time.sleep(1.0)
                w = rt.router.registry.get(b_name)
                assert w is not None and w.up, "a replayed withdrawal removed b"
                for i in range(4):
                    assert complete(rt, i).status_code == 200
            assert rt.router.health()[1]["bus"]["by_reason"].get("replayed") == 2
    finally:
        capture.stop()


@pytest.mark.processes
def test_a_30s_nats_outage_takes_no_healthy_worker_offline(tmp_path: Path) -> None:
    """NATS stopped for 30 s with requests flowing the whole time (discovery TTL 2 s,
    liveness window 5 s): every request is served (no 503), the worker stays registered;
    after NATS returns, discovery hears it again and the index equals its cache again."""
    outage_s = 30.0
    with nats_server(tmp_path) as srv, \
            signed_worker(srv, tmp_path / "w.log").start(60) as w, \
            discovering_router(srv, ttl=2.0, window=5.0) as rt:
        name = name_of(w)
        wait_until(lambda: names(rt) == {name}, 20, "the worker")
        for i in range(3):
            assert complete(rt, i).status_code == 200
        disc = rt.server.discovery
        assert disc is not None
        srv.stop()
        codes: dict[int, int] = {}
        t0, i = time.monotonic(), 100
        while time.monotonic() - t0 < outage_s:
            code = complete(rt, i % 7).status_code
            codes[code] = codes.get(code, 0) + 1
            i += 1
            time.sleep(0.1)
        assert set(codes) == {200}, codes
        assert names(rt) == {name} and disc.aged_out == 0
        assert httpx.get(rt.url + "/health").json()["bus"]["connected"] is False
        srv.start()
        t_back = rt.router.clock()
        wait_until(lambda: disc.last_heard.get(name, 0) > t_back, 15,
                   "an announcement after NATS returned")
        wait_until(lambda: httpx.get(rt.url + "/health").json()["bus"]["connected"], 10,
                   "the router's NATS connection back")
        for j in range(3):
            assert complete(rt, 1000 + j).status_code == 200
        ref = NatsEventPlane(plane_config(srv, component="*"), secret=SECRET).start()
        try:
            wid = httpx.get(w.url + "/kvloop/worker").json()["kv_events"]["worker_id"]

            def index_equals_cache() -> bool:
                view = snapshot_view(ref, wid, "backend")
                mine = rt.router.index.hashes_of(name)
                return bool(mine) and mine == view.hashes()
            wait_until(index_equals_cache, 15, "the index to equal the worker's cache")
        finally:
            ref.stop()
        assert disc.aged_out == 0 and codes.get(503, 0) == 0
