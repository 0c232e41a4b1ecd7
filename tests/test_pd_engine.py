"""Prefill/decode disaggregation in the engine: two simulated engines in this process, a real
side channel on 127.0.0.1 between them (docs/disaggregation.md).

Exact block ids and counts on both sides, the bytes a transfer moves, leases (expiry and
heartbeats), aborts while loading, a P that is gone, refused and mismatched transfers, and
the failure policies. The simulator's blocks carry no payload (the model's are checked in
tests/test_pd_model.py), but every message of the protocol runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq

from kvloop.config import (
    CacheConfig,
    EngineConfig,
    KVConnectorExtraConfig,
    KVTransferConfig,
    SchedulerConfig,
)
from kvloop.core.engine import EngineCore
from kvloop.core.outputs import KVConnectorOutput
from kvloop.core.request import RequestStatus, SamplingParams
from kvloop.events.types import BlockStored
from kvloop.kv_transfer import KvloopConnector
from kvloop.kv_transfer.protocol import (
    PROTOCOL_VERSION,
    READ_OK,
    Done,
    Meta,
    MetaReply,
    Read,
    ReadReply,
    decode_request,
    encode,
    host_id,
)
from kvloop.sim.kv_store import SIM_KV_BYTES_PER_TOKEN, SimKVBlockStore
from kvloop.sim.worker import SimWorkerRunner
from kvloop.trust import PURPOSE_KV_SIDE_CHANNEL, FleetSecret, curve_authenticator
from kvloop.wire import EngineCoreOutput, KVTransferStats
from tests.conftest import FakeClock, wait_until

pytestmark = pytest.mark.processes     # every engine here listens on a side channel

BS = 16
BLOCK_BYTES = SIM_KV_BYTES_PER_TOKEN * BS
PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
           "remote_block_ids": None, "remote_host": None, "remote_port": None}


def kv_config(role: str = "kv_both", policy: str = "fail", **extra: Any) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="KvloopConnector", kv_role=role,
                            kv_load_failure_policy=policy,
                            kv_connector_extra_config=KVConnectorExtraConfig(**extra))


def sim_engine(blocks: int = 20, *, caching: bool = True, budget: int = 512,
               max_model_len: int | None = None, clock: Callable[[], float] = time.monotonic,
               store: SimKVBlockStore | None = None, kv: KVTransferConfig | None = None,
               **extra: Any) -> EngineCore:
    """A simulated engine with a KV connector (kv None and no extra: kv_both, defaults)."""
    max_len = max_model_len or budget
    return make_engine(SimWorkerRunner(None, blocks, max_len), store or SimKVBlockStore(BS),
                       blocks, kv or kv_config(**extra), caching=caching, budget=budget,
                       max_model_len=max_len, clock=clock)


SECRET = FleetSecret.generate()   # every engine of these tests is one fleet's member


def make_engine(runner: Any, store: Any, blocks: int, kv: KVTransferConfig | None, *,
                block_size: int = BS, caching: bool = True, budget: int = 512,
                max_model_len: int | None = None, chunked: bool = True,
                clock: Callable[[], float] = time.monotonic) -> EngineCore:
    """An engine over `runner` checking its invariants every step, with a started
    KvloopConnector over `store` (kv None: no connector)."""
    config = EngineConfig(
        cache=CacheConfig(block_size=block_size, num_gpu_blocks=blocks,
                          enable_prefix_caching=caching, enable_kv_cache_events=True),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8,
                                  max_model_len=max_model_len or budget,
                                  enable_chunked_prefill=chunked),
        check_invariants=True, kv_transfer=kv)
    connector = None
    if kv is not None:
        connector = KvloopConnector(kv, store, clock, secret=SECRET)
        connector.start()
    return EngineCore(config, runner, blocks, connector=connector)


@pytest.fixture
def engines() -> Iterator[Callable[..., EngineCore]]:
    """A factory of engines, all shut down at the end (their side channels closed)."""
    made: list[EngineCore] = []

    def make(*args: Any, **kwargs: Any) -> EngineCore:
        made.append(sim_engine(*args, **kwargs))
        return made[-1]

    yield make
    for engine in made:
        engine.shutdown()


class Stats:
    """A step's KV stats summed over the steps seen."""

    def __init__(self) -> None:
        self.total = KVTransferStats()
        self.last: KVTransferStats | None = None

    def add(self, s: KVTransferStats | None) -> None:
        if s is None:
            return
        t = self.total
        for name in ("transfers_sent", "transfers_received", "bytes_sent", "bytes_received",
                     "expired_requests", "external_prefix_cache_queries",
                     "external_prefix_cache_hits"):
            setattr(t, name, getattr(t, name) + getattr(s, name))
        t.transfer_seconds += s.transfer_seconds
        for k, v in s.failures.items():
            t.failures[k] = t.failures.get(k, 0) + v
        self.last = s


