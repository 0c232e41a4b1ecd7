"""CacheView: copies, removals, clears, and snapshots that rebuild it exactly."""

from __future__ import annotations

import random

import pytest

from kvloop.config import CacheConfig, EngineConfig, SchedulerConfig
from kvloop.core.engine import EngineCore
from kvloop.core.request import SamplingParams
from kvloop.events.types import (
    AllBlocksCleared,
    BlockStored,
    event_int,
)
from kvloop.events.view import CacheView
from kvloop.sim.runner import SimRunner

from .conftest import block_removed as removed
from .conftest import block_stored, event_batch


def stored(*hashes: int, parent: int | None = None, lora: str | None = None) -> BlockStored:
    """Blocks of 2 tokens, both the hash (the hashes here are < 1000)."""
    return block_stored(*hashes, parent=parent, block_size=2, lora=lora)


def test_copies_are_counted_and_removed_one_at_a_time():
    v = CacheView()
    v.apply([stored(1, 2), stored(2, parent=1)])
    assert v.hashes() == {1, 2} and v.copies(2) == 2 and v.num_blocks() == 3
    v.apply_event(removed(2))
    assert v.hashes() == {1, 2} and v.copies(2) == 1
    v.apply([removed(2), removed(9)])
    assert v.hashes() == {1} and v.unknown_removes == 1 and 2 not in v
    v.apply(event_batch(AllBlocksCleared()))
    assert len(v) == 0
    with pytest.raises(TypeError):
        v.apply_event("BlockStored")  # type: ignore[arg-type]


def expand(events):
    """hash -> (parent, tokens, extra key, lora) for every block the events store."""
    out = {}
    for e in events:
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            extra = e.extra_keys[i] if e.extra_keys else None
            out.setdefault(h, (parent, e.token_ids[i * e.block_size:(i + 1) * e.block_size],
                               extra, e.lora_name))
            parent = h
    return out


def test_snapshot_keeps_chains_parents_first_and_every_copy():
    v = CacheView(keep_blocks=True)
    v.apply([stored(1, 2, 3), stored(4, parent=3), stored(10, 11, lora="ad"),
             stored(2, parent=1), removed(1), stored(1)])  # 1 re-stored after its child
    events = v.snapshot_events()
    seen: set = set()
    for e in events:  # every parent that is in the view comes before its child
        parent = e.parent_block_hash
        for h in e.block_hashes:
            assert parent is None or parent not in v or parent in seen
            seen.add(h)
            parent = h
    rebuilt = CacheView(keep_blocks=True)
    rebuilt.apply(events)
    assert rebuilt.hashes() == v.hashes() == {1, 2, 3, 4, 10, 11}
    assert {h: rebuilt.copies(h) for h in v.hashes()} == {h: v.copies(h) for h in v.hashes()}
    assert expand(events) == {1: (None, [1, 1], None, None), 2: (1, [2, 2], None, None),
                              3: (2, [3, 3], None, None), 4: (3, [4, 4], None, None),
                              10: (None, [10, 10], ("ad",), "ad"),
                              11: (10, [11, 11], ("ad",), "ad")}
    assert expand(rebuilt.snapshot_events()) == expand(events)
    # a chain is one event; different metadata is not merged into it
    chains = [e.block_hashes for e in events]
    assert [1, 2, 3, 4] in chains and [10, 11] in chains and [2] in chains
    assert [len(e.block_hashes) for e in v.snapshot_events(max_blocks_per_event=2)
            if 3 in e.block_hashes] == [2]


def test_snapshot_needs_kept_blocks():
    with pytest.raises(RuntimeError):
        CacheView().snapshot_events()


def test_view_of_a_real_engine_equals_its_block_pool_and_its_snapshot_rebuilds_it():
    cfg = EngineConfig(cache=CacheConfig(num_gpu_blocks=30, enable_kv_cache_events=True),
                       scheduler=SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=4),
                       check_invariants=True)
    engine = EngineCore(cfg, SimRunner())
    rng = random.Random(11)
    prefix = [rng.randrange(5000) for _ in range(48)]
    view, mirror = CacheView(), CacheView(keep_blocks=True)
    max_copies = 0
    for i in range(40):
        prompt = prefix[:rng.choice((0, 16, 32, 48))] + [rng.randrange(5000)
                                                          for _ in range(rng.randrange(1, 30))]
        if i % 5 == 0:  # exactly two cached blocks: the last is recomputed, a second copy
            prompt = prefix[:32]
        engine.add_request(engine.make_request(f"r{i}", prompt,
                                               SamplingParams(max_tokens=rng.randrange(1, 20))))
        while engine.has_unfinished_requests() and rng.random() < 0.8:
            result = engine.step()
            if result.events is not None:
                view.apply(result.events)
                mirror.apply(result.events)
            pool = engine.block_pool
            physical = {event_int(h): len(pool.cached_block_hash_to_block.blocks_of(h))
                        for h in pool.cached_hashes()}
            assert {h: view.copies(h) for h in view.hashes()} == physical
            max_copies = max([max_copies, *physical.values()])
    rebuilt = CacheView()
    rebuilt.apply(mirror.snapshot_events())
    assert rebuilt.hashes() == view.hashes()
    assert all(rebuilt.copies(h) == view.copies(h) for h in view.hashes())
    assert max_copies > 1  # the same hash was held by several physical blocks at some point
