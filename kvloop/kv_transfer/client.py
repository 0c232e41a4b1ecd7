"""D's transfer thread: one DEALER per prefill engine, loads, heartbeats and Dones.

Owner: the thread alone uses the DEALERs and the load states; the engine thread talks to it
through commands (`submit`, `cancel`, `watch`, `give_up`: a queue and an inproc wake-up
socket) and takes its results (`take_results`, under a lock).

A load: Meta once per P (the handshake: engine id, version, block size, fingerprint and
block bytes must match D's, else every load from that P fails as "mismatch"), then Read of
the blocks D lacks, the blocks written into D's store (raw frames after the reply, or a
`/dev/shm` file for the shm transport), then Done. A P that answers nothing within
`transfer_timeout` fails the loads waiting on it ("unreachable") and its socket is dropped.
A simulated store takes `nbytes / sim_bandwidth` seconds before the load completes (no
payload moves). Heartbeats go to each P for every request watched, from `watch` (the request
entered D's scheduler) until its Done.

Trust and bounds (docs/security.md): every DEALER is a CURVE client with the fleet's keys
(`keys`), so D talks only to a P holding the fleet secret; at most `max_peers` DEALERs are
open, least recently used first out (an idle one if any; a busy one's loads fail
"unreachable"), and a P that fails to answer is dropped and its socket closed; each frame's
checksum is checked before a block is written (a mismatch fails the load: its blocks are
never cached); for shared memory D names the file (`shm.new_name`), opens only that name,
never one P's reply names, and unlinks it when the load ends unless P answered that it wrote
no such file (a squatter's file of that name is neither read nor removed). If the thread
dies, `fault` says why and every load, queued or in flight, fails at once (none waits forever
with its blocks held).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from kvloop.core.kv_connector import KVBlockStore
from kvloop.kv_transfer import shm
from kvloop.kv_transfer.protocol import (
    PROTOCOL_VERSION,
    READ_OK,
    READ_REFUSED,
    Done,
    Heartbeat,
    Meta,
    MetaReply,
    Read,
    ReadReply,
    decode_reply,
    encode,
    frame_checksum,
    host_id,
)
from kvloop.kv_transfer.stats import ThrottledLog, TransferCounters
from kvloop.trust import CurveKeys
from kvloop.wire import (
    KV_FAILURE_ERROR,
    KV_FAILURE_MISMATCH,
    KV_FAILURE_REFUSED,
    KV_FAILURE_TRUNCATED,
    KV_FAILURE_UNREACHABLE,
)

logger = logging.getLogger("kvloop.kv_transfer")
PeerKey = tuple[str, str, int]     # (P's engine id, host, port)
_MAX_POLL_S = 0.1
DEFAULT_MAX_PEERS = 64          # DEALERs open at once (one per prefill engine)


@dataclass
class Load:
    """One request's pull: P's blocks `remote_block_ids` into D's `local_block_ids`."""

    request_id: str
    peer: PeerKey
    remote_request_id: str
    remote_block_ids: list[int]
    local_block_ids: list[int]
    started: float
    state: str = "new"          # new -> meta (waiting for the handshake) -> read -> delayed
    cancelled: bool = False
    shm_name: str | None = None  # the shared-memory file D named for its Read
    transport: str | None = None  # the Read's: "tcp" or "shm" (None: no Read sent)
    trace_headers: dict[str, str] | None = None   # the request's trace, passed on to P


@dataclass
class LoadResult:
    request_id: str
    ok: bool
    cancelled: bool = False
    reason: str | None = None     # one of kvloop.wire.KV_FAILURE_REASONS when not ok
    message: str | None = None
    nbytes: int = 0
    seconds: float = 0.0
    invalid_block_ids: list[int] = field(default_factory=list)
    recompute: bool = False       # a cache miss whatever the policy (a checksum failed)
    transport: str | None = None  # "tcp" or "shm"; None: nothing was read


