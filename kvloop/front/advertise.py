"""The address a worker tells others to reach it at (its *advertised* host), which is not
always the address it binds.

A worker binds `--host` (127.0.0.1 by default, 0.0.0.0 for every interface) and announces
`http://ADVERTISED:PORT` on discovery, its KV-event endpoints and its P/D side channel with
the same host. The advertised host is, in order:

1. `--advertise-host` (or `$VLLM_HOST_IP`, vLLM's variable for "this node's address as the
   others see it"), when given;
2. the bound host, when it is one address (not a wildcard);
3. for a wildcard bind (0.0.0.0, ::): the address of the interface that routes outwards
   (as Dynamo's `local_ip_for_advertise`; no packet is sent), else the first address the
   host name resolves to that is not a loopback one, else 127.0.0.1 with a warning that no
   other host can reach it.

`wildcard()`, `is_loopback_host()` and `unreachable_from_afar()` are the router's side of the
same facts: an advertised address that another host cannot use.

Standard library only.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

ADVERTISE_HOST_ENV = "VLLM_HOST_IP"
WILDCARDS = ("0.0.0.0", "::", "*", "")
_PROBE_ADDRESSES = (("10.255.255.255", socket.AF_INET), ("fd00::1", socket.AF_INET6))


@dataclass(frozen=True)
class Advertised:
    """The advertised host and how it was chosen (said at start-up)."""

    host: str
    how: str

    @property
    def reachable_from_afar(self) -> bool:
        return not is_loopback_host(self.host)


def wildcard(host: str) -> bool:
    """Does binding `host` listen on every interface?"""
    return host.strip("[]") in WILDCARDS


def is_loopback_host(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: an address only this host can use."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def advertised_host(bind_host: str, flag: str | None,
                    environ: Mapping[str, str] = os.environ) -> Advertised:
    """The host to announce for a front bound on `bind_host` (module docstring: the order)."""
    given = flag or environ.get(ADVERTISE_HOST_ENV)
    if given:
        source = "--advertise-host" if flag else f"${ADVERTISE_HOST_ENV}"
        return Advertised(given, f"from {source}")
    if not wildcard(bind_host):
        return Advertised(bind_host, "the address it binds (--host)")
    found = _outward_address() or _resolved_address()
    if found is not None:
        return Advertised(found, f"bound {bind_host or '0.0.0.0'}: the address of the "
                                 "interface that routes outwards (--advertise-host to choose)")
    return Advertised("127.0.0.1", f"bound {bind_host or '0.0.0.0'} but no address of this "
                                   "host routes outwards: 127.0.0.1, which NO OTHER HOST can "
                                   "reach (pass --advertise-host)")


def _outward_address() -> str | None:
    """The source address the kernel picks for an outward route (a UDP connect sends
    nothing), or None without such a route."""
    for target, family in _PROBE_ADDRESSES:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((target, 9))
                host = str(s.getsockname()[0])
        except OSError:
            continue
        if not is_loopback_host(host) and not wildcard(host):
            return host
    return None


def _resolved_address() -> str | None:
    """The first non-loopback address the host name resolves to (None: none)."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    for info in infos:
        host = str(info[4][0])
        if not is_loopback_host(host):
            return host
    return None


def url_with_host(url: str, host: str) -> str:
    """`url` (scheme://HOST:PORT...) with its host replaced by `host`."""
    parts = urlsplit(url)
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return parts._replace(netloc=netloc).geturl()


def advertised_endpoint(endpoint: str | None, host: str) -> str | None:
    """A bound tcp:// endpoint as others should dial it: a wildcard host becomes `host`;
    anything else (one address, ipc://, a NATS URL) is left as it is."""
    if endpoint is None or not endpoint.startswith("tcp://"):
        return endpoint
    if not wildcard(urlsplit(endpoint).hostname or ""):
        return endpoint
    return url_with_host(endpoint, host)


def unreachable_from_afar(worker_url: str, endpoint: str | None) -> str | None:
    """Why a router cannot dial `endpoint`, a tcp:// address the worker at `worker_url`
    advertises (None: it can, as far as the addresses say): a wildcard, or a loopback
    address of a worker whose URL names another host's IP address."""
    if endpoint is None or not endpoint.startswith("tcp://"):
        return None
    host = urlsplit(endpoint).hostname or ""
    if wildcard(host):
        return f"it advertises {endpoint}, a wildcard address nobody can dial"
    worker_host = urlsplit(worker_url).hostname or ""
    if is_loopback_host(host) and _another_hosts_address(worker_host):
        return (f"it advertises {endpoint}, a loopback address, but the worker is at "
                f"{worker_host}, another host: only the worker's own host can reach that")
    return None


def _another_hosts_address(host: str) -> bool:
    """Is `host` an IP address that is not this host's? (A name is not resolved: it may be
    this host's, and a wrong alarm is worse than none.) Binding it succeeds only for an
    address of this host; nothing is sent."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if ip.is_loopback:
        return False
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((str(ip), 0))
    except OSError:
        return True
    return False
