"""The routing request (kvloop/router/request.py) and the filters and profiles that read it,
in-process: what the edge builds from a body and headers, what `continued` keeps and
changes, which workers each filter leaves, a P/D session's decode worker, and the SSE relay's
pass-through."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from kvloop.router import filters
from kvloop.router.config import RouterConfig
from kvloop.router.flow import FlowKey
from kvloop.router.pd import CLIENT_PARAMS
from kvloop.router.registry import PREFILL_FAILING, WorkerSpec
from kvloop.router.request import RoutingRequest, routing_request
from kvloop.router.router import PDRouted, Router
from kvloop.router.sessions import SESSION_HEADER, session_key
from kvloop.router.sse import SseRelay

from .conftest import FakeClock
from .test_router_core import BS, FakeSub, desc
from .test_router_pd import make_pd_router, pd_desc

PROMPT = list(range(100, 164))   # 4 blocks


def _router(n: int = 2) -> Router:
    r = Router(RouterConfig(), lambda source, feed: FakeSub(source, feed), FakeClock())
    for i in range(n):
        d = msgspec.structs.replace(desc(), lora_adapters=["ad"] if i == 0 else [])
        r.register(WorkerSpec(f"http://w{i}:1"), d)
    return r


def test_the_edge_builds_everything_a_decision_reads_once():
    r = _router()
    body = {"model": "ad", "prompt": "x", "max_tokens": 7, "stream": True, "cache_salt": "s",
            "n": 2}
    key = FlowKey(priority=3, tenant=9)
    rr = routing_request(r, "/v1/completions", body, {SESSION_HEADER: "conv"}, PROMPT, key,
                         exclude=["w1:1"], migration_limit=1)
    assert rr.tokens == tuple(PROMPT) and rr.block_size == BS
    assert rr.hashes == tuple(r.block_hashes(PROMPT, "s", "ad")) and len(rr.hashes) == 4
    assert rr.hashes != tuple(r.block_hashes(PROMPT, "s", None))   # the adapter's key is in
    assert (rr.adapter, rr.cache_salt, rr.expected_output_tokens) == ("ad", "s", 7)
    assert rr.session == session_key({SESSION_HEADER: "conv"}, {})
    assert rr.exclude == ("w1:1",) and rr.flow_key == key
    assert not rr.migratable   # n 2 never migrates
    assert rr.disaggregable and rr.local_reason == "multiple_prompts"
    one = routing_request(r, "/v1/completions", {**body, "n": 1}, {}, PROMPT,
                          migration_limit=1)
    assert one.migratable and one.local_reason is None and one.session is None
    assert not routing_request(r, "/v1/completions", {**body, "n": 1}, {}, PROMPT).migratable
    emb = routing_request(r, "/v1/embeddings", {"input": "x"}, {}, None, output_tokens=0)
    assert (emb.tokens, emb.hashes, emb.expected_output_tokens) == ((), (), 0)
    assert not emb.disaggregable and emb.adapter is None
    assert routing_request(r, "/v1/chat/completions", {"kv_transfer_params": {}}, {},
                           PROMPT).local_reason == CLIENT_PARAMS
    with pytest.raises(dataclasses.FrozenInstanceError):
        rr.adapter = None   # type: ignore[misc]


def test_continued_keeps_adapter_session_salt_and_flow_and_rehashes_new_tokens():
    r = _router()
    rr = routing_request(r, "/v1/completions", {"model": "ad", "cache_salt": "s"},
                         {SESSION_HEADER: "c"}, PROMPT, FlowKey(1, 2), exclude=["a"])
    longer = PROMPT + list(range(900, 940))
    c = rr.continued(longer, ["b", "a"], 5)
    assert c.tokens == tuple(longer) and c.hashes == tuple(r.block_hashes(longer, "s", "ad"))
    assert c.hashes[:4] == rr.hashes and len(c.hashes) == 6
    assert c.exclude == ("a", "b") and c.expected_output_tokens == 5
    assert (c.adapter, c.session, c.cache_salt, c.flow_key, c.path) == (
        rr.adapter, rr.session, rr.cache_salt, rr.flow_key, rr.path)
    same = rr.continued(exclude=["z"])
    assert same.tokens == rr.tokens and same.hashes == rr.hashes and same.exclude == ("a", "z")


def test_filters_each_leave_their_workers():
    r, _, _ = make_pd_router()
    r.register(WorkerSpec("http://p:2", "prefill"), pd_desc("prefill", "ep2"))
    rr = RoutingRequest("/v1/completions", (), (), BS, exclude=("p:2",))
    everyone = r.registry.all()
    names = lambda ws: [w.name for w in ws]   # noqa: E731
    assert names(filters.role("prefill")(everyone, rr)) == ["p:1", "p:2"]
    assert names(filters.not_excluded(everyone, rr)) == ["p:1", "d:1"]
    r.registry.mark_draining("d:1")
    assert names(filters.usable(everyone, rr)) == ["p:1", "p:2"]
    r.raise_alarm("p:1", PREFILL_FAILING, "test")
    assert names(filters.prefill_capable(everyone, rr)) == ["p:2"]
    assert filters.run((filters.role("prefill"), filters.not_excluded,
                        filters.prefill_capable), everyone, rr) == []
    holders = _router()
    ad = RoutingRequest("", (), (), BS, adapter="ad")
    assert names(filters.adapter_holders(holders.registry.all(), ad)) == ["w0:1"]
    nobody = dataclasses.replace(ad, adapter="other")   # nobody holds it: all answer for it
    assert names(filters.adapter_holders(holders.registry.all(), nobody)) == ["w0:1", "w1:1"]


def test_a_pd_session_keeps_its_decode_worker_while_loads_tie():
    r, _, _ = make_pd_router()
    r.register(WorkerSpec("http://d:2", "decode"), pd_desc("decode", "ed2"))
    s = session_key({SESSION_HEADER: "chat"}, {})
    firsts = {}
    for i in range(6):   # unrelated prompts: their own tie-breaks differ
        prompt = list(range(1000 * i, 1000 * i + 64))
        alone = r.pick(RoutingRequest("/v1/completions", tuple(prompt),
                                      tuple(r.block_hashes(prompt)), BS, disaggregable=True))
        assert isinstance(alone, PDRouted)
        r.abandon(alone)
        firsts[i] = alone.decode.worker.name
        routed = r.route_pd(prompt, session=s)
        r.abandon(routed)
        if i == 0:
            home = routed.decode.worker.name
        assert routed.decode.worker.name == home
    assert len(set(firsts.values())) == 2   # without the session they spread


def test_the_relay_passes_token_events_through_unparsed_once_started():
    relay = SseRelay(strip_usage=True)
    first = b'data: {"choices":[{"text":"a"}]}\n\n'
    assert relay.feed(first) == first and relay.started
    token = b'data: {"choices":[{"text":"b"}]}\n\n'
    assert relay.feed(token) is token   # the very object: nothing split or rebuilt
    usage = (b'data: {"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":2,'
             b'"prompt_tokens_details":{"cached_tokens":3}}}\n\n')
    assert relay.feed(usage[:20]) == b"" and relay.feed(usage[20:] + b"data: [DONE]\n\n") \
        == b"data: [DONE]\n\n"
    assert relay.cached_tokens == 3


def test_cpu_seconds_reads_a_process_cpu_time():
    import os
    import time

    from kvloop.bench.router_cpu import cpu_seconds, text_prompts

    before, t0 = cpu_seconds(os.getpid()), time.process_time()
    while time.process_time() - t0 < 0.2:   # burn 0.2 s of this process's CPU
        pass
    assert cpu_seconds(os.getpid()) - before >= 0.15
    prompts = text_prompts(9, 8, 80, seed=1)
    assert len(prompts) == 9 and prompts[0].split(" 0: ")[0] == prompts[8].split(" 8: ")[0]
