"""The router's P/D half without HTTP: the estimated-TTFT cost model, the decisions, the legs'
bodies, fallbacks, and the alarms of a wrongly wired P/D fleet."""

from __future__ import annotations

import msgspec
import pytest

from kvloop.front.prometheus_text import metric_value
from kvloop.router.config import IndexConfig, LivenessConfig, PDConfig, RouterConfig
from kvloop.router.pd import (
    ALWAYS,
    CLIENT_PARAMS,
    DECODE_CANNOT_LOAD,
    LOCAL_CHEAPER,
    MULTIPLE_PROMPTS,
    NEVER,
    NO_KV_TRANSFER_PARAMS,
    NO_PREFILL_WORKER,
    REMOTE_CHEAPER,
    PDWorker,
    TransferModel,
    decide,
    estimate,
    fingerprint_bytes_per_token,
    local_reason,
    prefill_seconds,
)
from kvloop.router.pd_proxy import PREFILL_PARAMS, answer_params, prefill_body
from kvloop.router.registry import (
    NO_KV_CONNECTOR,
    NO_STORED_BLOCKS,
    PREFILL_FAILING,
    WRONG_EVENT_SOURCE,
    LoadSnapshot,
    WorkerSpec,
)
from kvloop.router.router import Router
from kvloop.sim.latency import LatencyModel, StepFeatures
from kvloop.wire import KVTransferInfo

from .conftest import FakeClock
from .test_router_core import BS, FakeSub, desc, stored

MODEL = LatencyModel.from_file()          # the sim's fitted SmolLM2 CPU coefficients
TRANSFER = TransferModel(1.25e9, 46080.0)
BUDGET = 512                              # max_num_batched_tokens of desc()
BUSY = (1000,) * 16                       # a decode worker running 16 requests of 1000 tokens


def _steps_by_hand(model: LatencyModel, new: int, cached: int, budget: int,
                   decoding: tuple[int, ...]) -> float:
    """The same prefill, one simulated step at a time (what a simulated worker would run)."""
    chunk, done, total = budget - len(decoding), 0, 0.0
    while done < new:
        k = min(chunk, new - done)
        done += k
        total += model.features_time(StepFeatures(
            k + len(decoding), 1 + len(decoding), cached + done + sum(decoding) + len(decoding)))
    return total


@pytest.mark.parametrize("new,cached,decoding", [(1, 0, ()), (511, 0, ()), (512, 0, ()),
                                                 (2000, 64, ()), (2000, 0, BUSY),
                                                 (37, 900, (5, 9))])
def test_prefill_time_is_the_simulated_steps_summed(new, cached, decoding):
    for model in (MODEL, LatencyModel(0.02, 7e-4, 4e-5, 5e-6, speedup=8)):
        assert prefill_seconds(model, new, cached, BUDGET, decoding) == pytest.approx(
            _steps_by_hand(model, new, cached, BUDGET, decoding), rel=1e-12)
    assert prefill_seconds(MODEL, 0, 100, BUDGET, BUSY) == 0.0


def _est(prompt: int, d: PDWorker | None = None, p: PDWorker | None = None):
    return estimate(MODEL, TRANSFER, d or PDWorker("d", BUDGET), p or PDWorker("p", BUDGET),
                    prompt, BS)