def step(engine: EngineCore, outputs: dict[str, list[EngineCoreOutput]] | None = None,
         stats: Stats | None = None) -> None:
    result = engine.step()
    engine.scheduler.check_invariants()
    if result.events is not None:
        _EVENTS.setdefault(id(engine), []).extend(result.events.events)
    for o in result.outputs:
        if outputs is not None:
            outputs.setdefault(o.request_id, []).append(o)
    if stats is not None and result.stats is not None:
        stats.add(result.stats.kv_transfer)
    if not (result.executed or result.outputs):
        engine.wait_for_work(0.02)


def run_until(engine: EngineCore, pred: Callable[[], Any], timeout: float = 10.0,
              what: str = "the condition", stats: Stats | None = None,
              outputs: dict[str, list[EngineCoreOutput]] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        step(engine, outputs, stats)


def generate(engine: EngineCore, rid: str, prompt: list[int], max_tokens: int,
             params: dict[str, Any] | None = None, stats: Stats | None = None,
             timeout: float = 10.0) -> tuple[list[int], EngineCoreOutput]:
    """Run one greedy request to its end: (its tokens, its last output)."""
    extra = {"kv_transfer_params": params} if params is not None else None
    sp = SamplingParams(max_tokens=max_tokens, min_tokens=1 if params else 0, temperature=0,
                        extra_args=extra)
    engine.add_request(engine.make_request(rid, prompt, sp))
    outs: dict[str, list[EngineCoreOutput]] = {}
    run_until(engine, lambda: outs.get(rid) and outs[rid][-1].finished, timeout,
              f"request {rid} to finish", stats, outs)
    return [t for o in outs[rid] for t in o.new_token_ids], outs[rid][-1]


def prefill(p: EngineCore, rid: str, prompt: list[int],
            stats: Stats | None = None) -> dict[str, Any]:
    """P's leg (max_tokens 1, min_tokens 1): the kv_transfer_params it hands on."""
    return prefill_and_token(p, rid, prompt, stats)[0]


def prefill_and_token(p: EngineCore, rid: str, prompt: list[int],
                      stats: Stats | None = None) -> tuple[dict[str, Any], int]:
    """P's leg: the params it hands on and the token it sampled (the proxy drops it)."""
    tokens, last = generate(p, rid, prompt, 1, dict(PREFILL), stats)
    assert last.finish_reason == "length" and last.kv_transfer_params is not None
    return last.kv_transfer_params, tokens[0]


def settle(engine: EngineCore, timeout: float = 5.0, stats: Stats | None = None) -> None:
    """Step until nothing waits on a transfer."""
    run_until(engine, lambda: not engine.has_transfers() and not engine.has_work(), timeout,
              "the transfers to end", stats)


def usable(engine: EngineCore) -> int:
    return engine.block_pool.num_usable_blocks


def free(engine: EngineCore) -> int:
    return engine.block_pool.get_num_free_blocks()


_EVENTS: dict[int, list[Any]] = {}     # id(engine) -> KV events its steps published


def stored_blocks(engine: EngineCore) -> int:
    """Blocks stored (BlockStored) since the last call."""
    events = _EVENTS.pop(id(engine), [])
    return sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored))


def aggregated(prompt: list[int], max_tokens: int) -> list[int]:
    """The same request on a plain simulated engine (no P/D)."""
    engine = sim_engine()
    try:
        return generate(engine, "agg", prompt, max_tokens)[0]
    finally:
        engine.shutdown()


PROMPT = list(range(300, 340))      # 40 tokens: 2 full blocks and 8


