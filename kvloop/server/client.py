"""Async client of the engine core process, living in the API server's event loop.

    API server                                   engine core process
    ROUTER (bind) --[identity, type, payload]--> DEALER   ADD / ABORT / UTILITY
    PULL   (bind) <--------- EngineCoreOutputs -- PUSH

Life cycle: `start()` binds both sockets as IPC files in a fresh directory only this user
can enter (mode 0700: no other local user can send the engine requests, forge its outputs or
its handshake, as anyone on the host could on loopback TCP; docs/security.md), starts
`python -m kvloop.engine.proc` in its own session (a signal to our process group, as
Ctrl-C or `kill -- -PGID` send, reaches only the API server, which then stops the engine: one
owner of its life, whether it is still loading the model or serving), writes its
`EngineStartConfig` on the child's stdin (kept open: closing it stops the engine) and waits
for the `EngineReady` handshake. From then on an
output task routes each `EngineCoreOutput` to the asyncio queue of its HTTP handler and feeds
the metrics; a waiter thread notices the engine process exiting and fails every request.
Stopping: `begin_drain()` refuses new requests and lets those in flight go on;
`begin_shutdown()` also ends those in flight; `shutdown()` then stops the engine process.

Owner: the client alone tracks which engine requests are in flight (`_requests`), how many
were never scheduled (admission control), and their timings for the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO, Any

import msgspec
import zmq
import zmq.asyncio

from kvloop.front.launcher import stop_processes
from kvloop.server.metrics import RequestTimes, ServerMetrics
from kvloop.server.tracing import end_llm_request, start_llm_request
from kvloop.tracing import Span, make_tracer
from kvloop.wire import (
    ENGINE_CORE_DEAD,
    WIRE_VERSION,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineHandshake,
    EngineReady,
    EngineStartConfig,
    EngineStartFailed,
    RequestType,
    UtilityOutput,
    UtilityRequest,
)

logger = logging.getLogger("kvloop.server")
# the engine core is told to exit by its stdin closing: it gets time to, then SIGTERM, SIGKILL
ENGINE_STOP_STEPS = (None, signal.SIGTERM, signal.SIGKILL)

QueueItem = tuple[str | None, EngineCoreOutput | BaseException]


class EngineStartError(RuntimeError):
    """The engine core process failed to start (its message says why)."""


class EngineDeadError(RuntimeError):
    """The engine core process died; the server cannot serve anymore."""


class ServerShuttingDown(RuntimeError):
    """The server is stopping: in-flight requests end, new ones are refused."""


def _decode_handshake(payload: bytes) -> EngineReady:
    """The engine's `EngineReady`; EngineStartError when it failed to start or sent
    something else (another kvloop version)."""
    try:
        msg = msgspec.msgpack.decode(payload, type=EngineHandshake)
    except msgspec.DecodeError as e:
        raise EngineStartError(f"engine core sent a handshake this server cannot read ({e}); "
                               f"is it another kvloop version? (this server speaks wire "
                               f"version {WIRE_VERSION})") from e
    if isinstance(msg, EngineStartFailed):
        raise EngineStartError(f"engine core failed to start: {msg.error}")
    return msg


@dataclass
class _Tracked:
    queue: asyncio.Queue[QueueItem]
    times: RequestTimes
    scheduled: bool = False
    engine_finished: bool = False
    span: Span | None = None    # its `llm_request` span (--otlp-traces-endpoint)


class EngineClient:
    """Talks to one engine core process. Not thread-safe: use it from its event loop."""

    def __init__(self, start_config: EngineStartConfig,
                 on_engine_exit: Callable[[int], None] | None = None):
        self._start_config = start_config
        self._on_engine_exit = on_engine_exit
        self._ctx = zmq.asyncio.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.LINGER, 0)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._proc: subprocess.Popen[bytes] | None = None
        self._stdin: IO[bytes] | None = None
        self._identity = b""
        self._ipc_dir: str | None = None   # the sockets' private directory, once bound
        self._requests: dict[str, _Tracked] = {}
        self._num_unscheduled = 0
        self._utility: dict[int, asyncio.Future[UtilityOutput]] = {}
        self._call_ids = itertools.count()
        self._send_queue: asyncio.Queue[list[bytes]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.metrics: ServerMetrics | None = None
        self.tracer = make_tracer(start_config.tracing, "kvloop-api-server")
        self.ready: EngineReady | None = None
        self.dead = False
        self.faults: list[str] = []  # the engine's internal threads that died (EngineCoreOutputs)
        self.shutting_down = False   # new requests are refused (draining or stopping)
        self._ending = False         # in-flight requests were told to end
        self._stopping = False       # shutdown() is stopping the engine process

    # --- start-up -------------------------------------------------------------------------
    async def start(self, timeout_s: float = 600.0) -> EngineReady:
        """Start the engine core process and wait for its handshake."""
        self._loop = asyncio.get_running_loop()
        self._ipc_dir = tempfile.mkdtemp(prefix="kvloop-engine-")
        self._router.bind(f"ipc://{self._ipc_dir}/input")
        self._pull.bind(f"ipc://{self._ipc_dir}/output")
        cfg = msgspec.structs.replace(
            self._start_config,
            input_address=self._router.getsockopt_string(zmq.LAST_ENDPOINT),
            output_address=self._pull.getsockopt_string(zmq.LAST_ENDPOINT))
        self._proc = subprocess.Popen([sys.executable, "-m", "kvloop.engine.proc"],
                                      stdin=subprocess.PIPE, start_new_session=True)
        assert self._proc.stdin is not None
        self._stdin = self._proc.stdin
        self._stdin.write(msgspec.json.encode(cfg) + b"\n")
        self._stdin.flush()
        ready = await self._await_ready(timeout_s)
        self.ready = ready
        self._tasks = [asyncio.create_task(self._output_loop(), name="engine-outputs"),
                       asyncio.create_task(self._send_loop(), name="engine-inputs")]
        threading.Thread(target=self._wait_process, name="engine-waiter", daemon=True).start()
        return ready

    async def _await_ready(self, timeout_s: float) -> EngineReady:
        assert self._proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await self._router.poll(200):
                identity, payload = await self._router.recv_multipart()
                ready = _decode_handshake(payload)
                if ready.wire_version != WIRE_VERSION:
                    raise EngineStartError(f"engine core speaks wire version "
                                           f"{ready.wire_version}, this server {WIRE_VERSION}")
                self._identity = identity
                return ready
            code = self._proc.poll()
            if code is not None:
                raise EngineStartError(f"engine core exited with code {code} during start-up")
        raise EngineStartError(f"engine core did not start within {timeout_s:.0f} s")

    @property
    def engine_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # --- requests -------------------------------------------------------------------------
    @property
    def num_unscheduled(self) -> int:
        """Requests sent to the engine and not scheduled yet (as far as this side knows)."""
        return self._num_unscheduled

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    def check_available(self) -> None:
        """Raise if no new request can be served (engine dead or server stopping)."""
        if self.dead:
            raise EngineDeadError("the engine core process is not running")
        if self.shutting_down:
            raise ServerShuttingDown("the server is shutting down")

    def add_request(self, request: EngineCoreRequest, queue: asyncio.Queue[QueueItem]) -> None:
        """Send one request; its outputs arrive on `queue` as (request_id, output)."""
        self.check_available()
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in flight")
        times = RequestTimes(arrival=request.arrival_time or time.monotonic(),
                             num_prompt_tokens=len(request.prompt_token_ids),
                             max_tokens=request.sampling_params.max_tokens)
        self._requests[rid] = _Tracked(queue, times)
        if self.tracer is not None:
            span = self._requests[rid].span = start_llm_request(self.tracer, request,
                                                                 times.arrival)
            request.trace_headers = span.headers
        self._num_unscheduled += 1
        self._send([self._identity, RequestType.ADD, msgspec.msgpack.encode(request)])

    def finish_request(self, request_id: str, reason: str) -> None:
        """The handler is done with a request (finished, stopped by a stop string, or
        abandoned): abort it in the engine if it is still running there, record its metrics,
        forget it. Unknown ids are ignored."""
        t = self._requests.pop(request_id, None)
        if t is None:
            return
        if not t.scheduled:
            self._num_unscheduled -= 1
        if not t.engine_finished and not self.dead:
            self._send([self._identity, RequestType.ABORT,
                        msgspec.msgpack.encode([request_id])])
        if self.metrics is not None:
            self.metrics.observe_finished(t.times, reason, time.monotonic())
        if t.span is not None:
            end_llm_request(t.span, t.times, reason, time.monotonic())

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.finish_request(rid, "abort")

    async def call_utility(self, method: str, *args: Any, timeout_s: float = 30.0) -> Any:
        """Call a whitelisted engine method (get_stats, reset_prefix_cache, check_invariants)."""
        self.check_available()
        call_id = next(self._call_ids)
        fut: asyncio.Future[UtilityOutput] = asyncio.get_running_loop().create_future()
        self._utility[call_id] = fut
        self._send([self._identity, RequestType.UTILITY,
                    msgspec.msgpack.encode(UtilityRequest(call_id, method, list(args)))])
        try:
            out = await asyncio.wait_for(fut, timeout_s)
        finally:
            self._utility.pop(call_id, None)
        if out.failure_message is not None:
            raise RuntimeError(out.failure_message)
        return out.result

    # --- I/O tasks ------------------------------------------------------------------------
    def _send(self, frames: list[bytes]) -> None:
        self._send_queue.put_nowait(frames)

    async def _send_loop(self) -> None:
        while True:
            frames = await self._send_queue.get()
            try:
                await self._router.send_multipart(frames)
            except zmq.ZMQError as e:
                logger.error("cannot send to the engine core: %s", e)

    async def _output_loop(self) -> None:
        decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        while True:
            frame = await self._pull.recv()
            if frame == ENGINE_CORE_DEAD:
                logger.error("the engine core reported a fatal error")
                self._mark_dead()
                return
            try:
                self._dispatch(decoder.decode(frame))
            except msgspec.DecodeError as e:
                logger.error("undecodable message from the engine core: %s", e)

    def _dispatch(self, outs: EngineCoreOutputs) -> None:
        ts = outs.timestamp
        if outs.utility_output is not None:
            fut = self._utility.get(outs.utility_output.call_id)
            if fut is not None and not fut.done():
                fut.set_result(outs.utility_output)
        if outs.faults is not None:
            self.faults = outs.faults
            for fault in outs.faults:
                logger.error("the engine reports: %s", fault)
        m = self.metrics
        if m is not None:
            if outs.scheduler_stats is not None:
                m.observe_scheduler_stats(outs.scheduler_stats)
            m.observe_iteration(outs.iteration_tokens)
        for rid in outs.scheduled or ():
            t = self._requests.get(rid)
            if t is not None and not t.scheduled:
                t.scheduled = True
                t.times.first_scheduled = ts
                self._num_unscheduled -= 1
        for rid in outs.preempted or ():
            t = self._requests.get(rid)
            if t is not None:
                t.times.num_preemptions += 1
        for o in outs.outputs:
            self._route(o, ts)

    def _route(self, o: EngineCoreOutput, ts: float) -> None:
        t = self._requests.get(o.request_id)
        if t is None:
            return  # finished or aborted here already
        if o.new_token_ids:
            self._count_tokens(t, o, ts)
        if o.finished:
            t.engine_finished = True
        t.queue.put_nowait((o.request_id, o))

    def _count_tokens(self, t: _Tracked, o: EngineCoreOutput, ts: float) -> None:
        times = t.times
        itl = None
        if times.first_token is None:
            times.first_token = ts
            times.num_cached_tokens = o.num_cached_tokens
            times.num_external_cached_tokens = o.num_external_computed_tokens
            if self.metrics is not None:
                self.metrics.observe_first_token(times)
        elif times.last_token is not None:
            itl = ts - times.last_token
        times.last_token = ts
        times.num_generation_tokens += len(o.new_token_ids)
        if self.metrics is not None:
            self.metrics.observe_tokens(len(o.new_token_ids), itl)

    # --- failure and shutdown -------------------------------------------------------------
    def _wait_process(self) -> None:
        assert self._proc is not None and self._loop is not None
        code = self._proc.wait()
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            self._loop.call_soon_threadsafe(self._on_process_exit, code)

    def _on_process_exit(self, code: int) -> None:
        if self._stopping:
            return
        if code == 0:
            logger.info("the engine core process stopped")
            self.begin_shutdown()
        else:
            logger.error("the engine core process exited with code %s", code)
        self._mark_dead()
        if self._on_engine_exit is not None:
            self._on_engine_exit(code)

    def _mark_dead(self) -> None:
        if self.dead:
            return
        self.dead = True
        self._fail_all(EngineDeadError("the engine core process died"))

    def _fail_all(self, error: BaseException) -> None:
        for t in self._requests.values():
            t.queue.put_nowait((None, error))
        for fut in self._utility.values():
            if not fut.done():
                fut.set_exception(error)

    def begin_drain(self) -> None:
        """Refuse new requests; those in flight go on (until `begin_shutdown`). /metrics
        says so from now on (`kvloop.front.drain`)."""
        self.shutting_down = True
        if self.metrics is not None:
            self.metrics.draining.set(1)

    async def wait_drained(self, timeout_s: float) -> None:
        """Until no request is in flight, or `timeout_s` has passed."""
        deadline = time.monotonic() + timeout_s
        while self._requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def begin_shutdown(self) -> None:
        """Refuse new requests and end the in-flight ones (each handler aborts its own)."""
        self.shutting_down = True
        if self._ending:
            return
        self._ending = True
        self._fail_all(ServerShuttingDown("the server is shutting down"))

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine core process (close its stdin, then SIGTERM, then SIGKILL)."""
        self.begin_shutdown()
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        proc = self._proc
        if proc is not None:
            with contextlib.suppress(OSError):
                if self._stdin is not None:
                    self._stdin.close()
            await asyncio.get_running_loop().run_in_executor(None, functools.partial(
                stop_processes, [("engine core", proc)], timeout_s / 2, steps=ENGINE_STOP_STEPS))
            logger.info("engine core process exited with code %s", proc.returncode)
        if self.tracer is not None:
            self.tracer.shutdown()
        self._router.close()
        self._pull.close()
        self._ctx.term()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
