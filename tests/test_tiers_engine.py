"""Tiers below the block pool (kvloop.kv_transfer.offloading), in process, exact.

A pool of 8 usable blocks of 4 tokens, a host tier of 32 blocks (the simulator's records, all
the same size): a sealed block is written below, an evicted prefix comes back from the tier
through WAITING_FOR_REMOTE_KVS with its cached tokens counted, and each tier publishes its
own BlockStored / BlockRemoved with the pool's hashes, tokens and parents. A torn or forged
record is a miss, counted, dropped, and the request recomputes. Hypothesis: random request
sequences keep the scheduler's invariants and every tier equal to what its events say.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvloop.config import CacheConfig, EngineConfig, KVOffloadConfig, SchedulerConfig
from kvloop.core.engine import EngineCore
from kvloop.core.request import SamplingParams
from kvloop.events.types import (
    LOCALITY_LOCAL,
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    event_int,
)
from kvloop.kv_transfer.offloading import OffloadingConnector
from kvloop.kv_transfer.tier_record import TierBlockHeader, encode_record, record_key
from kvloop.kv_transfer.tiers import FileTier, HostTier, Tier
from kvloop.sim.kv_store import SimKVBlockStore
from kvloop.sim.worker import SimWorkerRunner
from kvloop.trust import FleetSecret
from kvloop.wire import EngineCoreOutput

BS = 4
POOL = 9              # 8 usable blocks and the null block
TIER_BLOCKS = 32
SECRET = FleetSecret.generate()


def record_size(store: SimKVBlockStore) -> int:
    """The size of one simulated block's record (tokens < 128: one msgpack byte each)."""
    header = TierBlockHeader(fingerprint=b"f" * 16, block_hash=b"h" * 32,
                             parent_block_hash=b"p" * 32, token_ids=[1] * BS, block_size=BS,
                             lora_name=None, compressed=False, raw_nbytes=0)
    return len(encode_record(header, [], b"k" * 32))


class Rig:
    """An engine over the simulated runner with an offloading connector over `tiers`."""

    def __init__(self, tiers: list[Tier], threshold: int = 1, runner: Any = None,
                 store: Any = None, blocks: int = POOL, block_size: int = BS,
                 max_model_len: int = 128, compress: bool = False,
                 secret: FleetSecret | None = SECRET):
        self.store = store or SimKVBlockStore(block_size)
        runner = runner or SimWorkerRunner(None, blocks, max_model_len, block_size=block_size)
        offload = KVOffloadConfig(cpu_bytes=1, store_threshold=threshold, compress=compress)
        config = EngineConfig(
            cache=CacheConfig(block_size=block_size, num_gpu_blocks=blocks,
                              enable_kv_cache_events=True),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_model_len, max_num_seqs=4,
                                      max_model_len=max_model_len),
            check_invariants=True, kv_offload=offload)
        self.connector = OffloadingConnector(offload, self.store, tiers, enable_events=True,
                                             secret=secret)
        self.connector.start()
        self.engine = EngineCore(config, runner, blocks, connector=self.connector)
        self.events: list[KVEvent] = []
        self.outputs: dict[str, list[EngineCoreOutput]] = {}

    def step(self) -> None:
        result = self.engine.step()
        if result.events is not None:
            self.events.extend(result.events.events)
        for out in result.outputs:
            self.outputs.setdefault(out.request_id, []).append(out)

    def run(self, rid: str, prompt: list[int], max_tokens: int = 1,
            logprobs: int | None = None) -> EngineCoreOutput:
        """One greedy request to its end, then the tiers' writes drained."""
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                            logprobs=logprobs)
        self.engine.add_request(self.engine.make_request(rid, prompt, sp))
        for _ in range(2000):
            outs = self.outputs.get(rid)
            if outs and outs[-1].finished:
                break
            self.step()
            self.engine.wait_for_work(0.01)
        else:
            raise AssertionError(f"request {rid} did not finish")
        self.flush()
        return self.outputs[rid][-1]

    def flush(self) -> None:
        assert self.connector.drain()
        self.step()      # publishes the tiers' events

    def take(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs[rid] for t in o.new_token_ids]

    def close(self) -> None:
        self.engine.shutdown()