def test_the_cost_model_keeps_short_prompts_local_and_sends_long_ones_remote():
    busy = PDWorker("d", BUDGET, decoding_contexts=BUSY, active=16)
    short, long_ = _est(64, busy), _est(2000, busy)
    assert decide("cost", short).reason == LOCAL_CHEAPER and not decide("cost", short).remote
    assert decide("cost", long_).reason == REMOTE_CHEAPER and decide("cost", long_).remote
    # the transfer is priced: 125 blocks of 16 tokens of 46080 bytes at 1.25 GB/s
    assert long_.transfer_s == pytest.approx(125 * 16 * 46080 / 1.25e9)
    # ... only the blocks D reads: not a last block with only the last token, nor D's hit
    for n, d_hit, blocks in ((17, 0, 1), (16, 0, 1), (1, 0, 0), (33, 16, 1), (33, 32, 0)):
        got = _est(n, PDWorker("d", BUDGET, cached_tokens=d_hit)).transfer_s
        assert got == pytest.approx(blocks * 16 * 46080 / 1.25e9), (n, d_hit)
    # an idle decode worker prefills a long prompt as fast as P, without the transfer
    assert decide("cost", _est(2000)).reason == LOCAL_CHEAPER
    # ... unless P holds the prompt's prefix: then the remote prefill is cheap
    cached_on_p = _est(2000, p=PDWorker("p", BUDGET, cached_tokens=1984))
    assert decide("cost", cached_on_p).remote
    assert cached_on_p.remote_s < 0.2 * cached_on_p.local_s
    # a prefill worker with a long queue loses even against a busy decode worker
    queued = _est(2000, busy, PDWorker("p", BUDGET, queued_prefill_tokens=20000))
    assert decide("cost", queued).reason == LOCAL_CHEAPER
    # compute times scale with the speedup, the transfer does not: a fast simulated fleet
    # prefills locally what a slow one would send
    fast = LatencyModel.from_file(speedup=40)
    assert not decide("cost", estimate(fast, TRANSFER, busy, PDWorker("p", BUDGET), 2000,
                                       BS)).remote


def test_policies_always_and_never_and_no_prefill_worker():
    e = _est(64)
    assert (decide("always", e).remote, decide("always", e).reason) == (True, ALWAYS)
    assert (decide("never", e).remote, decide("never", e).reason) == (False, NEVER)
    assert decide("never", None).reason == NEVER
    assert (decide("cost", None).remote, decide("cost", None).reason) == (False,
                                                                          NO_PREFILL_WORKER)


def test_kv_bytes_per_token_from_a_fingerprint():
    fp = {"model": "m", "dtype": "float32", "num_layers": 30, "num_kv_heads": 3,
          "head_dim": 64, "layout": "NHD"}
    assert fingerprint_bytes_per_token(fp) == 46080.0
    assert fingerprint_bytes_per_token({**fp, "dtype": "torch.bfloat16"}) == 23040.0
    for bad in (None, [], {**fp, "dtype": "complex"}, {**fp, "num_layers": 0}):
        assert fingerprint_bytes_per_token(bad) is None


# --- the legs' bodies (docs/disaggregation.md section 2) -----------------------------------
def test_the_prefill_leg_body_is_the_contracts():
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 50, "min_tokens": 5,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
            "min_completion_tokens": 2}
    assert prefill_body(body, "/v1/completions") == {
        "model": "m", "prompt": [1, 2, 3], "max_tokens": 1, "min_tokens": 1, "stream": False,
        "temperature": 0, "kv_transfer_params": PREFILL_PARAMS}
    assert PREFILL_PARAMS == {"do_remote_decode": True, "do_remote_prefill": False,
                              "remote_engine_id": None, "remote_block_ids": None,
                              "remote_host": None, "remote_port": None}
    chat = prefill_body({"messages": [], "max_completion_tokens": 9}, "/v1/chat/completions")
    assert (chat["max_tokens"], chat["max_completion_tokens"], chat["stream"]) == (1, 1, False)
    assert body["max_tokens"] == 50 and body["stream"] is True   # the client's body is kept


def test_which_requests_cannot_take_a_remote_prefill():
    assert local_reason({"prompt": [1, 2]}) is None
    assert local_reason({"prompt": ["one"]}) is None
    assert local_reason({"prompt": "text", "n": 1}) is None
    for body in ({"prompt": "a", "n": 2}, {"prompt": "a", "best_of": 3},
                 {"prompt": ["a", "b"]}, {"prompt": [[1], [2]]}):
        assert local_reason(body) == MULTIPLE_PROMPTS, body
    assert local_reason({"prompt": "a", "kv_transfer_params": {"x": 1}}) == CLIENT_PARAMS