# --- a transfer, exactly ------------------------------------------------------------------------
def test_a_transfer_moves_exactly_the_prompt_blocks_and_both_sides_free_them(engines):
    p, d = engines(), engines()
    p_stats, d_stats = Stats(), Stats()
    params, p_token = prefill_and_token(p, "p1", PROMPT, p_stats)
    assert stored_blocks(p) == 2                        # the full prompt blocks, cached on P
    # P holds the request's 3 blocks (the first ones of a fresh pool) under a lease
    assert params["remote_block_ids"] == [1, 2, 3] and params["remote_request_id"] == "p1"
    assert params["remote_host"] == "127.0.0.1"
    assert params["remote_port"] == p.connector.info.side_channel_port > 0
    assert (params["remote_engine_id"], params["tp_size"], params["remote_num_tokens"],
            params["block_size"], params["remote_prefill_cached_tokens"]) == \
        (p.config.kv_transfer.engine_id, 1, 40, BS, 0)
    assert params["kv_fingerprint"]["num_layers"] == 30 and params["lease_expires_in_s"] == 30
    assert free(p) == usable(p) - 3 and p.has_transfers() and not p.has_unfinished_requests()
    assert p_stats.last.held_requests == 1

    sp = SamplingParams(max_tokens=5, temperature=0,
                        extra_args={"kv_transfer_params": params})
    d.add_request(d.make_request("d1", PROMPT, sp))
    step(d, stats=d_stats)
    req = d.scheduler.requests["d1"]
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and req.num_computed_tokens == 0
    assert d.kv_cache_manager.get_block_ids("d1") == [1, 2, 3]
    assert stored_blocks(d) == 0                        # nothing cached until loaded
    assert d_stats.last.loading_requests == 1
    assert (d_stats.total.external_prefix_cache_queries,
            d_stats.total.external_prefix_cache_hits) == (40, 40)
    outs: dict[str, list[EngineCoreOutput]] = {}
    run_until(d, lambda: outs.get("d1") and outs["d1"][-1].finished, stats=d_stats, outputs=outs)
    tokens = [t for o in outs["d1"] for t in o.new_token_ids]
    assert tokens == aggregated(PROMPT, 5)
    assert tokens[0] == p_token                         # P's discarded token is D's first
    assert outs["d1"][0].num_cached_tokens == 0         # nothing hit; the load is not a hit
    assert stored_blocks(d) == 2
    assert d_stats.total.transfers_received == 1
    assert d_stats.total.bytes_received == 3 * BLOCK_BYTES   # tokens 0..38 live in 3 blocks
    assert len(d_stats.total.transfer_seconds) == 1 and d_stats.total.failures == {}
    assert free(d) == usable(d)

    settle(p, stats=p_stats)
    assert free(p) == usable(p)                         # back to its count before the request
    assert (p_stats.total.transfers_sent, p_stats.total.bytes_sent) == (1, 3 * BLOCK_BYTES)
    assert p_stats.total.expired_requests == 0
    _, again = generate(p, "p2", PROMPT, 1)
    assert again.num_cached_tokens == 32                # P's prefix cache still has the prompt


def test_usage_on_d_counts_p_s_prefix_hit_and_its_own_never_the_transferred(engines):
    p, d = engines(), engines(caching=False)
    generate(p, "warm", PROMPT, 1)                      # P caches the prompt's 2 full blocks
    params = prefill(p, "p1", PROMPT)
    assert params["remote_prefill_cached_tokens"] == 32
    _, last = generate(d, "d1", PROMPT, 3, params)
    assert last.num_cached_tokens == 32


def test_a_second_request_reads_only_the_blocks_d_lacks(engines):
    p, d = engines(), engines()
    first = PROMPT + list(range(400, 408))              # 48 tokens: 3 full blocks
    generate(d, "d0", first, 2, prefill(p, "p0", first))
    settle(p)
    second = first[:32] + list(range(500, 516))         # shares 2 blocks with the first
    params = prefill(p, "p1", second)
    assert params["remote_prefill_cached_tokens"] == 32
    stats = Stats()
    tokens, last = generate(d, "d1", second, 3, params, stats)
    # D hits its 2 cached blocks and reads only P's third block (tokens 32..46)
    assert stats.total.bytes_received == BLOCK_BYTES
    assert last.num_cached_tokens == 32 and tokens == aggregated(second, 3)
    settle(p)
    assert free(p) == usable(p) and free(d) == usable(d)


