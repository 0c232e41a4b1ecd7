"""KV events are not a prompt leak (issue 25, item 6).

- A worker with --api-key tells its event and side-channel addresses only to key holders
  (`GET /kvloop/worker`).
- With CURVE on (--kv-events-curve, `kvloop fleet`'s default), a subscriber that connects to
  the PUB or replay socket anyway (the addresses found by scanning, or told) receives
  nothing, live or replayed; a fleet member holding the secret receives everything.
- --kv-events-omit-token-ids publishes hashes without token ids, and the router still routes
  by prefix on them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest
import zmq

from kvloop.events import protocol as proto
from kvloop.events.config import KVEventsConfig
from kvloop.events.publisher import ZmqEventPublisher
from kvloop.events.subscriber import KVEventSubscriber, WorkerBatch
from kvloop.events.types import BlockStored, KVEventBatch
from kvloop.front.launcher import ServeProcess
from kvloop.front.prometheus_text import metric_value
from kvloop.router.config import RouterConfig
from kvloop.router.fleet import Fleet, FleetConfig
from kvloop.router.registry import WorkerSpec
from kvloop.server.api import _kv_transfer
from kvloop.trust import PURPOSE_KV_EVENTS, CurveKeys, FleetSecret, write_secret_file
from kvloop.wire import KVTransferInfo

from .conftest import RouterThread, bearer, block_stored, event_batch, wait_until

LOCAL = "tcp://127.0.0.1:0"
SECRET = FleetSecret.generate()
KEYS = SECRET.curve_keys(PURPOSE_KV_EVENTS)
KEY = "events-api-key"
PROMPT = list(range(1000, 1064))        # 4 blocks of 16: the "private" prompt


# --- an attacker's sockets ------------------------------------------------------------------
class Stranger:
    """Plain pyzmq sockets on the worker's event addresses, as anyone on the network can open
    them: without keys, or (`rogue`) with the server's public key and a client key pair of
    its own (the server key is not secret; the fleet's client key is)."""

    def __init__(self, endpoint: str, replay_endpoint: str, rogue: bool = False):
        self.ctx = zmq.Context()
        self.sub = self._socket(zmq.SUB, rogue)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.dealer = self._socket(zmq.DEALER, rogue)
        self.dealer.connect(replay_endpoint)

    def _socket(self, kind: int, rogue: bool) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if rogue:
            public, secret = zmq.curve_keypair()
            sock.setsockopt(zmq.CURVE_SERVERKEY, KEYS.server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        return sock

    def ask_everything(self) -> None:
        """vLLM's replay from 0, kvloop's snapshot and info (a DEALER whose handshake was
        refused has no peer: its sends would block, so they are dropped instead)."""
        for frames in ([b"", proto.seq_bytes(0)], [b"", proto.KVLOOP, proto.CMD_SNAPSHOT],
                       [b"", proto.KVLOOP, proto.CMD_INFO]):
            try:
                self.dealer.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:
                pass

    def received(self, wait_ms: int) -> list[list[bytes]]:
        """Everything that reached either socket within `wait_ms`."""
        out: list[list[bytes]] = []
        deadline = time.monotonic() + wait_ms / 1000
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        poller.register(self.dealer, zmq.POLLIN)
        while (left := deadline - time.monotonic()) > 0:
            for sock, _ in poller.poll(int(left * 1000) + 1):
                out.append(sock.recv_multipart())
        return out

    def close(self) -> None:
        self.ctx.destroy(linger=0)


class Member:
    """A fleet member's subscriber (the router's kind), collecting what it is given."""

    def __init__(self, endpoint: str, replay_endpoint: str, keys: CurveKeys | None):
        self.batches: list[WorkerBatch] = []
        self.sub = KVEventSubscriber(endpoint, replay_endpoint, on_batch=self.batches.append,
                                     curve_keys=keys)
        self.sub.start()

    def stored(self, source: str | None = None) -> list[BlockStored]:
        return [ev for wb in list(self.batches) for ev in wb.events
                if isinstance(ev, BlockStored) and source in (None, wb.source)]

    def tokens(self, source: str | None = None) -> list[int]:
        return [t for ev in self.stored(source) for t in ev.token_ids]


def curve_publisher(**config: object) -> ZmqEventPublisher:
    cfg = KVEventsConfig(endpoint=LOCAL, replay_endpoint=LOCAL, heartbeat=True, **config)
    return ZmqEventPublisher(cfg, curve_keys=KEYS).start()


def prompt_batch() -> KVEventBatch:
    return event_batch(block_stored(11, 12, 13, 14, block_size=16, token_ids=PROMPT))


# --- in process: the publisher's sockets ------------------------------------------------------
def test_a_curve_publisher_needs_the_fleet_keys() -> None:
    cfg = KVEventsConfig(endpoint=LOCAL, curve=True)
    with pytest.raises(ValueError, match="fleet secret"):
        ZmqEventPublisher(cfg)


@pytest.mark.slow   # waits to prove that nothing arrives
def test_without_the_fleet_keys_a_subscriber_gets_nothing_live_or_replayed() -> None:
    pub = curve_publisher(curve=True)
    assert pub.endpoint is not None and pub.replay_endpoint is not None
    strangers = [Stranger(pub.endpoint, pub.replay_endpoint),
                 Stranger(pub.endpoint, pub.replay_endpoint, rogue=True)]
    live = Member(pub.endpoint, pub.replay_endpoint, KEYS)
    try:
        # publish until the member has the prompt live (a PUB drops what it sends before
        # a subscriber has joined), then a latecomer gets it by snapshot
        wait_until(lambda: pub.publish(prompt_batch()) or PROMPT[0] in live.tokens("live"),
                   timeout=10, what="the member's live batch")
        late = Member(pub.endpoint, pub.replay_endpoint, KEYS)
        wait_until(lambda: late.tokens("snapshot")[:len(PROMPT)] == PROMPT, timeout=10,
                   what="the member's snapshot")
        # the members may have asked a replay of what a PUB dropped before they joined (a
        # loaded run did): only what the strangers ask must be served nothing
        replays = pub.stats.replays_served
        for s in strangers:
            s.ask_everything()
        pub.publish(prompt_batch())
        for s in strangers:
            assert s.received(wait_ms=1500) == []
        assert pub.stats.snapshots_served >= 1 and pub.stats.replays_served == replays
        late.sub.stop()
    finally:
        live.sub.stop()
        for s in strangers:
            s.close()
        pub.shutdown()


@pytest.mark.slow   # the same stranger as the test above, without CURVE
def test_without_curve_the_same_stranger_reads_the_prompt() -> None:
    """The control: the stranger's sockets work against a publisher without CURVE."""
    pub = curve_publisher()
    assert pub.endpoint is not None and pub.replay_endpoint is not None
    s = Stranger(pub.endpoint, pub.replay_endpoint)
    try:
        wait_until(lambda: pub.publish(prompt_batch()) or s.sub.poll(50), timeout=10,
                   what="a live batch")
        s.ask_everything()
        got = s.received(wait_ms=1000)
        stored = [ev for frames in got if len(frames) >= 3 and frames[-3] == b""
                  for ev in _decode(frames[-1])]
        assert any(ev.token_ids == PROMPT for ev in stored)
    finally:
        s.close()
        pub.shutdown()


def _decode(payload: bytes) -> list[BlockStored]:
    try:
        batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
    except msgspec.DecodeError:
        return []
    return [ev for ev in batch.events if isinstance(ev, BlockStored)]


def test_omit_token_ids_publishes_hashes_only_live_and_in_snapshots() -> None:
    pub = curve_publisher(omit_token_ids=True)
    assert pub.endpoint is not None and pub.replay_endpoint is not None
    live = Member(pub.endpoint, pub.replay_endpoint, None)
    try:
        wait_until(lambda: pub.publish(prompt_batch()) or live.stored("live"), timeout=10,
                   what="a live batch")
        late = Member(pub.endpoint, pub.replay_endpoint, None)
        wait_until(lambda: late.stored("snapshot"), timeout=10, what="a snapshot")
        for member in (live, late):
            assert {h for ev in member.stored() for h in ev.block_hashes} == {11, 12, 13, 14}
            assert all(ev.token_ids == [] and ev.block_size == 16 for ev in member.stored())
        late.sub.stop()
    finally:
        live.sub.stop()
        pub.shutdown()


def test_the_side_channel_address_is_hidden_from_a_caller_not_admitted() -> None:
    kv = KVTransferInfo(engine_id="e", kv_role="kv_producer", side_channel_host="10.0.0.5",
                        side_channel_port=5600, transport="auto")
    assert _kv_transfer(kv, admitted=True) == kv
    hidden = _kv_transfer(kv, admitted=False)
    assert hidden is not None
    assert (hidden.side_channel_host, hidden.side_channel_port) == ("", 0)


def test_kvloop_fleet_turns_curve_on_when_it_has_a_secret() -> None:
    assert "--kv-events-curve" in FleetConfig(1, fleet_secret=SECRET).events_args()
    assert "--kv-events-curve" not in FleetConfig(1).events_args()


# --- a real worker ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    home = tmp_path_factory.mktemp("events_curve")
    secret_file = home / "fleet.secret"
    write_secret_file(str(secret_file), SECRET)
    log = home / "serve.log"
    args = ["--model", "sim", "--sim-speedup", "100", "--api-key", KEY,
            "--fleet-secret-file", str(secret_file), "--kv-events-curve",
            "--kv-events-endpoint", LOCAL, "--kv-events-replay-endpoint", LOCAL]
    with ServeProcess(args, log).start(timeout_s=60) as srv:
        yield srv
    assert "Traceback" not in srv.log(), srv.log()


@pytest.mark.processes
def test_an_anonymous_client_learns_no_event_address_and_reads_nothing(worker) -> None:
    anonymous = httpx.get(worker.url + "/kvloop/worker", timeout=10).json()
    assert anonymous["kv_events"]["endpoint"] is None
    assert anonymous["kv_events"]["replay_endpoint"] is None
    keyed = httpx.get(worker.url + "/kvloop/worker", headers=bearer(KEY), timeout=10).json()
    events = keyed["kv_events"]
    assert events["curve"] is True and events["token_ids"] is True
    endpoint, replay = events["endpoint"], events["replay_endpoint"]
    assert endpoint.startswith("tcp://127.0.0.1:") and replay.startswith("tcp://127.0.0.1:")

    stranger = Stranger(endpoint, replay)       # told the addresses (or found them by scanning)
    member = Member(endpoint, replay, KEYS)
    try:
        r = httpx.post(worker.url + "/v1/completions", headers=bearer(KEY), timeout=30,
                       json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200, r.text
        wait_until(lambda: member.tokens()[:len(PROMPT)] == PROMPT, timeout=10,
                   what="the member's copy of the prompt's blocks")
        stranger.ask_everything()
        r = httpx.post(worker.url + "/v1/completions", headers=bearer(KEY), timeout=30,
                       json={"prompt": PROMPT[::-1], "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert stranger.received(wait_ms=2000) == []
        wait_until(lambda: PROMPT[-1] in member.tokens("live")[-len(PROMPT):], timeout=10,
                   what="the member's live batch")
    finally:
        member.sub.stop()
        stranger.close()


# --- the defaults: no prompt tokens to a keyless subscriber ------------------------------------
def test_default_event_settings_give_no_keyless_subscriber_token_ids(tmp_path) -> None:
    """issue 37 (4): `kvloop serve` with the fleet secret turns CURVE on by itself; without
    it (no subscriber can authenticate) BlockStored carries no token ids unless asked."""
    from kvloop.server.cli_args import build_configs
    from tests.test_serve_cli import serve_args

    secret_file = tmp_path / "fleet.secret"
    write_secret_file(str(secret_file), SECRET)
    events = ("--model", "sim", "--enable-kv-cache-events")
    keyed = build_configs(serve_args(*events, "--fleet-secret-file", str(secret_file)))[1]
    assert keyed.kv_events is not None
    assert keyed.kv_events.curve and not keyed.kv_events.omit_token_ids
    keyless = build_configs(serve_args(*events))[1]
    assert keyless.kv_events is not None
    assert not keyless.kv_events.curve and keyless.kv_events.omit_token_ids
    opted = build_configs(serve_args(*events, "--no-kv-events-omit-token-ids"))[1]
    assert opted.kv_events is not None and not opted.kv_events.omit_token_ids


@pytest.mark.processes
def test_a_raw_subscriber_of_a_default_worker_reads_no_token_ids(tmp_path) -> None:
    """issue 37 (4): a worker started with events and nothing else (no secret, no key): a
    plain SUB and DEALER on its sockets get the block hashes, never a prompt token."""
    args = ["--model", "sim", "--sim-speedup", "100", "--kv-events-endpoint", LOCAL,
            "--kv-events-replay-endpoint", LOCAL]
    with ServeProcess(args, tmp_path / "serve.log").start(timeout_s=60) as srv:
        facts = httpx.get(srv.url + "/kvloop/worker", timeout=10).json()["kv_events"]
        assert facts["curve"] is False and facts["token_ids"] is False
        stranger = Stranger(facts["endpoint"], facts["replay_endpoint"])
        try:
            time.sleep(0.5)                    # the SUB's subscription reaches the PUB
            r = httpx.post(srv.url + "/v1/completions", timeout=30,
                           json={"prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == 200, r.text
            stranger.ask_everything()
            frames = stranger.received(wait_ms=2000)
        finally:
            stranger.close()
    dec = msgspec.msgpack.Decoder(KVEventBatch)
    stored = []
    for msg in frames:
        try:
            batch = dec.decode(msg[-1])
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue                           # heartbeats, info, snapshot framing
        stored += [e for e in batch.events if isinstance(e, BlockStored)]
    assert len({h for e in stored for h in e.block_hashes}) >= 4      # it saw the blocks
    assert [t for e in stored for t in e.token_ids] == []             # and no prompt token
    assert all(not e.lookahead_token_ids for e in stored)


# --- the router on hashes only --------------------------------------------------------------
@pytest.mark.processes
def test_the_router_routes_by_prefix_on_events_without_token_ids() -> None:
    fleet = Fleet(FleetConfig(2, "sim", ("both",),
                              ("--sim-speedup", "40", "--kv-events-omit-token-ids"),
                              start_timeout_s=120, echo_output=False, worker_api_key=KEY,
                              fleet_secret=SECRET))
    fleet.start()
    try:
        cfg = RouterConfig(worker_api_key=KEY, fleet_secret=SECRET)
        specs = [WorkerSpec(w.url) for w in fleet.workers]
        with RouterThread(cfg, specs) as rt:
            desc = rt.router.registry.all()[0].description
            assert desc is not None and desc.kv_events is not None
            assert desc.kv_events.curve and not desc.kv_events.token_ids
            prompt = list(range(2000, 2000 + 16 * 8 + 5))
            for attempt in range(2):
                before = httpx.get(rt.url + "/metrics").text
                r = httpx.post(rt.url + "/v1/completions", timeout=30,
                               json={"prompt": prompt, "max_tokens": 1})
                assert r.status_code == 200, r.text
                cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                if attempt == 0:   # wait for the BlockStored to reach the index
                    wait_until(lambda: rt.router.index.num_blocks() >= 8, timeout=10,
                               what="the index's entries")
                    continue
                after = httpx.get(rt.url + "/metrics").text
                predicted = (metric_value(after, "kvloop_router_predicted_hit_tokens_total")
                             - metric_value(before, "kvloop_router_predicted_hit_tokens_total"))
                assert cached == 128 and predicted == cached
    finally:
        fleet.stop()


# --- a consumer without the secret --------------------------------------------------------------
def test_a_router_without_the_secret_says_why_it_does_not_subscribe(caplog) -> None:
    from kvloop.router.feed import EventFeed
    from kvloop.router.index import PrefixIndex
    from kvloop.router.registry import EventCounters, EventSource
    from kvloop.router.subscription import NoSubscription, subscription_factory

    feed = EventFeed("w:1", PrefixIndex(), None, EventCounters(), lambda *a: None,
                     lambda *a: None)
    source = EventSource("tcp://127.0.0.1:9", "tcp://127.0.0.1:10", curve=True)
    with caplog.at_level("ERROR", logger="kvloop.router"):
        sub = subscription_factory(None)(source, feed)
    assert isinstance(sub, NoSubscription)
    assert "require CURVE keys" in caplog.text and "--fleet-secret-file" in caplog.text


def test_tail_curve_needs_the_secret(monkeypatch) -> None:
    import argparse

    from kvloop.events.cli_args import _tail_keys

    monkeypatch.delenv("KVLOOP_FLEET_SECRET", raising=False)
    monkeypatch.delenv("KVLOOP_FLEET_SECRET_FILE", raising=False)
    with pytest.raises(SystemExit, match="--curve needs the fleet secret"):
        _tail_keys(argparse.Namespace(curve=True, fleet_secret_file=None))
    monkeypatch.setenv("KVLOOP_FLEET_SECRET", SECRET.to_text())
    keys = _tail_keys(argparse.Namespace(curve=True, fleet_secret_file=None))
    assert keys is not None and keys.client_public == KEYS.client_public
