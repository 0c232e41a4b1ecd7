"""Many hosts, on one: three network namespaces joined by veth pairs, nothing leaving the
machine.

    bus   (nats-server, redis-server)  --veth--  work  (two `kvloop serve --model sim`)
      \\                                           /
       veth                                    veth
         \\                                     /
          route (two `kvloop router`s, no --worker: they discover the workers)
            |
           veth  -- this test's own namespace: it talks to the routers only

Each namespace sees the others only through its links, each link its own /24. Router A
listens to every component; router B is pinned to `prefill` while the workers are
aggregated (`backend`), so its bus watch must raise `wrong_subject`. Both keep their index
in the one Redis. Namespaces, links and processes are removed even when the test fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from kvloop.front.launcher import ROUTER_URL_LINE, SERVE_URL_LINE, UrlProcess, kvloop_command
from kvloop.router.services import NATS_READY, REDIS_READY, local_nats, local_redis

from .bus_helpers import NATS_PASSWORD, NATS_USER
from .conftest import sdk, wait_until

pytestmark = pytest.mark.processes

NATS_PORT, REDIS_PORT = 4222, 6379   # inside the bus namespace: nothing else listens there


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=30)


class Hosts:
    """Three namespaces (bus, work, route) plus a link from this one to route."""

    def __init__(self) -> None:
        n = os.getpid() % 10_000
        self.tag = f"{n}"
        self.net = 100 + os.getpid() % 100          # 10.<net>.<link>.<host>
        self.ns = {role: f"kvloop-{role}-{n}" for role in ("bus", "work", "route")}
        self.links: list[str] = []

    def addr(self, link: int, host: int) -> str:
        return f"10.{self.net}.{link}.{host}"

    def exec_prefix(self, role: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[role]]

    def create(self) -> None:
        for ns in self.ns.values():
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        self._link(1, "bus", "work")
        self._link(2, "bus", "route")
        self._link(3, "work", "route")
        self._link(4, None, "route")

    def _link(self, link: int, a: str | None, b: str) -> None:
        left, right = f"kv{self.tag}l{link}a", f"kv{self.tag}l{link}b"
        _ip("link", "add", left, "type", "veth", "peer", "name", right)
        self.links.append(left)
        for name, role, host in ((left, a, 1), (right, b, 2)):
            where = [] if role is None else ["-n", self.ns[role]]
            if role is not None:
                _ip("link", "set", name, "netns", self.ns[role])
            _ip(*where, "addr", "add", f"{self.addr(link, host)}/24", "dev", name)
            _ip(*where, "link", "set", name, "up")

    def remove(self) -> None:
        for ns in self.ns.values():
            _ip("netns", "del", ns, check=False)
        for name in self.links:
            _ip("link", "del", name, check=False)


@contextmanager
def hosts() -> Iterator[Hosts]:
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2): the multi-host test needs network namespaces")
    h = Hosts()
    probe = _ip("netns", "add", h.ns["bus"], check=False)
    if probe.returncode != 0:
        pytest.skip(f"network namespaces are not permitted here ({probe.stderr.strip()}): "
                    "the multi-host test needs root (or CAP_NET_ADMIN)")
    _ip("netns", "del", h.ns["bus"], check=False)
    try:
        h.create()
        yield h
    finally:
        h.remove()


def _process(h: Hosts, role: str, argv: list[str], log: Path, line: str) -> UrlProcess:
    return UrlProcess([*h.exec_prefix(role), *argv], log, line, name=f"{role}: {argv[3]}")


def test_routing_events_discovery_and_alarms_across_three_hosts(tmp_path):
    with hosts() as h, ExitStack() as stack:
        bus_to_work, bus_to_route = h.addr(1, 1), h.addr(2, 1)
        nats = local_nats("0.0.0.0", NATS_PORT, tmp_path / "nats.log", user=NATS_USER,
                          password=NATS_PASSWORD, prefix=h.exec_prefix("bus"),
                          ready_line=NATS_READY)
        stack.callback(nats.stop)
        nats.start()
        redis = local_redis(bus_to_route, REDIS_PORT, tmp_path / "redis.log",
                            prefix=h.exec_prefix("bus"), ready_line=REDIS_READY)
        stack.callback(redis.stop)
        redis.start()
        creds = f"{NATS_USER}:{NATS_PASSWORD}@"
        workers = []
        for i in range(2):
            argv = kvloop_command("serve", "--model", "sim", "--host", h.addr(3, 1),
                                  "--port", "0", "--event-plane",
                                  f"nats://{creds}{bus_to_work}:{NATS_PORT}",
                                  "--num-gpu-blocks-override", "64", "--sim-speedup", "20")
            w = _process(h, "work", argv, tmp_path / f"worker{i}.log", SERVE_URL_LINE)
            stack.callback(w.stop)
            w.launch()
            workers.append(w)
        routers = {}
        for name, pin in (("a", []), ("b", ["--dyn-component", "prefill"])):
            argv = kvloop_command("router", "--host", h.addr(4, 2), "--port", "0",
                                  "--discover", f"nats://{bus_to_route}:{NATS_PORT}",
                                  "--nats-user", NATS_USER, "--nats-password", NATS_PASSWORD,
                                  "--index", f"redis://{bus_to_route}:{REDIS_PORT}",
                                  "--liveness-window", "3", "--poll-interval", "0.2",
                                  "--discovery-ttl", "3", "--allow-unsigned-bus", *pin)
            r = _process(h, "route", argv, tmp_path / f"router-{name}.log", ROUTER_URL_LINE)
            stack.callback(r.stop)
            r.launch()
            routers[name] = r
        for p in [*workers, *routers.values()]:
            p.wait_url(90)
        a, b = routers["a"].url, routers["b"].url
        assert a.startswith(f"http://{h.addr(4, 2)}:")

        def listed(url: str) -> dict:
            return httpx.get(url + "/workers", timeout=10).json()
        for url in (a, b):   # discovery across hosts: no --worker given
            wait_until(lambda url=url: sum(w["up"] for w in listed(url).values()) == 2, 30,
                       "both workers discovered")
        assert all(w["url"].startswith(f"http://{h.addr(3, 1)}:") for w in listed(a).values())
        client = sdk(a)
        prompts = [[7] * 64 + [100 + i] * 16 for i in range(6)]
        for p in prompts:               # routing across hosts
            assert client.completions.create(model="sim", prompt=p, max_tokens=2).choices
        wait_until(lambda: sum(w["events"]["stored_blocks"] for w in listed(a).values()) > 0,
                   10, "events across hosts")
        again = client.completions.create(model="sim", prompt=prompts[0], max_tokens=2)
        assert again.usage.prompt_tokens_details.cached_tokens >= 64   # the prefix was hit
        assert all(not w["alarms"] for w in listed(a).values()), listed(a)
        # router B hears nothing on `prefill`: its bus watch says where the events are
        client_b = sdk(b)
        deadline = time.monotonic() + 15
        reasons: list[str] = []
        while time.monotonic() < deadline and not any("wrong_subject" in r for r in reasons):
            client_b.completions.create(model="sim", prompt=[9] * 80, max_tokens=2)
            time.sleep(0.5)
            reasons = httpx.get(b + "/health", timeout=10).json()["reasons"]
        alarm = next((r for r in reasons if "wrong_subject" in r), None)
        assert alarm is not None, reasons
        assert "`namespace.dynamo.component.backend.kv-events`" in alarm
        assert "`namespace.dynamo.component.prefill.kv-events`" in alarm
        for p in [*workers, *routers.values()]:
            p.stop()
        for p in [*workers, *routers.values()]:
            assert NATS_PASSWORD not in p.log() and "Traceback" not in p.log(), p.log()
