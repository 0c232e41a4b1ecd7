"""The router without HTTP: registration, hashing, feeds, verification alarms, health."""

from __future__ import annotations

import logging
import re

import msgspec
import pytest

from kvloop.config import Role
from kvloop.core.hashing import block_hashes
from kvloop.events.types import (
    AllBlocksCleared,
    KVEventBatch,
    event_int,
)
from kvloop.router.config import HashSpec, IndexConfig, LivenessConfig, RouterConfig
from kvloop.router.feed import EventFeed
from kvloop.router.poller import parse_load
from kvloop.router.registry import (
    CONFIG_MISMATCH,
    NO_EVENT_SOURCE,
    PREDICTIONS_MISS,
    SILENT,
    UNPREDICTED_HITS,
    EventSource,
    WorkerDescription,
    WorkerSpec,
)
from kvloop.router.router import NoWorkerError, Router
from kvloop.router.scorer import COLD, PREFIX_HIT
from kvloop.router.sse import SseRelay as _SseRelay
from kvloop.wire import KVEventsInfo

from .conftest import FakeClock, block_removed, block_stored, event_batch, serving


class FakeSub:
    def __init__(self, source: EventSource, feed: EventFeed):
        self.source, self.feed = source, feed
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True

    def stats(self) -> dict:
        return {"events_received": self.feed.counters.batches, "heartbeats": 0, "gaps": 0}


BS = 16


def desc(seed: str = "s", epoch: str = "e1", events: str | None = "tcp://127.0.0.1:1",
         role: Role = "both", block_size: int = BS) -> WorkerDescription:
    """A kvloop worker's description: what its /kvloop/worker answers."""
    ev = None if events is None else KVEventsInfo(endpoint=events, replay_endpoint=None,
                                                  topic="", recency=False)
    return WorkerDescription(model="sim", served_model_names=["sim"], role=role,
                             block_size=block_size, hash_algo="sha256", hash_seed=seed,
                             enable_prefix_caching=True, num_gpu_blocks=101,
                             kv_capacity_blocks=100, max_model_len=1024,
                             max_num_batched_tokens=512, max_num_seqs=64, epoch=epoch,
                             kv_events=ev, version="test", api_key_required=False,
                             api_key_accepted=False)


def make_router(**liveness) -> tuple[Router, FakeClock, dict[str, FakeSub]]:
    clock = FakeClock()
    subs: dict[str, FakeSub] = {}

    def factory(source, feed):
        subs[feed.worker] = FakeSub(source, feed)
        return subs[feed.worker]

    lv = LivenessConfig(**{"window_s": 5.0, "verify_window": 8, "verify_min_samples": 4,
                           **liveness})
    cfg = RouterConfig(liveness=lv, index=IndexConfig(provisional_ttl_s=1.0))
    return Router(cfg, factory, clock), clock, subs


def stored(tokens: list[int], seed: str = "s", parent=None) -> KVEventBatch:
    hs = [event_int(h) for h in block_hashes(tokens, BS, "sha256", seed)]
    return event_batch(block_stored(*hs, parent=parent, block_size=BS, token_ids=tokens))


PROMPT_A = list(range(100, 164))          # 4 blocks
PROMPT_B = list(range(500, 548))          # 3 blocks


def test_worker_spec_parsing():
    s = WorkerSpec.parse("http://h:1/,prefill,events=tcp://h:2,replay=tcp://h:3")
    assert (s.url, s.role, s.events_endpoint, s.replay_endpoint, s.name) == (
        "http://h:1", "prefill", "tcp://h:2", "tcp://h:3", "h:1")
    with pytest.raises(ValueError, match="role"):
        WorkerSpec.parse("http://h:1,sideways")
    with pytest.raises(ValueError, match="URL"):
        WorkerSpec.parse("h:1")
    with pytest.raises(ValueError, match="unknown worker option"):
        WorkerSpec.parse("http://h:1,colour=red")


def test_a_description_is_decoded_strictly():
    """The router decodes /kvloop/worker into the server's own Struct: no synonyms, no
    guessing; a missing or mistyped field fails with its name."""
    good = msgspec.json.encode(desc())
    assert msgspec.json.decode(good, type=WorkerDescription) == desc()
    assert desc().hash_spec() == HashSpec(BS, "sha256", "s")
    body = msgspec.json.decode(good)
    cases = {"block_size": ("Object missing required field `block_size`", None),
             "hash_seed": ("Expected `str`, got `int` - at `$.hash_seed`", 0),
             "role": ("Invalid enum value 'sideways' - at `$.role`", "sideways"),
             "kv_events": ("Object missing required field `topic` - at `$.kv_events`",
                           {"endpoint": "tcp://a:1", "replay_endpoint": None,
                            "recency": False})}
    for field, (message, value) in cases.items():
        bad = {k: v for k, v in body.items() if k != field}
        if value is not None:
            bad[field] = value
        with pytest.raises(msgspec.ValidationError, match=re.escape(message)):
            msgspec.json.decode(msgspec.json.encode(bad), type=WorkerDescription)
    synonym = {("model_name" if k == "model" else k): v for k, v in body.items()}
    with pytest.raises(msgspec.ValidationError, match="missing required field `model`"):
        msgspec.json.decode(msgspec.json.encode(synonym), type=WorkerDescription)