def hashes_of(rig: Rig, prompt: list[int], n: int) -> list[bytes]:
    request = rig.engine.make_request("probe", prompt, SamplingParams(max_tokens=1))
    return list(request.block_hashes[:n])


def summary(events: list[KVEvent]) -> list[tuple[str, str | None, list[int | bytes]]]:
    out = []
    for e in events:
        if isinstance(e, BlockStored):
            out.append(("stored", e.medium, list(e.block_hashes)))
        elif isinstance(e, BlockRemoved):
            out.append(("removed", e.medium, list(e.block_hashes)))
        elif isinstance(e, AllBlocksCleared):
            out.append(("cleared", None, []))
    return out


@pytest.fixture
def host_rig():
    store = SimKVBlockStore(BS)
    rig = Rig([HostTier(TIER_BLOCKS * record_size(store))], store=store)
    yield rig
    rig.close()


A = list(range(1, 18))          # 17 tokens: 4 full blocks and the last token
B = list(range(40, 69))         # 29 tokens: 8 blocks, the whole pool


def test_evict_and_reload_from_host_tier_exact_events(host_rig):
    rig = host_rig
    ha = [event_int(h) for h in hashes_of(rig, A, 4)]
    first = rig.run("a1", A)
    assert first.num_cached_tokens == 0
    events = rig.take()
    assert summary(events) == [("stored", MEDIUM_GPU, ha)] + [
        ("stored", MEDIUM_CPU, [h]) for h in ha]
    cpu = [e for e in events if isinstance(e, BlockStored) and e.medium == MEDIUM_CPU]
    assert [e.parent_block_hash for e in cpu] == [None, *ha[:3]]
    assert [e.token_ids for e in cpu] == [A[i * BS:(i + 1) * BS] for i in range(4)]
    assert all(e.block_size == BS for e in cpu)

    rig.run("b", B)                       # needs all 8 blocks: A leaves the pool
    removed_gpu = [h for kind, medium, hs in summary(rig.take())
                   if kind == "removed" and medium == MEDIUM_GPU for h in hs]
    assert sorted(removed_gpu) == sorted(ha)

    again = rig.run("a2", A)
    assert again.num_cached_tokens == 16     # 4 blocks from the host tier
    assert again.num_external_computed_tokens == 16
    assert rig.tokens("a2") == rig.tokens("a1")
    stored_gpu = [hs for kind, medium, hs in summary(rig.take())
                  if kind == "stored" and medium == MEDIUM_GPU]
    assert stored_gpu == [ha]                 # the loaded blocks enter the pool's cache
    assert rig.connector.record_errors == {}


def test_reset_prefix_cache_empties_the_private_tiers(host_rig):
    """vLLM's `reset_cache`: the pool's AllBlocksCleared, then the host tier's removals."""
    rig = host_rig
    rig.run("a1", A)
    ha = [event_int(h) for h in hashes_of(rig, A, 4)]
    rig.take()
    assert rig.engine.reset_prefix_cache()
    rig.flush()
    assert summary(rig.take()) == [("cleared", None, []), ("removed", MEDIUM_CPU, ha)]
    assert rig.run("a2", A).num_cached_tokens == 0


def test_prefix_cached_in_pool_is_not_loaded(host_rig):
    rig = host_rig
    rig.run("a1", A)
    rig.take()
    out = rig.run("a2", A)
    assert out.num_cached_tokens == 16
    assert not [e for e in rig.take() if isinstance(e, BlockStored)]   # nothing new anywhere


def test_reuse_gate_stores_only_blocks_seen_twice():
    store = SimKVBlockStore(BS)
    tier = HostTier(TIER_BLOCKS * record_size(store))
    rig = Rig([tier], threshold=2, store=store)
    try:
        rig.run("a1", A)
        assert tier.keys() == []              # seen once: not stored
        rig.run("b", B)
        rig.run("a2", A)                      # seen twice: stored now
        assert len(tier.keys()) == 4
        rig.run("b2", B)
        assert rig.run("a3", A).num_cached_tokens == 16
    finally:
        rig.close()


