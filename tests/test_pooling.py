"""Pooling requests (embeddings) in the scheduler and the engine: a request whose gap is its
prompt, scheduled like any prefill, that finishes with a vector and no token."""

from __future__ import annotations

import math

from kvloop.config import CacheConfig, EngineConfig, SchedulerConfig
from kvloop.core.engine import EngineCore
from kvloop.core.outputs import RunnerOutput
from kvloop.core.request import PoolingParams, Request, RequestStatus, SamplingParams
from kvloop.sim.runner import SIM_EMBED_DIM, SimRunner, sim_embedding

from .core_helpers import HASHER, make_scheduler

VEC = [0.6, 0.8]


def pooling_request(rid: str, tokens: list[int], normalize: bool = True) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), hasher=HASHER,
                   pooling_params=PoolingParams(normalize=normalize))


def step(sched, vectors: dict[str, list[float]] | None = None):
    """One step; pooling requests whose prompt completes get VEC (or `vectors[rid]`)."""
    out = sched.schedule()
    ro = RunnerOutput(req_ids=list(out.num_scheduled_tokens))
    ro.sampled_token_ids = [[] for _ in ro.req_ids]
    ro.pooler_output = [(vectors or {}).get(rid, VEC) if rid in out.sampling_req_ids else None
                        for rid in ro.req_ids]
    outputs = sched.update_from_output(out, ro)
    sched.check_invariants()
    return out, outputs


def test_chunked_pooling_request_finishes_with_its_vector_and_frees_its_blocks():
    s = make_scheduler(num_blocks=10, caching=True, max_num_batched_tokens=16,
                       max_model_len=64)
    pool = s.kv.block_pool
    s.add_request(pooling_request("p", list(range(1, 41))))     # 40 tokens: 16 + 16 + 8
    for expected in (16, 16):
        out, outputs = step(s)
        assert out.num_scheduled_tokens == {"p": expected}
        assert out.sampling_req_ids == set() and outputs == []
    assert pool.get_num_free_blocks() == 9 - 2     # blocks for what is computed
    out, outputs = step(s)
    assert out.num_scheduled_tokens == {"p": 8} and out.sampling_req_ids == {"p"}
    [o] = outputs
    assert (o.request_id, o.new_token_ids, o.finish_reason, o.pooling_output) == (
        "p", [], "stop", VEC)
    assert "p" not in s.requests and not s.running and not len(s.waiting)
    assert pool.get_num_free_blocks() == 9          # every block back in the free queue
    r = pooling_request("p2", list(range(1, 41)))
    assert [b.block_id for b in s.kv.get_computed_blocks(r)[0]] == [1, 2]   # full ones cached
    s.add_request(r)
    out, outputs = step(s)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 32
    assert out.num_scheduled_tokens == {"p2": 8}
    assert outputs[0].num_cached_tokens == 32


def test_fully_cached_prompt_recomputes_its_last_block():
    """The last token's hidden state is needed: at most num_tokens - 1 tokens hit, in whole
    blocks (vLLM's rule for every request), so a 32-token prompt recomputes 16."""
    s = make_scheduler(num_blocks=10, caching=True, max_num_batched_tokens=64,
                       max_model_len=64)
    s.add_request(pooling_request("a", list(range(1, 33))))
    step(s)
    s.add_request(pooling_request("b", list(range(1, 33))))
    out, outputs = step(s, {"b": [1.0, 0.0]})
    assert out.scheduled_new_reqs[0].num_computed_tokens == 16
    assert out.num_scheduled_tokens == {"b": 16}
    assert outputs[0].pooling_output == [1.0, 0.0] and outputs[0].num_cached_tokens == 16


def test_runner_without_a_vector_fails_the_request():
    s = make_scheduler(num_blocks=10, caching=False)
    s.add_request(pooling_request("p", [5] * 8))
    out = s.schedule()
    ro = RunnerOutput(req_ids=["p"], sampled_token_ids=[[]])
    [o] = s.update_from_output(out, ro)
    assert o.finish_reason == "error" and o.pooling_output is None and o.error
    assert s.kv.block_pool.get_num_free_blocks() == 9
    s.check_invariants()