@pytest.mark.processes
def test_capacity_is_the_usable_blocks_not_the_pool_with_its_null_block(tmp_path_factory):
    """/kvloop/worker says num_gpu_blocks (null block included, as vLLM) and
    kv_capacity_blocks (usable); the router must read the latter (it read one block high)."""
    import httpx

    with serving(tmp_path_factory, "capacity", ["--model", "sim",
                                                "--num-gpu-blocks-override", "64"]) as srv:
        info = httpx.get(srv.url + "/kvloop/worker", timeout=10).content
    d = msgspec.json.decode(info, type=WorkerDescription)
    assert (d.num_gpu_blocks, d.kv_capacity_blocks) == (64, 63)
    r, _, _ = make_router()
    r.register(WorkerSpec("http://w:1"), d)
    assert r._candidate(r.registry.get("w:1"), ()).capacity_blocks == 63   # what scoring reads


def test_events_feed_the_index_and_routing_follows_them():
    r, clock, subs = make_router()
    r.register(WorkerSpec("http://w:1"), desc())
    r.register(WorkerSpec("http://w:2"), desc())
    assert r.hash_spec is not None and r.hash_spec.seed == "s"
    subs["w:2"].feed.on_batch(stored(PROMPT_A))
    routed = r.route(PROMPT_A + [1, 2, 3])
    assert routed.worker.name == "w:2" and routed.decision.reason == PREFIX_HIT
    assert routed.predicted_tokens == 64 and routed.num_blocks == 4
    r.first_token(routed.ticket)
    r.finish(routed.ticket, 64, "ok")
    # a cold prompt goes to either; a sibling right after follows it (provisional entry)
    first = r.route(PROMPT_B + [9])
    assert first.decision.reason == COLD
    sibling = r.route(PROMPT_B + [8])
    assert sibling.worker.name == first.worker.name
    assert sibling.predicted_tokens == 48
    # once the guess expires unconfirmed, it is gone
    clock.t += 2.0
    assert r.index.match(r.block_hashes(PROMPT_B)) == {}


def test_removed_and_cleared_events():
    r, _, subs = make_router()
    r.register(WorkerSpec("http://w:1"), desc())
    feed = subs["w:1"].feed
    feed.on_batch(stored(PROMPT_A))
    hs = r.block_hashes(PROMPT_A)
    feed.on_batch(event_batch(block_removed(hs[2])))
    assert r.index.match(hs) == {"w:1": 2}
    feed.on_batch(event_batch(AllBlocksCleared()))
    assert r.index.num_blocks() == 0
    feed.on_batch(stored(PROMPT_A))
    feed.on_clear("epoch changed")
    assert r.index.num_blocks() == 0


def test_seed_mismatch_at_registration_is_refused_loudly(caplog):
    r, _, subs = make_router()
    r.register(WorkerSpec("http://w:1"), desc())
    with caplog.at_level(logging.WARNING, logger="kvloop.router"):
        warnings = r.register(WorkerSpec("http://w:2"), desc(seed="other"))
    assert warnings and "hash seed" in warnings[0]
    w2 = r.registry.get("w:2")
    assert CONFIG_MISMATCH in w2.alarms and w2.load_only
    assert any("w:2" in m and "hash seed" in m for m in caplog.messages)
    subs["w:2"].feed.on_batch(stored(PROMPT_A, seed="other"))
    assert r.index.worker_blocks("w:2") == 0          # its events are refused
    status, body = r.health()
    assert status == 200 and body["status"] == "degraded"
    assert any("w:2" in reason for reason in body["reasons"])
    assert 'kvloop_router_worker_alarm{alarm="config_mismatch",worker="w:2"} 1.0' in \
        r.metrics.render().decode()