def test_tier_lru_evicts_and_publishes_removal():
    store = SimKVBlockStore(BS)
    tier = HostTier(6 * record_size(store))            # room for 6 blocks
    rig = Rig([tier], store=store)
    try:
        rig.run("a", A)                                 # 4 blocks below
        rig.take()
        c = list(range(80, 93))                         # 13 tokens: 3 full blocks
        rig.run("c", c)
        hc = [event_int(h) for h in hashes_of(rig, c, 3)]
        ha = [event_int(h) for h in hashes_of(rig, A, 4)]
        cpu = [(kind, hs) for kind, medium, hs in summary(rig.take()) if medium == MEDIUM_CPU]
        assert cpu == [("stored", [hc[0]]), ("stored", [hc[1]]), ("stored", [hc[2]]),
                       ("removed", [ha[0]])]
        assert len(tier.keys()) == 6
    finally:
        rig.close()


def corrupt(path: str, how: str) -> None:
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[:len(data) // 2] if how == "torn"
                           else data[:40] + bytes([data[40] ^ 1]) + data[41:])


@pytest.mark.parametrize("how", ["torn", "flipped"])
def test_torn_or_corrupt_disk_block_is_a_miss(tmp_path, how):
    store = SimKVBlockStore(BS)
    rig = Rig([FileTier(str(tmp_path), 1 << 20, shared=False, key_prefix="")], store=store)
    try:
        rig.run("a1", A)
        ha = hashes_of(rig, A, 4)
        corrupt(os.path.join(tmp_path, record_key(rig.connector.fp, ha[2])), how)
        rig.run("b", B)
        rig.take()
        out = rig.run("a2", A)
        assert out.finish_reason is not None and out.error is None
        assert out.num_cached_tokens == 8            # blocks 0 and 1 loaded, 2 and 3 not
        assert out.num_external_computed_tokens == 8
        assert rig.tokens("a2") == rig.tokens("a1")
        assert rig.connector.record_errors == {"disk": 1}
        removed = [(medium, hs) for kind, medium, hs in summary(rig.take())
                   if kind == "removed" and medium == MEDIUM_STORAGE]
        assert removed == [(MEDIUM_STORAGE, [event_int(ha[2])])]
    finally:
        rig.close()


def test_another_fleet_or_model_block_is_a_miss(tmp_path):
    """A record MACed under another fleet's key is refused (never loaded as KV)."""
    store = SimKVBlockStore(BS)
    writer = Rig([FileTier(str(tmp_path), 1 << 20, shared=True, key_prefix="")], store=store)
    writer.run("a1", A)
    writer.close()
    store2 = SimKVBlockStore(BS)
    tier = FileTier(str(tmp_path), 1 << 20, shared=True, key_prefix="")
    offload = KVOffloadConfig(cpu_bytes=1, compress=False)
    other = OffloadingConnector(offload, store2, [tier], enable_events=False,
                                secret=FleetSecret.generate())
    other.start()
    try:
        h = hashes_of(writer, A, 1)[0]
        path = os.path.join(tmp_path, record_key(other.fp, h))
        assert os.path.exists(path) and other._held_below(h)
        assert other._read(h) is None
        assert other.record_errors == {"shared": 1}
        assert os.path.exists(path)      # the fleet's block stays for the fleet
    finally:
        other.shutdown()


