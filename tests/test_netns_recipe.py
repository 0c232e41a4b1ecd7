"""docs/router.md's two-host recipe, run as printed: one network namespace per host (the
router host, host A, host B) on one bridge, each with the address the recipe names; this
test's own namespace joins the bridge to talk to the router. The router must find the four
workers (two per host on the same ports: four identities), and predict exactly the cached
tokens the workers report, for text and chat; NATS runs with TLS and its users, and no log
shows a password. Namespaces, the bridge and processes are removed even when the test
fails."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from .conftest import sdk, wait_until
from .test_netns import _ip

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- two-host recipe -->"
HOST_LINE = re.compile(r"^# .*?(198\.51\.100\.\d+)")
CLIENT_ADDR = "198.51.100.254"


def recipe() -> list[tuple[str | None, str]]:
    """(host address or None for "any host", command) in the order docs/router.md prints."""
    text = (ROOT / "docs" / "router.md").read_text()
    block = text.split(MARKER, 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    host: str | None = None
    out: list[tuple[str | None, str]] = []
    for line in block.splitlines():
        m = HOST_LINE.match(line)
        if m:
            host = m.group(1)
        elif line.strip() and not line.startswith("#"):
            out.append((host, line))
    return out


class Bridge:
    """One namespace per host address on a bridge in this namespace."""

    def __init__(self, addresses: list[str]) -> None:
        n = os.getpid() % 10_000
        self.bridge = f"kvbr{n}"
        self.ns = {a: f"kvloop-h{i}-{n}" for i, a in enumerate(addresses)}
        self.links: list[str] = []

    def create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{CLIENT_ADDR}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, (addr, ns) in enumerate(self.ns.items()):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            outer, inner = f"{self.bridge}o{i}", f"{self.bridge}i{i}"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            self.links.append(outer)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("link", "set", inner, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")

    def remove(self) -> None:
        for ns in self.ns.values():
            _ip("netns", "del", ns, check=False)
        for name in [*self.links, self.bridge]:
            _ip("link", "del", name, check=False)


@contextmanager
def bridged(addresses: list[str]) -> Iterator[Bridge]:
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2): the recipe test needs network namespaces")
    b = Bridge(addresses)
    probe = _ip("netns", "add", b.ns[addresses[0]], check=False)
    if probe.returncode != 0:
        pytest.skip(f"network namespaces are not permitted here ({probe.stderr.strip()})")
    _ip("netns", "del", b.ns[addresses[0]], check=False)
    try:
        b.create()
        yield b
    finally:
        b.remove()


def _workers(router: str) -> dict:
    return httpx.get(router + "/workers", timeout=10).json()


def test_the_two_host_recipe_runs_as_printed(tmp_path):
    steps = recipe()
    hosts = sorted({h for h, _ in steps if h is not None})
    assert len(hosts) == 3, steps
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    with bridged(hosts) as b, ExitStack() as stack:
        for i, (host, line) in enumerate(steps):
            background = line.rstrip().endswith("&")
            command = line.rstrip().removesuffix("&").strip()
            where = [] if host is None else ["ip", "netns", "exec", b.ns[host]]
            command = command.replace(" deploy/", f" {ROOT}/deploy/")
            argv = [*where, "bash", "-c", command]
            if not background:
                subprocess.run(argv, cwd=tmp_path, env=env, check=True, timeout=60)
                continue
            log = open(tmp_path / f"step{i}.log", "wb")   # noqa: SIM115 (closed by the stack)
            stack.callback(log.close)
            p = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
            stack.callback(_stop, p)
        router = f"http://{hosts[0]}:8000"
        expected = {f"{h}:{port}" for h in hosts[1:] for port in (8001, 8002)}
        try:
            wait_until(lambda: _up(router) == expected, 120, "the router to discover 4 workers")
        except AssertionError as e:
            raise AssertionError(f"{e}; seen {_up(router)}; logs:\n{_logs(tmp_path)}") from None
        client = sdk(router)
        for attempt in range(2):
            for i in range(4):
                tag = f"conversation {i}"
                client.completions.create(model="sim", max_tokens=2,
                                          prompt=f"{tag}: tell me about the sea. " * 12)
                client.chat.completions.create(
                    model="sim", max_tokens=2,
                    messages=[{"role": "system", "content": f"{tag}: be brief. " * 30},
                              {"role": "user", "content": "What is a wave?"}])
            if attempt == 0:
                wait_until(lambda: sum(w["index_blocks"] for w in _workers(router).values())
                           >= 8 * 4, 20, "the KV events of every prompt")
        workers = _workers(router)
        predicted = sum(w["verification"]["predicted_tokens"] for w in workers.values())
        actual = sum(w["verification"]["actual_tokens"] for w in workers.values())
        assert actual > 0 and predicted == actual, workers
        health = httpx.get(router + "/health", timeout=10).json()
        assert health["status"] == "ok", health
    logs = {p: p.read_text(errors="replace") for p in tmp_path.glob("step*.log")}
    passwords = [(tmp_path / f"nats-{role}.pw").read_text().strip()
                 for role in ("worker", "router")]
    for log_path, text in logs.items():
        assert "Traceback" not in text, log_path
        assert not any(pw in text for pw in passwords), f"{log_path} shows a NATS password"
    # the bus ran deploy/nats/nats-server.conf: TLS required of every client
    assert sum("TLS required for client connections" in t for t in logs.values()) == 1


def _logs(folder: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                     for p in sorted(folder.glob("step*.log")))


def _up(router: str) -> set[str]:
    try:
        return {name for name, w in _workers(router).items() if w["up"]}
    except httpx.HTTPError:
        return set()


def _stop(p: subprocess.Popen) -> None:
    """End the command's whole process group (bash and what it started)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(5)


def test_the_recipe_names_every_command_with_its_host():
    steps = recipe()
    assert sum("kvloop serve" in c for _, c in steps) == 4
    for host, command in steps:
        if "kvloop serve" in command:
            assert f"--advertise-host {host}" in command, command
        for flag in re.findall(r"--[a-z-]+", command):
            assert flag in shlex.split(command), flag
