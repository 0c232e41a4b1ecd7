"""Suffix decoding without a model: the tree's counts against a brute-force count (through
appends and removals), exact drafts for crafted token sequences, the draft bounds (match
length times the spec factor, minimum probability, tree depth, room before max_model_len),
the global tree's bound on cached responses (oldest evicted first), the config's defaults
and errors, and the engine over the simulator: exact drafts and acceptances on a crafted
agent transcript, and the same output as without speculation through chunked prefill and
preemptions."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvloop.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from kvloop.core.engine import EngineCore
from kvloop.core.request import SamplingParams
from kvloop.core.spec_decode import NgramProposer, SuffixProposer, make_proposer
from kvloop.core.suffix_tree import SuffixCache, SuffixTree
from kvloop.sim.runner import SimRunner
from kvloop.wire import RequestSpecDecodingStats, SpecDecodingStats
from tests.core_helpers import make_request


# --- a brute-force reference ------------------------------------------------------------------
def brute_counts(seqs: dict[int, list[int]], depth: int) -> dict[tuple[int, ...], int]:
    """Every substring of length <= depth -> how often it occurs."""
    c: Counter[tuple[int, ...]] = Counter()
    for s in seqs.values():
        for i in range(len(s)):
            for n in range(1, min(depth, len(s) - i) + 1):
                c[tuple(s[i:i + n])] += 1
    return dict(c)


def brute_speculate(counts: dict[tuple[int, ...], int], depth: int, context: list[int],
                    k: int, factor: float, min_prob: float) -> tuple[list[int], float]:
    """The module docstring's rule, from substring counts alone."""
    context = context[-depth:]
    best: tuple[list[int], float] = ([], 0.0)
    for m in range(1, len(context)):
        cur = tuple(context[-m:])
        if cur not in counts:
            break
        limit, tokens, score, prob = min(k, int(m * factor + 1e-6)), [], 0.0, 1.0
        while len(tokens) < limit and len(cur) < depth:
            nxt = [(counts[cur + (t,)], -t) for t in range(50) if cur + (t,) in counts]
            if not nxt:
                break
            n, t = max(nxt)
            prob *= n / counts[cur]
            if prob < min_prob:
                break
            tokens.append(-t)
            score += prob
            cur += (-t,)
        if score >= best[1]:
            best = (tokens, score)
    return best


def test_counts_match_brute_force_through_appends_and_removals():
    rng = random.Random(7)
    for _ in range(150):
        depth = rng.randint(1, 6)
        tree, seqs = SuffixTree(depth), {}
        for _ in range(rng.randint(1, 30)):
            if seqs and rng.random() < 0.2:
                sid = rng.choice(sorted(seqs))
                tree.remove(sid)
                del seqs[sid]
            else:
                sid = rng.randint(0, 4)
                tokens = [rng.randint(0, 2) for _ in range(rng.randint(1, 8))]
                tree.extend(sid, tokens)
                seqs.setdefault(sid, []).extend(tokens)
            tree.check_invariants()
            assert tree.counts() == brute_counts(seqs, depth)
        assert tree.num_nodes() <= 2 * tree.num_tokens   # compressed: O(tokens) nodes


def test_drafts_match_brute_force():
    rng = random.Random(11)
    for _ in range(300):
        depth, tree, seqs = rng.randint(2, 8), None, {}
        tree = SuffixTree(depth)
        for sid in range(rng.randint(1, 3)):
            seqs[sid] = [rng.randint(0, 3) for _ in range(rng.randint(1, 25))]
            tree.extend(sid, seqs[sid])
        context = [rng.randint(0, 3) for _ in range(rng.randint(1, 10))]
        k, factor = rng.randint(1, 6), rng.choice([0.5, 1.0, 2.0])
        min_prob = rng.choice([0.0, 0.1, 0.3])
        got = tree.speculate(context, k, factor, min_prob)
        want = brute_speculate(brute_counts(seqs, depth), depth, context, k, factor, min_prob)
        assert (got.token_ids, round(got.score, 6)) == (want[0], round(want[1], 6))