def forge(path: str, how: str, secret: FleetSecret, fp: bytes) -> None:
    """A bad record in place of a good one: one bit flipped in its payload MAC region, or the
    same header re-signed with the key anybody can compute (a forger without the secret)."""
    from kvloop.kv_transfer.tier_record import decode_header, tier_key

    data = Path(path).read_bytes()
    if how == "flipped":
        Path(path).write_bytes(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
        return
    header, _ = decode_header(data, tier_key(secret, fp))
    Path(path).write_bytes(encode_record(header, [], tier_key(None, fp)))


@pytest.mark.parametrize("how", ["flipped", "forged"])
def test_bad_shared_record_is_one_miss_then_quarantined(tmp_path, how, caplog):
    """issue 37 (2): a shared store keeps a bad record (nothing of the fleet's is deleted), so
    a lookup would find it again and again: the request loaded it once, recomputes, and the
    record is quarantined until this worker's own write replaces it."""
    store = SimKVBlockStore(BS)
    shared = FileTier(str(tmp_path), 1 << 20, shared=True, key_prefix="")
    rig = Rig([shared], store=store)
    try:
        rig.run("a1", A)
        ha = hashes_of(rig, A, 4)
        path = os.path.join(tmp_path, record_key(rig.connector.fp, ha[0]))
        forge(path, how, SECRET, rig.connector.fp)
        rig.run("b", B)                                  # A leaves the pool
        caplog.clear()
        out = rig.run("a2", A)                           # old code: never finished
        assert out.error is None and out.num_cached_tokens == 0
        assert rig.tokens("a2") == rig.tokens("a1")
        assert rig.connector.record_errors == {"shared": 1}
        refusals = [r for r in caplog.records if "refusing block" in r.getMessage()]
        assert len(refusals) == 1
        # the recompute wrote a good record in its place: the next request loads it
        rig.run("b2", B)
        assert rig.run("a3", A).num_cached_tokens == 16
        assert rig.connector.record_errors == {"shared": 1}
    finally:
        rig.close()


def test_quarantine_is_bounded_and_skips_the_record(tmp_path, monkeypatch):
    """Refused (tier, key) pairs are remembered up to QUARANTINE_MAX, least recent out; a
    quarantined record is neither offered nor read."""
    from kvloop.kv_transfer import offloading

    monkeypatch.setattr(offloading, "QUARANTINE_MAX", 2)
    store = SimKVBlockStore(BS)
    shared = FileTier(str(tmp_path), 1 << 20, shared=True, key_prefix="")
    rig = Rig([shared], store=store)
    try:
        rig.run("a1", A)
        ha = hashes_of(rig, A, 4)
        for h in ha[:3]:
            forge(os.path.join(tmp_path, record_key(rig.connector.fp, h)), "flipped", SECRET,
                  rig.connector.fp)
            assert rig.connector._read(h) is None
        assert rig.connector.record_errors == {"shared": 3}
        assert [rig.connector._held_below(h) for h in ha] == [True, False, False, True]
        assert rig.connector._read(ha[2]) is None          # quarantined: not read again
        assert rig.connector.record_errors == {"shared": 3}
    finally:
        rig.close()


def test_disk_tier_announces_its_blocks_after_a_restart(tmp_path):
    store = SimKVBlockStore(BS)
    rig = Rig([FileTier(str(tmp_path), 1 << 20, shared=False, key_prefix="")], store=store)
    rig.run("a1", A)
    ha = [event_int(h) for h in hashes_of(rig, A, 4)]
    rig.close()
    rig2 = Rig([FileTier(str(tmp_path), 1 << 20, shared=False, key_prefix="")],
               store=SimKVBlockStore(BS))
    try:
        rig2.flush()
        stored = [e for e in rig2.take() if isinstance(e, BlockStored)]
        assert [e.block_hashes for e in stored] == [[h] for h in ha]     # parents first
        assert all(e.medium == MEDIUM_STORAGE and e.locality == LOCALITY_LOCAL
                   and e.block_size == BS for e in stored)
        assert [e.parent_block_hash for e in stored] == [None, *ha[:3]]
        assert rig2.run("a2", A).num_cached_tokens == 16
    finally:
        rig2.close()


def test_disk_tier_refuses_a_directory_others_can_write(tmp_path):
    """issue 37 (7): a pre-existing 0777 tier directory (or one another user owns) could hold
    another local user's records: refused at start; a new one is created 0700."""
    import stat

    from kvloop.kv_transfer.tiers import check_private_dir

    shared_dir = tmp_path / "open"
    shared_dir.mkdir()
    os.chmod(shared_dir, 0o777)
    with pytest.raises(ValueError, match="writable by other users"):
        FileTier(str(shared_dir), 1 << 20, shared=False, key_prefix="")
    os.chmod(shared_dir, 0o770)
    with pytest.raises(ValueError, match="writable by other users"):
        check_private_dir(str(shared_dir))
    old = os.umask(0)
    try:
        FileTier(str(tmp_path / "new" / "tier"), 1 << 20, shared=False, key_prefix="")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "new" / "tier").st_mode) == 0o700
    if os.geteuid() == 0:                     # as root: a directory another user owns
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(ValueError, match="belongs to uid 65534"):
            FileTier(str(theirs), 1 << 20, shared=False, key_prefix="")


