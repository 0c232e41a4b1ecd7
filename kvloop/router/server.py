"""`kvloop router` at run time: bind, serve, announce, stop cleanly.

    1. connect to the NATS event plane, if configured (kvloop.router.bus); bind the HTTP
       socket (port 0 = ephemeral);
    2. start uvicorn; its lifespan registers the initial workers and starts the poller;
    3. once it accepts connections: start discovery, if configured (kvloop.router.discovery,
       kvloop.router.discovery_file), and the endpoint picker for Envoy with --ext-proc-port
       (kvloop.router.ext_proc), and print "kvloop router on http://HOST:PORT";
    4. on SIGTERM/SIGINT: stop accepting, end the picker, the poller, discovery, every
       KV-event subscription, then the event plane.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

from kvloop.front.sockets import ROUTER_ANNOUNCEMENT, bind_tcp, http_url
from kvloop.front.uvicorn_server import FrontServer
from kvloop.router.config import RouterConfig
from kvloop.router.proxy import RouterApp
from kvloop.router.registry import WorkerSpec, event_source
from kvloop.router.router import Router, SubscriberFactory

if TYPE_CHECKING:
    from kvloop.router.bus import RouterBus
    from kvloop.router.discovery import Discovery
    from kvloop.router.discovery_file import FileDiscovery
    from kvloop.router.ext_proc import PickerServer

log = logging.getLogger("kvloop.router")

GRACEFUL_SHUTDOWN_S = 5.0   # what uvicorn gives open connections once stopping


class RouterServer:
    """One router process: a `Router`, its `RouterApp` and a uvicorn server on one socket."""

    def __init__(self, config: RouterConfig, workers: list[WorkerSpec],
                 subscriber_factory: SubscriberFactory | None = None,
                 log_level: str = "warning", sock: socket.socket | None = None):
        """`sock`: the listening socket, if the caller bound it already (`kvloop fleet` binds
        before starting its workers, so a port in use fails at once); bound here otherwise,
        before anything else starts (`BindError`: one line saying why)."""
        self.sock = bind_tcp(config.host, config.port) if sock is None else sock
        if subscriber_factory is None:
            from kvloop.router.subscription import subscription_factory

            subscriber_factory = subscription_factory(config.fleet_secret)
        self.bus: RouterBus | None = None
        self.discovery: Discovery | None = None
        if config.bus is not None:
            from kvloop.router.bus import RouterBus

            self.bus = RouterBus(config.bus, config.fleet_secret).start()
            subscriber_factory = self.bus.factory(subscriber_factory)
        self.router = Router(config, subscriber_factory)
        self.app = RouterApp(self.router, workers)
        self.picker: PickerServer | None = None
        self.file_discovery: FileDiscovery | None = None
        if config.discovery_file is not None:
            from kvloop.router.discovery_file import FileDiscovery

            self.file_discovery = FileDiscovery(self.app, config.discovery_file)
            self.router.details["discovery_file"] = self.file_discovery.describe
        if self.bus is not None:
            self.router.watchers.append(self.bus.watch)
            self.router.details["bus"] = self.bus.describe
            from kvloop.router.replicas import ReplicaSync

            replicas = ReplicaSync(self.router, self.bus.plane,
                                   self.bus.config.plane.namespace).start()
            self.router.details["replicas"] = replicas.describe
            if self.bus.config.discover:
                from kvloop.router.discovery import Discovery

                self.discovery = Discovery(self.app, self.bus)
                self.router.details["discovery"] = self.discovery.describe
        self.url = http_url(self.sock, config.tls is not None)
        self._log_level = log_level
        self._server: FrontServer | None = None

    async def serve(self, on_ready: Callable[[RouterServer], None] | None = None) -> None:
        """Serve until `stop()` or a signal."""
        self._server = FrontServer(self.app.app, self.sock, self.router.config.http_limits,
                                   tls=self.router.config.tls,
                                   log_level=self._log_level,
                                   graceful_shutdown_s=GRACEFUL_SHUTDOWN_S,
                                   on_ready=lambda url: self._ready(on_ready))
        try:
            await self._start_picker()
            await self._server.serve()
        finally:
            self.sock.close()
            if self.picker is not None:
                await self.picker.stop()
            if self.file_discovery is not None:
                await self.file_discovery.stop()
            if self.discovery is not None:
                await self.discovery.stop()
            if self.bus is not None:
                self.bus.stop()

    async def _start_picker(self) -> None:
        """With --ext-proc-port: the endpoint picker's gRPC server, on this event loop."""
        port = self.router.config.ext_proc_port
        if port is None:
            return
        from kvloop.router.ext_proc import PickerServer

        self.picker = PickerServer(self.app, self.router.config.host, port)
        await self.picker.start()
        self.router.details["ext_proc"] = self.picker.describe

    def _ready(self, on_ready: Callable[[RouterServer], None] | None) -> None:
        if self.discovery is not None:
            self.discovery.start()
        if self.file_discovery is not None:
            self.file_discovery.start()
        if on_ready is not None:
            on_ready(self)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True


def announce(server: RouterServer) -> None:
    """Print where the router listens and what it knows about each worker."""
    for w in server.router.registry.all():
        d = w.description
        state = "up" if w.up else f"DOWN ({w.down_reason})"
        events = event_source(w.spec, d)
        print(f"  worker {w.name}: {state}, role {w.role}, model {d.model if d else '?'}, "
              f"{d.kv_capacity_blocks if d else '?'} blocks, events "
              f"{events.endpoint if events else 'none'}"
              f"{' replay ' + events.replay_endpoint if events and events.replay_endpoint else ''}",
              flush=True)
    if server.bus is not None:
        print(f"  event plane {server.bus.config.plane.safe_url}: listening on "
              f"{server.bus.plane.listening}"
              f"{', discovering workers' if server.discovery else ''}", flush=True)
    if server.picker is not None:
        print(f"  endpoint picker (Envoy ext_proc) on {server.picker.host}:{server.picker.port}",
              flush=True)
    print(f"{ROUTER_ANNOUNCEMENT.format(url=server.url)} (policy {server.router.config.policy})",
          flush=True)


def _ignore_signal(signum: int, frame: FrameType | None) -> None:
    """uvicorn re-raises the signal that stopped it; by then we are already stopping."""


def run_router(config: RouterConfig, workers: list[WorkerSpec],
               log_level: str = "warning") -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code."""
    server = RouterServer(config, workers, log_level=log_level)
    signal.signal(signal.SIGTERM, _ignore_signal)
    signal.signal(signal.SIGINT, _ignore_signal)
    asyncio.run(server.serve(announce))
    return 0