def test_a_prefill_answer_is_usable_only_with_what_the_decode_worker_needs():
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e",
              "remote_request_id": "r", "remote_block_ids": [3, 4], "remote_host": "h",
              "remote_port": 5, "tp_size": 1, "kv_fingerprint": {}}
    assert answer_params({"kv_transfer_params": params}) == (params, "")
    assert answer_params({"kv_transfer_params": None})[0] is None
    assert "no kv_transfer_params" in answer_params({"choices": []})[1]
    assert answer_params(None)[0] is None
    gone = {k: v for k, v in params.items() if k != "remote_host"}
    assert answer_params({"kv_transfer_params": {**gone, "remote_block_ids": []}})[1] == \
        "its kv_transfer_params lack remote_host, remote_block_ids"
    # issue 37, low: a fleet member's malformed port (or any field) is not passed on to D
    # (whose 400 the client would get): the request goes decode-only
    for change in ({"remote_port": "5"}, {"remote_port": 70_000}, {"block_size": -16},
                   {"remote_host": 7}, {"lease_expires_in_s": "soon"}):
        usable, why = answer_params({"kv_transfer_params": {**params, **change}})
        assert usable is None and why.startswith("its kv_transfer_params are malformed: "), why


# --- the router's decisions ----------------------------------------------------------------
KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}


def pd_desc(role, epoch: str, caching: bool | None = None, connector: bool = True):
    """A P/D worker's description: its KV connector; a decode worker caches nothing."""
    kv = KVTransferInfo(engine_id=f"engine-{epoch}", kv_role=KV_ROLE[role],
                        side_channel_host="127.0.0.1", side_channel_port=1, transport="tcp")
    return msgspec.structs.replace(
        desc(role=role, epoch=epoch), kv_transfer=kv if connector else None,
        enable_prefix_caching=role != "decode" if caching is None else caching)


def make_pd_router(policy: str = "cost", **liveness) -> tuple[Router, FakeClock,
                                                              dict[str, FakeSub]]:
    clock = FakeClock()
    subs: dict[str, FakeSub] = {}

    def factory(source, feed):
        subs[feed.worker] = FakeSub(source, feed)
        return subs[feed.worker]

    lv = LivenessConfig(**{"window_s": 5.0, **liveness})
    cfg = RouterConfig(liveness=lv, index=IndexConfig(provisional_ttl_s=1.0),
                       pd=PDConfig(policy=policy, failures_to_skip=2))
    r = Router(cfg, factory, clock)
    r.register(WorkerSpec("http://p:1", "prefill"), pd_desc("prefill", "ep"))
    r.register(WorkerSpec("http://d:1", "decode"), pd_desc("decode", "ed"))
    return r, clock, subs


def _busy(r: Router, name: str = "d:1", n: int = 16, prompt: int = 1000) -> None:
    """`n` requests decoding on `name`, as the router's tickets know them."""
    for _ in range(n):
        r.registry.first_token(r.registry.open_ticket(name, prompt, 0, 0, False))


def _decisions(r: Router) -> dict[tuple[str, str], float]:
    text = r.metrics.render().decode()
    return {(d, why): metric_value(text, "kvloop_router_pd_decisions_total", decision=d,
                                   reason=why)
            for d in ("remote", "local") for why in (REMOTE_CHEAPER, LOCAL_CHEAPER)}