def test_without_a_secret_the_disk_tier_trusts_only_its_own_records(tmp_path):
    """issue 37 (7): without a fleet secret a record's MAC is a checksum anybody computes, so
    records found at start (planted, or a previous run's) are removed, never served; with
    the secret a restart still finds its blocks (test above)."""
    from kvloop.kv_transfer.tiers import make_tiers

    prefix = "ab" * 16
    store = SimKVBlockStore(BS)
    rig = Rig([FileTier(str(tmp_path), 1 << 20, shared=False, key_prefix="",
                        trust_existing=False)], store=store, secret=None)
    rig.run("a1", A)
    rig.close()
    planted = sorted(os.listdir(tmp_path))
    assert len(planted) == 4
    rig2 = Rig([FileTier(str(tmp_path), 1 << 20, shared=False, key_prefix="",
                         trust_existing=False)], store=SimKVBlockStore(BS), secret=None)
    try:
        rig2.flush()
        assert not [e for e in rig2.take() if isinstance(e, BlockStored)]   # nothing announced
        assert rig2.run("a2", A).num_cached_tokens == 0                     # nothing served
        assert rig2.connector.record_errors == {}
    finally:
        rig2.close()
    # the wiring: the configured disk tier trusts its files only when records are signed
    config = KVOffloadConfig(cpu_bytes=0, disk_path=str(tmp_path), disk_bytes=1 << 20)
    for name in planted:
        (tmp_path / f"{prefix}-{name}").write_bytes(b"x")
    [signed] = make_tiers(config, prefix, signed=True)
    assert len(signed.keys()) == 4
    [unsigned] = make_tiers(config, prefix, signed=False)
    assert unsigned.keys() == [] and not [n for n in os.listdir(tmp_path)
                                          if n.startswith(prefix)]


# --- hypothesis: many requests, invariants across tiers -----------------------------------------
PREFIXES = [list(range(1 + 20 * k, 1 + 20 * k + 12)) for k in range(4)]


class TierView:
    """Per medium, the hashes its events say it holds."""

    def __init__(self) -> None:
        self.held: dict[str | None, dict[int | bytes, int]] = {}

    def apply(self, events: list[KVEvent]) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                view = self.held.setdefault(e.medium, {})
                for h in e.block_hashes:
                    view[h] = view.get(h, 0) + 1
            elif isinstance(e, BlockRemoved):
                view = self.held.setdefault(e.medium, {})
                for h in e.block_hashes:
                    view[h] -= 1
                    if not view[h]:
                        del view[h]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 9), st.integers(1, 3)),
                min_size=1, max_size=12))
def test_random_requests_keep_tiers_and_events_in_step(tmp_path_factory, plan):
    store = SimKVBlockStore(BS)
    size = record_size(store)
    host = HostTier(TIER_BLOCKS * size)
    disk = FileTier(str(tmp_path_factory.mktemp("disk")), 12 * size, shared=False,
                    key_prefix="")
    rig = Rig([host, disk], store=store)
    view = TierView()
    try:
        for i, (prefix, tail, max_tokens) in enumerate(plan):
            prompt = PREFIXES[prefix] + [100 + tail] * (1 + tail)
            out = rig.run(f"r{i}", prompt, max_tokens)
            assert out.error is None
            assert out.num_cached_tokens <= len(prompt) - 1
            view.apply(rig.take())
            host_held = {event_int(bytes.fromhex(k.rsplit("-", 1)[1])) for k in host.keys()}
            disk_held = {event_int(bytes.fromhex(k.rsplit("-", 1)[1])) for k in disk.keys()}
            assert set(view.held.get(MEDIUM_CPU, {})) == host_held
            assert set(view.held.get(MEDIUM_STORAGE, {})) == disk_held
            assert len(host_held) <= TIER_BLOCKS and len(disk_held) <= 12
            pool = {event_int(h) for h in rig.engine.block_pool.cached_hashes()}
            assert set(view.held.get(MEDIUM_GPU, {})) == pool
        assert rig.connector.record_errors == {}
    finally:
        rig.close()


