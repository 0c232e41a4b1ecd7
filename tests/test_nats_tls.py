"""NATS with TLS and one user per role, as deploy/nats/nats-server.conf writes them: that file,
run by a real nats-server with certificates made in the test (`cryptography`). A worker
(`kvloop serve --event-plane ... --nats-tls-ca`) publishes, a router (`kvloop router
--discover ... --nats-tls-ca`) finds it and indexes its events, each as its own NATS user
from the environment; the server refuses a client without the CA and one with a wrong
password, and each role where its permissions end."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvloop.events.config import NatsPlaneConfig
from kvloop.events.nats_plane import connect_options, first_connect
from kvloop.front.launcher import ROUTER_URL_LINE, ServeProcess, UrlProcess, kvloop_command
from kvloop.router.services import NATS_SERVER, LocalService, find_binary

from .conftest import held_port, wait_until
from .pki_helpers import write_pki

pytestmark = pytest.mark.processes

CONF = Path(__file__).resolve().parents[1] / "deploy" / "nats" / "nats-server.conf"
USERS = {"worker": "kvloop-worker", "router": "kvloop-router"}
PASSWORDS = {role: secrets.token_hex(16) for role in USERS}
DATA = "namespace.dynamo.component.backend.kv-events"


class TlsNats:
    """The server's address and the CA its certificate chains to."""

    def __init__(self, url: str, ca: str, folder: Path) -> None:
        self.url, self.ca, self.folder = url, ca, folder

    def plane(self, role: str, password: str | None = None, ca: str | None = "ca"
              ) -> NatsPlaneConfig:
        return NatsPlaneConfig(self.url, component="*", user=USERS[role],
                               password=password or PASSWORDS[role],
                               tls_ca=self.ca if ca == "ca" else ca, connect_timeout_s=5)

    def env(self, role: str) -> dict[str, str]:
        """A kvloop process's NATS user (and the fleet secret), from the environment."""
        return {"KVLOOP_NATS_USER": USERS[role], "KVLOOP_NATS_PASSWORD": PASSWORDS[role],
                "KVLOOP_FLEET_SECRET_FILE": str(self.folder / "fleet.key")}


@pytest.fixture(scope="module")
def tls_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsNats]:
    """deploy/nats/nats-server.conf as printed, run from a folder holding nats-tls/ (the
    certificate names cert-manager gives a Kubernetes TLS Secret) and the passwords in the
    server's environment."""
    folder = tmp_path_factory.mktemp("nats-tls-run")
    (folder / "nats-tls").mkdir()
    pki = write_pki(folder / "nats-tls")
    for src, dst in (("server", "tls.crt"), ("server_key", "tls.key"), ("ca", "ca.crt")):
        Path(pki[src]).rename(folder / "nats-tls" / dst)
    key = folder / "fleet.key"
    key.write_text(secrets.token_hex(32))
    key.chmod(0o600)
    with ExitStack() as stack:
        port = stack.enter_context(held_port()).getsockname()[1]
        env = [f"KVLOOP_NATS_{role.upper()}_PASSWORD={pw}" for role, pw in PASSWORDS.items()]
        srv = LocalService(["env", "-C", str(folder), *env, find_binary(NATS_SERVER),
                            "-a", "127.0.0.1", "-p", str(port), "-c", str(CONF)],
                           "127.0.0.1", port, folder / "nats.log")
        stack.callback(srv.stop)
        srv.start()
        yield TlsNats(f"nats://127.0.0.1:{port}", str(folder / "nats-tls" / "ca.crt"),
                      folder)
        assert "TLS required for client connections" in srv.log()


def connect(cfg: NatsPlaneConfig) -> Any:
    return asyncio.run(_connect_and_close(cfg))


async def _connect_and_close(cfg: NatsPlaneConfig) -> bool:
    nc = await first_connect(connect_options(cfg, "test"), cfg.connect_timeout_s)
    await nc.close()
    return True


