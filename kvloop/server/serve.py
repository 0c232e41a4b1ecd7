"""`kvloop serve` at run time: port first, engine core process next, then HTTP, then a clean stop.

    1. bind the HTTP socket (port 0 = ephemeral), so a port in use fails before the model
       loads (exit 2);
    2. start the engine core process and wait for its handshake (model loaded, KV sized);
    3. start uvicorn on the socket, print "kvloop serving on http://HOST:PORT" once it
       accepts connections; the stats line (kvloop/server/logs.py) runs from then on;
    4. on SIGTERM with `--shutdown-timeout S` > 0: drain (new requests get 503 with
       `x-kvloop-draining`, /health 503, the /metrics gauge `kvloop:server_draining` 1, a
       NATS-announced worker withdraws now; requests in flight go on for up to S seconds,
       kvloop/front/drain.py); then, or at once on SIGINT, on SIGTERM
       without a timeout or on a second signal: end in-flight requests (streams get
       finish_reason "abort", others 503), stop uvicorn, then stop the engine process;
    5. if the engine process dies, fail in-flight requests, stop uvicorn and exit 1.

A signal during step 2 stops the engine process and exits 0.
Exit code: 0 after a signal (to this process or to both, as a process-group signal does),
1 if the engine failed to start or died, 2 if the port cannot be bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import time
from types import FrameType
from typing import Any

from kvloop.config import RunnerConfig
from kvloop.front.advertise import is_loopback_host, url_with_host
from kvloop.front.sockets import SERVE_ANNOUNCEMENT, BindError, bind_tcp, http_url
from kvloop.front.uvicorn_server import FrontServer
from kvloop.server.announce import WorkerAnnouncer
from kvloop.server.api import build_app, describe_worker
from kvloop.server.client import EngineClient, EngineStartError
from kvloop.server.config import ServeConfig
from kvloop.server.logs import StatLogger
from kvloop.server.lora_routes import load_startup_modules
from kvloop.server.metrics import ServerMetrics
from kvloop.server.serving import ServerContext
from kvloop.wire import EngineReady, EngineStartConfig

logger = logging.getLogger("kvloop.server")


class _Signals:
    """What SIGINT and SIGTERM do, from start-up to exit (steps 2 and 4 of the module
    docstring). The handler only hands the signal to the event loop; `on_signal` acts there."""

    def __init__(self, client: EngineClient, shutdown_timeout_s: float,
                 loop: asyncio.AbstractEventLoop):
        self.stop_requested = asyncio.Event()
        self.server: FrontServer | None = None   # set once uvicorn is about to serve
        self._client = client
        self._timeout_s = shutdown_timeout_s
        self._loop = loop
        self._drain: asyncio.Task[None] | None = None
        self.discovery: WorkerAnnouncer | None = None   # withdrawn when the drain begins

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.handler)

    def handler(self, signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: we are exiting anyway
            self._loop.call_soon_threadsafe(self.on_signal, signum)

    def on_signal(self, sig: int) -> None:
        self.stop_requested.set()
        server = self.server
        if server is None or server.should_exit:
            return  # still starting (`_serve` sees `stop_requested`), or already stopping
        if sig == signal.SIGTERM and self._timeout_s > 0 and self._drain is None:
            logger.info("SIGTERM: draining %d requests for up to %g s (new ones get 503)",
                        self._client.num_in_flight, self._timeout_s)
            self._client.begin_drain()
            if self.discovery is not None:
                self.discovery.begin_withdraw()
            self._drain = asyncio.ensure_future(self._drain_then_stop(server))
            return
        if self._drain is not None:
            self._drain.cancel()
        self._stop(server)

    async def _drain_then_stop(self, server: FrontServer) -> None:
        await self._client.wait_drained(self._timeout_s)
        self._stop(server)

    def _stop(self, server: FrontServer) -> None:
        """End in-flight requests, then let uvicorn stop (they end at once, so it never needs
        uvicorn's force exit, which would skip the app's shutdown)."""
        self._client.begin_shutdown()
        server.should_exit = True


def _announce(url: str) -> None:
    print(SERVE_ANNOUNCEMENT.format(url=url), flush=True)


def _on_ready(url: str, discovery: WorkerAnnouncer | None) -> None:
    """Accepting connections: print the URL, and announce the worker on its event plane."""
    _announce(url)
    if discovery is not None:
        asyncio.get_running_loop().create_task(discovery.start())


def advertised_url(cfg: ServeConfig, bound: str) -> str:
    """The URL other hosts reach this worker at (said at start-up)."""
    host = cfg.advertise_host or cfg.host
    url = bound if host == cfg.host else url_with_host(bound, host)
    level = logging.INFO if not is_loopback_host(host) or is_loopback_host(cfg.host) \
        else logging.WARNING
    logger.log(level, "advertised as %s (%s)", url, cfg.advertise_how or "the address it binds")
    return url


def _announcer(ctx: ServerContext, start: EngineStartConfig, url: str
               ) -> WorkerAnnouncer | None:
    """The discovery announcer of a worker whose KV events go to a NATS event plane."""
    ev = ctx.ready.kv_events
    plane = start.kv_events.nats if start.kv_events is not None else None
    if plane is None or ev is None or ev.worker_id is None:
        return None
    return WorkerAnnouncer(plane, url, ev.worker_id,
                           lambda: describe_worker(ctx, private=False, key_accepted=False),
                           ctx.config.fleet_secret)


def _cache_info(ready: EngineReady, runner: RunnerConfig) -> dict[str, str]:
    return {"block_size": str(ready.block_size), "num_gpu_blocks": str(ready.num_gpu_blocks),
            "enable_prefix_caching": str(ready.enable_prefix_caching),
            "prefix_caching_hash_algo": ready.hash_algo, "cache_dtype": runner.kv_cache_dtype}


async def _first(work: Any, stop: asyncio.Event) -> tuple[bool, Any]:
    """(True, result of `work`), or (False, None) if `stop` is set first (`work` cancelled)."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if task.done():
        return True, task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False, None