def test_undisclosed_seed_mismatch_is_caught_from_the_first_root_block():
    r, _, subs = make_router()
    r.register(WorkerSpec("http://w:1"), desc())
    r.register(WorkerSpec("http://w:2", events_endpoint="tcp://x:1"), None)  # not kvloop
    subs["w:2"].feed.on_batch(stored(PROMPT_A, seed="secret"))
    w2 = r.registry.get("w:2")
    assert CONFIG_MISMATCH in w2.alarms
    assert "hash seed or algorithm" in w2.alarms[CONFIG_MISMATCH].detail
    assert r.index.worker_blocks("w:2") == 0
    # a block-size mismatch is named as such
    r.register(WorkerSpec("http://w:3", events_endpoint="tcp://x:2"), None)
    ev = stored(PROMPT_A)
    ev.events[0].block_size = 32
    subs["w:3"].feed.on_batch(ev)
    assert "block size 32" in r.registry.get("w:3").alarms[CONFIG_MISMATCH].detail


def test_role_mismatch_and_missing_event_source():
    r, _, _ = make_router()
    r.register(WorkerSpec("http://w:1", role="both"), desc(role="prefill"))
    r.register(WorkerSpec("http://w:2"), desc(events=None))
    assert "role 'prefill'" in r.registry.get("w:1").alarms[CONFIG_MISMATCH].detail
    assert NO_EVENT_SOURCE in r.registry.get("w:2").alarms


def test_silent_worker_alarm_raises_after_the_window_and_clears_on_events():
    r, clock, subs = make_router()
    r.register(WorkerSpec("http://w:1"), desc())
    r.check_liveness()
    routed = r.route(PROMPT_A)
    r.finish(routed.ticket, 0, "ok")
    clock.t += 4.0
    assert r.check_liveness() == []
    clock.t += 2.0
    raised = r.check_liveness()
    assert [a.kind for a in raised] == [SILENT]
    assert "wrong --kv-events-endpoint" in raised[0].message
    assert r.registry.get("w:1").load_only
    subs["w:1"].feed.on_batch(stored(PROMPT_A))
    r.check_liveness()
    assert SILENT not in r.registry.get("w:1").alarms


def test_idle_worker_is_never_silent():
    r, clock, _ = make_router()
    r.register(WorkerSpec("http://w:1"), desc())
    clock.t += 60
    assert r.check_liveness() == []


def _serve(r: Router, prompt: list[int], actual: int) -> None:
    routed = r.route(prompt)
    r.first_token(routed.ticket)
    r.finish(routed.ticket, actual, "ok")


def test_unpredicted_hits_raise_an_alarm():
    r, clock, subs = make_router()
    r.register(WorkerSpec("http://w:1"), desc())
    for i in range(4):
        clock.t += 5  # provisional guesses expire between requests
        subs["w:1"].feed.on_heartbeat()  # alive, but its blocks never reach the index
        _serve(r, [i] + PROMPT_A, actual=64)
    assert [a.kind for a in r.check_liveness()] == [UNPREDICTED_HITS]


def test_predictions_that_keep_missing_raise_an_alarm():
    r, _, subs = make_router()
    r.register(WorkerSpec("http://w:1"), desc())
    subs["w:1"].feed.on_batch(stored(PROMPT_A))
    for _ in range(3):
        _serve(r, PROMPT_A + [1], actual=0)
    assert r.check_liveness() == []        # 3 samples: below the minimum
    _serve(r, PROMPT_A + [1], actual=0)
    assert [a.kind for a in r.check_liveness()] == [PREDICTIONS_MISS]
    for _ in range(8):
        _serve(r, PROMPT_A + [1], actual=64)
    r.check_liveness()
    assert not r.registry.get("w:1").alarms


def test_serving_pool_prefers_both_then_decode_then_prefill():
    r, _, _ = make_router()
    r.register(WorkerSpec("http://p:1", role="prefill"), desc(role="prefill"))
    assert r.route(PROMPT_A).worker.name == "p:1"
    r.register(WorkerSpec("http://d:1", role="decode"), desc(role="decode"))
    assert {r.route([i] + PROMPT_A).worker.name for i in range(4)} == {"d:1"}
    r.register(WorkerSpec("http://b:1", role="both"), desc(role="both"))
    assert {r.route([i] + PROMPT_B).worker.name for i in range(4)} == {"b:1"}
    r.worker_down("b:1", "gone")
    assert r.route(PROMPT_B).worker.name == "d:1"


def test_worker_down_drops_entries_and_no_worker_is_a_clear_error():
    r, _, subs = make_router()
    r.register(WorkerSpec("http://w:1"), desc())
    subs["w:1"].feed.on_batch(stored(PROMPT_A))
    r.worker_down("w:1", "connection refused")
    assert subs["w:1"].stopped and r.index.num_blocks() == 0
    with pytest.raises(NoWorkerError, match="w:1 \\(connection refused\\)"):
        r.route(PROMPT_A)
    assert r.health()[0] == 503
    r.register(WorkerSpec("http://w:1"), desc(epoch="e2"))   # back, new epoch
    assert r.route(PROMPT_A).worker.name == "w:1"
    assert r.deregister("w:1") and not r.deregister("w:1")