def test_a_worker_publishes_and_a_router_indexes_over_tls(tls_nats, tmp_path):
    url, ca = tls_nats.url, tls_nats.ca
    worker = ServeProcess(["--model", "sim", "--sim-speedup", "100", "--event-plane", url,
                           "--nats-tls-ca", ca, "--num-gpu-blocks-override", "64"],
                          tmp_path / "worker.log", env=tls_nats.env("worker"))
    router = UrlProcess(kvloop_command("router", "--port", "0", "--discover", url,
                                       "--nats-tls-ca", ca),
                        tmp_path / "router.log", ROUTER_URL_LINE, env=tls_nats.env("router"))
    with worker.start(timeout_s=90), router.start(timeout_s=60):
        def workers() -> dict:
            return httpx.get(router.url + "/workers", timeout=10).json()

        wait_until(lambda: [w["up"] for w in workers().values()] == [True], 60,
                   "the router to discover the worker over TLS")
        prompt = "tell me about the sea. " * 12
        for _ in range(2):
            r = httpx.post(router.url + "/v1/completions", timeout=60,
                           json={"model": "sim", "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200, r.text
            wait_until(lambda: next(iter(workers().values()))["index_blocks"] >= 4, 30,
                       "the worker's KV events in the router's index")
        (w,) = workers().values()
        assert w["verification"]["actual_tokens"] > 0
        assert w["verification"]["predicted_tokens"] == w["verification"]["actual_tokens"]
    for proc in (worker, router):
        log = Path(proc.log_path).read_text(errors="replace")
        assert "Traceback" not in log and all(pw not in log for pw in PASSWORDS.values())


def test_the_roles_connect_and_strangers_are_refused(tls_nats):
    assert connect(tls_nats.plane("worker")) and connect(tls_nats.plane("router"))
    # without the CA (the system's roots): the server's certificate is refused
    with pytest.raises(OSError, match="CERTIFICATE_VERIFY_FAILED"):
        connect(tls_nats.plane("router", ca=None))
    with pytest.raises(OSError, match="Authorization Violation"):
        connect(tls_nats.plane("router", password="not-the-password"))
    with pytest.raises(OSError, match="Authorization Violation"):   # a user's, another's pw
        connect(tls_nats.plane("worker", password=PASSWORDS["router"]))


def test_a_server_without_tls_never_gets_the_password(tmp_path):
    """A kvloop client with a CA speaks TLS first: a server (or a man in the middle) that
    answers in the clear gets a TLS hello, never a CONNECT with the password."""
    from kvloop.events.nats_plane import TLS_FIRST_HINT
    from kvloop.router.services import local_nats

    ca = write_pki(tmp_path)["ca"]
    with ExitStack() as stack:
        port = stack.enter_context(held_port()).getsockname()[1]
        plain = stack.enter_context(local_nats("127.0.0.1", port, tmp_path / "plain.log",
                                               user=USERS["router"],
                                               password=PASSWORDS["router"]))
        cfg = NatsPlaneConfig(f"nats://127.0.0.1:{plain.port}", user=USERS["router"],
                              password=PASSWORDS["router"], tls_ca=ca, connect_timeout_s=3)
        with pytest.raises(OSError, match="WRONG_VERSION_NUMBER") as refused:
            connect(cfg)
        assert str(refused.value).endswith(TLS_FIRST_HINT)
        assert connect(dataclasses.replace(cfg, tls_ca=None))   # the same server, in clear


def test_each_role_is_held_to_its_permissions(tls_nats):
    """The router reads what a worker publishes; a worker may not read the events, the
    router may not publish them."""
    assert asyncio.run(_permissions(tls_nats)) == {
        "router received": [b"from the worker"],
        "worker subscribing to events": f'subscription to "{DATA}"',
        "router publishing events": f'publish to "{DATA}"'}


async def _permissions(tls_nats: TlsNats) -> dict[str, Any]:
    import nats

    errors: dict[str, list[str]] = {"worker": [], "router": []}
    conns = {}
    for role in USERS:
        async def on_error(e: Exception, role: str = role) -> None:
            errors[role].append(str(e))

        conns[role] = await nats.connect(**connect_options(tls_nats.plane(role), role),
                                         error_cb=on_error)
    got: list[bytes] = []

    async def received(msg: Any) -> None:
        got.append(msg.data)

    try:
        await conns["router"].subscribe("namespace.>", cb=received)
        await conns["worker"].subscribe(DATA, cb=received)
        await conns["router"].flush()
        await conns["worker"].publish(DATA, b"from the worker")
        await conns["router"].publish(DATA, b"from the router")
        for role in USERS:
            await conns[role].flush()
        for _ in range(100):   # at most 10 s for both refusals and the delivery
            if got and errors["worker"] and errors["router"]:
                break
            await asyncio.sleep(0.1)
    finally:
        for nc in conns.values():
            await nc.close()

    def first(role: str, what: str) -> str:
        """`what` when a permissions violation names it, else what the server said."""
        named = any("permissions violation" in e.lower() and what in e for e in errors[role])
        return what if named else "; ".join(errors[role])

    return {"router received": got,
            "worker subscribing to events": first("worker", f'subscription to "{DATA}"'),
            "router publishing events": first("router", f'publish to "{DATA}"')}


def test_a_ca_that_is_not_there_is_a_one_line_error(tmp_path):
    import subprocess

    done = subprocess.run(kvloop_command("router", "--port", "0", "--discover",
                                         "nats://127.0.0.1:4222", "--nats-tls-ca",
                                         str(tmp_path / "nope.pem")),
                          capture_output=True, text=True, timeout=60)
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "--nats-tls-ca" in out and "no such file" in out, out
    assert "Traceback" not in out