# tokens, context, k, max_spec_factor, min_token_prob, depth, drafts
DRAFTS = [
    # "1 2" occurred twice, once followed by 3: a match of 2 allows 2 drafts, of 3 none
    ([1, 2, 3, 1, 2], None, 8, 1.0, 0.1, 24, [3, 1]),
    ([1, 2, 3, 1, 2], None, 8, 2.0, 0.1, 24, [3, 1, 2]),     # factor 2: 4 allowed, 3 known
    ([1, 2, 3, 1, 2], None, 1, 2.0, 0.1, 24, [3]),           # k caps it
    # "9" was followed by 1, 2, 3, 4, 5 once each (1/6): the smaller id, unless pruned
    ([9, 1, 9, 2, 9, 3, 9, 4, 9, 5, 9], None, 8, 1.0, 0.1, 24, [1]),
    ([9, 1, 9, 2, 9, 3, 9, 4, 9, 5, 9], None, 8, 1.0, 0.2, 24, []),
    # "7" -> 1 twice, 2 once (1/2); then "7 1 7" -> 1 or 2 (1/2 each: 1/4 in all)
    ([7, 1, 7, 1, 7, 2, 7], None, 8, 3.0, 0.1, 24, [1, 7, 1]),
    ([7, 1, 7, 1, 7, 2, 7], None, 8, 3.0, 0.3, 24, [1, 7]),
    # depth 4: suffixes hold 4 tokens, so "1 2" continues with 3 4 only (score 1.0) and
    # "2" with 3 4 5 (score 1.5, the winner)
    ([1, 2, 3, 4, 5, 6, 1, 2], None, 8, 4.0, 0.1, 4, [3, 4, 5]),
    ([1, 2, 3, 4, 5, 6, 1, 2], [6, 1, 2], 8, 4.0, 0.1, 4, [3, 4, 5]),
    # the context is matched, not the tree's own last tokens
    ([5, 6, 7, 8, 9], [0, 6, 7], 8, 1.0, 0.1, 24, [8, 9]),
    ([5, 6, 7, 8, 9], [0, 4, 7], 8, 1.0, 0.1, 24, [8]),
    ([5, 6, 7, 8, 9], [3], 8, 1.0, 0.1, 24, []),
]


@pytest.mark.parametrize(("tokens", "context", "k", "factor", "min_prob", "depth", "drafts"),
                         DRAFTS)
def test_exact_drafts(tokens, context, k, factor, min_prob, depth, drafts):
    tree = SuffixTree(depth)
    tree.extend(0, tokens)
    got = tree.speculate(tokens if context is None else context, k, factor, min_prob)
    assert got.token_ids == drafts


def test_the_longer_match_wins_over_a_frequent_short_one():
    """"3" is followed by 4 three times and by 9 once; "2 3" only by 9: the match of 2 with
    a 2-token draft (score 1.0) beats the match of 1 (one token, 3/4)."""
    tree = SuffixTree(24)
    tree.extend(0, [3, 4, 3, 4, 3, 4, 1, 2, 3, 9, 8, 2, 3])
    draft = tree.speculate([1, 2, 3], 8, 1.0, 0.1)
    assert (draft.token_ids, draft.match_len) == ([9, 8], 2)


# --- the cache: per-request trees and the global tree -----------------------------------------
def test_the_global_tree_drafts_from_earlier_responses_and_evicts_the_oldest():
    def served(max_cached: int) -> SuffixCache:
        cache = SuffixCache(24, max_cached)
        for rid, out in (("r1", [1, 2, 3, 4, 5]), ("r2", [6, 7, 8, 9])):
            cache.start(rid, [100])
            cache.extend(rid, out)
            cache.stop(rid)
        cache.start("r3", [100])
        return cache

    kept = served(3)
    assert kept.speculate("r3", [0, 1, 2], 8, 1.0, 0.1).token_ids == [3, 4]
    assert kept.speculate("r3", [0, 6, 7], 8, 1.0, 0.1).token_ids == [8, 9]
    assert kept.num_cached_responses == 3 and kept.global_tree.num_tokens == 9
    bounded = served(2)        # r3's slot pushes r1's response out
    assert bounded.speculate("r3", [0, 1, 2], 8, 1.0, 0.1).token_ids == []
    assert bounded.speculate("r3", [0, 6, 7], 8, 1.0, 0.1).token_ids == [8, 9]
    assert bounded.num_cached_responses == 2 and bounded.global_tree.num_tokens == 4
    bounded.global_tree.check_invariants()
    off = served(0)
    assert off.speculate("r3", [0, 6, 7], 8, 1.0, 0.1).token_ids == []
    assert off.global_tree.num_tokens == 0 and off.active_requests == {"r3"}


