"""Speculative decoding without a model: the n-gram proposer on vLLM's vectors, the config's
defaults and errors, the scheduler's 1 + k and its rewind, drafts never cached nor hashed,
the counters, the engine's post-step proposer over the simulator (same output with and
without speculation, through chunked prefill and a preemption), and the metrics' shapes."""

from __future__ import annotations

import pytest

from kvloop.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from kvloop.core.engine import EngineCore
from kvloop.core.outputs import CachedRequestData, NewRequestData, RunnerOutput, SchedulerOutput
from kvloop.core.request import SamplingParams
from kvloop.core.scheduler import Scheduler
from kvloop.core.spec_decode import NgramProposer, propose_ngram
from kvloop.events.types import BlockStored
from kvloop.front.prometheus_text import metric_value
from kvloop.server.logs import spec_line
from kvloop.server.metrics import ServerMetrics
from kvloop.sim.runner import SimRunner
from kvloop.wire import SchedulerStats, SpecDecodingStats
from tests.core_helpers import HASHER, make_manager, make_request, run_step

# vLLM's own vectors (docs/vllm-facts.md#speculative-decoding): tokens, min_n, max_n, k, drafts
NGRAM_VECTORS = [
    ([1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 2, [4, 1]),
    ([1, 2, 3, 4, 1, 2, 3], 1, 1, 3, [4, 1, 2]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 1, 2, [6, 2]),
    ([1, 2, 3, 4, 5], 2, 2, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 4, 4, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 3, 4, 2, [4, 1]),
    ([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 3, 4, 2, [1, 2]),
    ([3, 4, 5, 2, 3, 4, 1, 2, 3, 4], 2, 4, 2, [1, 2]),
    ([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 3, 3, 2, [100, 1]),
]


@pytest.mark.parametrize(("tokens", "lo", "hi", "k", "drafts"), NGRAM_VECTORS)
def test_ngram_proposer_matches_vllms_vectors(tokens, lo, hi, k, drafts):
    assert propose_ngram(tokens, lo, hi, k, max_model_len=100) == drafts


def test_ngram_proposer_edges():
    seq = [1, 2, 3, 4, 1, 2, 3]
    assert propose_ngram(seq, 2, 2, 3, max_model_len=9) == [4, 1]      # room for 2 more
    assert propose_ngram(seq, 2, 2, 3, max_model_len=7) == []          # no room
    assert propose_ngram([1, 2], 3, 3, 2, max_model_len=100) == []     # shorter than min_n
    assert propose_ngram([1, 1, 1, 1], 2, 2, 3, max_model_len=100) == [1, 1]  # overlapping
    assert propose_ngram([5, 6, 7, 5, 6], 2, 5, 9, max_model_len=100) == [7, 5, 6]  # to the end
    r = make_request("a", seq, max_tokens=5)
    long = make_request("b", seq, max_tokens=5)
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2,
                                               prompt_lookup_max=2), max_model_len=8)
    assert proposer.propose([r]) == {"a": [4]}
    assert NgramProposer(proposer.config, max_model_len=7).propose([long]) == {}


# --- the config ------------------------------------------------------------------------------
def spec(**kw) -> SpeculativeConfig:
    return SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, **kw})


def test_speculative_config_defaults_as_vllm():
    assert (spec().prompt_lookup_min, spec().prompt_lookup_max) == (5, 5)
    got = spec(prompt_lookup_max=4)
    assert (got.prompt_lookup_min, got.prompt_lookup_max) == (4, 4)
    got = spec(prompt_lookup_min=2)
    assert (got.prompt_lookup_min, got.prompt_lookup_max) == (2, 2)
    got = spec(prompt_lookup_min=2, prompt_lookup_max=5)
    assert (got.prompt_lookup_min, got.prompt_lookup_max, got.num_speculative_tokens) == (2, 5, 3)
    assert SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 2}) \
        == SpeculativeConfig(num_speculative_tokens=2)
    assert spec(method="[ngram]").method == "ngram"
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}') \
        == SpeculativeConfig(num_speculative_tokens=4)


@pytest.mark.parametrize(("doc", "message"), [
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ({"method": "eagle", "num_speculative_tokens": 3},
     "speculative method 'eagle' is not supported; kvloop supports: ngram"),
    ({"model": "org/draft-model", "num_speculative_tokens": 3},
     "draft models are not supported (model 'org/draft-model'); kvloop supports: ngram"),
    ({"num_speculative_tokens": 3}, "speculative config needs a method; kvloop supports: ngram"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0},
     "num_speculative_tokens must be an integer >= 1, got 0"),
    ({"method": "ngram", "num_speculative_tokens": "3"},
     "num_speculative_tokens must be an integer >= 1, got '3'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0},
     "prompt_lookup_min must be an integer >= 1, got 0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
     "unknown key(s) draft_tensor_parallel_size; kvloop knows method, num_speculative_tokens"),
    ([1, 2], "speculative config must be a JSON object, got [1, 2]"),
])
def test_speculative_config_errors_name_the_fix(doc, message):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.from_dict(doc)
    assert message in str(e.value)


