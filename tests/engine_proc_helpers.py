"""An engine core process (`python -m kvloop.engine.proc`) started as the API server starts
one, for the tests that talk to it over the wire."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgspec
import zmq

from kvloop.wire import EngineHandshake, EngineReady, EngineStartConfig

HANDSHAKE_TIMEOUT_MS = 60_000


@dataclass
class StartedEngine:
    """The process, the test's ROUTER (requests) and PULL (outputs) sockets, the engine's
    ROUTER identity and its handshake."""

    proc: subprocess.Popen[bytes]
    router: zmq.Socket
    pull: zmq.Socket
    identity: bytes
    ready: EngineReady


@contextlib.contextmanager
def engine_core_process(make_start: Callable[[str, str], EngineStartConfig]
                        ) -> Iterator[StartedEngine]:
    """Binds a ROUTER and a PULL socket on 127.0.0.1 (linger 0), starts the engine core in a
    session of its own with `make_start(input_address, output_address)` on its stdin and
    waits for its handshake (asserted `EngineReady`). On exit a process still running is
    killed, and the sockets and their context are destroyed (linger 0)."""
    ctx = zmq.Context()
    router, pull = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL)
    for s in (router, pull):
        s.setsockopt(zmq.LINGER, 0)
        s.bind("tcp://127.0.0.1:*")
    start = make_start(router.getsockopt_string(zmq.LAST_ENDPOINT),
                       pull.getsockopt_string(zmq.LAST_ENDPOINT))
    proc = subprocess.Popen([sys.executable, "-m", "kvloop.engine.proc"],
                            stdin=subprocess.PIPE, start_new_session=True)
    assert proc.stdin is not None
    try:
        proc.stdin.write(msgspec.json.encode(start) + b"\n")
        proc.stdin.flush()
        assert router.poll(HANDSHAKE_TIMEOUT_MS), "no handshake from the engine core"
        identity, payload = router.recv_multipart()
        ready = msgspec.msgpack.decode(payload, type=EngineHandshake)
        assert isinstance(ready, EngineReady), ready
        yield StartedEngine(proc, router, pull, identity, ready)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError):
            proc.stdin.close()
        ctx.destroy(linger=0)
