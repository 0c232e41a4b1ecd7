"""The listening socket of an HTTP front (API server and router): bind it, name its URL, and
the line that announces it.

Both fronts bind before anything slow starts (so a port in use is found at once) and hand the
socket to uvicorn (`kvloop.front.uvicorn_server.FrontServer`). Once it accepts connections
each prints its announcement; whoever starts a front as a child process
(`kvloop.front.launcher`) reads the URL back from that line (`announced_url`).
"""

from __future__ import annotations

import errno
import re
import socket

DEFAULT_PORT = 8000   # `kvloop serve` and `kvloop router` listen here unless told (vLLM's)
SERVE_ANNOUNCEMENT = "kvloop serving on {url}"
ROUTER_ANNOUNCEMENT = "kvloop router on {url}"


class BindError(OSError):
    """A front's address cannot be bound. Its text is one line saying why and what to pass
    instead, the same from `kvloop serve`, `router` and `fleet`."""

    def __str__(self) -> str:
        return str(self.strerror)


def bind_error(host: str, port: int, e: OSError) -> str:
    """One line saying why `host:port` cannot be bound and what to pass instead."""
    if e.errno == errno.EADDRINUSE:
        return (f"cannot listen on {host}:{port}: the port is in use; pass another --port "
                f"(--port 0 picks a free one)")
    return f"cannot listen on {host}:{port}: {e.strerror or e}; check --host and --port"


def bind_tcp(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on host:port (port 0 = ephemeral), not inherited by
    children; `BindError` when the address cannot be had. proto must say TCP: asyncio sets
    TCP_NODELAY on accepted sockets only then (without it every small response waits ~40 ms
    for the client's delayed ACK)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise BindError(e.errno, bind_error(host, port, e)) from None
    sock.set_inheritable(False)
    return sock


def http_url(sock: socket.socket, tls: bool = False) -> str:
    """http://HOST:PORT (https:// when the front serves TLS) of a bound socket (brackets
    around an IPv6 host)."""
    host, port = sock.getsockname()[:2]
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def announced_url(announcement: str) -> str:
    """The regular expression of an announcement line, its URL as group 1."""
    return re.escape(announcement).replace(re.escape("{url}"), r"(https?://\S+)")