def test_speculative_config_flag_text_must_be_json():
    with pytest.raises(ValueError, match="--speculative-config is not JSON"):
        SpeculativeConfig.parse("{method: ngram}")


# --- the scheduler ---------------------------------------------------------------------------
def test_drafts_are_never_cached_or_hashed():
    """Block 0 fills up with a draft: its slots are all computed, yet it is cached only once
    its 16 tokens are known, with the real token's hash and ids."""
    kv = make_manager(20, caching=True, events=True, max_model_len=256)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256),
                  kv)
    prompt = list(range(100, 114))                                   # 14 tokens
    r = make_request("a", prompt, max_tokens=20)
    s.add_request(r)
    run_step(s, {"a": [7]})                                          # 15 known tokens
    assert kv.take_events() == [] and r.block_hashes == []
    r.spec_token_ids = [8, 9, 10]                                    # positions 15, 16, 17
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.scheduled_spec_decode_tokens == {"a": [8, 9, 10]} and r.spec_token_ids == []
    assert len(kv.get_block_ids("a")) == 2                           # slots for the drafts
    assert kv.take_events() == [] and not kv.block_pool.cached_block_hash_to_block
    s.update_from_output(out, RunnerOutput(["a"], [[11]]))           # all three rejected
    assert r.num_computed_tokens == 15 and r.all_token_ids == prompt + [7, 11]
    assert r.block_hashes == HASHER.hash_range(prompt + [7, 11], None, 0)
    s.check_invariants()
    r.spec_token_ids = [12, 13]
    out = s.schedule()                                               # 11 again, then drafts
    assert out.num_scheduled_tokens == {"a": 3}
    (stored,) = kv.take_events()
    assert isinstance(stored, BlockStored) and stored.token_ids == prompt + [7, 11]
    assert len(kv.block_pool.cached_block_hash_to_block) == 1        # block 1: drafts only
    s.update_from_output(out, RunnerOutput(["a"], [[12, 13, 14]]))   # both accepted + bonus
    assert r.num_computed_tokens == 18 and r.num_tokens == 19 and len(r.block_hashes) == 1
    s.check_invariants()
    stats = s.make_stats().spec_decoding_stats
    assert stats == SpecDecodingStats(num_drafts=2, num_draft_tokens=5, num_accepted_tokens=2,
                                      num_accepted_tokens_per_pos=[1, 1])
    assert s.make_stats().spec_decoding_stats is None                # none without drafts


def test_drafts_are_cut_by_the_budget_and_dropped_by_a_preemption():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=3, max_num_seqs=1, max_model_len=64),
                  make_manager(10, caching=False, events=False, max_model_len=64))
    r = make_request("a", [1, 2, 3], max_tokens=20, hasher=None)
    s.add_request(r)
    run_step(s, {"a": [4]})
    r.spec_token_ids = [5, 6, 7]
    out, _ = run_step(s, {"a": [5, 6, 9]})                           # budget 3: two drafts
    assert out.scheduled_spec_decode_tokens == {"a": [5, 6]}
    assert r.output_token_ids == [4, 5, 6, 9] and r.num_computed_tokens == 6
    r.spec_token_ids = [1, 2]
    s.reset_prefix_cache(reset_running_requests=True)                # preempts it
    assert r.spec_token_ids == [] and r.num_computed_tokens == 0


# --- the engine over the simulator -----------------------------------------------------------
PHRASE = [500 + i for i in range(12)]
PROMPTS = {"copy": [7, 8] + PHRASE + [9] + PHRASE + PHRASE[:4],       # 31 tokens
           "twice": PHRASE + [11] + PHRASE[:2],
           "plain": [300 + 7 * i for i in range(20)]}                      # nothing to copy


def sim_engine(k: int, blocks: int = 12) -> EngineCore:
    sp = (SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=2, prompt_lookup_max=5)
          if k else None)
    cfg = EngineConfig(cache=CacheConfig(num_gpu_blocks=blocks, block_size=8),
                       scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4,
                                                 max_model_len=256),
                       check_invariants=True, speculative=sp)
    engine = EngineCore(cfg, SimRunner(copy_rate=1.0))
    for rid, prompt in PROMPTS.items():
        engine.add_request(engine.make_request(
            rid, prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)))
    return engine


