"""The router on a hybrid worker (full-attention and sliding-window KV-cache groups): its
index and self-check stay exact, and a group it cannot predict raises an alarm.

The worker is kvloop's own KV cache manager with a full-attention group and a sliding-window
group (window 8, blocks of 4) on a 40-block pool: requests of shared-prefix prompts are
admitted, decode (their sliding-window blocks leave the window and are freed), finish, and
are evicted, and every step's KV events reach the router's feed as a real subscriber
delivers them. Before each admission the router predicts the hit; the engine's actual hit
must be exactly that, every time.
"""

from __future__ import annotations

import logging

import numpy as np

from kvloop.core.block_pool import BlockPool
from kvloop.core.hashing import BlockHasher
from kvloop.core.kv_cache_groups import FULL_ATTENTION, SLIDING_WINDOW, KVCacheGroupSpec
from kvloop.core.kv_cache_manager import KVCacheManager
from kvloop.core.request import Request, SamplingParams
from kvloop.events.types import BlockStored, KVEventBatch
from kvloop.events.view import CacheView
from kvloop.router.groups import GroupSpec
from kvloop.router.registry import CONFIG_MISMATCH, WorkerSpec

from .test_router_core import desc, make_router

BS = 4
GROUPS = (KVCacheGroupSpec(FULL_ATTENTION, (0,)), KVCacheGroupSpec(SLIDING_WINDOW, (1,), 8))


class HybridWorker:
    """A KV cache manager driven like an engine: admit, decode, finish; events out."""

    def __init__(self, feed):
        self.kv = KVCacheManager(BlockPool(40, enable_kv_cache_events=True), BS, 1024,
                                 groups=GROUPS)
        self.hasher = BlockHasher(BS, "sha256", "s")
        self.feed = feed
        self.running: list[Request] = []
        self.view = CacheView(keep_blocks=True)   # what a publisher's snapshot is made of

    def admit(self, rid: str, prompt: list[int]) -> int | None:
        """The engine's hit for `prompt` (None: no room; nothing admitted)."""
        req = Request(rid, prompt, SamplingParams(max_tokens=4), hasher=self.hasher)
        hits, n = self.kv.get_computed_group_blocks(req)
        if self.kv.allocate_group_slots(req, req.num_tokens - n, n, hits) is None:
            return None
        req.num_computed_tokens = req.num_tokens
        self.running.append(req)
        self.publish()
        return n

    def decode(self, token: int) -> None:
        for req in self.running:
            assert self.kv.allocate_group_slots(req, 1) is not None
            req.num_computed_tokens += 1
            req.append_output_token_ids(token)
        self.publish()

    def finish_oldest(self) -> None:
        self.kv.free(self.running.pop(0))
        self.publish()

    def publish(self) -> None:
        self.kv.check_invariants()
        events = self.kv.take_events()
        if events:
            self.feed.on_batch(KVEventBatch(ts=1.0, events=events))
            self.view.apply(events)


def prompt_family(rng: np.random.Generator) -> list[int]:
    stems = [list(range(100, 116)), list(range(300, 312))]
    stem = stems[int(rng.integers(0, 2))]
    return stem + rng.integers(1, 50, int(rng.integers(3, 14))).tolist()


