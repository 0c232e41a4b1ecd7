"""OffloadingConnector: tiers below the block pool, as vLLM's offloading connector is one.

A KV connector like `KvloopConnector` (the core's `KVConnector`), so a tier hit takes the
path a remote prefill takes: nothing new in the scheduler.

- **Store (write-through on seal).** `build_connector_meta` lists the blocks each scheduled
  request fills this step (those past what it already stored, loaded or hit), keeping only
  blocks whose hash passed the reuse gate (`store_threshold` lookups, vLLM's
  `FilterReusedOffloadingManager`). After the forward pass, `wait_for_save` copies their
  bytes out of the runner's cache (on the engine thread: the block may be reused next step)
  and queues them; the I/O thread encodes each block once (`tier_record`) and puts it into
  every tier that lacks it, fastest first, publishing `BlockStored` per tier and
  `BlockRemoved` for what each tier evicted.
- **Load.** `get_num_new_matched_tokens` offers the longest run of blocks past the local hit
  that some tier holds (a run ending before the last prompt token, recomputed as always),
  asynchronously: the request waits in WAITING_FOR_REMOTE_KVS at no token cost.
  `update_state_after_alloc` makes the load; the I/O thread reads each block from the
  fastest tier holding it, checks it (MAC, fingerprint, hash, size) and writes it into the
  runner's cache; a block that fails is a miss, counted, dropped from its tier: the request
  recomputes from there (`recompute_recving`, whatever the load-failure policy). A block
  found only in a slower tier is copied into the faster ones.
- **Refused records.** A record that fails its checks costs a request one load at most: a
  request whose load failed is offered nothing more (it recomputes), and the record's key is
  quarantined for this worker (`QUARANTINE_MAX` keys, least recent out) so no lookup offers
  it again: a shared store keeps a bad record (another worker may hold the key that accepts
  it) and would otherwise be found again at every lookup. A record this worker writes under
  the key lifts its quarantine. Each refusal counts as `kvloop:kv_transfer_failures_total`
  `{reason="corrupt"}` (or `mismatch`: another model), in `record_errors` per tier, and in
  a warning throttled to one line per `WARN_EVERY_S`.
- **Restart.** Tiers that survive a restart (the disk) are read at start: every record whose
  MAC and fingerprint check out is announced as a `BlockStored` (parents first). Only with
  the fleet secret: without it a record's MAC is a checksum anybody computes, so the disk
  tier keeps only what this process writes (`tiers.FileTier`'s `trust_existing`).

Owner: the engine thread calls every connector method and owns the request tables; the I/O
thread owns the tiers' writes; the two share only queues, the result list and the event list
(under `_lock`). Events carry the block pool's hashes (`event_int` unless raw bytes are
configured), tokens, parent and block size: self-describing in every tier.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvloop.config import CacheConfig, KVOffloadConfig
from kvloop.core.kv_connector import REMOTE_CACHED_TOKENS_KEY, KVBlockStore
from kvloop.core.outputs import KVConnectorOutput, SchedulerOutput
from kvloop.core.request import Request
from kvloop.events.types import BlockRemoved, BlockStored, KVEvent, event_int
from kvloop.kv_transfer.stats import ThrottledLog, TransferCounters
from kvloop.kv_transfer.tier_record import (
    RecordError,
    ShortPrefix,
    TierBlockHeader,
    decode_header,
    decode_record,
    encode_record,
    fingerprint_digest,
    header_span,
    record_key,
    tier_key,
)
from kvloop.kv_transfer.tiers import Tier, make_tiers
from kvloop.trust import FleetSecret
from kvloop.wire import (
    KV_FAILURE_CORRUPT,
    KV_FAILURE_ERROR,
    KV_FAILURE_MISMATCH,
    KVTransferStats,
)

logger = logging.getLogger("kvloop.kv_offload")
MAX_PENDING_STORES = 4096      # blocks queued for the I/O thread; beyond: not stored (counted)
QUARANTINE_MAX = 4096          # refused (tier, key) pairs remembered; beyond: least recent out
_CLEAR = object()              # the I/O thread's job: empty the private tiers


@dataclass
class BlockStore:
    """One sealed block to write below, with what its events and record say."""

    block_id: int
    header: TierBlockHeader
    frames: list[bytes] = field(default_factory=list)   # filled by `wait_for_save`


@dataclass
class TierLoad:
    """One request's blocks to read from the tiers, in prompt order."""

    request_id: str
    blocks: list[tuple[int, bytes]]     # (block id in the pool, block hash)
    started: float


