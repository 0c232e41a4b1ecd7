"""Issue 25, KV slice: "KV only from trusted peers". Each attack of the issue is run as it was
written and must no longer achieve its effect (docs/security.md, docs/disaggregation.md):

- a client's `kv_transfer_params` naming a peer it runs (plain, or CURVE with another
  fleet's keys) answering with all-zero KV or the name of a victim /dev/shm file;
- 1,100 distinct `remote_engine_id` values through the API;
- a squatted shared-memory name, a tiny lease, a 3 M-element `remote_block_ids`;
- a dead transfer thread (the worker must say so, and no request may hang on it).

Workers are real `kvloop serve --model sim` processes with the fleet secret; the transport
tests (shm, checksums, peer cap) drive P's side-channel server and D's transfer thread over
real ZMQ sockets with a store holding real bytes."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from kvloop.config import KVConnectorExtraConfig, KVTransferConfig
from kvloop.core.kv_connector import KV_BLOCK_LAYOUT, KVFingerprint
from kvloop.front.launcher import ServeProcess
from kvloop.kv_transfer import KvloopConnector, shm
from kvloop.kv_transfer import server as side_channel
from kvloop.kv_transfer.client import Load, LoadResult, TransferClient
from kvloop.kv_transfer.leases import LeaseTable
from kvloop.kv_transfer.params import MIN_LEASE_S, parse_remote_prefill
from kvloop.kv_transfer.protocol import (
    PROTOCOL_VERSION,
    READ_OK,
    Meta,
    MetaReply,
    Read,
    ReadReply,
    decode_request,
    encode,
    frame_checksum,
    host_id,
)
from kvloop.kv_transfer.server import SideChannelServer
from kvloop.kv_transfer.stats import TransferCounters
from kvloop.sim.kv_store import SimKVBlockStore
from kvloop.trust import PURPOSE_KV_SIDE_CHANNEL, FleetSecret, curve_authenticator

from .conftest import serving, wait_until
from .test_pd_engine import (
    PREFILL,
    Stats,
    engines,  # noqa: F401  (a fixture)
    generate,
    settle,
)
from .test_pd_engine import prefill as engine_prefill
from .test_pd_model import (
    assert_same_greedy,
    greedy,
    model_engine,
    tiny,  # noqa: F401  (a fixture)
)
from .test_pd_serve import (
    BS,
    FLEET,
    FLEET_ENV,
    GENERATE,
    PREFILL_PARAMS,
    SECRET,
    SIM,
    SLOW_BANDWIDTH,
    completion,
    idle,
    kv_config,
    prefill,
    token_ids,
    tokens,
    worker_info,
)

pytestmark = pytest.mark.processes   # workers, side channels and ZMQ sockets on 127.0.0.1

USER_KEY = "user-key-not-the-router"
ADMIN_KEY = "admin-key-of-the-operator"
USER = {"Authorization": f"Bearer {USER_KEY}"}            # a client of the API
ROUTER = {**USER, **FLEET}                                # this fleet's router
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


# --- the workers ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def p(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with serving(tmp_path_factory, "sec_p", [
            *SIM, "--role", "prefill", "--block-size", str(BS), "--admin-api-key", ADMIN_KEY,
            "--kv-transfer-config", kv_config()], env=FLEET_ENV) as srv:
        yield srv


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """A decode worker with API keys on everything (the issue's setting), prefix caching
    on, slow simulated loads (a 2,000-token prompt takes about a second)."""
    with serving(tmp_path_factory, "sec_d", [
            *SIM, "--role", "decode", "--enable-prefix-caching", "--block-size", str(BS),
            "--api-key", USER_KEY, "--admin-api-key", ADMIN_KEY,
            "--kv-transfer-config", kv_config(sim_bandwidth=SLOW_BANDWIDTH)],
            env=FLEET_ENV) as srv:
        yield srv


def post(w: ServeProcess, body: dict[str, Any], headers: dict[str, str],
         path: str = "/v1/completions", timeout: float = 60) -> httpx.Response:
    return httpx.post(w.url + path, json=body, headers=headers, timeout=timeout)


def pd_params(p: ServeProcess, prompt: list[int]) -> dict[str, Any]:
    """P's leg run by the router (its token): the params P hands on for `prompt`."""
    return prefill(p, completion(prompt))["kv_transfer_params"]  # type: ignore[no-any-return]


def idle_d(d: ServeProcess, timeout_s: float = 8.0) -> None:
    """`idle` for the decode worker, whose stats route needs its API key."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = httpx.get(d.url + "/kvloop/stats", headers=USER, timeout=10).json()
        if s["num_requests"] == 0 and s["num_free_blocks"] == s["num_total_blocks"]:
            return
        assert time.monotonic() < deadline, s
        time.sleep(0.05)


def cached_tokens(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def engine_fds(d: ServeProcess) -> int:
    """Open files of the decode worker's engine process (its pid: a private fact, shown to a
    caller with a key)."""
    info = httpx.get(d.url + "/kvloop/worker", headers=USER, timeout=10).json()
    return len(os.listdir(f"/proc/{info['engine_pid']}/fd"))


# --- 1. who may send kv_transfer_params -----------------------------------------------------------
def _bodies(prompt: list[int], params: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {"/v1/completions": {**completion(prompt), "kv_transfer_params": params},
            "/v1/chat/completions": {"model": "sim", "max_completion_tokens": 2,
                                     "messages": [{"role": "user", "content": "hi " * 20}],
                                     "kv_transfer_params": params},
            GENERATE: {"token_ids": prompt, "sampling_params": {"max_tokens": 2},
                       "kv_transfer_params": params}}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", GENERATE])
def test_kv_transfer_params_need_the_fleet_token_or_the_admin_key(
        p: ServeProcess, d: ServeProcess, path: str) -> None:
    """A client (with or without an API key, or with a forged token) asking a worker to hold
    or to load KV gets 403 naming why; P holds nothing, D loads nothing."""
    prompt = tokens(40, 2501)
    load = {**pd_params(p, prompt), "remote_request_id": "stolen"}
    for worker, params, callers in (
            (p, PREFILL_PARAMS, ({}, {"x-kvloop-fleet-token": "0" * 64})),
            (d, load, (USER, {**USER, "x-kvloop-fleet-token": "forged"}))):
        for headers in callers:
            r = post(worker, _bodies(prompt, params)[path], headers, path)
            assert r.status_code == 403, r.text
            err = r.json()["error"]
            assert "only from this fleet's router or with the admin key" in err["message"]
            assert err["param"] == "kv_transfer_params"
    # asking for nothing needs nothing; the admin key may ask
    assert post(p, _bodies(prompt, {"do_remote_decode": False})[path], {}, path
                ).status_code == 200
    r = post(p, _bodies(prompt, PREFILL_PARAMS)[path], ADMIN, path)
    assert r.status_code == 200 and r.json()["kv_transfer_params"]["do_remote_prefill"], r.text
    idle(p)
    idle_d(d)


# --- 2. a client-chosen peer ----------------------------------------------------------------------
class RoguePrefill:
    """The issue's fake prefill worker: answers Meta as a P of D's geometry and every Read
    with all-zero KV, or with the name of a victim file in /dev/shm. `keys`: it speaks CURVE
    with these (another fleet's) keys; None: plaintext."""

    def __init__(self, victim: str | None, other_fleet: FleetSecret | None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.auth = None
        if other_fleet is not None:
            keys = other_fleet.curve_keys(PURPOSE_KV_SIDE_CHANNEL)
            self.auth = curve_authenticator(self.ctx, [keys])
            keys.make_server(self.sock)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.victim = victim
        self.received: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        store = SimKVBlockStore(BS)
        meta = MetaReply(engine_id="rogue", kv_fingerprint=store.fingerprint, block_size=BS,
                         block_nbytes=store.block_nbytes, version=PROTOCOL_VERSION,
                         host_id=host_id())
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            identity, *frames = self.sock.recv_multipart()
            msg = decode_request(frames[0])
            self.received.append(msg)
            if isinstance(msg, Meta):
                self.sock.send_multipart([identity, encode(meta)])
            elif isinstance(msg, Read):
                n = len(msg.block_ids) * store.block_nbytes
                self.sock.send_multipart([identity, encode(ReadReply(
                    status=READ_OK, block_ids=msg.block_ids, nbytes=n, num_frames=1,
                    shm_name=self.victim)), *([] if self.victim else [bytes(n)])])

    def params(self, num_tokens: int) -> dict[str, Any]:
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": "rogue", "remote_request_id": "r", "remote_host":
                "127.0.0.1", "remote_port": self.port, "remote_num_tokens": num_tokens,
                "remote_block_ids": list(range(-(-num_tokens // BS))), "block_size": BS}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
        if self.auth is not None:
            self.auth.stop()
        self.ctx.destroy(linger=0)   # term() waits on any socket left open


@pytest.fixture
def victim() -> Iterator[Path]:
    path = Path(shm.SHM_DIR) / f"victim-{uuid.uuid4().hex}"
    path.write_bytes(b"precious")
    yield path
    path.unlink(missing_ok=True)


@pytest.mark.parametrize("reply", ["zero-kv", "victim-shm"])
@pytest.mark.parametrize("peer", ["plaintext", "other-fleet"])
def test_a_client_chosen_peer_gets_no_connection_and_no_kv(
        p: ServeProcess, d: ServeProcess, victim: Path, reply: str, peer: str) -> None:
    """The client's params name its own P: 403. Even an authorized caller tricked into
    naming it (the admin key here) gets no KV from it: it cannot complete the CURVE
    handshake, so D never sends it a Read, fails the load within transfer_timeout, caches
    nothing, and leaves the victim file alone; the same prefix then gets no poisoned hit."""
    rogue = RoguePrefill(str(victim.name) if reply == "victim-shm" else None,
                         FleetSecret.generate() if peer == "other-fleet" else None)
    try:
        prompt = tokens(49, 2600 + len(reply) + len(peer))    # 3 full blocks and one token
        body = {**completion(prompt), "kv_transfer_params": rogue.params(len(prompt))}
        assert post(d, body, USER).status_code == 403
        t0 = time.monotonic()
        r = post(d, body, {**ADMIN})
        assert r.status_code == 500 and "unreachable" in r.json()["error"]["message"], r.text
        assert time.monotonic() - t0 < 2.0 + 3          # transfer_timeout 2 s, then failed
        assert rogue.received == []                      # not even Meta reached it
        assert victim.read_bytes() == b"precious"
        # another client's request with that prefix: no hit, the right (sim) answer
        longer = completion(prompt + tokens(5, 7))
        r = post(d, longer, USER)
        assert cached_tokens(r) == 0
        assert token_ids(r) == token_ids(post(p, longer, {}))
        idle_d(d)
    finally:
        rogue.close()


@pytest.mark.parametrize("client", ["plaintext", "other-fleet"])
def test_p_s_side_channel_answers_no_stranger(p: ServeProcess, client: str) -> None:
    """The issue's anonymous `Meta` (engine id, hostname, boot id to anyone): a client
    without the fleet's keys gets no answer to Meta, nor to a Read of held blocks."""
    port = worker_info(p).kv_transfer.side_channel_port   # type: ignore[union-attr]
    params = pd_params(p, tokens(40, 2650))
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        if client == "other-fleet":
            FleetSecret.generate().curve_keys(PURPOSE_KV_SIDE_CHANNEL).make_client(sock)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(encode(Meta()))
        sock.send(encode(Read(remote_request_id=params["remote_request_id"],
                              block_ids=params["remote_block_ids"])))
        assert not sock.poll(1500), "P answered a stranger"
    idle(p)


# --- 3. bounded peers --------------------------------------------------------------------------
def test_1100_distinct_engine_ids_leave_the_transfer_thread_alive_and_fds_bounded(
        p: ServeProcess, d: ServeProcess) -> None:
    """The issue's 1,100 distinct remote_engine_id values (each a new peer for D) through an
    authorized caller: each load fails (P is not that engine), D's open sockets stay under
    its cap, /health stays 200 and a real P/D request still completes."""
    port = worker_info(p).kv_transfer.side_channel_port   # type: ignore[union-attr]
    prompt = tokens(40, 2700)
    fds0 = engine_fds(d)

    async def attack() -> list[int]:
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            sem = asyncio.Semaphore(32)

            async def one(i: int) -> int:
                params = {"do_remote_prefill": True, "remote_engine_id": f"engine-{i}",
                          "remote_request_id": f"r{i}", "remote_host": "127.0.0.1",
                          "remote_port": port, "remote_block_ids": [0, 1, 2]}
                async with sem:
                    r = await client.post(d.url + "/v1/completions", headers=ROUTER, json={
                        **completion(prompt, 1), "kv_transfer_params": params})
                    return r.status_code

            return await asyncio.gather(*(one(i) for i in range(1100)))

    t0 = time.monotonic()
    codes = asyncio.run(attack())
    assert set(codes) == {500}, {c: codes.count(c) for c in set(codes)}   # each load refused
    assert time.monotonic() - t0 < 120
    assert engine_fds(d) < fds0 + 200, (fds0, engine_fds(d))
    assert httpx.get(d.url + "/health").status_code == 200
    real = tokens(60, 2701)
    r = post(d, {**completion(real), "kv_transfer_params": pd_params(p, real)}, ROUTER)
    assert token_ids(r) == token_ids(post(p, completion(real), {}))
    assert r.json()["usage"]["prompt_tokens"] == 60
    assert d.log().count("refusing prefill engine") < 50       # warnings throttled
    idle_d(d)
    idle(p)


def test_params_are_bounded_before_any_work(p: ServeProcess, d: ServeProcess) -> None:
    """3 M block ids are refused (400) in well under a second of work; so are a list longer
    than the prompt's blocks, an address that is not a host, and long strings. The worker
    answers /health meanwhile."""
    prompt = tokens(40, 2800)
    good = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r",
            "remote_host": "127.0.0.1", "remote_port": 5000, "remote_block_ids": [0, 1, 2]}
    huge = {**completion(prompt), "kv_transfer_params": {**good,
                                                         "remote_block_ids": [7] * 3_000_000}}
    content = httpx.Request("POST", "/", json=huge).read()
    t0 = time.monotonic()
    r = httpx.post(d.url + "/v1/completions", content=content, timeout=60,
                   headers={**ROUTER, "content-type": "application/json"})
    took = time.monotonic() - t0
    assert r.status_code == 400 and "names 3000000 blocks" in r.json()["error"]["message"]
    assert took < 6.0, took   # parsed and refused: no work per block id
    for change, message in (({"remote_block_ids": [0, 1, 2, 3]}, "at most 3 of 16 tokens"),
                            ({"remote_host": "evil host/x"}, "must be a hostname or an IP"),
                            ({"remote_engine_id": "e" * 300}, "longer than 256"),
                            ({"remote_block_ids": [0, 2 ** 40]}, "list of block ids")):
        r = post(d, {**completion(prompt), "kv_transfer_params": {**good, **change}}, ROUTER)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert httpx.get(d.url + "/health").status_code == 200
    idle_d(d, 0)


MALFORMED = [("remote_port", v) for v in ("5000", -1, 0, 65536, 1e10, 5000.5, True, None,
                                        [5000], {"p": 1}, 2 ** 70)] + [
    ("remote_block_ids", v) for v in ("0,1", [0.5], [-1], [True], [None], {"0": 1}, 7)] + [
    (k, v) for k in ("remote_engine_id", "remote_request_id", "remote_host")
    for v in (5, None, ["e"], {"e": 1}, True)] + [
    ("remote_num_tokens", v) for v in ("40", -1, 1e300, [40], True)] + [
    ("block_size", v) for v in ("16", 0, -16, 1e300, [16], True, 2 ** 70)] + [
    ("lease_expires_in_s", v) for v in ("5", -1, float("nan"), [5], {"s": 5}, 1e308)] + [
    ("kv_fingerprint", v) for v in ("x", 5, [1], {"model": 5}, {"dtype": [1]})] + [
    ("do_remote_prefill", v) for v in ("yes", 1, [True])] + [
    ("remote_prefill_cached_tokens", v) for v in ("0", -5, [0])]


def test_malformed_params_from_a_fleet_member_are_a_4xx_never_a_500(
        p: ServeProcess, d: ServeProcess) -> None:
    """Issue 37, low: every field of `kv_transfer_params` with a wrong type or value, sent
    by a fleet member (the router's token) to D in otherwise good params of a real P: a 400
    naming kv_transfer_params before any work, or (a field D only reads as advice, well
    typed) a 200; never a 5xx. P's leg with such fields: the same. Both keep serving."""
    prompt = tokens(40, 2900)
    failures = []
    for key, value in MALFORMED:
        for worker, base in ((d, pd_params(p, prompt)), (p, PREFILL_PARAMS)):
            body = {**completion(prompt, max_tokens=2), "kv_transfer_params": {**base, key: value}}
            r = httpx.post(worker.url + "/v1/completions", content=json_dumps(body), timeout=60,
                           headers={**ROUTER, "content-type": "application/json"})
            ok = r.status_code == 200 or (r.status_code == 400 and r.json()["error"]["param"]
                                          == "kv_transfer_params")
            if not ok:
                failures.append((worker is d, key, value, r.status_code, r.text[:200]))
    assert failures == [], "\n".join(map(str, failures))
    for worker in (p, d):
        assert httpx.get(worker.url + "/health").status_code == 200
    idle(p)
    idle_d(d)


def json_dumps(body: Any) -> bytes:
    """JSON as Python writes it (NaN allowed: a peer may send it)."""
    import json
    return json.dumps(body).encode()


def test_a_tiny_lease_does_not_spin_or_spam_the_log(p: ServeProcess, d: ServeProcess) -> None:
    """`lease_expires_in_s: 1e-9` (the issue's 7,400 lines in 10 s): D heeds at least
    MIN_LEASE_S, heartbeats a few times during a one-second load and logs next to nothing."""
    prompt = tokens(2000, 2900)
    params = {**pd_params(p, prompt), "lease_expires_in_s": 1e-9}
    lines0 = len(d.log().splitlines())
    r = post(d, {**completion(prompt), "kv_transfer_params": params}, ROUTER)
    assert token_ids(r) == token_ids(post(p, completion(prompt), {}))
    time.sleep(1.0)
    new = d.log().splitlines()[lines0:]
    assert len(new) < 15, new
    assert parse_remote_prefill(params, 2000, BS).lease_s == MIN_LEASE_S  # type: ignore[union-attr]
    idle_d(d)


# --- 4. a dead transfer thread is loud -----------------------------------------------------------
_INJECT = '''
import os
if os.environ.get("KVLOOP_TEST_KILL_TRANSFER_THREAD"):
    from kvloop.kv_transfer import client as _client

    def _boom(self, load):
        raise RuntimeError("injected: the transfer thread's first load")

    _client.TransferClient._start_load = _boom
'''


def test_a_dead_transfer_thread_fails_its_loads_and_health_says_why(
        tmp_path: Path, p: ServeProcess) -> None:
    """The transfer thread dies (an exception injected into its first load, as the issue's
    EMFILE killed it): the request waiting on it ends with an error instead of hanging with
    its blocks held, later P/D requests fail at once, and /health is 503 naming the cause."""
    (tmp_path / "sitecustomize.py").write_text(_INJECT)
    env = {**FLEET_ENV, "KVLOOP_TEST_KILL_TRANSFER_THREAD": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    with ServeProcess([*SIM, "--block-size", str(BS), "--kv-transfer-config", kv_config()],
                      tmp_path / "d.log", env).start(timeout_s=60) as doomed:
        assert httpx.get(doomed.url + "/health").status_code == 200
        for i in range(2):
            prompt = tokens(40, 3000 + i)
            t0 = time.monotonic()
            r = post(doomed, {**completion(prompt), "kv_transfer_params":
                              pd_params(p, prompt)}, FLEET, timeout=30)
            assert r.status_code == 500, r.text
            assert "the KV transfer thread died" in r.json()["error"]["message"]
            assert time.monotonic() - t0 < 5
        health = httpx.get(doomed.url + "/health")
        assert health.status_code == 503
        (reason,) = health.json()["reasons"]
        assert reason.startswith("the KV transfer thread died: RuntimeError: injected"), reason
        s = doomed.wait_idle(10)
        assert s["num_requests"] == 0 and s["num_free_blocks"] == s["num_total_blocks"], s
        assert "Traceback" in doomed.log()                  # logged with its stack, once
        # requests that ask for no transfer are still served
        assert post(doomed, completion(tokens(10, 3005)), {}).status_code == 200
    idle(p)


# --- 5. the transport, byte for byte ----------------------------------------------------------
NUM_LAYERS, FRAME_BLOCK = 2, 2 * 1 * 4 * 8     # per layer per block: [2, 1 head, 4 tokens, 8]


class BytesStore:
    """A KV store of real bytes (2 layers, blocks of 4 tokens): what P reads, D writes."""

    has_payload = True
    block_size = 4
    block_nbytes = NUM_LAYERS * FRAME_BLOCK

    def __init__(self, num_blocks: int, fill: Callable[[int, int], int] = lambda L, b: 0):
        self.fingerprint = KVFingerprint(model="bytes", dtype="uint8", num_layers=NUM_LAYERS,
                                         num_kv_heads=1, head_dim=8, layout=KV_BLOCK_LAYOUT)
        self.data = [[bytes([fill(L, b)]) * FRAME_BLOCK for b in range(num_blocks)]
                     for L in range(NUM_LAYERS)]

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        return [b"".join(layer[b] for b in block_ids) for layer in self.data]

    def write_blocks(self, block_ids: list[int], frames: list[Any]) -> None:
        for layer, frame in zip(self.data, frames, strict=True):
            raw = bytes(frame)
            for i, b in enumerate(block_ids):
                layer[b] = raw[i * FRAME_BLOCK:(i + 1) * FRAME_BLOCK]


class Pair:
    """P's side-channel server and D's transfer thread over real sockets, CURVE-keyed by one
    fleet secret; P holds blocks 0-3 of request "r" (block b, layer L filled with 10L + b)."""

    def __init__(self, transport: str = "shm", max_peers: int = 64):
        keys = SECRET.curve_keys(PURPOSE_KV_SIDE_CHANNEL)
        self.p_ctx, self.d_ctx = zmq.Context(), zmq.Context()
        self.auth = curve_authenticator(self.p_ctx, [keys])
        self.p_store = BytesStore(8, lambda L, b: 10 * L + b + 1)
        self.d_store = BytesStore(8)
        self.leases = LeaseTable(30.0)
        self.leases.add("r", [0, 1, 2, 3])
        meta = MetaReply(engine_id="p", kv_fingerprint=self.p_store.fingerprint,
                         block_size=4, block_nbytes=BytesStore.block_nbytes,
                         version=PROTOCOL_VERSION, host_id=host_id())
        self.server = SideChannelServer(self.p_ctx, "127.0.0.1", 0, meta, self.leases,
                                        self.p_store, TransferCounters(), lambda: None, keys)
        self.client = TransferClient(self.d_ctx, self.d_store, transport=transport,
                                     transfer_timeout=2.0, sim_bandwidth=1e9,
                                     wakeup=lambda: None, counters=TransferCounters(),
                                     keys=keys, max_peers=max_peers)
        self.server.start()
        self.client.start()

    def load(self, rid: str = "d1", port: int | None = None,
             engine_id: str = "p") -> Load:
        load = Load(rid, (engine_id, "127.0.0.1", port or self.server.port), "r",
                    [0, 1, 2], [5, 6, 7], started=time.monotonic())
        self.client.submit(load)
        return load

    def results(self, n: int = 1, timeout: float = 10) -> list[LoadResult]:
        got: list[LoadResult] = []
        wait_until(lambda: got.extend(self.client.take_results()) or len(got) >= n, timeout,
                   f"{n} load result(s)")
        return got

    def close(self) -> None:
        self.client.shutdown()
        self.server.shutdown()
        self.auth.stop()
        self.p_ctx.destroy(linger=0)
        self.d_ctx.destroy(linger=0)


@pytest.fixture
def pair() -> Iterator[Pair]:
    made = Pair()
    yield made
    made.close()


def kvloop_shm() -> set[str]:
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith(shm.PREFIX)}


def test_shm_moves_exact_bytes_through_a_file_d_named_and_unlinked(pair: Pair) -> None:
    before = kvloop_shm()
    pair.load()
    (res,) = pair.results()
    assert res.ok, res
    for L in range(NUM_LAYERS):
        assert pair.d_store.data[L][5:8] == pair.p_store.data[L][0:3]
    assert kvloop_shm() == before


def test_a_squatted_shm_name_falls_back_to_tcp(pair: Pair,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Pre-created plausible names (D's pid, P's old `kvloop-<engine>-<pid>-<n>` form) and
    the very name D asks for: the load still succeeds (over TCP); the squatter's file is
    neither used nor removed."""
    squats = [f"{shm.PREFIX}{os.getpid()}-{secrets.token_hex(16)}" for _ in range(100)]
    squats += [f"kvloop-p-{os.getpid()}-{n}" for n in range(100)]
    for name in squats:
        (Path(shm.SHM_DIR) / name).write_bytes(b"squat")
    try:
        monkeypatch.setattr(shm, "new_name", lambda: squats[0])
        pair.load()
        (res,) = pair.results()
        assert res.ok, res
        assert pair.d_store.data[1][5:8] == pair.p_store.data[1][0:3]
        assert all((Path(shm.SHM_DIR) / n).read_bytes() == b"squat" for n in squats)
    finally:
        for name in squats:
            (Path(shm.SHM_DIR) / name).unlink(missing_ok=True)


class FleetFake:
    """A fleet member (it has the secret) that answers Reads as the test says: what a
    compromised or buggy P could send."""

    def __init__(self, reply: Callable[[Read], list[bytes]]):
        keys = SECRET.curve_keys(PURPOSE_KV_SIDE_CHANNEL)
        self.ctx = zmq.Context()
        self.auth = curve_authenticator(self.ctx, [keys])
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        keys.make_server(self.sock)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.reply = reply
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        store = BytesStore(1)
        meta = MetaReply(engine_id="p", kv_fingerprint=store.fingerprint, block_size=4,
                         block_nbytes=BytesStore.block_nbytes, version=PROTOCOL_VERSION,
                         host_id=host_id())
        while not self._stop.is_set():
            if self.sock.poll(50):
                identity, payload = self.sock.recv_multipart()
                msg = decode_request(payload)
                if isinstance(msg, Meta):
                    self.sock.send_multipart([identity, encode(meta)])
                elif isinstance(msg, Read) and (frames := self.reply(msg)):
                    self.sock.send_multipart([identity, *frames])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
        self.auth.stop()
        self.ctx.destroy(linger=0)


def _frames(n: int, value: int = 0) -> list[bytes]:
    return [bytes([value]) * (n * FRAME_BLOCK) for _ in range(NUM_LAYERS)]


@pytest.mark.parametrize("answer", ["bad-checksum", "no-checksum", "victim-shm"])
def test_a_peer_s_bad_blocks_or_foreign_shm_name_fail_the_load(
        pair: Pair, victim: Path, answer: str) -> None:
    """All-zero KV whose checksums do not match (or are missing), or a ReadReply naming a
    file D did not ask for: the load fails, nothing is written into D's blocks, the victim
    file is untouched."""
    def reply(read: Read) -> list[bytes]:
        n, frames = len(read.block_ids), _frames(len(read.block_ids))
        good = [frame_checksum(f) for f in _frames(n, 1)]
        base = dict(status=READ_OK, block_ids=read.block_ids, nbytes=n * BytesStore.block_nbytes,
                    num_frames=NUM_LAYERS)
        if answer == "victim-shm":
            return [encode(ReadReply(**base, shm_name=victim.name,   # type: ignore[arg-type]
                                     checksums=good))]
        sums = good if answer == "bad-checksum" else []
        return [encode(ReadReply(**base, checksums=sums)), *frames]  # type: ignore[arg-type]

    fake = FleetFake(reply)
    try:
        marker = [list(layer) for layer in pair.d_store.data]
        pair.load(port=fake.port)
        (res,) = pair.results()
        assert not res.ok and res.invalid_block_ids == [5, 6, 7], res
        assert res.reason == ("error" if answer == "victim-shm" else "truncated"), res
        assert res.recompute == (answer != "victim-shm")      # a checksum failure: a miss
        assert [list(layer) for layer in pair.d_store.data] == marker      # nothing written
        assert victim.read_bytes() == b"precious"
    finally:
        fake.close()


def test_a_file_written_by_a_p_that_died_mid_read_is_removed_by_d(pair: Pair) -> None:
    """P creates the file D named, writes part of it and dies (never answers): when the
    load fails ("unreachable", after transfer_timeout) D unlinks its name."""
    written: list[Path] = []

    def reply(read: Read) -> list[bytes]:
        assert read.shm_name is not None and shm.is_valid_name(read.shm_name)
        written.append(Path(shm.shm_path(read.shm_name)))
        written[-1].write_bytes(b"half a frame")
        return []

    fake = FleetFake(reply)
    try:
        pair.load(port=fake.port)
        (res,) = pair.results()
        assert (res.ok, res.reason) == (False, "unreachable")
        assert len(written) == 1 and not written[0].exists()
    finally:
        fake.close()


def test_peer_sockets_are_capped_and_closed() -> None:
    """Loads naming 20 distinct unreachable peers with a cap of 4: never more than 4 DEALERs
    open; every load gets a result (evicted ones "unreachable" at once)."""
    made = Pair(max_peers=4)
    try:
        dead_ports = []
        for _ in range(20):
            with zmq.Context() as c, c.socket(zmq.ROUTER) as s:
                dead_ports.append(s.bind_to_random_port("tcp://127.0.0.1"))
        seen: list[int] = []
        for i, port in enumerate(dead_ports):
            made.load(f"d{i}", port=port, engine_id=f"e{i}")
            seen.append(len(made.client._peers))
        results = made.results(20, timeout=15)
        assert max(seen) <= 4 and len(made.client._peers) <= 4
        assert {r.reason for r in results} == {"unreachable"}
    finally:
        made.close()


def test_a_dead_transfer_thread_fails_loads_in_flight_and_later(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's EMFILE, raised inside the thread: the load waiting on a silent P and
    every later one fail at once, naming the cause; none waits for an answer."""
    with zmq.Context() as c, c.socket(zmq.ROUTER) as s:
        silent = s.bind_to_random_port("tcp://127.0.0.1")
    pair.load("in-flight", port=silent)
    wait_until(lambda: "in-flight" in pair.client._loads, 5, "the load in flight")

    def boom(*args: Any) -> None:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(pair.client, "_check_deadlines", boom)
    wait_until(lambda: pair.client.fault is not None, 5, "the fault")
    fault = pair.client.fault
    assert fault == "the KV transfer thread died: OSError: [Errno 24] Too many open files"
    (res,) = pair.results(timeout=1)
    assert (res.request_id, res.ok, res.message) == ("in-flight", False, fault)
    pair.load("later")
    (res,) = pair.results(timeout=1)
    assert (res.request_id, res.ok, res.message) == ("later", False, fault)
    assert res.invalid_block_ids == [5, 6, 7]


def test_a_dead_side_channel_thread_is_named_and_its_loads_fail(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """P's side-channel thread dies on a message: `fault` names the cause (the connector
    reports it; the worker's /health turns 503); D's load fails instead of hanging."""
    def boom(*args: Any) -> None:
        raise MemoryError("injected")

    monkeypatch.setattr(pair.server, "_handle", boom)
    pair.load()
    wait_until(lambda: pair.server.fault is not None, 5, "the side channel's fault")
    assert pair.server.fault == "the KV side-channel thread died: MemoryError: injected"
    (res,) = pair.results()
    assert (res.ok, res.reason) == (False, "unreachable")


def test_orphans_of_dead_processes_are_swept(tmp_path: Path) -> None:
    """Files of kvloop's form whose naming process is gone are removed; a live process's,
    another form's and a symlink are kept."""
    child = subprocess.Popen(["true"])
    child.wait()
    dead = child.pid            # reaped: no such process now
    names = {"dead": f"{shm.PREFIX}{dead}-{'a' * 32}", "live": shm.new_name(),
             "other": f"kvloop-x-{dead}-1", "link": f"{shm.PREFIX}{dead}-{'b' * 32}"}
    for key, name in names.items():
        path = tmp_path / name
        path.symlink_to(tmp_path / "target") if key == "link" else path.write_bytes(b"x")
    assert shm.sweep_orphans(str(tmp_path)) == [names["dead"]]
    assert sorted(os.listdir(tmp_path)) == sorted(n for k, n in names.items() if k != "dead")


# --- 6. the connector's safe default, and whose hashes KV is cached under ------------------------
def test_the_connector_refuses_to_start_without_the_fleet_secret() -> None:
    config = KVTransferConfig(kv_connector="KvloopConnector", kv_role="kv_both")
    with pytest.raises(ValueError, match="--fleet-secret-file PATH, \\$KVLOOP_FLEET_SECRET_FILE"):
        KvloopConnector(config, SimKVBlockStore(BS))
    insecure = KVTransferConfig(
        kv_connector="KvloopConnector", kv_role="kv_both",
        kv_connector_extra_config=KVConnectorExtraConfig(insecure_side_channel=True))
    KvloopConnector(insecure, SimKVBlockStore(BS)).shutdown()
    assert KVTransferConfig.from_dict({
        "kv_connector": "KvloopConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"insecure_side_channel": True}}).extra.insecure_side_channel
    with pytest.raises(ValueError, match="insecure_side_channel must be true or false"):
        KVTransferConfig.from_dict({"kv_connector": "KvloopConnector", "kv_role": "kv_both",
                                    "kv_connector_extra_config": {"insecure_side_channel": 1}})


def test_a_p_d_worker_without_the_secret_does_not_start(tmp_path: Path) -> None:
    no_secret = {"KVLOOP_FLEET_SECRET": "", "KVLOOP_FLEET_SECRET_FILE": ""}
    with pytest.raises(RuntimeError, match="KvloopConnector needs the fleet secret"):
        ServeProcess([*SIM, "--kv-transfer-config", kv_config()], tmp_path / "w.log",
                     no_secret).start(timeout_s=60)


def test_loaded_kv_is_cached_under_d_s_own_hashes(engines: Any) -> None:  # noqa: F811
    """Params for prompt A used with prompt B (a caller naming another request's blocks):
    the blocks D loads are cached under B's hashes, computed by D from B's tokens, never A's:
    a later request for A finds nothing on D."""
    p, d = engines(), engines()
    a, b = list(range(300, 340)), list(range(500, 540))
    params = engine_prefill(p, "pa", a)
    _, last = generate(d, "db", b, 2, params)
    assert last.finish_reason == "length"
    settle(p)
    _, hit_b = generate(d, "b-again", b, 1)
    _, hit_a = generate(d, "a-on-d", a, 1)
    assert (hit_b.num_cached_tokens, hit_a.num_cached_tokens) == (32, 0)


def test_blocks_that_fail_their_checksum_are_a_miss_recomputed_on_d(
        tiny: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Real KV whose checksums do not match (bytes changed on the way): D, under policy
    "fail", treats the load as a miss, prefills the prompt itself and answers exactly as an
    aggregated engine; none of P's blocks is cached."""
    monkeypatch.setattr(side_channel, "frame_checksum", lambda frame: 0)
    p, d = (model_engine(tiny, 12, pd=True, transport="tcp") for _ in range(2))
    agg = model_engine(tiny, 12, pd=False)
    try:
        prompt = list(range(20, 60))
        ref, _ = greedy(agg, "agg", prompt, 3)
        _, p_last = greedy(p, "p", prompt, 1, dict(PREFILL))
        stats = Stats()
        got, last = greedy(d, "d", prompt, 3, p_last.kv_transfer_params, stats)
        assert (last.finish_reason, last.error) == ("length", None)
        assert stats.total.failures == {"truncated": 1} and stats.total.bytes_received == 0
        assert_same_greedy(ref, got)
    finally:
        for engine in (p, d, agg):
            engine.shutdown()