def test_the_cache_drafts_as_brute_force_over_its_requests():
    """Random requests over 3 token ids, several active at once, starting and stopping in a
    random order: every draft is the brute-force draft of the request's prompt + output, or
    of the last `max_cached` responses (outputs only) when that scores strictly higher."""
    rng = random.Random(5)
    for _ in range(25):
        depth, max_cached = rng.randint(2, 6), rng.randint(0, 3)
        cache = SuffixCache(depth, max_cached)
        own: dict[str, list[int]] = {}
        responses: dict[str, list[int]] = {}        # in start order, as the global tree's
        for step in range(30):
            if len(own) < 3 and (not own or rng.random() < 0.3):
                rid = f"r{step}"
                own[rid] = [rng.randint(0, 2) for _ in range(rng.randint(1, 6))]
                cache.start(rid, own[rid])
                if max_cached:
                    responses[rid] = []
                    while len(responses) > max_cached:
                        del responses[next(iter(responses))]
            rid = rng.choice(sorted(own))
            if rng.random() < 0.2:
                cache.stop(rid)
                del own[rid]
                continue
            new = [rng.randint(0, 2) for _ in range(rng.randint(1, 3))]
            cache.extend(rid, new)
            own[rid] += new
            if rid in responses:
                responses[rid] += new
            context = own[rid][-depth:]
            local = brute_speculate(brute_counts({0: own[rid]}, depth), depth, context, 4, 1.0,
                                    0.1)
            glob = brute_speculate(brute_counts(dict(enumerate(responses.values())), depth),
                                   depth, context, 4, 1.0, 0.1)
            want = glob[0] if glob[1] > local[1] else local[0]
            assert cache.speculate(rid, context, 4, 1.0, 0.1).token_ids == want
        cache.global_tree.check_invariants()


def test_the_global_tree_holds_at_most_max_cached_requests_responses():
    cache = SuffixCache(8, 5)
    for i in range(40):
        rid = f"r{i}"
        cache.start(rid, [1, 2, 3])
        cache.extend(rid, [10 + i, 11 + i, 12 + i, 13 + i])
        cache.stop(rid)
    assert cache.num_cached_responses == 5 and cache.global_tree.num_sequences == 5
    assert cache.global_tree.num_tokens == 20 and not cache.active_requests
    assert cache.global_tree.num_nodes() <= 2 * 20      # nothing left of the evicted ones
    cache.global_tree.check_invariants()


def test_a_request_s_own_tree_wins_ties_and_the_global_one_wins_when_better():
    cache = SuffixCache(24, 10)
    cache.start("old", [0])
    cache.extend("old", [5, 6, 7, 8])
    cache.stop("old")
    cache.start("new", [5, 6, 1])            # its prompt: "5 6" then 1
    # a match of 1 ("6"): one draft each, 1.0 against 1.0: its own
    assert cache.speculate("new", [5, 6], 8, 1.0, 0.1).token_ids == [1]
    # a match of 2 ("5 6"): its own knows 1 more token (1.0), the global tree 2 (2.0)
    assert cache.speculate("new", [4, 5, 6], 8, 1.0, 0.1).token_ids == [7, 8]


# --- the proposer ---------------------------------------------------------------------------
def suffix_spec(**kw) -> SpeculativeConfig:
    return SpeculativeConfig.from_dict({"method": "suffix", **kw})


def test_the_proposer_learns_prompt_and_outputs_and_forgets_finished_requests():
    proposer = make_proposer(suffix_spec(num_speculative_tokens=4), max_model_len=100)
    assert isinstance(proposer, SuffixProposer)
    r = make_request("a", [1, 2, 3, 4, 5, 6, 1], max_tokens=10)
    r.append_output_token_ids(2)
    assert proposer.propose([r], live={"a"}) == {"a": [3, 4]}
    r.append_output_token_ids(3)
    r.append_output_token_ids(4)
    assert proposer.propose([r], live={"a"}) == {"a": [5, 6, 1, 2]}
    assert proposer.cache.active_requests == {"a"}
    proposer.propose([], live=set())                  # a left (aborted)
    assert proposer.cache.active_requests == set()
    assert proposer.cache.global_tree.num_tokens == 3  # its response stays: 2 3 4
    room = SuffixProposer(suffix_spec(num_speculative_tokens=4), max_model_len=12)
    assert room.propose([r], live={"a"}) == {"a": [5]}   # 10 tokens: room for 1 + 1


