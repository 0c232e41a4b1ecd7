"""The engine core process: socket I/O in threads, state in the busy loop.

    input thread  : DEALER recv -> decode -> input queue      (aborts also go straight to
                                                               `EngineCore.abort_requests`;
                                                               an ADD that fails to decode
                                                               or validate is answered with
                                                               an error output)
    busy loop     : drain the input queue (add, abort, utility) -> `EngineCore.step()` ->
                    output queue; publish KV events; append the step to the trace file
    output thread : output queue -> encode -> PUSH send

Start-up handshake: the process connects its DEALER and PUSH to the API server's ROUTER and
PULL, builds the engine (`kvloop.engine.build.build_engine`, the same assembly as the offline
`LLM`: runner by factory name, config, grammar backend, connectors), then sends one
`EngineReady` on the DEALER (the ROUTER learns its identity from it). A failed start sends
`EngineStartFailed` instead and exits 1.

Process: `python -m kvloop.engine.proc`, started by the API server in a session of its
own, which writes one `EngineStartConfig` JSON line on its stdin and keeps the pipe open.

Shutdown: the busy loop ends
- when the API server closes the pipe (stdin reaches EOF: it stopped us, exited or died, so
  this process never outlives it);
- on SIGTERM (from an operator, or a kill of the whole cgroup as systemd does: signals to the
  API server's process group do not reach this session) once `shutdown_timeout_s` has passed
  (0: at once; meanwhile the API server drains its requests, then closes the pipe); a second
  SIGTERM stops at once.
SIGINT is ignored (the API server owns Ctrl-C). A SIGTERM or EOF while the runner is being
built interrupts the build (exit 0). Every thread is joined before the process exits, so none
holds a stdio lock at interpreter shutdown. An exception in the loop sends `ENGINE_CORE_DEAD`
and exits 1.

With a KV connector (P/D, tiers or both: `kvloop.engine.build.make_connectors`) the loop
also runs while requests only wait on transfers; it then sleeps on the input queue, which the
connector's threads wake (a `_WAKE` item) when a Done, a finished load or a failure arrives,
and looks at lease expiry at least every `_IDLE_WAIT_S`.

Owner: the busy loop alone touches the EngineCore (aborts excepted: thread-safe by design).
It lives outside the pure core (`kvloop/core` imports no zmq and no KV connector): the
engine process's composition root, it has the engine built and adds the sockets, the
publisher and the trace.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import FrameType
from typing import Any

import msgspec
import zmq

from kvloop.config import GRAMMAR_BACKEND
from kvloop.core.engine import IDLE_BACKOFF_S, EngineCore, StepResult
from kvloop.core.trace import TraceWriter
from kvloop.engine.build import build_engine
from kvloop.engine.spans import EngineSpans, make_engine_spans
from kvloop.events.config import KVEventsConfig
from kvloop.trust import PURPOSE_KV_EVENTS, CurveKeys
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
    KVEventsInfo,
    RequestType,
    UtilityOutput,
    UtilityRequest,
)

logger = logging.getLogger("kvloop.engine")

ENGINE_IDENTITY = (0).to_bytes(2, "little")
_POLL_MS = 100
_IDLE_WAIT_S = 0.1   # an idle busy loop looks at its stop conditions this often
_WAKE = b"wake"      # input-queue item: the KV connector has news


class EngineCoreProc:
    """One engine core behind ZMQ sockets. Built and run inside the engine process."""

    def __init__(self, config: EngineStartConfig, ctx: zmq.Context):
        self.config = config
        self.input_queue: queue.Queue[tuple[bytes, Any]] = queue.Queue()
        self.output_queue: queue.Queue[EngineCoreOutputs | bytes | None] = queue.Queue()
        self._stop = threading.Event()
        self._dealer = ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.IDENTITY, ENGINE_IDENTITY)
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.connect(config.input_address)
        self._push = ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 4000)
        self._push.connect(config.output_address)
        self._threads: list[threading.Thread] = []
        self._api_pid = os.getppid()   # the API server; once it is not, it died
        self._parent_gone = threading.Event()
        self._stop_deadline: float | None = None   # set by SIGTERM (monotonic seconds)
        self.engine: EngineCore | None = None
        self.publisher: Any = None
        self.trace: TraceWriter | None = None
        self.spans: EngineSpans | None = None   # --otlp-traces-endpoint (engine/spans.py)
        self._last_stats_key: tuple[Any, ...] | None = None
        self._faults: list[str] = []     # the faults last sent to the API server

    # --- start-up -------------------------------------------------------------------------
    def start(self) -> bool:
        """Build runner, engine, publisher and trace; send the handshake; start the threads.
        False if the build failed (the handshake carries the error; the API server logs it)."""
        try:
            ready = self._build()
        except Exception as e:  # start-up failures of any kind go back to the API server
            logger.debug("engine core start-up failed", exc_info=True)
            self._send_ready(EngineStartFailed(wire_version=WIRE_VERSION, pid=os.getpid(),
                                               error=f"{type(e).__name__}: {e}"))
            return False
        self._send_ready(ready)
        self._start_thread(self._input_loop, "engine-input")
        self._start_thread(self._output_loop, "engine-output")
        return True

    def _start_thread(self, target: Callable[[], None], name: str) -> None:
        """A thread that `shutdown()` joins (daemon only so a stuck one cannot block exit)."""
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def watch_parent(self) -> None:
        """Start the thread that notices the API server closing our stdin (see `_watch_stdin`)."""
        self._start_thread(self._watch_stdin, "engine-parent-watchdog")

    def _send_ready(self, ready: EngineHandshake) -> None:
        self._dealer.send(msgspec.msgpack.encode(ready))

    def _build(self) -> EngineReady:
        cfg = self.config
        built = build_engine(cfg.runner, cfg.engine, kv_events=cfg.kv_events is not None,
                             secret=cfg.secret())
        self.engine = engine = built.engine
        if engine.connector is not None:
            engine.connector.set_wakeup(lambda: self.input_queue.put((_WAKE, None)))
        econf, runner = engine.config, built.runner
        ready = EngineReady(
            wire_version=WIRE_VERSION, pid=os.getpid(),
            model_name=runner.model_name,
            max_model_len=econf.scheduler.max_model_len,
            num_gpu_blocks=econf.cache.num_gpu_blocks, block_size=econf.cache.block_size,
            enable_prefix_caching=econf.cache.enable_prefix_caching,
            hash_algo=econf.cache.prefix_caching_hash_algo, hash_seed=econf.cache.hash_seed or "",
            max_num_batched_tokens=econf.scheduler.max_num_batched_tokens,
            max_num_seqs=econf.scheduler.max_num_seqs,
            vocab_size=runner.vocab_size, epoch=cfg.epoch, kv_events=None,
            kv_transfer=built.kv_transfer,
            structured_output_backend=(GRAMMAR_BACKEND if engine.structured_output is not None
                                       else None))
        if cfg.kv_events is not None:
            ready = self._start_publisher(ready, cfg.kv_events)
        if cfg.trace_file:
            self.trace = TraceWriter(cfg.trace_file)
        self.spans = make_engine_spans(cfg.tracing, engine.connector)
        return ready

    def _start_publisher(self, ready: EngineReady, ev_cfg: KVEventsConfig) -> EngineReady:
        """Start the KV-event publisher; `ready` with its actual addresses and epoch."""
        try:
            if ev_cfg.nats is not None:
                from kvloop.events.nats_publisher import NatsEventPublisher
                self.publisher = NatsEventPublisher(ev_cfg, epoch=self.config.epoch,
                                                    secret=self.config.secret())
            else:
                from kvloop.events.publisher import ZmqEventPublisher
                self.publisher = ZmqEventPublisher(ev_cfg, epoch=self.config.epoch,
                                                   curve_keys=self._events_keys(ev_cfg))
        except ImportError as e:
            raise RuntimeError(f"KV events were asked for but the publisher is not available "
                               f"({e})") from e
        self.publisher.start()
        assert self.engine is not None
        if ev_cfg.recency:
            self.engine.block_pool.track_touches = True
        return msgspec.structs.replace(ready, kv_events=_events_info(self.publisher, ev_cfg),
                                       epoch=self.publisher.epoch)

    def _events_keys(self, ev_cfg: KVEventsConfig) -> CurveKeys | None:
        """The fleet's KV-event CURVE keys when the events require CURVE (else None)."""
        secret = self.config.secret()
        if not ev_cfg.curve or secret is None:
            return None   # without a secret, the publisher refuses a CURVE config
        return secret.curve_keys(PURPOSE_KV_EVENTS)

    # --- threads --------------------------------------------------------------------------
    def _input_loop(self) -> None:
        decode_add = msgspec.msgpack.Decoder(EngineCoreRequest)
        decode_abort = msgspec.msgpack.Decoder(list[str])
        decode_utility = msgspec.msgpack.Decoder(UtilityRequest)
        poller = zmq.Poller()
        poller.register(self._dealer, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(_POLL_MS):
                continue
            frames = self._dealer.recv_multipart(copy=False)
            if len(frames) != 2:
                logger.warning("dropping a message of %d frames", len(frames))
                continue
            kind, payload = bytes(frames[0].buffer), frames[1].buffer
            try:
                if kind == RequestType.ADD:
                    self.input_queue.put((kind, decode_add.decode(payload)))
                elif kind == RequestType.ABORT:
                    ids = decode_abort.decode(payload)
                    if self.engine is not None:
                        self.engine.abort_requests(ids)  # eager: applied mid-step
                    self.input_queue.put((kind, ids))    # ordered: after a pending ADD
                elif kind == RequestType.UTILITY:
                    self.input_queue.put((kind, decode_utility.decode(payload)))
                else:
                    logger.warning("dropping a message of unknown type %r", kind)
            except msgspec.DecodeError as e:
                self._refuse_undecodable(kind, payload, e)

    def _refuse_undecodable(self, kind: bytes, payload: memoryview,
                            error: msgspec.DecodeError) -> None:
        """A message that does not decode, or whose sampling params break a rule
        (`SamplingParams.__post_init__` runs on decode): an ADD whose request id can still be
        read is answered with an error output, so its sender is not left waiting; anything
        else is dropped with a warning. The engine goes on either way."""
        request_id = _request_id_of(payload) if kind == RequestType.ADD else None
        if request_id is None:
            logger.warning("dropping an undecodable %r message: %s", kind, error)
            return
        logger.warning("refusing request %s: %s", request_id, error)
        self._refuse(request_id, f"invalid request: {error}")

    def _refuse(self, request_id: str, message: str) -> None:
        """Finish a request the engine will not run with `finish_reason="error"`."""
        self.output_queue.put(EngineCoreOutputs(
            timestamp=time.monotonic(),
            outputs=[EngineCoreOutput(request_id, [], finish_reason="error", error=message)]))

    def _output_loop(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            item = self.output_queue.get()
            if item is None:
                return
            self._push.send(item if isinstance(item, bytes) else encoder.encode(item))

    def _watch_stdin(self) -> None:
        """Wait for EOF on stdin: the API server holds its other end, so EOF means it exited,
        died, or closed the pipe to stop us. Reads the raw fd (never `sys.stdin`'s buffer,
        whose lock a blocked reader would hold at interpreter shutdown) and polls, so
        `shutdown()` can join it."""
        fd = sys.stdin.fileno()
        while not self._stop.is_set():
            if select.select([fd], [], [], _IDLE_WAIT_S)[0] and not os.read(fd, 65536):
                logger.info("API server closed the pipe; engine core exiting")
                self._parent_gone.set()
                # to the main thread itself, so a blocking call there is interrupted: this
                # stops a runner still being built
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGTERM)
                return

    # --- signals --------------------------------------------------------------------------
    def interrupt_start(self, signum: int, frame: FrameType | None) -> None:
        """SIGTERM handler while the runner is being built: stop building."""
        self._stop_deadline = time.monotonic()
        raise SystemExit(0)

    @property
    def stop_requested(self) -> bool:
        return self._parent_gone.is_set() or self._stop_deadline is not None

    def on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        """SIGTERM handler once the busy loop runs: stop after `shutdown_timeout_s` (a second
        SIGTERM: now). Only records a deadline; the loop acts on it."""
        now = time.monotonic()
        first = self._stop_deadline is None
        self._stop_deadline = now + self.config.shutdown_timeout_s if first else now

    def _should_stop(self) -> bool:
        if self._parent_gone.is_set():
            return True
        return self._stop_deadline is not None and time.monotonic() >= self._stop_deadline

    # --- the busy loop --------------------------------------------------------------------
    def run_busy_loop(self) -> None:
        """Drain inputs, step, send; until `_should_stop()` or an error."""
        assert self.engine is not None
        while True:
            self._process_input_queue(self.engine)
            if self._should_stop():
                return
            self._process_engine_step(self.engine)

    def _process_input_queue(self, engine: EngineCore) -> None:
        """Wait while there is no work (and no reason to stop); then handle every pending
        message, in order."""
        while not engine.has_work() and not self._should_stop():
            try:
                self._handle(engine, *self.input_queue.get(timeout=_IDLE_WAIT_S))
                break
            except queue.Empty:
                continue
        while True:
            try:
                self._handle(engine, *self.input_queue.get_nowait())
            except queue.Empty:
                return

    def _handle(self, engine: EngineCore, kind: bytes, msg: Any) -> None:
        if kind == RequestType.ADD:
            self._add(engine, msg)
        elif kind == RequestType.ABORT:
            engine.abort_requests(msg)
        elif kind == RequestType.UTILITY:
            self.output_queue.put(EngineCoreOutputs(
                timestamp=time.monotonic(), utility_output=self._utility(engine, msg)))

    def _add(self, engine: EngineCore, msg: EngineCoreRequest) -> None:
        """Add a request; a request the engine refuses gets an output with `error`."""
        try:
            self._check_fits_cache(engine, len(msg.prompt_token_ids))
            req = engine.make_request(msg.request_id, msg.prompt_token_ids, msg.sampling_params,
                                      lora_name=msg.lora_name, client_index=msg.client_index,
                                      pooling_params=msg.pooling_params)
            req.trace_headers = msg.trace_headers
            req.tenant = msg.tenant
            engine.add_request(req)
            if self.spans is not None:
                self.spans.on_add(msg)
        except (ValueError, TypeError) as e:
            self._refuse(msg.request_id, str(e))

    @staticmethod
    def _check_fits_cache(engine: EngineCore, num_prompt_tokens: int) -> None:
        bs = engine.config.cache.block_size
        need = (num_prompt_tokens + 1 + bs - 1) // bs
        have = engine.block_pool.num_usable_blocks
        if need > have:
            raise ValueError(f"the prompt needs {need} KV blocks; the KV cache has {have}")

    def _utility(self, engine: EngineCore, req: UtilityRequest) -> UtilityOutput:
        methods: dict[str, Callable[..., Any]] = {
            "get_stats": lambda: engine_stats(engine),
            "reset_prefix_cache": lambda: self._reset_prefix_cache(engine),
            "check_invariants": lambda: _run_check(engine),
            "add_lora": lambda name, path: engine.add_lora(str(name), str(path)),
            "remove_lora": lambda name: engine.remove_lora(str(name)),
            "list_loras": engine.list_loras,
        }
        fn = methods.get(req.method)
        if fn is None:
            return UtilityOutput(req.call_id, failure_message=f"unknown method {req.method!r}")
        try:
            return UtilityOutput(req.call_id, result=fn(*req.args))
        except Exception as e:  # a failing utility call must not kill the engine
            return UtilityOutput(req.call_id, failure_message=f"{type(e).__name__}: {e}")

    def _reset_prefix_cache(self, engine: EngineCore) -> bool:
        """Reset, and publish `AllBlocksCleared` now: an idle engine may not step for long."""
        ok = engine.reset_prefix_cache()
        batch = engine.take_event_batch()
        if batch is not None and self.publisher is not None:
            self.publisher.publish(batch)
        return ok

    def _process_engine_step(self, engine: EngineCore) -> None:
        t0 = time.monotonic()
        result = engine.step()
        if self.spans is not None:
            self.spans.on_step(engine, result, t0, time.monotonic())
        self._publish_events(engine, result)
        if result.executed:
            if self.trace is not None and result.record is not None:
                self.trace.write(result.record)
        outputs = self._make_outputs(result)
        if outputs is not None:
            self.output_queue.put(outputs)
        self._send_faults(engine)
        if not result.executed and engine.has_unfinished_requests():
            time.sleep(IDLE_BACKOFF_S)  # waiting requests that cannot be admitted yet

    def _publish_events(self, engine: EngineCore, result: StepResult) -> None:
        if self.publisher is None:
            return
        if result.events is not None:
            self.publisher.publish(result.events)
        if engine.block_pool.track_touches:
            touched = engine.block_pool.take_touched_hashes()
            if touched:
                self.publisher.publish_touches(touched)

    def _make_outputs(self, result: StepResult) -> EngineCoreOutputs | None:
        """The message of one step, or None when it would tell the API server nothing new."""
        stats = result.stats
        key: tuple[int, ...] | None = None
        kv_counts = False
        if stats is not None:
            pcs = stats.prefix_cache_stats
            key = (stats.num_running_reqs, stats.num_waiting_reqs, stats.num_free_blocks,
                   stats.num_preemptions, pcs.requests, pcs.preempted_requests,
                   *(stats.num_waiting_by_reason or {}).values())
            if stats.kv_transfer is not None:
                key += (stats.kv_transfer.held_requests, stats.kv_transfer.loading_requests)
                kv_counts = stats.kv_transfer.has_counts
        if not (result.executed or result.outputs or kv_counts
                or (key is not None and key != self._last_stats_key)):
            return None
        self._last_stats_key = key
        out = result.scheduler_output
        return EngineCoreOutputs(
            outputs=result.outputs, scheduler_stats=stats, timestamp=time.monotonic(),
            engine_index=self.config.engine_index,
            scheduled=[a.request_id for a in result.admissions if not a.resumed] or None,
            preempted=list(out.preempted_req_ids) or None if out else None,
            iteration_tokens=out.total_num_scheduled_tokens if out else 0)

    def _send_faults(self, engine: EngineCore) -> None:
        """Tell the API server when the connector's threads' faults change."""
        faults = engine.connector.faults() if engine.connector is not None else []
        if faults != self._faults:
            self._faults = faults
            self.output_queue.put(EngineCoreOutputs(timestamp=time.monotonic(),
                                                    engine_index=self.config.engine_index,
                                                    faults=faults))

    # --- shutdown -------------------------------------------------------------------------
    def send_dead(self) -> None:
        self.output_queue.put(ENGINE_CORE_DEAD)

    def shutdown(self) -> None:
        """Stop and join every thread (flushing queued outputs), then publisher, trace and
        runner."""
        self._stop.set()
        self.output_queue.put(None)
        for t in self._threads:
            t.join(timeout=5.0)
        if self.publisher is not None:
            self.publisher.shutdown()
        if self.trace is not None:
            self.trace.close()
        if self.spans is not None:
            self.spans.tracer.shutdown()
        if self.engine is not None:
            self.engine.shutdown()
        self._dealer.close()
        self._push.close()
        if os.getppid() != self._api_pid:   # killed: its own close cannot remove them
            _remove_ipc_sockets(self.config.input_address, self.config.output_address)


def _remove_ipc_sockets(*addresses: str) -> None:
    """The socket files of `ipc://` addresses, and each one's folder once empty (the API
    server's private folder, kvloop.server.client); other addresses are left alone."""
    for address in addresses:
        if not address.startswith("ipc://"):
            continue
        path = address.removeprefix("ipc://")
        with contextlib.suppress(OSError):
            os.unlink(path)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(path))