class _Failed(Exception):
    def __init__(self, reason: str, message: str, recompute: bool = False):
        super().__init__(message)
        self.reason = reason
        self.recompute = recompute


@dataclass
class _Peer:
    key: PeerKey
    sock: zmq.Socket
    meta: MetaReply | None = None
    meta_error: str | None = None
    meta_asked: bool = False
    expect: deque[tuple[Load | None, float]] = field(default_factory=deque)  # (load, deadline)
    waiting: list[Load] = field(default_factory=list)


class TransferClient:
    """D's side of the side channel (see the module docstring). `start()` runs the thread."""

    def __init__(self, ctx: zmq.Context, store: KVBlockStore, *, transport: str,
                 transfer_timeout: float, sim_bandwidth: float, wakeup: Callable[[], None],
                 counters: TransferCounters, keys: CurveKeys | None,
                 max_peers: int = DEFAULT_MAX_PEERS,
                 clock: Callable[[], float] = time.monotonic):
        """`keys`: the side channel's CURVE keys (None: plaintext, the insecure opt-out)."""
        self.ctx = ctx
        self.keys = keys
        self.max_peers = max_peers
        self.fault: str | None = None   # why the thread died (None: alive or stopped)
        self._fault_lock = threading.Lock()
        self._warn = ThrottledLog(logger, clock=clock)
        self.store = store
        self.transport = transport
        self.transfer_timeout = transfer_timeout
        self.sim_bandwidth = sim_bandwidth
        self.wakeup = wakeup
        self.counters = counters
        self.clock = clock
        self._commands: deque[tuple[Any, ...]] = deque()
        address = f"inproc://kv-transfer-{id(self)}"
        self._wake_pull = ctx.socket(zmq.PULL)
        self._wake_pull.bind(address)
        self._wake_push = ctx.socket(zmq.PUSH)
        self._wake_push.setsockopt(zmq.LINGER, 0)
        self._wake_push.connect(address)
        self._results_lock = threading.Lock()
        self._results: list[LoadResult] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-transfer", daemon=True)
        # owned by the thread:
        self._poller = zmq.Poller()
        self._peers: OrderedDict[PeerKey, _Peer] = OrderedDict()   # least recently used first
        self._by_sock: dict[zmq.Socket, _Peer] = {}
        self._loads: dict[str, Load] = {}
        self._delayed: dict[str, tuple[Load, float, int]] = {}   # sim: (load, ready at, bytes)
        self._watches: dict[PeerKey, dict[str, float]] = {}      # remote id -> interval
        self._next_heartbeat: dict[PeerKey, float] = {}

    # --- the engine thread's side ---------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, load: Load) -> None:
        """Start `load` (its result comes from `take_results`; at once when the thread is
        dead)."""
        with self._fault_lock:
            if self.fault is None:
                self._command("submit", load)
                return
        self._report(_dead_result(load, self.fault))

    def cancel(self, request_id: str) -> None:
        """The request was aborted: send Done now; its result comes when the Read ends."""
        self._command("cancel", request_id)

    def watch(self, peer: PeerKey, remote_request_id: str, interval: float) -> None:
        """Heartbeat P for this request every `interval` seconds until its Done."""
        self._command("watch", peer, remote_request_id, interval)

    def give_up(self, peer: PeerKey, remote_request_id: str) -> None:
        """Send Done for a request that will not load (P frees now)."""
        self._command("done", peer, remote_request_id)

    def take_results(self) -> list[LoadResult]:
        with self._results_lock:
            results, self._results = self._results, []
        return results

    def has_results(self) -> bool:
        with self._results_lock:
            return bool(self._results)

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._wake_push.send(b"", zmq.NOBLOCK)
            self._thread.join(timeout=5.0)
        for peer in self._peers.values():
            peer.sock.close(linger=0)
        self._wake_push.close()
        self._wake_pull.close()

    def _command(self, *cmd: Any) -> None:
        if self.fault is not None:
            return          # the thread is dead: its loads already failed
        self._commands.append(cmd)
        try:
            self._wake_push.send(b"", zmq.NOBLOCK)
        except zmq.Again:   # the thread is behind on wake-ups; the queue still holds cmd
            pass

    # --- the thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except Exception as e:  # recorded, logged, reported by /health: never silent
            self._die(f"the KV transfer thread died: {type(e).__name__}: {e}")

    def _die(self, fault: str) -> None:
        """Fail every load, in flight or queued, and refuse new ones (`submit`)."""
        logger.exception("KV transfer: %s", fault)
        with self._fault_lock:
            self.fault = fault
            queued = [cmd[1] for cmd in self._commands if cmd[0] == "submit"]
            self._commands.clear()
        for load in [*self._loads.values(), *queued]:
            self._report(_dead_result(load, fault))
        self.wakeup()

    def _loop(self) -> None:
        self._poller.register(self._wake_pull, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in self._poller.poll(int(self._poll_timeout() * 1000)):
                if sock is self._wake_pull:
                    self._drain_wakeups()
                elif sock in self._by_sock:
                    self._on_replies(self._by_sock[sock])
            self._run_commands()
            now = self.clock()
            self._check_deadlines(now)
            self._send_heartbeats(now)
            self._complete_delayed(now)

    def _poll_timeout(self) -> float:
        now = self.clock()
        times = [t for _, t, _ in self._delayed.values()]
        times += list(self._next_heartbeat.values())
        times += [p.expect[0][1] for p in self._peers.values() if p.expect]
        return max(0.001, min([now + _MAX_POLL_S, *times]) - now)

    def _drain_wakeups(self) -> None:
        while True:
            try:
                self._wake_pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def _run_commands(self) -> None:
        while self._commands:
            kind, *args = self._commands.popleft()
            if kind == "submit":
                self._loads[args[0].request_id] = args[0]   # reported even if this raises
                self._start_load(args[0])
            elif kind == "cancel":
                self._cancel(args[0])
            elif kind == "watch":
                self._watch(*args)
            elif kind == "done":
                self._send_done(args[0], args[1])

    # --- peers ----------------------------------------------------------------------------
    def _peer(self, key: PeerKey) -> _Peer:
        """P's DEALER, opened on first use (CURVE client); the most recently used now.
        Raises zmq.ZMQError when no socket can be opened."""
        peer = self._peers.get(key)
        if peer is not None:
            self._peers.move_to_end(key)
            return peer
        if len(self._peers) >= self.max_peers:
            self._evict()
        sock = self.ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            if self.keys is not None:
                self.keys.make_client(sock)
            host = f"[{key[1]}]" if ":" in key[1] else key[1]
            if ":" in key[1]:
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(f"tcp://{host}:{key[2]}")
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        peer = self._peers[key] = _Peer(key, sock)
        self._by_sock[sock] = peer
        self._poller.register(sock, zmq.POLLIN)
        return peer

    def _evict(self) -> None:
        """Close the least recently used idle DEALER (else the least recently used one)."""
        idle = next((p for p in self._peers.values() if not (p.expect or p.waiting)), None)
        peer = idle or next(iter(self._peers.values()))
        self._drop_peer(peer, f"closing the connection to prefill engine {peer.key[0]} at "
                              f"{peer.key[1]}:{peer.key[2]}: more than {self.max_peers} "
                              f"prefill engines at once", quiet=idle is not None)

    def _send(self, peer: _Peer, msg: Any) -> None:
        try:
            peer.sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            self._warn.warning("KV transfer: the queue to %s:%d is full; dropping a %s",
                               peer.key[1], peer.key[2], type(msg).__name__)

    def _send_to(self, key: PeerKey, msg: Any) -> None:
        """Send a Done or Heartbeat, opening P's DEALER if needed (a failure is logged)."""
        try:
            self._send(self._peer(key), msg)
        except zmq.ZMQError as e:
            self._warn.warning("KV transfer: cannot reach prefill engine at %s:%d: %s",
                               key[1], key[2], e)

    def _drop_peer(self, peer: _Peer, message: str, quiet: bool = False) -> None:
        """P did not answer in time (or its DEALER is evicted): fail everything waiting on
        it, close and forget its socket."""
        if not quiet:
            self._warn.warning("KV transfer: %s", message)
        loads = [load for load, _ in peer.expect if load is not None] + peer.waiting
        del self._peers[peer.key]
        del self._by_sock[peer.sock]
        self._poller.unregister(peer.sock)
        peer.sock.close(linger=0)
        for load in loads:
            self._fail(load, _Failed(KV_FAILURE_UNREACHABLE, message), send_done=False)

    # --- loads ----------------------------------------------------------------------------
    def _start_load(self, load: Load) -> None:
        self._loads[load.request_id] = load
        if not load.remote_block_ids:
            self._succeed(load, 0)          # a full local hit: nothing to read, P frees
            return
        try:
            peer = self._peer(load.peer)
        except zmq.ZMQError as e:
            self._fail(load, _Failed(KV_FAILURE_UNREACHABLE, f"cannot open a connection to "
                                     f"{load.peer[1]}:{load.peer[2]}: {e}"), send_done=False)
            return
        if peer.meta_error is not None:
            self._fail(load, _Failed(KV_FAILURE_MISMATCH, peer.meta_error))
        elif peer.meta is not None:
            self._send_read(peer, load)
        else:
            load.state = "meta"
            peer.waiting.append(load)
            if not peer.meta_asked:
                peer.meta_asked = True
                self._send(peer, Meta())
                peer.expect.append((None, self.clock() + self.transfer_timeout))

    def _send_read(self, peer: _Peer, load: Load) -> None:
        load.state = "read"
        assert peer.meta is not None
        same_host = peer.meta.host_id == host_id()
        transport = "shm" if self.transport == "shm" or (
            self.transport == "auto" and same_host) else "tcp"
        load.transport = transport
        if transport == "shm" and self.store.has_payload:
            load.shm_name = shm.new_name()
        self._send(peer, Read(remote_request_id=load.remote_request_id,
                              block_ids=load.remote_block_ids, transport=transport,
                              shm_name=load.shm_name, trace_headers=load.trace_headers))
        peer.expect.append((load, self.clock() + self.transfer_timeout))

    def _on_replies(self, peer: _Peer) -> None:
        while peer.key in self._peers:
            try:
                frames = peer.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if not peer.expect:
                self._warn.warning("KV transfer: an unexpected reply from %s:%d",
                                   *peer.key[1:])
                continue
            load, _ = peer.expect.popleft()
            try:
                reply: Any = decode_reply(frames[0].buffer)
            except msgspec.DecodeError as e:
                reply = e
            if load is None:
                self._on_meta(peer, reply)
            else:
                self._on_read(load, reply, frames[1:])

    def _on_meta(self, peer: _Peer, reply: Any) -> None:
        error = self._check_meta(peer.key, reply)
        waiting, peer.waiting = peer.waiting, []
        if error is not None:
            self._warn.warning("KV transfer: refusing prefill engine %s: %s", peer.key[0],
                               error)
            peer.meta_error = error
            for load in waiting:
                self._fail(load, _Failed(KV_FAILURE_MISMATCH, error))
            return
        peer.meta = reply
        for load in waiting:
            if load.cancelled:
                self._finish_cancelled(load)
            else:
                self._send_read(peer, load)

    def _check_meta(self, key: PeerKey, reply: Any) -> str | None:
        if not isinstance(reply, MetaReply):
            return f"P at {key[1]}:{key[2]} answered the handshake with {reply!r}"
        store = self.store
        theirs = (reply.engine_id, reply.version, reply.block_size, reply.block_nbytes,
                  reply.kv_fingerprint)
        ours = (key[0], PROTOCOL_VERSION, store.block_size, store.block_nbytes,
                store.fingerprint)
        if theirs == ours:
            return None
        names = ("engine_id", "version", "block_size", "block_nbytes", "kv_fingerprint")
        diffs = [f"{n}: P has {t!r}, D has {o!r}" if n != "engine_id"
                 else f"engine_id: P at {key[1]}:{key[2]} is {t!r}, the request names {o!r}"
                 for n, t, o in zip(names, theirs, ours, strict=True) if t != o]
        if reply.kv_fingerprint.dtype != store.fingerprint.dtype:
            diffs.insert(0, f"KV cache dtype: P stores {reply.kv_fingerprint.dtype}, D stores "
                            f"{store.fingerprint.dtype} (--kv-cache-dtype must be the same on "
                            "both)")
        return "; ".join(diffs)

    def _on_read(self, load: Load, reply: Any, frames: list[Any]) -> None:
        if not (isinstance(reply, ReadReply) and reply.shm_name == load.shm_name):
            load.shm_name = None    # P wrote no file of D's name: nothing of D's to remove
        if load.cancelled:
            self._finish_cancelled(load)
            return
        try:
            nbytes = self._write(load, reply, frames)
        except _Failed as e:
            self._fail(load, e)
            return
        except Exception as e:  # a failed write fails this load, not the thread
            self._fail(load, _Failed(KV_FAILURE_ERROR, f"writing blocks failed: {e}"))
            return
        if not self.store.has_payload and nbytes:
            load.state = "delayed"
            ready = self.clock() + nbytes / self.sim_bandwidth
            self._delayed[load.request_id] = (load, ready, nbytes)
        else:
            self._succeed(load, nbytes)

    def _write(self, load: Load, reply: Any, frames: list[Any]) -> int:
        """Check the reply and write its blocks into D's store; returns the bytes moved."""
        if not isinstance(reply, ReadReply):
            raise _Failed(KV_FAILURE_ERROR, f"P answered the Read with {reply!r}")
        if reply.status == READ_REFUSED:
            raise _Failed(KV_FAILURE_REFUSED, reply.error or "refused")
        if reply.status != READ_OK:
            raise _Failed(KV_FAILURE_ERROR, reply.error or reply.status)
        store = self.store
        expected = len(load.local_block_ids) * store.block_nbytes
        if reply.block_ids != load.remote_block_ids or reply.nbytes != expected:
            raise _Failed(KV_FAILURE_TRUNCATED,
                          f"P sent blocks {reply.block_ids} ({reply.nbytes} bytes), asked for "
                          f"{load.remote_block_ids} ({expected} bytes)")
        if not store.has_payload:
            return expected
        if reply.shm_name is not None:
            if load.shm_name is None or reply.shm_name != load.shm_name:
                raise _Failed(KV_FAILURE_ERROR, f"P names the shared-memory file "
                                                f"{reply.shm_name[:80]!r}, which D did not ask for")
            with shm.mapped_frames(load.shm_name, reply.num_frames, expected) as views:
                self._write_frames(load, views, expected, reply.checksums)
        else:
            self._write_frames(load, [f.buffer for f in frames], expected, reply.checksums)
        return expected

    def _write_frames(self, load: Load, frames: list[Any], expected: int,
                      checksums: list[int]) -> None:
        num_layers = self.store.fingerprint.num_layers
        sizes = [memoryview(f).nbytes for f in frames]
        if len(frames) != num_layers or sum(sizes) != expected or len(set(sizes)) != 1:
            raise _Failed(KV_FAILURE_TRUNCATED,
                          f"P sent {len(frames)} frames of {sum(sizes)} bytes, expected "
                          f"{num_layers} of {expected} bytes in all")
        bad = [i for i, f in enumerate(frames)
               if i >= len(checksums) or frame_checksum(f) != checksums[i]]
        if bad or len(checksums) != len(frames):
            raise _Failed(KV_FAILURE_TRUNCATED, f"the blocks' checksums do not match in "
                                                f"frame(s) {bad or 'count'}: not cached",
                          recompute=True)
        self.store.write_blocks(load.local_block_ids, frames)

    def _complete_delayed(self, now: float) -> None:
        for rid, (load, ready, nbytes) in list(self._delayed.items()):
            if ready <= now:
                del self._delayed[rid]
                if load.cancelled:
                    self._finish_cancelled(load)
                else:
                    self._succeed(load, nbytes)

    def _check_deadlines(self, now: float) -> None:
        for peer in list(self._peers.values()):
            if peer.expect and peer.expect[0][1] <= now:
                self._drop_peer(peer, f"no answer from prefill engine {peer.key[0]} at "
                                      f"{peer.key[1]}:{peer.key[2]} within "
                                      f"{self.transfer_timeout:g} s")

    def _cancel(self, request_id: str) -> None:
        load = self._loads.get(request_id)
        if load is None or load.cancelled:
            return
        load.cancelled = True
        self._send_done(load.peer, load.remote_request_id)
        if load.state == "meta":
            peer = self._peers.get(load.peer)
            if peer is not None and load in peer.waiting:
                peer.waiting.remove(load)
            self._finish_cancelled(load)
        # "read": the reply (or the timeout) finishes it; "delayed": a simulated transfer
        # runs its course, as a real one would go on writing into the blocks

    # --- endings --------------------------------------------------------------------------
    def _succeed(self, load: Load, nbytes: int) -> None:
        self._send_done(load.peer, load.remote_request_id)
        seconds = self.clock() - load.started
        if nbytes:
            self.counters.add_received(nbytes, seconds)
        self._report(LoadResult(load.request_id, ok=True, nbytes=nbytes, seconds=seconds,
                                transport=load.transport))

    def _fail(self, load: Load, error: _Failed, send_done: bool = True) -> None:
        if load.cancelled:
            self._finish_cancelled(load)
            return
        if send_done:
            self._send_done(load.peer, load.remote_request_id)   # give up: P frees now
        else:
            self._unwatch(load.peer, load.remote_request_id)
        self.counters.add_failure(error.reason)
        self._report(LoadResult(load.request_id, ok=False, reason=error.reason,
                                message=str(error),
                                invalid_block_ids=list(load.local_block_ids),
                                recompute=error.recompute))

    def _finish_cancelled(self, load: Load) -> None:
        self._report(LoadResult(load.request_id, ok=False, cancelled=True))

    def _report(self, result: LoadResult) -> None:
        load = self._loads.pop(result.request_id, None)
        if load is not None and load.shm_name is not None:
            shm.unlink_own(load.shm_name)    # D's name, which P wrote or may have written
        with self._results_lock:
            self._results.append(result)
        self.wakeup()

    # --- heartbeats and Done --------------------------------------------------------------
    def _watch(self, key: PeerKey, remote_request_id: str, interval: float) -> None:
        self._watches.setdefault(key, {})[remote_request_id] = interval
        self._next_heartbeat.setdefault(key, self.clock())

    def _unwatch(self, key: PeerKey, remote_request_id: str) -> None:
        ids = self._watches.get(key)
        if ids is not None:
            ids.pop(remote_request_id, None)
            if not ids:
                del self._watches[key]
                self._next_heartbeat.pop(key, None)

    def _send_done(self, key: PeerKey, remote_request_id: str) -> None:
        self._unwatch(key, remote_request_id)
        self._send_to(key, Done(remote_request_id=remote_request_id))

    def _send_heartbeats(self, now: float) -> None:
        for key, ids in list(self._watches.items()):   # opening a DEALER may evict a peer
            if key not in self._watches or self._next_heartbeat.get(key, now) > now:
                continue
            self._send_to(key, Heartbeat(engine_id=key[0], remote_request_ids=sorted(ids)))
            if key in self._watches:
                self._next_heartbeat[key] = now + min(ids.values())


def _dead_result(load: Load, fault: str) -> LoadResult:
    return LoadResult(load.request_id, ok=False, reason=KV_FAILURE_ERROR, message=fault,
                      invalid_block_ids=list(load.local_block_ids))