def test_sse_relay_strips_only_the_injected_usage_chunk():
    usage = (b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":5,'
             b'"prompt_tokens_details":{"cached_tokens":32}}}\n\n')
    token = b'data: {"id":"x","choices":[{"text":"a"}],"usage":null}\n\n'
    done = b"data: [DONE]\n\n"
    stream = token + usage + done
    relay = _SseRelay(strip_usage=True)
    out = b"".join(relay.feed(stream[i:i + 7]) for i in range(0, len(stream), 7))
    assert out + relay.flush() == token + done
    assert relay.cached_tokens == 32 and relay.started
    keep = _SseRelay(strip_usage=False)
    assert keep.feed(stream) == stream


def test_parse_load_sums_engines():
    text = ('# HELP x\nvllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
            'vllm:num_requests_waiting{engine="0"} 4.0\nvllm:kv_cache_usage_perc 0.25\n')
    load = parse_load(text, 3.0)
    assert (load.running, load.waiting, load.kv_usage, load.at) == (3, 4, 0.25, 3.0)


def test_a_stopped_feed_never_clears_its_successor():
    r, _, subs = make_router()
    r.register(WorkerSpec("http://w:1"), desc(epoch="e1"))
    old = subs["w:1"].feed
    r.register(WorkerSpec("http://w:1"), desc(epoch="e2"))      # restarted: a new feed
    assert old is not subs["w:1"].feed and old.refusing == "stopped"
    subs["w:1"].feed.on_batch(stored(PROMPT_A))
    old.on_clear("late reset from the old subscriber")
    old.on_batch(stored(PROMPT_B))
    assert r.index.match(r.block_hashes(PROMPT_A)) == {"w:1": 4}
    assert r.index.match(r.block_hashes(PROMPT_B)) == {}


def test_fleet_hashing_learned_late_revives_earlier_feeds():
    r, _, subs = make_router()
    r.register(WorkerSpec("http://w:1", events_endpoint="tcp://x:1"), None)
    assert subs["w:1"].feed.refusing is not None          # nothing to hash with yet
    r.register(WorkerSpec("http://w:2"), desc())
    subs["w:1"].feed.on_batch(stored(PROMPT_A))
    assert r.index.match(r.block_hashes(PROMPT_A)) == {"w:1": 4}


def test_prompt_tokenizer_mirrors_the_server():
    from kvloop.front.byte_tokenizer import ByteTokenizer
    from kvloop.router.prompts import PromptTokenizer

    pt, tok = PromptTokenizer(), ByteTokenizer()
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "ab"},
                                                        {"type": "text", "text": "c"}]}]}
    expected = tok.encode(tok.apply_chat_template([{"role": "user", "content": "abc"}]))
    assert pt.token_ids("/v1/chat/completions", parts, "bytes") == expected
    assert pt.token_ids("/v1/completions", {"prompt": "hi"}, "bytes") == [104, 105]
    assert pt.token_ids("/v1/completions", {"prompt": [[1, 2], [3]]}, "bytes") == [1, 2]
    assert pt.token_ids("/v1/completions", {"prompt": ["hey", "x"]}, "bytes") == [104, 101, 121]
    # what the server refuses is routed by load, for the worker to answer
    for body in ({"prompt": 5}, {"prompt": []}, {"prompt": ""}):
        assert pt.token_ids("/v1/completions", body, "bytes") is None, body
    assert pt.token_ids("/v1/chat/completions", {"messages": [{"content": "x"}]}, "bytes") \
        is None
    # an unknown model: no local tokenizer, text routed by load (and said so once), token
    # ids still by prefix
    assert pt.token_ids("/v1/completions", {"prompt": "hi"}, "/no/such/model") is None
    assert pt.token_ids("/v1/completions", {"prompt": [5, 6]}, "/no/such/model") == [5, 6]
    assert pt.token_ids("/v1/chat/completions", parts, "/no/such/model") is None


def test_prompt_tokenizer_of_simulated_workers():
    """A `--model sim` worker reports the embedded GGUF as its model path; one that reports
    only its name `sim` speaks the embedded model's vocabulary too."""
    from kvloop.front.tokenizer import Tokenizer, find_model_path
    from kvloop.router.prompts import PromptTokenizer

    pt, smol = PromptTokenizer(), Tokenizer.from_model(None)
    msgs = [{"role": "user", "content": "hello there"}]
    chat = smol.encode(smol.apply_chat_template(msgs), add_special_tokens=False)
    for model in ("sim", find_model_path(None)):
        assert pt.token_ids("/v1/chat/completions", {"messages": msgs}, model) == chat
        assert pt.token_ids("/v1/completions", {"prompt": "hello there"}, model) == \
            smol.encode("hello there")