def test_dynamo_tier_names_on_the_nats_plane():
    """Each tier's events carry Dynamo's storage_tier: device, host_pinned, disk, external."""
    import json

    from kvloop.events.nats_plane import encode_dynamo
    from kvloop.events.types import LOCALITY_REMOTE

    def stored(medium: str, locality: str | None = None) -> BlockStored:
        return BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1] * BS,
                           block_size=BS, lora_id=None, medium=medium, lora_name=None,
                           locality=locality)

    events: list[KVEvent] = [stored(MEDIUM_GPU), stored(MEDIUM_CPU),
                             stored(MEDIUM_STORAGE, LOCALITY_LOCAL),
                             stored(MEDIUM_STORAGE, LOCALITY_REMOTE)]
    tiers = [json.loads(m)["storage_tier"] for m in encode_dynamo(events, 7, 0, 0)]
    assert tiers == ["device", "host_pinned", "disk", "external"]


def test_snapshot_covers_every_tier(host_rig):
    """The publisher's mirror (a CacheView) keeps each copy's tier: after the pool evicts a
    prefix the host tier still holds, a snapshot re-announces it as CPU, chain intact."""
    from kvloop.events.view import CacheView

    rig = host_rig
    mirror = CacheView(keep_blocks=True)
    rig.run("a", A)
    rig.run("b", B)
    mirror.apply(rig.take())
    ha = [event_int(h) for h in hashes_of(rig, A, 4)]
    snap = mirror.snapshot_events()
    of_a = [e for e in snap if set(e.block_hashes) & set(ha)]
    assert [(e.medium, e.block_hashes, e.parent_block_hash) for e in of_a] == [
        (MEDIUM_CPU, ha, None)]
    assert of_a[0].token_ids == A[:16]
    rebuilt = CacheView(keep_blocks=True)
    rebuilt.apply(snap)
    assert sorted(map(summary_key, rebuilt.snapshot_events())) == sorted(map(summary_key, snap))


def summary_key(e: BlockStored) -> tuple[Any, ...]:
    return (e.medium, tuple(e.block_hashes), e.parent_block_hash)


# --- flags and vLLM's --kv-transfer-config spelling ---------------------------------------------
def tier_config(*argv: str) -> EngineConfig:
    from kvloop.server import cli_args
    from tests.test_serve_cli import serve_args

    return cli_args.engine_config(serve_args("sim", *argv))


def test_tier_flags_and_vllm_json_give_the_same_host_tier():
    import json

    flags = tier_config("--kv-offloading-backend", "native", "--kv-offloading-size", "0.5",
                        "--kv-offload-store-threshold", "2")
    vllm = tier_config("--kv-transfer-config", json.dumps({
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 29, "store_threshold": 2}}))
    assert flags.kv_offload == vllm.kv_offload
    assert flags.kv_offload is not None and flags.kv_offload.cpu_bytes == 1 << 29
    assert vllm.kv_transfer is None
    disk = tier_config("--kv-disk-path", "/tmp/kv", "--kv-disk-size", "1")
    assert disk.kv_offload is not None and disk.kv_offload.disk_bytes == 1 << 30


def test_pd_and_tier_flags_compose_on_a_decode_worker():
    """--kv-transfer-config (P/D) and the tier flags give one config with both; a decode
    worker with a tier keeps prefix caching (the tiers' keys are block hashes)."""
    both = tier_config("--role", "decode", "--kv-disk-path", "/tmp/kv", "--kv-disk-size", "1",
                       "--kv-transfer-config",
                       '{"kv_connector": "KvloopConnector", "kv_role": "kv_consumer"}')
    assert both.kv_transfer is not None and both.kv_transfer.kv_role == "kv_consumer"
    assert both.kv_offload is not None and both.kv_offload.disk_path == "/tmp/kv"
    assert both.cache.enable_prefix_caching
    assert not tier_config("--role", "decode").cache.enable_prefix_caching