def test_predicted_equals_reported_on_a_sliding_window_worker():
    r, clock, subs = make_router()
    r.register(WorkerSpec("http://w:1"), desc(block_size=BS))
    worker = HybridWorker(subs["w:1"].feed)
    rng = np.random.default_rng(0)
    seen_hits = 0
    partial = 0
    for i in range(60):
        clock.t += 5          # the provisional guess of the last routing expires
        prompt = prompt_family(rng) if i % 3 else worker_repeat(worker, rng)
        routed = r.route(prompt)
        actual = worker.admit(f"r{i}", prompt)
        if actual is None:
            r.finish(routed.ticket, None, "worker_error")
            worker.finish_oldest()
            continue
        assert routed.predicted_tokens == actual, (i, prompt)
        seen_hits += actual > 0
        # a hit shorter than the full group's run: the window decided it
        full = r.index.match(r.block_hashes(prompt)).get("w:1", 0)
        partial += 0 < actual < min(full, (len(prompt) - 1) // BS) * BS
        r.first_token(routed.ticket)
        r.finish(routed.ticket, actual, "ok")
        for t in range(int(rng.integers(0, 6))):
            worker.decode(t)
        if len(worker.running) > 2:
            worker.finish_oldest()
    assert seen_hits >= 20 and partial >= 1
    assert subs["w:1"].feed.counters.groups == {
        0: GroupSpec("full_attention"), 1: GroupSpec("sliding_window", 8)}
    assert r.check_liveness() == [] and not r.registry.get("w:1").alarms
    # a router that joins late learns the worker from a snapshot: the same predictions
    late, _, late_subs = make_router()
    late.register(WorkerSpec("http://w:1"), desc(block_size=BS))
    late_subs["w:1"].feed.on_batch(KVEventBatch(ts=1.0, events=worker.view.snapshot_events()))
    for _ in range(20):
        prompt = prompt_family(rng) if rng.integers(0, 2) else worker_repeat(worker, rng)
        hashes = r.block_hashes(prompt)
        want = r._group_matches(r.index.match_tiers(hashes, ["w:1"]), hashes,
                                [r.registry.get("w:1")], len(prompt))
        got = late._group_matches(late.index.match_tiers(hashes, ["w:1"]), hashes,
                                  [late.registry.get("w:1")], len(prompt))
        assert got == want


def worker_repeat(worker: HybridWorker, rng: np.random.Generator) -> list[int]:
    """A running request's whole sequence plus a token: a hit past its freed blocks."""
    if not worker.running:
        return prompt_family(rng)
    req = worker.running[int(rng.integers(0, len(worker.running)))]
    return list(req.all_token_ids) + [7]


def test_a_group_the_router_cannot_predict_raises_an_alarm(caplog):
    r, _, subs = make_router()
    r.register(WorkerSpec("http://w:1"), desc(block_size=BS))
    mamba = BlockStored(block_hashes=[11], parent_block_hash=10, token_ids=[1, 2, 3, 4],
                        block_size=BS, lora_id=None, medium="GPU", lora_name=None,
                        group_idx=1, kv_cache_spec_kind="mamba")
    with caplog.at_level(logging.WARNING, logger="kvloop.router"):
        subs["w:1"].feed.on_batch(KVEventBatch(ts=1.0, events=[mamba]))
    w = r.registry.get("w:1")
    assert CONFIG_MISMATCH in w.alarms and "mamba" in w.alarms[CONFIG_MISMATCH].detail
    assert w.load_only                      # routing to it is load-only, and says why
    assert any("mamba" in rec.getMessage() for rec in caplog.records)
    raised = r.metrics.alarms_raised.labels("w:1", CONFIG_MISMATCH)._value.get()
    assert raised == 1


def test_predicted_equals_reported_on_a_gemma3_engine(tmp_path):
    """The whole engine on a tiny random Gemma 3 (global and sliding-window layers): its
    step events feed the router; each request's reported `num_cached_tokens` equals the
    router's prediction at routing time. The 48-block pool evicts sliding-window blocks
    that left the window while the global layers' blocks stay: a longest-prefix match
    alone predicts 12 tokens where the engine hits 8 (request 2)."""
    import dataclasses

    from kvloop.config import RunnerConfig
    from kvloop.engine.build import build_engine
    from kvloop.llm import engine_config
    from tests.test_model_sliding import tiny_sliding_model
    from tests.test_model_tiny import write_hf_folder

    folder = write_hf_folder(tiny_sliding_model("gemma3", seed=3), tmp_path / "g")
    template = engine_config(256, block_size=BS, num_gpu_blocks=48, check_invariants=True)
    template = dataclasses.replace(template, cache=dataclasses.replace(
        template.cache, hash_seed="s", prefix_caching_hash_algo="sha256"))
    rc = RunnerConfig(model=str(folder), dtype="float32", device="cpu", block_size=BS,
                      num_gpu_blocks_override=48, num_threads=1)
    built = build_engine(rc, template, kv_events=True)
    engine = built.engine
    r, clock, subs = make_router()
    r.register(WorkerSpec("http://w:1"), desc(block_size=BS))
    feed = subs["w:1"].feed
    rng = np.random.default_rng(1)
    stems = [rng.integers(3, 200, 14).tolist(), rng.integers(3, 200, 9).tolist()]
    seen = []
    try:
        for i in range(16):
            clock.t += 5
            stem = stems[i % 2]
            prompt = stem + rng.integers(3, 200, int(rng.integers(2, 12))).tolist()
            routed = r.route(prompt)
            engine.add_request(engine.make_request(
                f"q{i}", prompt, SamplingParams(max_tokens=int(rng.integers(1, 10)),
                                                temperature=0.0, ignore_eos=True)))
            cached = None
            for _ in range(100):
                step = engine.step()
                if step.events is not None:
                    feed.on_batch(step.events)
                for out in step.outputs:
                    cached = out.num_cached_tokens
                if not engine.scheduler.has_requests():
                    break
            assert cached == routed.predicted_tokens, (i, cached, routed.predicted_tokens)
            seen.append(cached)
            r.first_token(routed.ticket)
            r.finish(routed.ticket, cached, "ok")
    finally:
        engine.shutdown()
    assert sum(1 for c in seen if c) >= 8, seen
    assert set(feed.counters.groups) == {0, 1, 2, 3}
    assert r.check_liveness() == [] and not r.registry.get("w:1").alarms