def test_the_ngram_proposer_keeps_its_answers():
    proposer = make_proposer(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=2,
                                               prompt_lookup_max=2), max_model_len=100)
    assert isinstance(proposer, NgramProposer)
    r = make_request("a", [1, 2, 3, 4, 1, 2, 3])
    assert proposer.propose([r], live={"a"}) == {"a": [4, 1]}


# --- the config -----------------------------------------------------------------------------
def test_suffix_config_has_vllms_defaults():
    got = SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 16})
    assert (got.method, got.num_speculative_tokens, got.suffix_decoding_max_tree_depth,
            got.suffix_decoding_max_cached_requests, got.suffix_decoding_max_spec_factor,
            got.suffix_decoding_min_token_prob) == ("suffix", 16, 24, 10000, 1.0, 0.1)
    assert suffix_spec().num_speculative_tokens == 24                 # k: the tree depth
    assert suffix_spec(suffix_decoding_max_tree_depth=32).num_speculative_tokens == 32
    got = SpeculativeConfig.parse(
        '{"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": '
        '16, "suffix_decoding_max_cached_requests": 0, "suffix_decoding_max_spec_factor": 2, '
        '"suffix_decoding_min_token_prob": 0}')
    assert (got.suffix_decoding_max_tree_depth, got.suffix_decoding_max_cached_requests,
            got.suffix_decoding_max_spec_factor, got.suffix_decoding_min_token_prob) == (
                16, 0, 2.0, 0.0)


@pytest.mark.parametrize(("doc", "message"), [
    ({"num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 0},
     "suffix_decoding_max_tree_depth must be an integer >= 1, got 0"),
    ({"suffix_decoding_max_cached_requests": -1},
     "suffix_decoding_max_cached_requests must be an integer >= 0, got -1"),
    ({"suffix_decoding_max_spec_factor": -0.5},
     "suffix_decoding_max_spec_factor must be a number >= 0.0, got -0.5"),
    ({"suffix_decoding_min_token_prob": 1.5},
     "suffix_decoding_min_token_prob must be a number in [0.0, 1.0], got 1.5"),
    ({"suffix_decoding_min_token_prob": "0.1"},
     "suffix_decoding_min_token_prob must be a number in [0.0, 1.0], got '0.1'"),
    ({"prompt_lookup_max": 3}, "prompt_lookup_max belong(s) to method 'ngram', not 'suffix'"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1, got 0"),
])
def test_suffix_config_errors_name_the_fix(doc, message):
    with pytest.raises(ValueError) as e:
        suffix_spec(**doc)
    assert message in str(e.value)
    with pytest.raises(ValueError, match="belong.s. to method 'suffix', not 'ngram'"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2,
                                     "suffix_decoding_max_tree_depth": 8})


# --- the engine over the simulator ----------------------------------------------------------
SCRIPT = [600 + i for i in range(20)]    # what the simulated agent answers, every turn


def agent_engine(k: int, blocks: int = 64, method: str = "suffix", max_seqs: int = 4,
                 budget: int = 64) -> EngineCore:
    spec = (SpeculativeConfig.from_dict({"method": method, "num_speculative_tokens": k})
            if k else None)
    cfg = EngineConfig(cache=CacheConfig(num_gpu_blocks=blocks, block_size=8),
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget,
                                                 max_num_seqs=max_seqs, max_model_len=256),
                       check_invariants=True, speculative=spec)
    return EngineCore(cfg, SimRunner(token_source=lambda rid, i: SCRIPT[i % len(SCRIPT)]))


