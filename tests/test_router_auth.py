"""Keys, admin routes, run-time registration checks, the body limit and the read timeouts of
the router, in front of real simulated workers that require a key of their own."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvloop.front.auth import AuthConfig
from kvloop.front.http_limits import HttpLimits
from kvloop.front.launcher import ServeProcess
from kvloop.front.tokenizer import find_model_path
from kvloop.router.config import RouterConfig
from kvloop.router.fleet import Fleet, FleetConfig
from kvloop.router.registry import WorkerSpec

from .conftest import RouterThread, bearer, lines_until, sdk, wait_until
from .test_router_fleet import ADMIN, SIM_ARGS, router_config
from .test_security_bus import descendants, environ_of
from .test_serve_auth import (
    _connect,
    _head,
    _read_until_closed,
    assert_error,
    half_sent_requests_are_closed,
)

pytestmark = pytest.mark.processes   # a fleet of real workers; routers on threads

WORKER_KEY = "worker-key"
ROUTER_KEY = "router-key"
ROUTER_ADMIN = "router-admin"
LIMIT = 4096
TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    """Two sim workers that require WORKER_KEY."""
    f = Fleet(FleetConfig(2, "sim", ("both",), SIM_ARGS, start_timeout_s=120,
                          stop_timeout_s=10, echo_output=False, worker_api_key=WORKER_KEY))
    f.start()
    yield f
    f.stop()


def keyed_router(specs: list[WorkerSpec], worker_key: str | None = WORKER_KEY) -> RouterThread:
    cfg = router_config()
    cfg = RouterConfig(policy=cfg.policy, liveness=cfg.liveness, index=cfg.index,
                       auth=AuthConfig((ROUTER_KEY,), ROUTER_ADMIN), worker_api_key=worker_key,
                       http_limits=HttpLimits(LIMIT, TIMEOUT_S, TIMEOUT_S))
    return RouterThread(cfg, specs)


def test_clients_need_the_routers_key_and_the_router_uses_the_workers(fleet: Fleet) -> None:
    specs = fleet.specs()
    with keyed_router(specs) as rt:
        r = sdk(rt.url, ROUTER_KEY).completions.create(model="sim", prompt=[7] * 40,
                                                       max_tokens=2)
        assert r.usage is not None and r.usage.completion_tokens == 2
        chat = sdk(rt.url, ROUTER_KEY).chat.completions.create(
            model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert chat.choices[0].finish_reason == "length"
        for wrong in ("nope", WORKER_KEY):
            with pytest.raises(openai.AuthenticationError) as e:
                sdk(rt.url, wrong).completions.create(model="sim", prompt=[7], max_tokens=1)
            assert e.value.body["type"] == "UnauthorizedError"  # type: ignore[index]
        no_key = httpx.post(rt.url + "/v1/completions", json={"prompt": [7], "max_tokens": 1})
        assert no_key.headers["www-authenticate"].startswith("Bearer")
        assert_error(no_key, 401, "UnauthorizedError")
        assert httpx.get(rt.url + "/health").json()["status"] == "ok"
        assert "kvloop_router_worker_up" in httpx.get(rt.url + "/metrics").text
        assert_error(httpx.get(rt.url + "/workers"), 401, "UnauthorizedError")
        listed = httpx.get(rt.url + "/workers", headers=bearer(ROUTER_KEY)).json()
        assert set(listed) == {s.name for s in specs}
        for s in specs:   # the router read the workers' private facts: it sent their key
            w = rt.router.registry.get(s.name)
            assert w is not None and w.up and w.description.model_path == find_model_path(None)
            assert wait_until(lambda w=w: w.load.at > 0, 10, "a /metrics poll")


def test_admin_routes_and_run_time_registration(fleet: Fleet, tmp_path: Path,
                                                free_port: Callable[[], int]) -> None:
    specs = fleet.specs()
    admin = bearer(ROUTER_ADMIN)
    with keyed_router(specs[:1]) as rt, ServeProcess(
            ["--model", "sim", "--sim-speedup", "40", "--block-size", "32"],
            tmp_path / "bs32.log", env={"VLLM_API_KEY": WORKER_KEY}).start() as bs32:
        url = rt.url + "/workers"
        body = {"url": specs[1].url}
        assert_error(httpx.post(url, json=body), 401, "UnauthorizedError")
        assert_error(httpx.post(url, json=body, headers=bearer(ROUTER_KEY)), 403,
                     "ForbiddenError")
        assert_error(httpx.request("DELETE", url, json={"url": specs[0].url},
                                   headers=bearer(ROUTER_KEY)), 403, "ForbiddenError")

        silent = f"http://127.0.0.1:{free_port()}"   # nothing listens there
        err = assert_error(httpx.post(url, json={"url": silent}, headers=admin), 422,
                           "UnprocessableEntityError")
        assert "not registered" in err["message"] and "/kvloop/worker failed" in err["message"]
        err = assert_error(httpx.post(url, json={"url": bs32.url}, headers=admin), 409,
                           "ConflictError")
        assert "block size 32 differs from the fleet's 16" in err["message"]
        listed = httpx.get(url, headers=bearer(ROUTER_KEY)).json()
        assert set(listed) == {specs[0].name}
        for _ in range(4):   # nothing is routed to the refused URLs
            r = httpx.post(rt.url + "/v1/completions", json={"prompt": [3] * 20, "max_tokens": 1},
                           headers=bearer(ROUTER_KEY))
            assert r.status_code == 200, r.text

        r = httpx.post(url, json={"url": specs[1].url, "role": "both"}, headers=admin)
        assert r.status_code == 201 and r.json()["up"] is True, r.text
        r = httpx.request("DELETE", url, json={"url": specs[1].url}, headers=admin)
        assert r.status_code == 200 and r.json() == {"worker": specs[1].name, "removed": True}


def test_a_worker_that_refuses_the_routers_key_is_not_registered(fleet: Fleet) -> None:
    specs = fleet.specs()
    with keyed_router(specs[:1], worker_key="not-the-workers") as rt:
        r = httpx.post(rt.url + "/workers", json={"url": specs[1].url},
                       headers=bearer(ROUTER_ADMIN))
        err = assert_error(r, 422, "UnprocessableEntityError")
        assert "refused the router's (--worker-api-key)" in err["message"]
        health = httpx.get(rt.url + "/health").json()  # the initial worker: up, with a warning
        assert health["workers"][specs[0].name]["up"] is True


def test_a_router_without_keys_passes_the_clients_key_through(fleet: Fleet) -> None:
    specs = fleet.specs()
    with RouterThread(router_config(), specs[:1]) as rt:   # no API key, no worker key
        body = {"prompt": [9] * 20, "max_tokens": 1}
        assert_error(httpx.post(rt.url + "/v1/completions", json=body), 401,
                     "UnauthorizedError")   # the worker's answer, passed on
        ok = httpx.post(rt.url + "/v1/completions", json=body, headers=bearer(WORKER_KEY))
        assert ok.status_code == 200, ok.text
        r = httpx.post(rt.url + "/workers", json={"url": specs[1].url}, headers=ADMIN)
        assert r.status_code == 201, r.text
        assert any("only clients sending the worker's key" in w for w in r.json()["warnings"])


def test_the_router_front_limits_bodies_and_times_out_half_sent_requests(fleet: Fleet) -> None:
    with keyed_router(fleet.specs()) as rt:
        with _connect(rt.url) as s:
            s.sendall(_head(ROUTER_KEY, "Transfer-Encoding: chunked\r\n"))
            s.sendall(b"%x\r\n" % (LIMIT + 1) + b"z" * (LIMIT + 1) + b"\r\n")
            answer = _read_until_closed(s)   # the final chunk was never sent
        assert answer.startswith(b"HTTP/1.1 413 ") and b"RequestEntityTooLargeError" in answer
        with _connect(rt.url) as s:
            s.sendall(_head(ROUTER_KEY, f"Content-Length: {10 ** 12}\r\n"))
            assert _read_until_closed(s).startswith(b"HTTP/1.1 413 ")
        half_sent_requests_are_closed(rt.url, ROUTER_KEY, 50, TIMEOUT_S)


def test_fleet_api_key_reaches_router_and_workers(tmp_path: Path) -> None:
    """`kvloop fleet --api-key K`: clients of the router need K; the workers need a key of
    their own that the fleet made (K opens nothing on them: the router never presents its
    own key); no key is on any worker's command line."""
    cmd = [sys.executable, "-m", "kvloop", "fleet", "--workers", "1", "--port", "0",
           "--api-key", "fleet-key", "--", "--sim-speedup", "40"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"})
    try:
        lines = lines_until(proc, "kvloop router on", 90)
        m = re.search(r"kvloop router on (http://\S+)", "\n".join(lines))
        assert m is not None
        url = m.group(1)
        key = bearer("fleet-key")
        r = httpx.post(url + "/v1/completions", json={"prompt": [5] * 20, "max_tokens": 1},
                       headers=key)
        assert r.status_code == 200, r.text
        assert httpx.post(url + "/v1/completions", json={"prompt": [5]}).status_code == 401
        (worker,) = httpx.get(url + "/workers", headers=key).json().values()
        assert httpx.get(worker["url"] + "/v1/models").status_code == 401
        assert httpx.get(worker["url"] + "/v1/models", headers=key).status_code == 401
        (pid,) = [p for p in descendants(proc.pid)
                  if b"\0serve\0" in Path(f"/proc/{p}/cmdline").read_bytes()]
        worker_key = environ_of(pid)["VLLM_API_KEY"]
        assert worker_key != "fleet-key"
        info = httpx.get(worker["url"] + "/kvloop/worker", headers=bearer(worker_key)).json()
        assert info["api_key_accepted"] is True and info["api_pid"] == pid
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert b"fleet-key" not in cmdline and worker_key.encode() not in cmdline
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