def _events_info(publisher: Any, cfg: KVEventsConfig) -> KVEventsInfo:
    """Where the started `publisher` sends its events (ZMQ addresses, or NATS subjects)."""
    if cfg.nats is None:
        return KVEventsInfo(endpoint=publisher.endpoint,
                            replay_endpoint=publisher.replay_endpoint, topic=cfg.topic,
                            recency=cfg.recency, curve=cfg.curve,
                            token_ids=not cfg.omit_token_ids)
    return KVEventsInfo(endpoint=publisher.endpoint, replay_endpoint=publisher.replay_endpoint,
                        topic="", recency=cfg.recency, token_ids=not cfg.omit_token_ids,
                        subject=publisher.subjects.data,
                        worker_id=publisher.worker_id, payload_format=cfg.nats.payload_format)


def _request_id_of(payload: memoryview) -> str | None:
    """The request id of an ADD payload that did not decode as an `EngineCoreRequest`
    (an array whose first item is the id), or None when not even that can be read."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return None
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        return raw[0]
    return None


def engine_stats(engine: EngineCore) -> dict[str, bool | int | float | str | None]:
    """A snapshot of the engine's state for tests and operators (no counters are drained)."""
    pool = engine.block_pool
    sched = engine.scheduler
    return {
        "num_gpu_blocks": pool.num_gpu_blocks,
        "num_total_blocks": pool.num_usable_blocks,
        "num_free_blocks": pool.get_num_free_blocks(),
        "num_cached_blocks": len(pool.cached_block_hash_to_block),
        "kv_cache_usage": pool.get_usage(),
        "num_running_reqs": len(sched.running),
        "num_waiting_reqs": len(sched.waiting),
        "num_requests": len(sched.requests),
        "num_preemptions_total": sched.num_preemptions_total,
        "step_index": sched.step_index,
        "num_kv_transfers": (len(engine.connector.request_ids_in_transfer())
                             if engine.connector is not None else 0),
    }


