"""`kvloop serve` at run time: engine core process first, then HTTP, then a clean stop.

    1. start the engine core process and wait for its handshake (model loaded, KV sized);
    2. bind the HTTP socket (port 0 = ephemeral), start uvicorn, print
       "kvloop serving on http://HOST:PORT" once it accepts connections; the stats line
       (kvloop/server/logs.py) runs from then on;
    3. on SIGTERM/SIGINT: refuse new requests, end in-flight ones (streams get
       finish_reason "abort", others 503), stop uvicorn, then stop the engine process;
    4. if the engine process dies, fail in-flight requests, stop uvicorn and exit 1.

Exit code: 0 after a signal (to this process or to both, as a process-group signal does),
1 if the engine failed to start or died.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import time
from types import FrameType
from typing import Any

import uvicorn

from kvloop.server.api import build_app
from kvloop.server.client import EngineClient, EngineStartError
from kvloop.server.config import ServeConfig
from kvloop.server.guard import http_protocol
from kvloop.server.logs import StatLogger
from kvloop.server.metrics import ServerMetrics
from kvloop.server.serving import ServerContext
from kvloop.server.sockets import bind_tcp, http_url
from kvloop.wire import EngineReady, EngineStartConfig

logger = logging.getLogger("kvloop.server")


class _Uvicorn(uvicorn.Server):
    """uvicorn that ends in-flight requests on a signal and announces its URL."""

    def __init__(self, config: uvicorn.Config, client: EngineClient, url: str,
                 loop: asyncio.AbstractEventLoop):
        super().__init__(config)
        self._client = client
        self._url = url
        self._loop = loop

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._loop.call_soon_threadsafe(self._client.begin_shutdown)
        super().handle_exit(sig, frame)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            print(f"kvloop serving on {self._url}", flush=True)


def _cache_info(ready: EngineReady) -> dict[str, str]:
    return {"block_size": str(ready.block_size), "num_gpu_blocks": str(ready.num_gpu_blocks),
            "enable_prefix_caching": str(ready.enable_prefix_caching),
            "prefix_caching_hash_algo": ready.hash_algo}


def _ignore_signal(signum: int, frame: FrameType | None) -> None:
    """uvicorn re-raises the signal that stopped it; by then we are already stopping."""


async def _serve(cfg: ServeConfig, start: EngineStartConfig, tokenizer: Any) -> int:
    exit_code = 0
    server: _Uvicorn | None = None

    def on_engine_exit(code: int) -> None:
        nonlocal exit_code
        exit_code = 0 if code == 0 else 1   # 0: it was stopped by a signal, as we are
        if server is not None:
            server.should_exit = True

    client = EngineClient(start, on_engine_exit)
    try:
        ready = await client.start(cfg.engine_start_timeout_s)
    except EngineStartError as e:
        logger.error("%s", e)
        await client.shutdown()
        return 1
    client.metrics = ServerMetrics(cfg.model_name, ready.max_model_len, start.engine_index,
                                   _cache_info(ready))
    ctx = ServerContext(cfg, client, tokenizer, ready, client.metrics, int(time.time()))
    sock = bind_tcp(cfg.host, cfg.port)
    uv_cfg = uvicorn.Config(build_app(ctx), log_level=cfg.log_level, access_log=False,
                            http=http_protocol(cfg.http_limits),
                            timeout_graceful_shutdown=int(cfg.graceful_shutdown_s))
    server = _Uvicorn(uv_cfg, client, http_url(sock), asyncio.get_running_loop())
    signal.signal(signal.SIGTERM, _ignore_signal)
    signal.signal(signal.SIGINT, _ignore_signal)
    stats = (asyncio.create_task(StatLogger(client.metrics, cfg.log_stats_interval_s,
                                            start.engine_index).run(), name="stat-logger")
             if cfg.log_stats else None)
    try:
        await server.serve(sockets=[sock])
    finally:
        if stats is not None:
            stats.cancel()
        await client.shutdown(cfg.graceful_shutdown_s)
        sock.close()
    return exit_code


def run_server(cfg: ServeConfig, start: EngineStartConfig, tokenizer: Any) -> int:
    """Serve until a signal or an engine failure; returns the process exit code."""
    code = asyncio.run(_serve(cfg, start, tokenizer))
    sys.stdout.flush()
    return code