async def _serve(cfg: ServeConfig, start: EngineStartConfig, tokenizer: Any) -> int:
    try:
        sock = bind_tcp(cfg.host, cfg.port)
    except BindError as e:
        logger.error("%s", e)
        return 2
    try:
        return await _serve_on(sock, cfg, start, tokenizer)
    finally:
        sock.close()


async def _serve_on(sock: socket.socket, cfg: ServeConfig, start: EngineStartConfig,
                    tokenizer: Any) -> int:
    exit_code = 0
    server: FrontServer | None = None

    def on_engine_exit(code: int) -> None:
        nonlocal exit_code
        exit_code = 0 if code == 0 else 1   # 0: it was stopped by a signal, as we are
        if server is not None:
            server.should_exit = True

    client = EngineClient(start, on_engine_exit)
    signals = _Signals(client, cfg.shutdown_timeout_s, asyncio.get_running_loop())
    signals.install()
    try:
        started, ready = await _first(client.start(cfg.engine_start_timeout_s),
                                      signals.stop_requested)
    except EngineStartError as e:
        logger.error("%s", e)
        await client.shutdown()
        return 1
    try:
        if not started:
            logger.info("stopped before the engine core was ready")
            return 0
        spec = start.engine.speculative
        client.metrics = ServerMetrics(cfg.model_name, ready.max_model_len,
                                       start.engine_index, _cache_info(ready, start.runner),
                                       spec.num_speculative_tokens if spec else 0,
                                       kv_transfer=(ready.kv_transfer is not None
                                                    or start.engine.kv_offload is not None))
        if ready.kv_transfer is not None:
            kv = ready.kv_transfer
            logger.info("KV connector: engine_id %s, kv_role %s, side channel tcp://%s:%d "
                        "(transport %s)", kv.engine_id, kv.kv_role, kv.side_channel_host,
                        kv.side_channel_port, kv.transport)
        ctx = ServerContext(cfg, client, tokenizer, ready, client.metrics, int(time.time()))
        try:
            await load_startup_modules(ctx.loras, client.call_utility)
        except RuntimeError as e:
            logger.error("--lora-modules: %s", e)
            return 1
        discovery = signals.discovery = _announcer(ctx, start,
                                                  advertised_url(cfg, http_url(sock, cfg.tls
                                                                               is not None)))
        server = FrontServer(build_app(ctx), sock, cfg.http_limits, tls=cfg.tls,
                             log_level=cfg.uvicorn_log_level,
                             graceful_shutdown_s=cfg.graceful_shutdown_s,
                             on_ready=lambda url: _on_ready(url, discovery),
                             on_signal=signals.handler)
        signals.server = server
        if not signals.stop_requested.is_set():  # none came between start-up and now
            stats = (asyncio.create_task(StatLogger(client.metrics, cfg.log_stats_interval_s,
                                                    start.engine_index).run(),
                                         name="stat-logger") if cfg.log_stats else None)
            try:
                await server.serve()
            finally:
                if stats is not None:
                    stats.cancel()
                if discovery is not None:
                    await discovery.stop()
    finally:
        await client.shutdown(cfg.graceful_shutdown_s)
    return exit_code


def run_server(cfg: ServeConfig, start: EngineStartConfig, tokenizer: Any) -> int:
    """Serve until a signal or an engine failure; returns the process exit code."""
    code = asyncio.run(_serve(cfg, start, tokenizer))
    sys.stdout.flush()
    return code