def _run_check(engine: EngineCore) -> bool:
    engine.scheduler.check_invariants()
    return True


# --- process entry ----------------------------------------------------------------------------
def _raise_exit(signum: int, frame: FrameType | None) -> None:
    """SIGTERM handler until the engine core process object exists."""
    raise SystemExit(0)


def run_engine_core(config: EngineStartConfig) -> int:
    """Run one engine core until it is stopped (see the module docstring) or fails; returns
    the process exit code. Runs in the main thread (it installs the SIGTERM handler)."""
    ctx = zmq.Context()
    proc = EngineCoreProc(config, ctx)
    code = 1
    try:
        signal.signal(signal.SIGTERM, proc.interrupt_start)
        proc.watch_parent()
        code = _run(proc)
    except SystemExit:  # SIGTERM or EOF during start-up
        code = 0
    except Exception:
        logger.error("engine core died:\n%s", traceback.format_exc())
        proc.send_dead()
        code = 1
    finally:
        if code == 0:
            logger.info("engine core shutting down")
        proc.shutdown()
        ctx.term()
    return code


def _run(proc: EngineCoreProc) -> int:
    if not proc.start():  # a stop may surface as another exception from inside a library
        return 0 if proc.stop_requested else 1
    signal.signal(signal.SIGTERM, proc.on_sigterm)
    proc.run_busy_loop()
    return 0


def main() -> int:
    """`python -m kvloop.engine.proc`: read one `EngineStartConfig` JSON line on stdin."""
    signal.signal(signal.SIGTERM, _raise_exit)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    line = sys.stdin.buffer.readline()
    if not line:
        return 2
    config = msgspec.json.decode(line, type=EngineStartConfig)
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s engine[%(process)d] %(message)s")
    return run_engine_core(config)


if __name__ == "__main__":
    sys.exit(main())