@pytest.mark.parametrize(("argv", "why"), [
    (["--kv-offloading-size", "1"], "go together"),
    (["--kv-disk-path", "/tmp/kv"], "--kv-disk-size"),
    (["--kv-shared-store", "redis://u:p@h:1"], "no credentials"),
    (["--kv-shared-store", "http://h:1"], "redis://HOST:PORT or file:///DIR"),
    (["--kv-transfer-config", '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",'
      ' "kv_connector_extra_config": {"cpu_bytes_to_use": 1, "spec_name": "x"}}'], "spec_name"),
    (["--kv-transfer-config", '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",'
      ' "kv_connector_extra_config": {"cpu_bytes_to_use": 1, "block_size": 64}}'],
     "block_size"),
])
def test_bad_tier_settings_are_refused_naming_the_problem(argv, why):
    with pytest.raises(ValueError, match=why):
        tier_config(*argv)


# --- records ------------------------------------------------------------------------------------
def test_record_checks_refuse_what_a_writer_with_the_key_could_still_get_wrong():
    import zlib

    from kvloop.kv_transfer.tier_record import (
        RecordError,
        ShortPrefix,
        decode_header,
        decode_record,
    )

    key, fp, h = b"k" * 32, b"f" * 16, b"h" * 32
    frames = [bytes([i]) * 8 for i in range(2)]            # 2 layers of 8 bytes

    def header(**kw: Any) -> TierBlockHeader:
        base: dict[str, Any] = dict(fingerprint=fp, block_hash=h, parent_block_hash=None,
                                    token_ids=[1, 2], block_size=2, lora_name=None,
                                    compressed=True, raw_nbytes=16)
        return TierBlockHeader(**{**base, **kw})

    good = encode_record(header(), frames, key)
    assert decode_record(good, key, fp, h, 2, 16)[1] == frames
    end = decode_header(good, key)[1]
    assert decode_header(good[:end], key)[0] == header()      # from the first bytes alone
    with pytest.raises(ShortPrefix):
        decode_header(good[:end - 1], key)
    with pytest.raises(RecordError, match="block of 16 bytes, expected 8"):
        decode_record(good, key, fp, h, 2, 8)                   # another geometry
    with pytest.raises(RecordError, match="MAC"):
        decode_record(good, b"x" * 32, fp, h, 2, 16)            # another fleet
    with pytest.raises(RecordError, match="block hash"):
        decode_record(good, key, fp, b"g" * 32, 2, 16)
    with pytest.raises(RecordError, match="fingerprint"):
        decode_record(good, key, b"e" * 16, h, 2, 16)
    # a bomb MACed by a key holder: inflated no further than the block's size
    bomb_header = header()
    head = encode_record(bomb_header, frames, key)
    bomb = zlib.compress(b"\0" * (64 << 20), 9)
    forged = _reseal(head, bomb, key)
    with pytest.raises(RecordError, match="truncated or too large"):
        decode_record(forged, key, fp, h, 2, 16)


def _reseal(record: bytes, payload: bytes, key: bytes) -> bytes:
    """`record` with its payload replaced and its MAC recomputed (a key holder's forgery)."""
    import hashlib
    import hmac

    from kvloop.kv_transfer.tier_record import decode_header

    _, end = decode_header(record, key)
    body = record[:end] + payload
    return body + hmac.new(key, body, hashlib.sha256).digest()


def test_a_torn_file_found_at_restart_is_dropped_not_announced(tmp_path):
    store = SimKVBlockStore(BS)
    rig = Rig([FileTier(str(tmp_path), 1 << 20, shared=False, key_prefix="")], store=store)
    rig.run("a1", A)
    ha = hashes_of(rig, A, 4)
    rig.close()
    path = os.path.join(tmp_path, record_key(rig.connector.fp, ha[3]))
    Path(path).write_bytes(Path(path).read_bytes()[:20])
    rig2 = Rig([FileTier(str(tmp_path), 1 << 20, shared=False, key_prefix="")],
               store=SimKVBlockStore(BS))
    try:
        rig2.flush()
        stored = [h for e in rig2.take() if isinstance(e, BlockStored) for h in e.block_hashes]
        assert stored == [event_int(h) for h in ha[:3]]
        assert rig2.connector.record_errors == {"disk": 1} and not os.path.exists(path)
        assert rig2.run("a2", A).num_cached_tokens == 12
    finally:
        rig2.close()
