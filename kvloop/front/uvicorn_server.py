"""An HTTP front (the API server, the router) served by uvicorn on the socket it bound first.

    sock = bind_tcp(host, port)     # kvloop.front.sockets: a port in use fails at once
    server = FrontServer(app, sock, limits, log_level="info", graceful_shutdown_s=5,
                         on_ready=lambda url: print(SERVE_ANNOUNCEMENT.format(url=url)))
    await server.serve()            # until `server.should_exit`

uvicorn gets the fronts' HTTP protocol (read timeouts: `kvloop.front.guard.http_protocol`)
and no access log, and calls `on_ready(url)` once it accepts connections (each front
announces its URL then). `on_signal`, when given, receives SIGINT and SIGTERM instead of
uvicorn (which would otherwise stop, and re-raise the signal once stopped).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from types import FrameType

import uvicorn
from starlette.types import ASGIApp

from kvloop.front.guard import http_protocol
from kvloop.front.http_limits import HttpLimits
from kvloop.front.sockets import http_url
from kvloop.front.tls import TlsConfig

SignalHandler = Callable[[int, FrameType | None], None]


class FrontServer(uvicorn.Server):
    """uvicorn on one bound socket (`url` names it), announcing when it accepts connections;
    HTTPS with `tls` (kvloop.front.tls)."""

    def __init__(self, app: ASGIApp, sock: socket.socket, limits: HttpLimits, *,
                 log_level: str, graceful_shutdown_s: float, on_ready: Callable[[str], None],
                 on_signal: SignalHandler | None = None, tls: TlsConfig | None = None):
        options = tls.uvicorn_options() if tls is not None else {}
        super().__init__(uvicorn.Config(app, log_level=log_level, access_log=False,
                                        http=http_protocol(limits),
                                        timeout_graceful_shutdown=int(graceful_shutdown_s),
                                        **options))  # type: ignore[arg-type]
        self.sock = sock
        self.url = http_url(sock, tls is not None)
        self._on_ready = on_ready
        self._on_signal = on_signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._on_signal is None:
            super().handle_exit(sig, frame)
        else:
            self._on_signal(sig, frame)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self._on_ready(self.url)

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        """Serve on the bound socket until `should_exit`."""
        await super().serve(sockets or [self.sock])
