"""Advertised addresses: what a worker announces when it binds a wildcard or one address,
and the router's alarm for an event address it cannot dial (`degraded`, with the cause)."""

from __future__ import annotations

import msgspec
import pytest

from kvloop.front.advertise import (
    ADVERTISE_HOST_ENV,
    advertised_endpoint,
    advertised_host,
    unreachable_from_afar,
    url_with_host,
)
from kvloop.router.registry import UNREACHABLE_EVENT_SOURCE, WorkerSpec

from .test_router_core import desc, make_router

FAR = "192.0.2.7"   # TEST-NET-1: never an address of this host


def test_the_advertised_host_in_order_flag_env_bound_outward():
    assert advertised_host("0.0.0.0", "10.1.2.3", {}).host == "10.1.2.3"
    assert advertised_host("0.0.0.0", None, {ADVERTISE_HOST_ENV: "10.9.9.9"}).host == \
        "10.9.9.9"
    assert advertised_host("10.0.0.5", None, {}).host == "10.0.0.5"
    assert advertised_host("127.0.0.1", None, {}).host == "127.0.0.1"
    picked = advertised_host("0.0.0.0", None, {})
    assert picked.host not in ("0.0.0.0", "::", "")   # never the wildcard
    assert "0.0.0.0" in picked.how   # and start-up says how it was chosen


def test_only_wildcard_endpoints_are_rewritten():
    assert advertised_endpoint("tcp://0.0.0.0:5557", "10.0.0.5") == "tcp://10.0.0.5:5557"
    assert advertised_endpoint("tcp://*:5557", "10.0.0.5") == "tcp://10.0.0.5:5557"
    assert advertised_endpoint("tcp://10.0.0.6:5557", "10.0.0.5") == "tcp://10.0.0.6:5557"
    assert advertised_endpoint("ipc:///tmp/x", "10.0.0.5") == "ipc:///tmp/x"
    assert advertised_endpoint("nats://10.0.0.9:4222", "10.0.0.5") == "nats://10.0.0.9:4222"
    assert advertised_endpoint(None, "10.0.0.5") is None
    assert url_with_host("http://0.0.0.0:8000", "::1") == "http://[::1]:8000"


@pytest.mark.parametrize(("url", "endpoint", "alarm"), [
    (f"http://{FAR}:8000", "tcp://127.0.0.1:5557", "loopback"),
    ("http://127.0.0.1:8000", "tcp://0.0.0.0:5557", "wildcard"),
    (f"http://{FAR}:8000", f"tcp://{FAR}:5557", None),
    ("http://127.0.0.1:8000", "tcp://127.0.0.1:5557", None),
    ("http://worker-a:8000", "tcp://127.0.0.1:5557", None),   # a name may be this host
    (f"http://{FAR}:8000", "nats://10.0.0.9:4222", None),
])
def test_unreachable_event_addresses(url, endpoint, alarm):
    why = unreachable_from_afar(url, endpoint)
    assert (why is None) if alarm is None else (alarm in why)


def test_a_worker_with_an_undialable_event_address_is_load_only_and_degrades_health():
    r, _, _ = make_router()
    r.register(WorkerSpec(f"http://{FAR}:8000"), desc(events="tcp://127.0.0.1:5557"))
    w = r.registry.get(f"{FAR}:8000")
    assert w is not None and UNREACHABLE_EVENT_SOURCE in w.alarms and w.load_only
    status, body = r.health()
    assert status == 200 and body["status"] == "degraded"
    assert any(UNREACHABLE_EVENT_SOURCE in m and "--advertise-host" in m
               for m in body["reasons"]), body
    # the worker re-registers with a reachable address: the alarm clears
    r.register(WorkerSpec(f"http://{FAR}:8000"), desc(events=f"tcp://{FAR}:5557"))
    assert UNREACHABLE_EVENT_SOURCE not in w.alarms


def test_a_worker_that_hides_its_events_says_why():
    r, _, _ = make_router()
    hidden = msgspec.structs.replace(desc(events=None), api_key_required=True,
                                     api_key_accepted=False)
    r.register(WorkerSpec("http://w:1"), hidden)
    _, body = r.health()
    assert any("hides its KV-event endpoint" in m for m in body["reasons"]), body
