"""The global prefix index: exact entries, consecutive matches, bounds, provisional TTLs."""

from __future__ import annotations

import random
import threading

import pytest

from kvloop.router.config import IndexConfig
from kvloop.router.index import PrefixIndex, to_u64

from .conftest import FakeClock


def make(**kw) -> tuple[PrefixIndex, FakeClock]:
    clock = FakeClock(100.0)
    idx = PrefixIndex(IndexConfig(**kw), clock)
    for name in ("a", "b", "c"):
        idx.add_worker(name)
    return idx, clock


def test_to_u64_matches_event_conventions():
    assert to_u64(5) == 5
    assert to_u64(-1) == (1 << 64) - 1
    assert to_u64(bytes(range(32))) == int.from_bytes(bytes(range(24, 32)), "big")
    assert to_u64(b"\x01\x02") == 0x0102


def test_match_is_longest_consecutive_prefix_per_worker():
    idx, _ = make()
    idx.store("a", [1, 2, 3, 4])
    idx.store("b", [1, 2, 9, 4])  # holds 4 but not 3: consecutiveness stops at 2
    idx.store("c", [2, 3])        # no block 0: no match at all
    assert idx.match([1, 2, 3, 4]) == {"a": 4, "b": 2}
    assert idx.match([1, 2, 3, 4], ["b", "c"]) == {"b": 2}
    assert idx.match([7, 1]) == {}
    assert idx.match([]) == {}
    idx.check_invariants()


def test_remove_and_duplicate_stores_are_counted():
    idx, _ = make()
    idx.store("a", [1, 2])
    idx.store("a", [2])           # a second block with the same content
    idx.remove("a", [2])
    assert idx.match([1, 2]) == {"a": 2}
    idx.remove("a", [2])
    assert idx.match([1, 2]) == {"a": 1}
    idx.remove("a", [42])         # unknown hash: ignored
    assert idx.num_blocks() == 1
    idx.check_invariants()


def test_clear_and_remove_worker_drop_only_that_worker():
    idx, _ = make()
    idx.store("a", [1, 2])
    idx.store("b", [1, 2, 3])
    assert idx.clear_worker("a") == 2
    assert idx.match([1, 2, 3]) == {"b": 3}
    assert idx.remove_worker("b") == 3
    assert idx.num_blocks() == 0 and idx.num_hashes() == 0
    assert "b" not in idx.workers()
    with pytest.raises(KeyError):
        idx.store("b", [1])
    idx.check_invariants()


def test_slots_are_reused_and_never_leak_entries_to_a_new_worker():
    idx, _ = make()
    idx.store("b", [5])
    idx.remove_worker("b")
    idx.add_worker("d")           # takes b's freed slot
    assert idx.match([5]) == {}
    idx.store("d", [5])
    assert idx.match([5]) == {"d": 1}


def test_per_worker_capacity_evicts_least_recently_stored():
    clock = FakeClock(100.0)
    idx = PrefixIndex(IndexConfig(capacity_slack=1.0), clock)
    idx.add_worker("a", capacity_blocks=3)  # cap = 3 * 1.0 + 1 = 4
    idx.store("a", [1, 2, 3, 4])
    idx.store("a", [1])           # re-store refreshes 1
    res = idx.store("a", [5])
    assert res.evicted == 1
    assert idx.hashes_of("a") == {1, 3, 4, 5}
    assert idx.worker_evictions("a") == 1
    idx.check_invariants()


def test_touch_refreshes_recency():
    idx = PrefixIndex(IndexConfig(capacity_slack=1.0), FakeClock(100.0))
    idx.add_worker("a", capacity_blocks=2)  # cap 3
    idx.store("a", [1, 2, 3])
    assert idx.touch("a", [1, 99]) == 1
    idx.store("a", [4])
    assert idx.hashes_of("a") == {1, 3, 4}
    assert idx.touch("nobody", [1]) == 0


def test_fleet_bound_evicts_from_the_largest_worker():
    idx, _ = make(max_blocks=5)
    idx.store("a", [1, 2, 3])
    idx.store("b", [10, 11])
    idx.store("b", [12])          # 6 > 5: the largest (a) loses its oldest
    assert idx.num_blocks() == 5
    assert idx.hashes_of("a") == {2, 3}
    assert idx.hashes_of("b") == {10, 11, 12}
    idx.check_invariants()


def test_provisional_entries_live_until_ttl_or_confirmation():
    idx, clock = make(provisional_ttl_s=2.0)
    idx.store("a", [1])
    assert idx.add_provisional("b", [1, 2, 3]) == 3
    assert idx.match([1, 2, 3]) == {"a": 1, "b": 3}
    assert idx.match([1, 2, 3], include_provisional=False) == {"a": 1}
    clock.t += 1.0
    idx.store("b", [1, 2])        # confirms 1 and 2; 3 stays provisional
    assert idx.num_provisional() == 1
    clock.t += 1.5                # 3's guess expires, the confirmed entries stay
    assert idx.match([1, 2, 3]) == {"a": 1, "b": 2}
    assert idx.num_provisional() == 0
    idx.check_invariants()


def test_provisional_refresh_extends_and_clear_drops():
    idx, clock = make(provisional_ttl_s=2.0)
    idx.add_provisional("c", [7])
    clock.t += 1.5
    assert idx.add_provisional("c", [7]) == 0   # refreshed, not new
    clock.t += 1.0
    assert idx.match([7]) == {"c": 1}
    idx.clear_worker("c")
    assert idx.match([7]) == {}


def test_zero_ttl_disables_provisional():
    idx, _ = make(provisional_ttl_s=0.0)
    assert idx.add_provisional("a", [1]) == 0
    assert idx.match([1]) == {}


def test_randomized_against_a_reference_model():
    rng = random.Random(7)
    idx, _ = make()
    ref: dict[str, dict[int, int]] = {"a": {}, "b": {}, "c": {}}
    for _ in range(3000):
        w = rng.choice("abc")
        op = rng.random()
        hs = [rng.randrange(40) for _ in range(rng.randrange(1, 5))]
        if op < 0.55:
            idx.store(w, hs)
            for h in hs:
                ref[w][h] = ref[w].get(h, 0) + 1
        elif op < 0.95:
            idx.remove(w, hs)
            for h in hs:
                if h in ref[w]:
                    ref[w][h] -= 1
                    if not ref[w][h]:
                        del ref[w][h]
        else:
            idx.clear_worker(w)
            ref[w].clear()
        query = [rng.randrange(40) for _ in range(4)]
        expect = {}
        for name, held in ref.items():
            d = 0
            while d < len(query) and query[d] in held:
                d += 1
            if d:
                expect[name] = d
        assert idx.match(query, include_provisional=False) == expect
    idx.check_invariants()


def test_concurrent_writers_and_readers_keep_invariants():
    idx, _ = make(num_shards=4)
    errors: list[BaseException] = []

    def writer(name: str, seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(2000):
                hs = [rng.randrange(200) for _ in range(3)]
                if rng.random() < 0.6:
                    idx.store(name, hs)
                else:
                    idx.remove(name, hs)
        except BaseException as e:  # surfaced below
            errors.append(e)

    def reader() -> None:
        try:
            for i in range(2000):
                idx.match([i % 200, (i + 1) % 200])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(n, i)) for i, n in enumerate("abc")]
    threads.append(threading.Thread(target=reader))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    idx.check_invariants()
