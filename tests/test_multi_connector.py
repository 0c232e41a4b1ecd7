"""P/D and a tier on one engine (kvloop.kv_transfer.multi.MultiConnector), in process, exact.

A prefill engine P (KvloopConnector) and a decode engine D whose connector list is
[KvloopConnector, OffloadingConnector over a host tier], simulated runners, a pool of 8 usable
blocks of 16 tokens on D, a real side channel on 127.0.0.1 between them:

- D pulls a prompt from P (the P/D connector is the loader) and saves it to its tier too
  (save to all): the pool's BlockStored, then one host-tier BlockStored per block, in order;
- once the prompt left D's pool, D loads it from the tier (the first connector with the
  blocks), P untouched; the pool's BlockStored again, and no second write below;
- a prefill engine with a tier holds its blocks for D (P/D) and writes them below (tiers).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvloop.config import CacheConfig, EngineConfig, KVOffloadConfig, SchedulerConfig
from kvloop.core.engine import EngineCore
from kvloop.core.request import SamplingParams
from kvloop.events.types import MEDIUM_CPU, MEDIUM_GPU, event_int
from kvloop.kv_transfer import KvloopConnector
from kvloop.kv_transfer.multi import MultiConnector, merge_stats
from kvloop.kv_transfer.offloading import OffloadingConnector
from kvloop.kv_transfer.tiers import HostTier
from kvloop.sim.kv_store import SimKVBlockStore
from kvloop.sim.worker import SimWorkerRunner
from kvloop.wire import KVTransferStats

from .test_pd_engine import (
    _EVENTS,
    BS,
    SECRET,
    Stats,
    generate,
    kv_config,
    prefill,
    settle,
    sim_engine,
    step,
)
from .test_tiers_engine import summary

pytestmark = pytest.mark.processes     # the engines listen on a side channel

POOL = 9                                 # 8 usable blocks and the null block
A = list(range(1, 66))                   # 65 tokens: 4 full blocks and the last token
B = list(range(100, 220))                # 120 tokens: with its output, the whole pool


class MultiRig:
    """An engine over the simulator with [KvloopConnector, OffloadingConnector(host)]."""

    def __init__(self, role: str = "kv_both", blocks: int = POOL):
        store = SimKVBlockStore(BS)
        offload = KVOffloadConfig(cpu_bytes=1)
        self.pd = KvloopConnector(kv_config(role), store, secret=SECRET)
        self.tiers = OffloadingConnector(offload, store, [HostTier(1 << 20)],
                                         enable_events=True, secret=SECRET)
        self.connector = MultiConnector([self.pd, self.tiers])
        self.connector.start()
        config = EngineConfig(
            cache=CacheConfig(block_size=BS, num_gpu_blocks=blocks,
                              enable_kv_cache_events=True),
            scheduler=SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=4,
                                      max_model_len=128),
            check_invariants=True, kv_transfer=kv_config(role), kv_offload=offload)
        self.engine = EngineCore(config, SimWorkerRunner(None, blocks, 128), blocks,
                                 connector=self.connector)

    def events(self) -> list[tuple[str, str | None, list[int | bytes]]]:
        """The KV events published since the last call, summarized."""
        assert self.tiers.drain()
        step(self.engine)       # publishes what the tier's thread wrote meanwhile
        return summary(_EVENTS.pop(id(self.engine), []))


@pytest.fixture
def rigs() -> Iterator[tuple[EngineCore, MultiRig]]:
    p = sim_engine(blocks=20)
    d = MultiRig()
    yield p, d
    d.engine.shutdown()
    p.shutdown()


def hashes(engine: EngineCore, prompt: list[int], n: int) -> list[int | bytes]:
    request = engine.make_request("probe", prompt, SamplingParams(max_tokens=1))
    return [event_int(h) for h in request.block_hashes[:n]]


def test_decode_pulls_from_p_saves_below_and_later_loads_from_its_tier(rigs):
    p, d = rigs
    ha = hashes(d.engine, A, 4)
    p_stats = Stats()
    params = prefill(p, "a-p", A, p_stats)
    d_stats = Stats()
    tokens, out = generate(d.engine, "a-d", A, 2, params, d_stats)
    assert out.error is None and len(tokens) == 2
    assert d_stats.total.transfers_received == 1            # the P/D connector loaded
    assert d.events() == [("stored", MEDIUM_GPU, ha)] + [
        ("stored", MEDIUM_CPU, [h]) for h in ha]             # and the tier saved them

    generate(d.engine, "b", B, 1)                            # the pool's 8 blocks: A leaves
    removed = [h for kind, medium, hs in d.events()
               if kind == "removed" and medium == MEDIUM_GPU for h in hs]
    assert sorted(removed, key=str) == sorted(ha, key=str)

    settle(p, stats=p_stats)                                 # P's Read served, counted
    assert p_stats.total.transfers_sent == 1
    again_stats = Stats()
    _, again = generate(d.engine, "a-again", A, 2, stats=again_stats)
    assert again.num_cached_tokens == 4 * BS                  # from the host tier
    assert again.num_external_computed_tokens == 4 * BS
    assert again_stats.total.transfers_received == 1
    settle(p, stats=p_stats)
    assert p_stats.total.transfers_sent == 1                 # P was not asked again
    hb = hashes(d.engine, B, 7)
    stored = [e for e in d.events() if e[0] == "stored" or e[2][0] not in hb]
    assert stored == [("stored", MEDIUM_GPU, ha)]    # B's blocks made room; nothing new below
    d.engine.scheduler.check_invariants()


def test_a_prefill_engine_with_a_tier_holds_for_d_and_saves_below():
    p = MultiRig(blocks=20)
    try:
        ha = hashes(p.engine, A, 4)
        params = prefill(p.engine, "a", A)
        assert params["do_remote_prefill"] is True and len(params["remote_block_ids"]) == 5
        assert p.engine.has_transfers()                      # the lease holds the blocks
        assert p.connector.request_ids_in_transfer() == {"a"}
        events = summary(_EVENTS.pop(id(p.engine), []))
        assert ("stored", MEDIUM_GPU, ha) in events
        assert p.events() == [("stored", MEDIUM_CPU, [h]) for h in ha]
    finally:
        p.engine.shutdown()


def test_stats_of_several_connectors_add_up():
    a = KVTransferStats(transfers_sent=1, bytes_sent=10, transfer_seconds=[0.5],
                        failures={"error": 1}, held_requests=2)
    b = KVTransferStats(transfers_received=3, transfer_seconds=[0.25], failures={"error": 2,
                        "mismatch": 1}, loading_requests=1)
    total = merge_stats([a, b])
    assert (total.transfers_sent, total.transfers_received, total.bytes_sent) == (1, 3, 10)
    assert total.transfer_seconds == [0.5, 0.25]
    assert total.failures == {"error": 3, "mismatch": 1}
    assert (total.held_requests, total.loading_requests) == (2, 1)


class Holder:
    """A connector that offers `offer` tokens, holds finished requests' blocks, and reports
    them in `finished_sending` when told (what a P/D connector and a tier do, reduced)."""

    def __init__(self, offer: int | None):
        self.offer = offer
        self.allocs: list[tuple[list[int], int]] = []
        self.done: set[str] = set()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return (self.offer, bool(self.offer))

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocs.append((list(block_ids), num_external_tokens))

    def request_finished(self, request, block_ids):
        return True, ({"from": id(self)} if self.offer else None)

    def get_finished(self, finished_req_ids):
        from kvloop.core.outputs import KVConnectorOutput

        out = KVConnectorOutput(finished_sending=set(self.done))
        self.done.clear()
        return out


def test_the_first_offer_loads_and_a_request_is_freed_when_its_last_holder_reports():
    first, second = Holder(0), Holder(32)
    multi = MultiConnector([first, second])       # type: ignore[list-item]
    request = d_request()
    assert multi.get_num_new_matched_tokens(request, 0) == (32, True)
    multi.update_state_after_alloc(request, [3, 4], 32)
    assert (first.allocs, second.allocs) == ([([3, 4], 0)], [([3, 4], 32)])
    assert multi.request_finished(request, [3, 4]) == (True, {"from": id(second)})
    first.done.add(request.request_id)
    assert multi.get_finished(set()).finished_sending == set()       # one holder left
    second.done.add(request.request_id)
    assert multi.get_finished(set()).finished_sending == {request.request_id}
    assert Holder(None).get_num_new_matched_tokens(request, 0)[0] is None
    assert MultiConnector([Holder(None), second]).get_num_new_matched_tokens(  # type: ignore[list-item]
        request, 0) == (None, False)                                # still looking: ask again


def d_request():
    from kvloop.core.request import Request

    return Request("r", list(range(40)), SamplingParams(max_tokens=1), 0.0, None)