def run_to_end(engine: EngineCore, prompts: dict[str, list[int]], max_tokens: int):
    """Add the requests, step until all finish: their tokens, the spec stats, the steps,
    and each request's own stats (from its finishing output)."""
    for rid, prompt in prompts.items():
        engine.add_request(engine.make_request(
            rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                        ignore_eos=True)))
    tokens: dict[str, list[int]] = {}
    total, steps = SpecDecodingStats(), 0
    own: dict[str, RequestSpecDecodingStats | None] = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        result = engine.step()
        steps += 1
        for o in result.outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                own[o.request_id] = o.spec_decoding_stats
        if result.stats is not None and result.stats.spec_decoding_stats is not None:
            total.add(result.stats.spec_decoding_stats)
    assert not engine.has_unfinished_requests()
    return tokens, total, steps, own


def test_an_agent_turn_drafts_from_the_previous_turn_s_answer():
    """Turn 1 answers SCRIPT with nothing to draft from (its prompt and answer never repeat
    inside it). Turn 2 gives the same answer: after its first token S0 the global tree holds
    turn 1's answer, and a match of the whole answer so far (L tokens) allows L drafts, all
    accepted, plus the bonus token: 1 -> 3 -> 7 -> 15 tokens in 4 steps, 1 + 3 + 7 = 11
    drafts in 3 verifications, every one accepted."""
    engine = agent_engine(k=8)
    first, stats1, steps1, own1 = run_to_end(engine, {"turn1": [1, 2, 3, 4]}, max_tokens=15)
    assert first == {"turn1": SCRIPT[:15]}
    assert stats1 == SpecDecodingStats() and steps1 == 15
    second, stats2, steps2, own2 = run_to_end(engine, {"turn2": [1, 2, 3, 4, 5, 6]}, max_tokens=15)
    assert second == {"turn2": SCRIPT[:15]} and steps2 == 4
    assert stats2 == SpecDecodingStats(num_drafts=3, num_draft_tokens=11, num_accepted_tokens=11,
                                       num_accepted_tokens_per_pos=[3, 2, 2, 1, 1, 1, 1])
    # each request's own figure, on its finishing output: turn 1 drafted nothing; turn 2
    # verified 1, 3 and 7 drafts and accepted them all
    assert own1 == {"turn1": None}
    assert own2["turn2"] == RequestSpecDecodingStats(
        {1: [0, 1], 3: [0, 0, 0, 1], 7: [0, 0, 0, 0, 0, 0, 0, 1]})
    assert isinstance(engine.proposer, SuffixProposer)
    assert engine.proposer.cache.active_requests == set()
    assert engine.proposer.cache.global_tree.num_tokens == 30      # both answers kept


def test_a_tool_output_in_the_prompt_is_drafted_from_the_request_s_own_tree():
    """The prompt holds the tool output the answer repeats: the same 1 -> 3 -> 7 -> 15 from
    the request's own tree; n-gram (k = 8, its default n-gram of 5 tokens) waits for a
    5-token match, then copies 8 (14 tokens in 6 steps)."""
    tool = [1, 2, *SCRIPT, 3]
    got, stats, steps, _ = run_to_end(agent_engine(k=8), {"edit": tool}, max_tokens=15)
    assert got == {"edit": SCRIPT[:15]} and steps == 4
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 11, 11)
    got, stats, steps, _ = run_to_end(agent_engine(k=8, method="ngram"), {"edit": tool},
                                   max_tokens=14)
    assert got == {"edit": SCRIPT[:14]} and steps == 6   # 5 plain steps, then 8 + 1
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 8, 8)


def test_speculation_keeps_the_output_through_chunks_and_preemptions():
    """Four requests at once in a pool too small for them, 16-token chunks: the suffix
    drafts change no token, and accepted drafts save steps."""
    prompts = {f"r{i}": [1 + i, 2, 3, *SCRIPT[:i * 3]] for i in range(4)}
    plain, none, plain_steps, _ = run_to_end(agent_engine(0, blocks=12, budget=16), prompts, 30)
    got, stats, steps, own = run_to_end(agent_engine(6, blocks=12, budget=16), prompts, 30)
    assert got == plain and none == SpecDecodingStats()
    assert {len(t) for t in got.values()} == {30}
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens <= 6 * stats.num_drafts
    assert steps < plain_steps
    mine = [s for s in own.values() if s is not None]     # they add up to the counters
    assert sum(s.num_spec_steps for s in mine) == stats.num_drafts
    assert sum(s.num_draft_tokens for s in mine) == stats.num_draft_tokens
    assert sum(s.num_accepted_tokens for s in mine) == stats.num_accepted_tokens