@pytest.mark.parametrize("prompt", [PROMPT[:33], PROMPT[:1]], ids=["33-tokens", "1-token"])
def test_a_full_local_hit_reads_nothing_and_still_frees_p(engines, prompt):
    p, d = engines(), engines()
    if len(prompt) > 1:
        generate(d, "warm", prompt, 1)                  # D caches the 2 full blocks
    params = prefill(p, "p1", prompt)
    p_stats, d_stats = Stats(), Stats()
    tokens, last = generate(d, "d1", prompt, 3, params, d_stats)
    assert tokens == aggregated(prompt, 3)
    assert (d_stats.total.transfers_received, d_stats.total.bytes_received) == (0, 0)
    assert last.num_cached_tokens == len(prompt) - 1
    settle(p, stats=p_stats)                           # Done with zero blocks freed it
    assert p_stats.total.transfers_sent == 0 and p_stats.total.expired_requests == 0
    assert free(p) == usable(p) and free(d) == usable(d)


# --- leases -------------------------------------------------------------------------------------
def test_an_unread_lease_expires_on_an_idle_p(engines, caplog):
    clock = FakeClock()
    p = engines(clock=clock)
    stats = Stats()
    prefill(p, "p1", PROMPT, stats)
    step(p, stats=stats)
    assert not p.has_work() and p.has_transfers() and free(p) == usable(p) - 3
    clock.t += 29.9
    assert not p.has_work()
    clock.t += 0.2
    assert p.has_work()                                 # an idle loop wakes for the expiry
    with caplog.at_level(logging.WARNING, "kvloop.kv_transfer"):
        settle(p, stats=stats)
    assert stats.total.expired_requests == 1 and stats.last.held_requests == 0
    assert free(p) == usable(p)
    assert "Releasing expired KV blocks for request p1" in caplog.text


def test_heartbeats_keep_a_lease_past_its_duration(engines):
    lease = 0.6
    p = engines(kv_lease_duration=lease)
    d = engines(kv_lease_duration=lease)
    params = prefill(p, "p1", PROMPT)
    sp = SamplingParams(max_tokens=2, temperature=0, extra_args={"kv_transfer_params": params})
    d.add_request(d.make_request("d1", PROMPT, sp))     # heartbeats start now (not stepped)
    deadline = time.monotonic() + 2.5 * lease
    while time.monotonic() < deadline:
        step(p)
        assert p.connector.leases.num_held() == 1, "the lease expired despite heartbeats"
    stats = Stats()
    run_until(d, lambda: not d.has_unfinished_requests(), stats=stats)
    assert stats.total.transfers_received == 1 and stats.total.failures == {}
    settle(p)
    assert free(p) == usable(p)


def test_without_heartbeats_the_same_lease_expires(engines):
    p = engines(kv_lease_duration=0.3)
    stats = Stats()
    prefill(p, "p1", PROMPT, stats)
    run_until(p, lambda: stats.total.expired_requests == 1, timeout=3, stats=stats)
    assert free(p) == usable(p)


# --- aborts -------------------------------------------------------------------------------------
def test_an_abort_while_loading_frees_p_at_once_and_d_when_the_transfer_ends(engines):
    p = engines()
    d = engines(sim_bandwidth=3 * BLOCK_BYTES / 2.0)    # this load takes 2 s
    params = prefill(p, "p1", PROMPT)
    sp = SamplingParams(max_tokens=2, temperature=0, extra_args={"kv_transfer_params": params})
    d.add_request(d.make_request("d1", PROMPT, sp))
    step(d)                                             # admitted: the load starts
    p_stats = Stats()
    run_until(p, lambda: p_stats.total.transfers_sent == 1, stats=p_stats, what="P's Read")
    t0 = time.monotonic()
    d.abort_requests(["d1"])
    step(d)
    assert d.scheduler.requests["d1"].status == RequestStatus.FINISHED_ABORTED
    assert free(d) == usable(d) - 3                     # held: the transfer may still write
    settle(p)                                           # the Done came with the abort
    assert free(p) == usable(p) and time.monotonic() - t0 < 1.6   # before the load ends
    assert free(d) == usable(d) - 3
    run_until(d, lambda: "d1" not in d.scheduler.requests, what="D's blocks back")
    assert free(d) == usable(d) and time.monotonic() - t0 >= 1.0   # not at the abort