def test_route_pd_decides_per_request_and_counts_each_decision():
    r, _, subs = make_pd_router()
    assert r.pd_mode()
    _busy(r)
    short = r.route_pd(list(range(64)))
    assert short.prefill is None and short.decision.reason == LOCAL_CHEAPER
    assert short.decode.worker.name == "d:1" and short.decode.ticket.uncached_tokens == 64
    long_ = r.route_pd(list(range(2000)))
    assert long_.decision.reason == REMOTE_CHEAPER and long_.prefill is not None
    assert long_.prefill.worker.name == "p:1" and long_.prefill.ticket.uncached_tokens == 2000
    # the decode leg recomputes one token and its reported hit is P's, not verified on D
    assert (long_.decode.ticket.uncached_tokens, long_.decode.ticket.verify) == (1, False)
    assert _decisions(r) == {("remote", REMOTE_CHEAPER): 1, ("local", LOCAL_CHEAPER): 1,
                             ("remote", LOCAL_CHEAPER): 0, ("local", REMOTE_CHEAPER): 0}
    # the prefill worker's index: its provisional entries for the prompt; none on D, which
    # caches nothing
    hashes = r.block_hashes(list(range(2000)))
    assert r.index.match(hashes, ["p:1", "d:1"]) == {"p:1": 2000 // BS}
    health = r.health()[1]
    assert health["pd"]["mode"] == "disaggregated"
    assert health["pd"]["decisions"] == {"remote/remote_cheaper": 1, "local/local_cheaper": 1}


def test_a_prompt_cached_on_the_prefill_worker_goes_remote_even_to_an_idle_decoder():
    r, _, subs = make_pd_router()
    prompt = list(range(3000, 5000))
    cold = r.route_pd(prompt + [1])
    assert cold.prefill is None            # idle D, nothing cached: local is cheaper
    r.finish(cold.decode.ticket, 0)
    subs["p:1"].feed.on_batch(stored(prompt))  # P caches the prompt's 125 blocks
    warm = r.route_pd(prompt + [2])
    assert warm.decision.reason == REMOTE_CHEAPER and warm.prefill is not None
    assert warm.prefill.predicted_tokens == 2000
    assert warm.decision.estimate.remote_s < 0.2 * warm.decision.estimate.local_s


def test_prefill_worker_choice_follows_its_prefix_index():
    r, _, subs = make_pd_router()
    r.register(WorkerSpec("http://p:2", "prefill"), pd_desc("prefill", "ep2"))
    prompt = list(range(7000, 8024))
    subs["p:2"].feed.on_batch(stored(prompt))
    _busy(r)
    routed = r.route_pd(prompt + list(range(64)))
    assert routed.prefill is not None and routed.prefill.worker.name == "p:2"
    assert routed.prefill.predicted_tokens == 1024


def test_decode_worker_is_chosen_by_load():
    r, _, _ = make_pd_router("never")
    r.register(WorkerSpec("http://d:2", "decode"), pd_desc("decode", "ed2"))
    _busy(r, "d:1", 4)
    _busy(r, "d:2", 1)
    assert [r.route_pd([i] * 40).decode.worker.name for i in range(3)] == ["d:2"] * 3
    # 4 requests each now: the lower KV usage wins
    r.registry.set_load("d:1", LoadSnapshot(4, 0, 0.30))
    r.registry.set_load("d:2", LoadSnapshot(4, 0, 0.50))
    assert r.route_pd([7] * 40).decode.worker.name == "d:1"
    assert r.route_pd([9] * 40).decision.reason == NEVER


def test_a_sessions_next_turn_is_not_sent_away_by_the_poll_its_last_turn_left():
    """A poll taken while a turn ran counts it (1 running, its 4 of 100 blocks); once the
    router closes that turn, the snapshot less it is what decides: the next turn of the
    session goes back to its decoder, not to the other idle one."""
    r, clock, _ = make_pd_router("never")
    r.register(WorkerSpec("http://d:2", "decode"), pd_desc("decode", "ed2"))
    first = r.route_pd([1] * 64, session=42)
    home = first.decode.worker.name
    other = ({"d:1", "d:2"} - {home}).pop()
    clock.t += 0.1
    r.registry.set_load(home, LoadSnapshot(1, 0, 0.04, clock()))
    r.registry.set_load(other, LoadSnapshot(0, 0, 0.0, clock()))
    clock.t += 0.1
    late = r.route_pd([3] * 64)             # to the idle one, after its poll: never counted
    assert late.decode.worker.name == other
    r.finish(late.decode.ticket, 0)
    assert r.registry.get(other).finished_since_load == 0
    r.finish(first.decode.ticket, 0)
    state = r.registry.get(home)
    assert (state.load.running, state.load.kv_usage) == (1, 0.04)       # as polled
    assert (state.reported_load().running, state.reported_load().kv_usage) == (0, 0.0)
    for i in (5, 6):
        turn = r.route_pd([i] * 64, session=42)
        assert turn.decode.worker.name == home
        r.finish(turn.decode.ticket, 0)
    # the next poll is the worker's own word again
    r.registry.set_load(home, LoadSnapshot(2, 0, 0.08, clock()))
    assert r.registry.get(home).reported_load() == LoadSnapshot(2, 0, 0.08, clock())


def test_a_failed_prefill_leg_falls_back_is_counted_visible_and_then_skipped():
    r, clock, subs = make_pd_router("always")
    routed = r.route_pd(list(range(100)))
    assert routed.prefill is not None
    r.prefill_failed(routed, NO_KV_TRANSFER_PARAMS, "its answer has no kv_transfer_params")
    assert (routed.decode.ticket.uncached_tokens, routed.decode.ticket.verify) == (100, True)
    text = r.metrics.render().decode()
    assert metric_value(text, "kvloop_router_pd_fallbacks_total", worker="p:1",
                        reason=NO_KV_TRANSFER_PARAMS) == 1
    status, health = r.health()
    assert status == 200 and health["status"] == "degraded"
    assert any("prefill worker p:1: a prefill leg failed (no_kv_transfer_params" in x
               for x in health["reasons"])
    assert health["pd"]["fallbacks"] == {"p:1/no_kv_transfer_params": 1}
    # a second failure in a row (failures_to_skip=2): p:1 is left out of remote prefills
    r.prefill_failed(r.route_pd(list(range(100))), NO_KV_TRANSFER_PARAMS, "again")
    assert [a.kind for a in r.check_liveness()] == [PREFILL_FAILING]
    assert r.route_pd(list(range(100))).decision.reason == NO_PREFILL_WORKER
    # the window passes (p:1's events flow meanwhile): one more try; a success ends the streak
    subs["p:1"].feed.on_batch(stored(list(range(100))))
    clock.t += 6
    r.check_liveness()
    assert PREFILL_FAILING not in r.registry.get("p:1").alarms
    again = r.route_pd(list(range(100)))
    assert again.prefill is not None
    r.prefill_done(again, 0, {"kv_fingerprint": {"dtype": "bfloat16", "num_layers": 2,
                                                 "num_kv_heads": 1, "head_dim": 8}})
    assert r.registry.get("p:1").prefill_failures == 0
    assert r._transfer(r.registry.get("p:1")).bytes_per_token == 2 * 2 * 1 * 8 * 2
    assert r.health()[1]["status"] == "ok"   # the fallback is older than the window


def test_both_workers_keep_aggregated_routing():
    r, _, _ = make_pd_router()
    r.register(WorkerSpec("http://b:1", "both"), desc(epoch="eb"))
    assert not r.pd_mode() and r.route(list(range(64))).worker.name == "b:1"


# --- loud wiring -----------------------------------------------------------------------------
class EpochSub(FakeSub):
    """A subscription whose publisher names `epoch` (what a kvloop heartbeat carries)."""

    epoch: str | None = None

    def stats(self) -> dict:
        return {**super().stats(), "current_epoch": self.epoch}


def _epoch_router() -> tuple[Router, FakeClock, dict[str, EpochSub]]:
    clock = FakeClock()
    subs: dict[str, EpochSub] = {}

    def factory(source, feed):
        subs[feed.worker] = EpochSub(source, feed)
        return subs[feed.worker]

    r = Router(RouterConfig(liveness=LivenessConfig(window_s=5.0)), factory, clock)
    r.register(WorkerSpec("http://p:1", "prefill", events_endpoint="tcp://127.0.0.1:7"),
               pd_desc("prefill", "ep"))
    r.register(WorkerSpec("http://d:1", "decode"), pd_desc("decode", "ed", caching=True))
    return r, clock, subs


def test_events_of_another_worker_raise_an_alarm_naming_role_and_worker(caplog):
    r, clock, subs = _epoch_router()
    subs["d:1"].epoch = "ed"
    subs["p:1"].epoch = "ed"           # p:1 was pointed at d:1's event endpoint
    raised = r.check_liveness()
    assert [(a.worker, a.kind) for a in raised] == [("p:1", WRONG_EVENT_SOURCE)]
    msg = raised[0].message
    assert msg.startswith("worker p:1: wrong_event_source: prefill worker: the KV events it "
                          "is subscribed to are worker d:1's (role decode, epoch ed), not "
                          "its own (epoch ep)")
    assert "another worker's KV-event endpoint" in msg and msg in caplog.text
    p = r.registry.get("p:1")
    assert p.load_only and r.feed("p:1").refusing is not None
    subs["p:1"].feed.on_batch(stored(list(range(64))))
    assert r.index.worker_blocks("p:1") == 0        # d:1's blocks are not indexed as p:1's
    text = r.metrics.render().decode()
    assert metric_value(text, "kvloop_router_worker_alarm", worker="p:1",
                        alarm=WRONG_EVENT_SOURCE) == 1
    assert r.health()[1]["status"] == "degraded"


def test_an_unknown_publisher_epoch_counts_only_after_the_window():
    r, clock, subs = _epoch_router()
    subs["p:1"].epoch = "restarted"   # a restart the poller has not re-read yet
    assert r.check_liveness() == []
    clock.t += 6
    assert [a.kind for a in r.check_liveness()] == [WRONG_EVENT_SOURCE]
    assert "an unknown publisher's (epoch restarted)" in r.registry.get(
        "p:1").alarms[WRONG_EVENT_SOURCE].detail


def test_a_prefill_worker_whose_events_store_nothing_raises_an_alarm():
    r, clock, subs = _epoch_router()
    d_prompt = list(range(300, 364))
    subs["d:1"].feed.on_batch(stored(d_prompt))     # decode workers' events do arrive
    p_ticket = r.registry.open_ticket("p:1", 2000, 2000, 0, True)   # a prefill leg sent
    subs["p:1"].feed.on_heartbeat()                 # alive: heartbeats, never a BlockStored
    clock.t += 4
    assert r.check_liveness() == []
    clock.t += 2
    subs["p:1"].feed.on_heartbeat()
    raised = r.check_liveness()
    assert [(a.worker, a.kind) for a in raised] == [("p:1", NO_STORED_BLOCKS)]
    assert "BlockStored events arrive only from d:1 (not prefill workers)" in raised[0].detail
    assert "decode worker's, which stores nothing" in raised[0].message
    assert r.registry.get("p:1").load_only
    r.finish(p_ticket, 0)
    subs["p:1"].feed.on_batch(stored(list(range(2000))))
    r.check_liveness()
    assert NO_STORED_BLOCKS not in r.registry.get("p:1").alarms


def test_workers_without_the_connector_their_role_needs_are_named_and_avoided(caplog):
    r, _, _ = make_pd_router("always")
    r.register(WorkerSpec("http://p:2", "prefill"), pd_desc("prefill", "e2", connector=False))
    r.register(WorkerSpec("http://d:2", "decode"), msgspec.structs.replace(
        pd_desc("decode", "e3"), kv_transfer=msgspec.structs.replace(
            pd_desc("decode", "e3").kv_transfer, kv_role="kv_producer")))
    p2, d2 = r.registry.get("p:2"), r.registry.get("d:2")
    assert p2.alarms[NO_KV_CONNECTOR].message.startswith(
        "worker p:2: no_kv_connector: prefill worker with no KV connector; it needs one that "
        "holds blocks for a decode worker: no prefill leg goes to it")
    assert not d2.alarms    # it serves (prefilling locally): a warning, no alarm
    assert "worker d:2: decode worker with a kv_producer KV connector; it needs one that " \
           "loads blocks from a prefill worker" in caplog.text
    _busy(r, "d:1", 8)               # d:2 is the idle one: chosen, and it cannot load
    routed = r.route_pd(list(range(64)))
    assert routed.decode.worker.name == "d:2" and routed.decision.reason == DECODE_CANNOT_LOAD
    _busy(r, "d:2", 20)
    assert {r.route_pd([i] * 64).prefill.worker.name for i in range(4)} == {"p:1"}


def test_router_flags_make_the_pd_config():
    from kvloop.cli import build_parser
    from kvloop.router.cli_args import router_config

    args = build_parser().parse_args([
        "router", "--worker", "http://h:1,prefill", "--pd-policy", "always", "--pd-speedup",
        "40", "--pd-transfer-bandwidth", "2e9", "--pd-kv-bytes-per-token", "1024"])
    assert router_config(args).pd == PDConfig(policy="always", speedup=40.0,
                                              transfer_bandwidth=2e9, kv_bytes_per_token=1024)
    assert router_config(build_parser().parse_args(["router"])).pd == PDConfig()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--pd-policy", "sometimes"])
    for bad in (dict(speedup=0), dict(transfer_bandwidth=-1), dict(policy="x"),
                dict(failures_to_skip=0)):
        with pytest.raises(ValueError):
            PDConfig(**bad)