@dataclass
class TierLoadResult:
    request_id: str
    invalid_block_ids: list[int]        # empty: every block loaded
    message: str = ""


@dataclass
class OffloadingConnectorMetadata:
    loads: list[TierLoad] = field(default_factory=list)
    stores: list[BlockStore] = field(default_factory=list)


class OffloadingConnector:
    """Implements `kvloop.core.kv_connector.KVConnector` over `tiers` (see the module
    docstring). `enable_events`: publish the tiers' KV events; `int_hashes`: as the pool."""

    def __init__(self, config: KVOffloadConfig, store: KVBlockStore, tiers: list[Tier], *,
                 enable_events: bool, int_hashes: bool = True,
                 secret: FleetSecret | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.store = store
        self.tiers = tiers
        self.block_size = store.block_size
        self.enable_events = enable_events
        self.int_hashes = int_hashes
        self.clock = clock
        self.fp = fingerprint_digest(store.fingerprint, store.block_size)
        self._block_nbytes = store.block_nbytes if store.has_payload else 0
        self.key = tier_key(secret, self.fp)
        self.counters = TransferCounters()
        self.record_errors: dict[str, int] = {}       # tier name -> records refused
        self._quarantine: OrderedDict[tuple[str, str], None] = OrderedDict()  # refused records
        self._missed: set[str] = set()                # requests whose tier load failed
        self._warn = ThrottledLog(logger, clock=clock)
        self._requests: dict[str, Request] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._stored_upto: dict[str, int] = {}        # leading blocks considered for storing
        self._below: OrderedDict[bytes, None] = OrderedDict()   # hashes put or found below
        self._seen: OrderedDict[bytes, int] = OrderedDict()   # the reuse gate's counts
        self._to_load: list[TierLoad] = []
        self._loading: set[str] = set()
        self._metadata: OffloadingConnectorMetadata | None = None
        self._lock = threading.Lock()
        self._events: list[KVEvent] = []
        self._results: list[TierLoadResult] = []
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._pending_stores = 0
        self._wakeup: Callable[[], None] = _nothing
        self.fault: str | None = None
        self._announce_held()
        self._thread = threading.Thread(target=self._run, name="kv-offload-io", daemon=True)

    def start(self) -> None:
        self._thread.start()
        logger.info("KV offloading tiers: %s", ", ".join(
            f"{t.name} ({t.medium})" for t in self.tiers))

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        self._wakeup = wakeup

    # --- scheduler side -------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        if not request.sampling_params.skips_prefix_cache:
            self._requests[request.request_id] = request

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens past the local hit whose blocks some tier holds with a record not refused
        (side-effect free); none for a request whose tier load failed (it recomputes)."""
        rid = request.request_id
        if rid not in self._requests or rid in self._missed:
            return 0, False
        bs = self.block_size
        first, last = num_computed_tokens // bs, (request.num_tokens - 1) // bs
        keys = [record_key(self.fp, h) for h in request.block_hashes[first:last]]
        held = [False] * len(keys)
        for tier in self.tiers:       # each tier asked once for the whole run
            usable = [has and not self._quarantined(tier, k)
                      for k, has in zip(keys, tier.contains_many(keys), strict=True)]
            held = [a or b for a, b in zip(held, usable, strict=True)]
        n = held.index(False) if False in held else len(held)
        return (n * bs, True) if n else (0, False)

    def _quarantined(self, tier: Tier, key: str) -> bool:
        with self._lock:
            return (tier.name, key) in self._quarantine

    def _held_below(self, block_hash: bytes) -> bool:
        key = record_key(self.fp, block_hash)
        return any(t.contains(key) and not self._quarantined(t, key) for t in self.tiers)

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """Count the prompt's hashes for the reuse gate; make the load of the offered blocks
        (the allocation holds exactly the local hit plus them)."""
        rid = request.request_id
        if rid not in self._requests:
            return
        self._count_seen(request.block_hashes[:request.num_prompt_tokens // self.block_size])
        self._block_ids[rid] = list(block_ids)
        n_ext = num_external_tokens // self.block_size
        if n_ext == 0:
            return
        first = len(block_ids) - n_ext
        hashes = request.block_hashes[first:len(block_ids)]
        self._to_load.append(TierLoad(rid, list(zip(block_ids[first:], hashes, strict=True)),
                                      self.clock()))
        self._loading.add(rid)
        params = dict(request.kv_transfer_params or {})
        params[REMOTE_CACHED_TOKENS_KEY] = len(block_ids) * self.block_size   # a tier's hit
        request.kv_transfer_params = params

    def _count_seen(self, hashes: Sequence[bytes]) -> None:
        seen = self._seen
        for h in hashes:
            seen[h] = seen.get(h, 0) + 1
            seen.move_to_end(h)
        while len(seen) > self.config.max_tracker_size:
            seen.popitem(last=False)

    def build_connector_meta(self, scheduler_output: SchedulerOutput
                             ) -> OffloadingConnectorMetadata:
        """The step's loads, and the blocks its scheduled requests seal (to store)."""
        self._track_block_ids(scheduler_output)
        stores: list[BlockStore] = []
        for rid in scheduler_output.num_scheduled_tokens:
            request = self._requests.get(rid)
            if request is not None:
                stores.extend(self._sealed_blocks(request))
        meta = OffloadingConnectorMetadata(self._to_load, stores)
        self._to_load = []
        return meta

    def _track_block_ids(self, out: SchedulerOutput) -> None:
        for new in out.scheduled_new_reqs:
            if new.req_id in self._requests:
                self._block_ids[new.req_id] = list(new.block_ids)
        for cached in out.scheduled_cached_reqs:
            ids = self._block_ids.get(cached.req_id)
            if ids is not None:
                ids.extend(cached.new_block_ids)

    def _sealed_blocks(self, request: Request) -> list[BlockStore]:
        """Blocks full of known tokens after this step, not below yet, past the gate."""
        rid, bs = request.request_id, self.block_size
        hashes = request.block_hashes
        sealed = min(request.num_computed_tokens, request.num_tokens, len(hashes) * bs) // bs
        ids = self._block_ids.get(rid, [])
        sealed = min(sealed, len(ids))
        start = self._stored_upto.get(rid, 0)
        if sealed <= start:
            return []
        self._stored_upto[rid] = sealed
        threshold = self.config.store_threshold
        tokens = request.all_token_ids
        with self._lock:
            below = [h in self._below for h in hashes[start:sealed]]
        return [BlockStore(ids[i], TierBlockHeader(
                    fingerprint=self.fp, block_hash=hashes[i],
                    parent_block_hash=hashes[i - 1] if i else None,
                    token_ids=list(tokens[i * bs:(i + 1) * bs]), block_size=bs,
                    lora_name=request.lora_name, compressed=self.config.compress,
                    raw_nbytes=self._block_nbytes))
                for i in range(start, sealed)
                if self._seen.get(hashes[i], 0) >= threshold and not below[i - start]]

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A load in flight keeps the blocks until it reports (they are being written)."""
        rid = request.request_id
        self._requests.pop(rid, None)
        self._block_ids.pop(rid, None)
        self._stored_upto.pop(rid, None)
        self._missed.discard(rid)
        return rid in self._loading, None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Nothing: `get_finished` already moved the state on."""

    # --- worker side ----------------------------------------------------------------------
    def bind_connector_metadata(self, metadata: object) -> None:
        assert metadata is None or isinstance(metadata, OffloadingConnectorMetadata)
        self._metadata = metadata

    def start_load_kv(self) -> None:
        if self._metadata is not None:
            for load in self._metadata.loads:
                self._jobs.put(load)

    def wait_for_save(self) -> None:
        """Copy the sealed blocks out of the runner's cache (the forward pass filled them)
        and queue them for the I/O thread; beyond `MAX_PENDING_STORES` they are dropped."""
        if self._metadata is None:
            return
        for block in self._metadata.stores:
            with self._lock:
                if self._pending_stores >= MAX_PENDING_STORES:
                    self.counters.add_failure("store_dropped")
                    continue
                self._pending_stores += 1
            block.frames = [bytes(memoryview(f).cast("B"))
                            for f in self.store.read_blocks([block.block_id])]
            self._jobs.put(block)

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        out = KVConnectorOutput()
        with self._lock:
            results, self._results = self._results, []
        for r in results:
            self._loading.discard(r.request_id)
            out.finished_recving.add(r.request_id)
            if r.invalid_block_ids:
                if r.request_id in self._requests:
                    self._missed.add(r.request_id)        # one miss per request, no more
                out.invalid_block_ids.update(r.invalid_block_ids)
                out.failed_recving[r.request_id] = r.message
                out.recompute_recving.add(r.request_id)   # a tier miss: prefill here
        return out

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    # --- the engine loop ------------------------------------------------------------------
    def take_events(self) -> list[KVEvent]:
        """The tiers' KV events since the last call (vLLM's connector `take_events`)."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def reset_cache(self) -> None:
        """The pool was reset: empty the private tiers (host, disk; each drop published as
        `BlockRemoved`), after the writes already queued. A shared store keeps the fleet's
        blocks."""
        self._jobs.put(_CLEAR)

    def take_stats(self) -> KVTransferStats:
        stats = self.counters.take()
        stats.loading_requests = len(self._loading)
        return stats

    def request_ids_in_transfer(self) -> set[str]:
        return set(self._loading)

    def faults(self) -> list[str]:
        return [self.fault] if self.fault is not None else []

    def has_news(self) -> bool:
        """Loads reported, or tier events to publish (after a restart: the disk's blocks)."""
        with self._lock:
            return bool(self._results or self._events)

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until the I/O thread has done everything queued (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._jobs.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.002)
        return not self._jobs.unfinished_tasks

    def shutdown(self) -> None:
        """Finish the queued writes (a restart finds them), then stop."""
        if self._thread.is_alive():
            self.drain()
            self._jobs.put(None)
            self._thread.join(timeout=5.0)
        for tier in self.tiers:
            tier.close()

    # --- the I/O thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                job = self._jobs.get()
                try:
                    if job is None:
                        return
                    if job is _CLEAR:
                        self._clear_private()
                    elif isinstance(job, TierLoad):
                        self._load(job)
                    else:
                        self._store(job)
                finally:
                    self._jobs.task_done()
        except Exception as e:   # a bug or a dead store: report it, the engine stops
            logger.exception("KV offloading I/O thread died")
            self.fault = f"KV offloading I/O thread: {type(e).__name__}: {e}"
            self._wakeup()

    def _clear_private(self) -> None:
        for tier in self.tiers:
            dropped = [_hash_of(k) for k in tier.clear()]
            self._mark_below([], dropped)
            self._emit(tier, stored=[], removed=dropped)

    def _store(self, block: BlockStore) -> None:
        with self._lock:
            self._pending_stores -= 1
        key = record_key(self.fp, block.header.block_hash)
        record = encode_record(block.header, block.frames, self.key)
        for tier in self.tiers:
            if self._quarantined(tier, key) or not tier.contains(key):
                self._put(tier, key, record, block.header)

    def _put(self, tier: Tier, key: str, record: bytes, header: TierBlockHeader) -> None:
        """Write `record` into `tier` (replacing a refused one: its quarantine ends)."""
        evicted = tier.put(key, record)
        with self._lock:
            self._quarantine.pop((tier.name, key), None)
        self.counters.add_sent(len(record))
        removed = [_hash_of(k) for k in evicted]
        self._mark_below([header.block_hash], removed)
        self._emit(tier, stored=[header], removed=removed)

    def _mark_below(self, held: Sequence[bytes], gone: Sequence[bytes]) -> None:
        """Keep `_below` (what the engine thread need not copy out again) in step with the
        tiers, within `max_tracker_size` hashes."""
        with self._lock:
            for h in held:
                self._below[h] = None
                self._below.move_to_end(h)
            for h in gone:
                self._below.pop(h, None)
            while len(self._below) > self.config.max_tracker_size:
                self._below.popitem(last=False)

    def _load(self, load: TierLoad) -> None:
        nbytes = 0
        for i, (block_id, block_hash) in enumerate(load.blocks):
            got = self._read(block_hash)
            if got is None:
                bad = [b for b, _ in load.blocks[i:]]
                self._report(TierLoadResult(load.request_id, bad,
                                            f"{KV_FAILURE_ERROR}: block {i} missed in every "
                                            f"tier"))
                return
            frames, size = got
            if frames:
                self.store.write_blocks([block_id], frames)
            nbytes += size
        self.counters.add_received(nbytes, self.clock() - load.started)
        self._report(TierLoadResult(load.request_id, []))

    def _read(self, block_hash: bytes) -> tuple[list[bytes], int] | None:
        """The block's frames from the fastest tier with a valid record (and the record's
        size), copied into the faster tiers; None: no tier has a valid one."""
        key = record_key(self.fp, block_hash)
        for depth, tier in enumerate(self.tiers):
            record = None if self._quarantined(tier, key) else tier.get(key)
            if record is None:
                continue
            try:
                header, frames = decode_record(record, self.key, self.fp, block_hash,
                                               self.store.fingerprint.num_layers,
                                               self._block_nbytes)
            except RecordError as e:
                self._refuse(tier, key, block_hash, str(e))
                continue
            for faster in self.tiers[:depth]:
                self._put(faster, key, record, header)
            self._mark_below([block_hash], [])
            return frames, len(record)
        return None

    def _refuse(self, tier: Tier, key: str, block_hash: bytes, why: str) -> None:
        """A record that failed its checks: counted, dropped (a private tier) and quarantined
        for this worker (see the module docstring), its removal published."""
        self._warn.warning("KV tier %s: refusing block %s: %s", tier.name,
                           block_hash.hex()[:16], why)
        with self._lock:
            self.record_errors[tier.name] = self.record_errors.get(tier.name, 0) + 1
            self._quarantine[(tier.name, key)] = None
            self._quarantine.move_to_end((tier.name, key))
            while len(self._quarantine) > QUARANTINE_MAX:
                self._quarantine.popitem(last=False)
        self.counters.add_failure(KV_FAILURE_MISMATCH if "fingerprint" in why
                                  else KV_FAILURE_CORRUPT)
        tier.discard(key)
        self._mark_below([], [block_hash])
        self._emit(tier, stored=[], removed=[block_hash])

    def _report(self, result: TierLoadResult) -> None:
        with self._lock:
            self._results.append(result)
        self._wakeup()

    # --- events ---------------------------------------------------------------------------
    def _ext(self, block_hash: bytes) -> int | bytes:
        return event_int(block_hash) if self.int_hashes else block_hash

    def _emit(self, tier: Tier, stored: Sequence[TierBlockHeader],
              removed: Sequence[bytes]) -> None:
        if not self.enable_events or not (stored or removed):
            return
        events: list[KVEvent] = [self._stored_event(tier, h) for h in stored]
        if removed:
            events.append(BlockRemoved(block_hashes=[self._ext(h) for h in removed],
                                       medium=tier.medium, group_idx=0,
                                       locality=tier.locality))
        with self._lock:
            self._events.extend(events)

    def _stored_event(self, tier: Tier, h: TierBlockHeader) -> BlockStored:
        parent = self._ext(h.parent_block_hash) if h.parent_block_hash is not None else None
        return BlockStored(block_hashes=[self._ext(h.block_hash)], parent_block_hash=parent,
                           token_ids=list(h.token_ids), block_size=h.block_size, lora_id=None,
                           medium=tier.medium, lora_name=h.lora_name, group_idx=0,
                           kv_cache_spec_kind="full_attention", locality=tier.locality)

    def _announce_held(self) -> None:
        """BlockStored for every valid record a tier already holds (after a restart),
        parents before children; invalid ones are dropped and counted."""
        for tier in self.tiers:
            headers: dict[bytes, TierBlockHeader] = {}
            for key in tier.keys():
                try:
                    header = self._read_header(tier, key)
                except RecordError as e:
                    self._refuse(tier, key, _hash_of(key), str(e))
                    continue
                if header is not None:
                    headers[header.block_hash] = header
            self._mark_below(list(headers), [])
            self._emit(tier, stored=_parents_first(headers), removed=[])
            if headers:   # a restart that found its blocks says so (start-up's one line)
                logger.info("KV tier %s: %d blocks found from before, announced", tier.name,
                            len(headers))


    def _read_header(self, tier: Tier, key: str) -> TierBlockHeader | None:
        """A held record's checked header, read from its first bytes (the whole record only
        when its header is unusually long); None: gone meanwhile."""
        prefix = tier.head(key, header_span(self.block_size))
        if prefix is None:
            return None
        try:
            header, _ = decode_header(prefix, self.key)
        except ShortPrefix:
            record = tier.get(key)
            if record is None:
                return None
            header, _ = decode_header(record, self.key)
        if header.fingerprint != self.fp or key != record_key(self.fp, header.block_hash):
            raise RecordError("fingerprint or key mismatch")
        return header


def _parents_first(headers: dict[bytes, TierBlockHeader]) -> list[TierBlockHeader]:
    children: dict[bytes | None, list[bytes]] = {}
    for h, header in headers.items():
        parent = header.parent_block_hash if header.parent_block_hash in headers else None
        children.setdefault(parent, []).append(h)
    order: list[TierBlockHeader] = []
    todo = list(children.get(None, []))
    while todo:
        h = todo.pop()
        order.append(headers[h])
        todo.extend(children.get(h, []))
    return order


def _hash_of(key: str) -> bytes:
    """The block hash a record key names (`record_key`'s second half)."""
    return bytes.fromhex(key.rsplit("-", 1)[-1])


def _nothing() -> None:
    pass


def make_offloading_connector(config: KVOffloadConfig, runner: object, cache: CacheConfig,
                              secret: FleetSecret | None = None) -> OffloadingConnector:
    """The offloading connector over `runner`'s block store and the configured tiers
    (ValueError: no block store, or a shared store without the fleet secret)."""
    store = getattr(runner, "kv_block_store", None)
    if store is None:
        raise ValueError(f"KV offloading: the runner ({type(runner).__name__}) has no KV "
                         f"block store")
    if config.shared_store is not None and secret is None:
        raise ValueError("--kv-shared-store needs the fleet secret (--fleet-secret-file): "
                         "blocks in a shared store are signed with a key derived from it")
    fp = fingerprint_digest(store.fingerprint, store.block_size)
    tiers = make_tiers(config, fp.hex(), signed=secret is not None)
    return OffloadingConnector(config, store, tiers, enable_events=cache.enable_kv_cache_events,
                               int_hashes=cache.kv_events_int_hashes, secret=secret)