def test_preempted_pooling_request_recomputes_and_still_pools():
    s = make_scheduler(num_blocks=4, caching=False, max_num_batched_tokens=32,
                       max_model_len=64)   # 3 usable blocks
    s.add_request(Request("g", [9] * 16, SamplingParams(max_tokens=3), hasher=None))
    p = pooling_request("p", [7] * 32)
    s.add_request(p)
    out = s.schedule()           # g: its prompt, 1 block; p: a 16-token chunk, 1 block
    assert out.num_scheduled_tokens == {"g": 16, "p": 16}
    s.update_from_output(out, RunnerOutput(req_ids=["g", "p"], sampled_token_ids=[[3], []]))
    out = s.schedule()           # g's decode takes the last block; p's chunk finds none
    assert out.num_scheduled_tokens == {"g": 1} and out.preempted_req_ids == ["p"]
    assert p.status == RequestStatus.PREEMPTED and p.num_computed_tokens == 0
    s.update_from_output(out, RunnerOutput(req_ids=["g"], sampled_token_ids=[[3]]))
    pooled = []
    while s.requests:
        out = s.schedule()
        ro = RunnerOutput(req_ids=list(out.num_scheduled_tokens))
        ro.sampled_token_ids = [[3] if r == "g" else [] for r in ro.req_ids]
        ro.pooler_output = [VEC if r == "p" and r in out.sampling_req_ids else None
                            for r in ro.req_ids]
        pooled += [o for o in s.update_from_output(out, ro) if o.request_id == "p"]
        s.check_invariants()
    [o] = pooled
    assert o.new_token_ids == [] and o.pooling_output == VEC and p.num_preemptions == 1
    assert s.kv.block_pool.get_num_free_blocks() == 3


def make_engine(blocks=20, budget=32) -> EngineCore:
    cfg = EngineConfig(cache=CacheConfig(num_gpu_blocks=blocks),
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8,
                                                 max_model_len=256),
                       check_invariants=True)
    return EngineCore(cfg, SimRunner())


def test_engine_batches_pooling_with_generation_and_frees_everything():
    engine = make_engine()
    prompt = list(range(100, 150))                 # 50 tokens: two chunks beside "g"
    engine.add_request(engine.make_request("g", list(range(10, 30)),
                                           SamplingParams(max_tokens=6, ignore_eos=True)))
    engine.add_request(engine.make_request("p", prompt, SamplingParams(max_tokens=1),
                                           pooling_params=PoolingParams()))
    engine.add_request(engine.make_request("raw", [1, 2, 3], SamplingParams(max_tokens=1),
                                           pooling_params=PoolingParams(normalize=False)))
    got: dict[str, list] = {"g": [], "p": [], "raw": []}
    mixed = False
    while engine.has_unfinished_requests():
        res = engine.step()
        sched = res.scheduler_output
        mixed |= {"g", "p"} <= set(sched.num_scheduled_tokens)
        for o in res.outputs:
            got[o.request_id].append(o)
    assert mixed                                    # one forward pass held both
    assert sum(len(o.new_token_ids) for o in got["g"]) == 6
    [p] = got["p"]
    assert p.new_token_ids == [] and p.finish_reason == "stop"
    assert p.pooling_output == sim_embedding(prompt)
    assert len(p.pooling_output) == SIM_EMBED_DIM
    assert math.isclose(math.fsum(v * v for v in p.pooling_output), 1.0, rel_tol=1e-12)
    [raw] = got["raw"]
    assert raw.pooling_output == sim_embedding([1, 2, 3], normalize=False)
    engine.step()                                   # reports the finished ids to the runner
    assert engine.block_pool.get_num_free_blocks() == engine.block_pool.num_usable_blocks
    assert not engine.scheduler.requests