def test_an_abort_before_d_schedules_tells_p_to_free(engines):
    p, d = engines(), engines()
    params = prefill(p, "p1", PROMPT)
    sp = SamplingParams(max_tokens=2, extra_args={"kv_transfer_params": params})
    d.add_request(d.make_request("d1", PROMPT, sp))
    d.abort_requests(["d1"])
    step(d)
    settle(p)
    assert free(p) == usable(p) and free(d) == usable(d)


def test_late_reports_for_requests_that_are_gone_are_ignored(engines):
    d = engines()
    outputs = d.scheduler._update_from_kv_xfer_finished(
        KVConnectorOutput(finished_sending={"gone"}, finished_recving={"gone-too"},
                          invalid_block_ids={3}, failed_recving={"gone-too": "late"}))
    assert outputs == []
    d.scheduler.check_invariants()


# --- failures -----------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_p_gone_before_the_pull(engines, policy):
    p = engines()
    d = engines(kv=kv_config(policy=policy, transfer_timeout=0.5))
    params = prefill(p, "p1", PROMPT)
    p.shutdown()                                        # its side channel closes
    stats = Stats()
    tokens, last = generate(d, "d1", PROMPT, 4, params, stats)
    assert stats.total.failures == {"unreachable": 1}
    if policy == "fail":
        assert tokens == [] and last.finish_reason == "error"
        assert "unreachable" in last.error and "within 0.5 s" in last.error
    else:
        assert tokens == aggregated(PROMPT, 4) and last.finish_reason == "length"
        assert last.num_cached_tokens == 0
    assert free(d) == usable(d) and not d.has_transfers()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_fingerprint_mismatch_is_refused_with_both_sides_named(engines, policy, caplog):
    p = engines(store=SimKVBlockStore(BS, model_name="another-model"))
    d = engines(kv=kv_config(policy=policy))
    params = prefill(p, "p1", PROMPT)
    stats = Stats()
    with caplog.at_level(logging.WARNING):
        tokens, last = generate(d, "d1", PROMPT, 2, params, stats)
    assert stats.total.failures == {"mismatch": 1}
    assert "kv_fingerprint: P has" in caplog.text and "another-model" in caplog.text
    assert ("model='sim'" in caplog.text)
    if policy == "fail":
        assert last.finish_reason == "error" and "mismatch" in last.error
    else:
        assert tokens == aggregated(PROMPT, 2)
    settle(p)                                           # D gave up with a Done
    assert free(p) == usable(p) and free(d) == usable(d)


def test_a_block_size_mismatch_is_refused(engines):
    p, d = engines(), engines()
    params = dict(prefill(p, "p1", PROMPT), block_size=32)
    tokens, last = generate(d, "d1", PROMPT, 2, params)
    assert last.finish_reason == "error" and "block_size: P has 32, D has 16" in last.error
    settle(p)
    assert free(p) == usable(p) and free(d) == usable(d)


def test_a_read_of_blocks_p_does_not_hold_is_refused(engines):
    p, d = engines(), engines()
    params = prefill(p, "p1", PROMPT)
    stats = Stats()
    tampered = dict(params, remote_block_ids=[7, 8, 9])
    _, last = generate(d, "d1", PROMPT, 2, tampered, stats)
    assert stats.total.failures == {"refused": 1}
    assert last.finish_reason == "error" and "blocks [7, 8, 9] are not held" in last.error
    unknown = dict(params, remote_request_id="nobody")
    _, last = generate(d, "d2", PROMPT, 2, unknown)
    assert "'nobody' is not held here" in last.error
    settle(p)                                           # the Done for p1 came with d1's failure
    assert free(p) == usable(p) and free(d) == usable(d)


def test_invalid_params_prefill_locally(engines, caplog):
    d = engines()
    with caplog.at_level(logging.WARNING):
        tokens, last = generate(d, "d1", PROMPT, 3, {"do_remote_prefill": True,
                                                     "remote_host": "127.0.0.1"})
    assert "invalid kv_transfer_params: missing remote_engine_id" in caplog.text
    assert tokens == aggregated(PROMPT, 3) and last.finish_reason == "length"


