"""A worker whose CURVE sockets have peers stops on SIGTERM within a bounded time: no ZAP
authenticator, socket or context keeps `zmq.Context.term()` waiting (pyzmq retries it on
EINTR, so a hang there outlives SIGTERM and pytest-timeout; tests/test_trust.py hung CI so).

A prefill worker's engine process (the simulator) with the fleet secret runs both production
users of `kvloop.trust.curve_authenticator`: the KV side channel (KvloopConnector) and the
KV-event publisher (PUB and replay ROUTER, `curve`). Before the SIGTERM each CURVE socket has
a client of the fleet that completed its handshake (the replay client having sent a
request), a TCP connection stopped inside its greeting, and a client with another fleet's keys
that the authenticator refused, and more such clients come, one every 10 ms, until the
process is gone (ZAP requests arriving while the authenticator stops). The process runs
apart, so a hang fails the wait, not the suite (with either authenticator left running at
`term()`, it did: still running after 20 s; as it is, it stops in 0.2-0.3 s).

A connector that cannot bind its side channel leaves no authenticator thread behind.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvloop.config import CacheConfig, EngineConfig, RunnerConfig, SchedulerConfig, SimSettings
from kvloop.events.config import KVEventsConfig
from kvloop.kv_transfer import KvloopConnector
from kvloop.sim.kv_store import SimKVBlockStore
from kvloop.trust import PURPOSE_KV_EVENTS, PURPOSE_KV_SIDE_CHANNEL, CurveKeys, FleetSecret
from kvloop.wire import EngineReady, EngineStartConfig
from tests.engine_proc_helpers import engine_core_process
from tests.test_pd_engine import BS, SECRET, kv_config

pytestmark = pytest.mark.processes

STOP_TIMEOUT_S = 20     # a stop takes well under a second here: this bounds a hang
OTHER_FLEET = FleetSecret.generate()


@pytest.fixture
def worker() -> Iterator[tuple[subprocess.Popen[bytes], EngineReady]]:
    """A P engine process with CURVE on its side channel and KV events, and its handshake."""
    def start(input_address: str, output_address: str) -> EngineStartConfig:
        engine = EngineConfig(cache=CacheConfig(block_size=BS, num_gpu_blocks=32),
                              scheduler=SchedulerConfig(max_num_batched_tokens=256,
                                                        max_num_seqs=8, max_model_len=256),
                              kv_transfer=kv_config())
        runner = RunnerConfig(block_size=BS, num_gpu_blocks_override=32, max_model_len=256,
                              sim=SimSettings(model_latency=False))
        events = KVEventsConfig(endpoint="tcp://127.0.0.1:0",
                                replay_endpoint="tcp://127.0.0.1:0", curve=True)
        return EngineStartConfig(engine=engine, runner=runner, kv_events=events,
                                 input_address=input_address, output_address=output_address,
                                 fleet_secret=SECRET.to_text())

    with engine_core_process(start) as e:
        yield e.proc, e.ready


class Peers:
    """The test's clients of one worker's CURVE sockets (own context, linger 0)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)
        self.raw: list[socket.socket] = []

    def admitted(self, kind: int, address: str, keys: CurveKeys) -> zmq.Socket:
        """A client of the fleet, returned once its CURVE handshake succeeded."""
        sock = self.ctx.socket(kind)
        keys.make_client(sock)
        self._connect_seeing(sock, address, zmq.EVENT_HANDSHAKE_SUCCEEDED)
        return sock

    def refused(self, kind: int, address: str, keys: CurveKeys) -> None:
        """A client with another fleet's client key, once ZAP refused it."""
        self._connect_seeing(self._stranger(kind, keys), address,
                             zmq.EVENT_HANDSHAKE_FAILED_AUTH)

    @contextlib.contextmanager
    def strangers(self, targets: list[tuple[int, str, CurveKeys]]) -> Iterator[None]:
        """Meanwhile, a thread connects a client with another fleet's key to each target
        every 10 ms (each refused by ZAP: libzmq does not retry a refused handshake)."""
        stop = threading.Event()

        def connect() -> None:
            while not stop.wait(0.01):
                for kind, address, keys in targets:
                    self._stranger(kind, keys).connect(address)

        thread = threading.Thread(target=connect, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(5)

    def _stranger(self, kind: int, keys: CurveKeys) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        other = OTHER_FLEET.curve_keys(PURPOSE_KV_SIDE_CHANNEL)
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, other.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, other.client_secret)
        return sock

    def _connect_seeing(self, sock: zmq.Socket, address: str, event: int) -> None:
        """Connect `sock` to `address` and wait for its first `event`."""
        monitor = sock.get_monitor_socket(event)
        sock.connect(address)
        assert monitor.poll(10_000), f"no event {event} from {address}"
        assert recv_monitor_message(monitor)["event"] == event
        sock.disable_monitor()
        monitor.close()

    def mid_greeting(self, address: str) -> None:
        """A TCP connection that sends half a ZMTP greeting and stops there."""
        host, port = address.rsplit("/", 1)[1].rsplit(":", 1)
        conn = socket.create_connection((host, int(port)), timeout=5)
        conn.sendall(b"\xff" + bytes(8) + b"\x7f\x03")    # signature, major version
        self.raw.append(conn)

    def close(self) -> None:
        for conn in self.raw:
            with contextlib.suppress(OSError):
                conn.close()
        self.ctx.destroy(linger=0)


def test_sigterm_stops_a_worker_whose_curve_sockets_have_peers(worker):
    proc, ready = worker
    side = ready.kv_transfer
    events = ready.kv_events
    assert side is not None and events is not None and events.curve
    assert events.endpoint is not None and events.replay_endpoint is not None
    side_address = f"tcp://127.0.0.1:{side.side_channel_port}"
    side_keys = SECRET.curve_keys(PURPOSE_KV_SIDE_CHANNEL)
    event_keys = SECRET.curve_keys(PURPOSE_KV_EVENTS)
    peers = Peers()
    try:
        peers.admitted(zmq.DEALER, side_address, side_keys)
        sub = peers.admitted(zmq.SUB, events.endpoint, event_keys)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        replay = peers.admitted(zmq.DEALER, events.replay_endpoint, event_keys)
        replay.send_multipart([b"", b"not a request"])
        targets = [(zmq.DEALER, side_address, side_keys), (zmq.SUB, events.endpoint, event_keys),
                   (zmq.DEALER, events.replay_endpoint, event_keys)]
        for kind, address, keys in targets:
            peers.mid_greeting(address)
            peers.refused(kind, address, keys)
        with peers.strangers(targets):
            time.sleep(0.1)
            assert proc.poll() is None
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=STOP_TIMEOUT_S) == 0
    finally:
        peers.close()


def test_a_connector_that_cannot_bind_leaves_no_authenticator_running():
    """The side channel's port taken: OSError, and the ZAP thread and context it started
    are stopped (they outlived the error before)."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    before = set(threading.enumerate())
    try:
        config = kv_config(side_channel_host="127.0.0.1", side_channel_port=taken.getsockname()[1])
        with pytest.raises(OSError, match="cannot bind the KV side channel"):
            KvloopConnector(config, SimKVBlockStore(BS), secret=SECRET)
        assert set(threading.enumerate()) == before
    finally:
        taken.close()