def run_sim(engine: EngineCore):
    tokens: dict[str, list[int]] = {}
    total = SpecDecodingStats()
    records = []
    for _ in range(400):
        if not engine.has_unfinished_requests():
            break
        result = engine.step()
        records.append(result.record)
        for o in result.outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        if result.stats is not None and result.stats.spec_decoding_stats is not None:
            total.add(result.stats.spec_decoding_stats)
    assert not engine.has_unfinished_requests()
    return tokens, total, records


def test_speculation_keeps_the_output_and_closes_gaps_of_1_plus_k():
    plain, none, plain_records = run_sim(sim_engine(0))
    got, stats, records = run_sim(sim_engine(3))
    assert got == plain and none == SpecDecodingStats()
    assert {len(t) for t in got.values()} == {30}
    assert any(rec.preempted for rec in records)                    # the pool is too small
    assert any(w.kind == "prefill" and w.tokens == 16 for rec in records
               for w in rec.scheduled.values())                     # chunked
    spec = [w for rec in records for w in rec.scheduled.values() if w.kind == "spec"]
    assert spec and all(w.tokens == 1 + w.draft_tokens and 1 <= w.draft_tokens <= 3
                        for w in spec)
    assert all(w.accepted_tokens is not None and 0 <= w.accepted_tokens <= w.draft_tokens
               for w in spec)
    assert stats.num_drafts == len(spec)
    assert stats.num_draft_tokens == sum(w.draft_tokens for w in spec)
    assert stats.num_accepted_tokens == sum(w.accepted_tokens or 0 for w in spec) > 0
    per_pos = stats.num_accepted_tokens_per_pos
    assert per_pos == sorted(per_pos, reverse=True) and sum(per_pos) == stats.num_accepted_tokens
    assert len(records) < len(plain_records)                        # accepted drafts save steps


def test_the_simulator_verifies_drafts_exactly():
    runner = SimRunner()
    params = SamplingParams(temperature=0.0)
    first = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("r", [1, 2], [1, 2], params, [1], 0, [1, 2])],
        num_scheduled_tokens={"r": 2}, total_num_scheduled_tokens=2, sampling_req_ids={"r"})
    t0 = runner.execute(first).sampled_token_ids[0][0]
    want = [runner.token_source("r", k) for k in (1, 2, 3)]
    for drafts, expected in [([want[0], want[1]], want), ([want[0], -5], want[:2]),
                             ([-5, want[1]], want[:1])]:
        step = SchedulerOutput(
            scheduled_cached_reqs=[CachedRequestData("r", [], 2, [t0], 1)],
            num_scheduled_tokens={"r": 1 + len(drafts)},
            total_num_scheduled_tokens=1 + len(drafts),
            scheduled_spec_decode_tokens={"r": drafts}, sampling_req_ids={"r"})
        assert runner.execute(step).sampled_token_ids == [expected]


# --- metrics ---------------------------------------------------------------------------------
def test_spec_metrics_have_vllms_names_and_positions():
    m = ServerMetrics("m", 1000, num_speculative_tokens=3)
    text = m.render().decode()
    assert metric_value(text, "vllm:spec_decode_num_drafts_total", model_name="m",
                        engine="0") == 0.0
    assert metric_value(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                        model_name="m", engine="0", position="2") == 0.0
    s = SpecDecodingStats()
    s.observe_draft(3, 2)
    s.observe_draft(2, 0)
    m.observe_scheduler_stats(SchedulerStats(spec_decoding_stats=s))
    text = m.render().decode()
    labels = {"model_name": "m", "engine": "0"}
    assert metric_value(text, "vllm:spec_decode_num_drafts_total", **labels) == 2.0
    assert metric_value(text, "vllm:spec_decode_num_draft_tokens_total", **labels) == 5.0
    assert metric_value(text, "vllm:spec_decode_num_accepted_tokens_total", **labels) == 2.0
    assert [metric_value(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                         **labels, position=str(i)) for i in range(3)] == [1.0, 1.0, 0.0]
    assert m.spec_counts() == (2.0, 5.0, 2.0, 1.0, 1.0, 0.0)
    assert "spec_decode" not in ServerMetrics("m", 1000).render().decode()   # off: absent


def test_spec_log_line_is_vllms():
    line = spec_line((4.0, 10.0, 6.0, 3.0, 2.0, 1.0), (2.0, 4.0, 2.0, 1.0, 1.0, 0.0), 2.0)
    assert line == ("SpecDecoding metrics: Mean acceptance length: 3.00, Accepted throughput: "
                    "2.00 tokens/s, Drafted throughput: 3.00 tokens/s, Accepted: 4 tokens, "
                    "Drafted: 6 tokens, Per-position acceptance rate: 1.000, 0.500, 0.500, "
                    "Avg Draft acceptance rate: 66.7%")
    assert spec_line((2.0, 4.0, 2.0, 1.0), (2.0, 4.0, 2.0, 1.0), 1.0) is None   # no drafts
    assert spec_line((), (), 1.0) is None