class FakePrefill:
    """A P that speaks the protocol but answers Reads as the test says (a faulty peer of the
    fleet: it holds the secret's CURVE keys)."""

    def __init__(self, ctx: zmq.Context, reply: Callable[[Read], list[bytes]]):
        keys = SECRET.curve_keys(PURPOSE_KV_SIDE_CHANNEL)
        self.auth = curve_authenticator(ctx, [keys])
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        keys.make_server(self.sock)
        self.sock.bind("tcp://127.0.0.1:*")
        self.port = int(self.sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self.reply = reply
        self.dones: list[str] = []
        store = SimKVBlockStore(BS)
        self.meta = MetaReply(engine_id="fake-p", kv_fingerprint=store.fingerprint,
                              block_size=BS, block_nbytes=store.block_nbytes,
                              version=PROTOCOL_VERSION, host_id=host_id())

    def serve_once(self) -> None:
        if not self.sock.poll(0):
            return
        identity, payload = self.sock.recv_multipart()
        msg = decode_request(payload)
        if isinstance(msg, Meta):
            self.sock.send_multipart([identity, encode(self.meta)])
        elif isinstance(msg, Read):
            self.sock.send_multipart([identity, *self.reply(msg)])
        elif isinstance(msg, Done):
            self.dones.append(msg.remote_request_id)

    def params(self) -> dict[str, Any]:
        return {"do_remote_prefill": True, "remote_engine_id": "fake-p",
                "remote_request_id": "r", "remote_block_ids": [5, 6, 7],
                "remote_host": "127.0.0.1", "remote_port": self.port, "block_size": BS}


@pytest.mark.parametrize("answer", ["fewer-bytes", "other-blocks", "not-a-reply"])
def test_a_truncated_or_garbled_read_fails_the_load(engines, answer):
    ctx = zmq.Context()
    replies = {
        "fewer-bytes": lambda r: [encode(ReadReply(status=READ_OK, block_ids=r.block_ids,
                                                   nbytes=BLOCK_BYTES))],
        "other-blocks": lambda r: [encode(ReadReply(status=READ_OK, block_ids=[1, 2],
                                                    nbytes=2 * BLOCK_BYTES))],
        "not-a-reply": lambda r: [b"\x00garbage"],
    }
    fake = FakePrefill(ctx, replies[answer])
    try:
        d = engines()
        sp = SamplingParams(max_tokens=2, extra_args={"kv_transfer_params": fake.params()})
        d.add_request(d.make_request("d1", PROMPT, sp))
        outs: dict[str, list[EngineCoreOutput]] = {}
        stats = Stats()

        def finished() -> bool:
            fake.serve_once()
            return bool(outs.get("d1")) and outs["d1"][-1].finished

        run_until(d, finished, outputs=outs, stats=stats)
        last = outs["d1"][-1]
        reason = "error" if answer == "not-a-reply" else "truncated"
        assert last.finish_reason == "error" and stats.total.failures == {reason: 1}
        wait_until(lambda: fake.serve_once() or fake.dones == ["r"], what="D's Done")
        assert free(d) == usable(d)
    finally:
        fake.sock.close()
        fake.auth.stop()
        ctx.destroy(linger=0)


def test_roles_refuse_the_other_leg(engines, caplog):
    consumer = engines(kv=kv_config(role="kv_consumer"))
    _, last = generate(consumer, "c1", PROMPT, 1, dict(PREFILL))
    assert last.kv_transfer_params is None and free(consumer) == usable(consumer)
    assert consumer.connector.info.side_channel_port == 0   # a consumer binds nothing
    producer = engines(kv=kv_config(role="kv_producer"))
    params = prefill(engines(), "p1", PROMPT)
    with caplog.at_level(logging.WARNING):
        tokens, _ = generate(producer, "d1", PROMPT, 2, params)
    assert "this worker is a kv_producer" in caplog.text and tokens == aggregated(PROMPT, 2)


def test_p_emits_params_only_for_a_length_or_stop_finish_holding_blocks(engines):
    p = engines()
    sp = SamplingParams(max_tokens=50, extra_args={"kv_transfer_params": dict(PREFILL)})
    p.add_request(p.make_request("a", PROMPT, sp))
    step(p)
    p.abort_requests(["a"])
    step(p)
    assert not p.has_transfers() and free(p) == usable(p)
    _, last = generate(p, "plain", PROMPT, 1)           # no params: nothing held
    assert last.kv_transfer_params is None and not p.has_transfers()


def test_the_facts_and_messages_round_trip():
    info = sim_engine()
    try:
        facts = info.connector.info
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(facts), type=type(facts)) == facts
        assert facts.kv_role == "kv_both" and facts.transport == "auto"
    finally:
        info.shutdown()
