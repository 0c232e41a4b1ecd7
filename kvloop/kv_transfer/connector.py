"""KvloopConnector: vLLM's NIXL-style pull over kvloop's side channel, both halves.

P (producer) side: a finished `do_remote_decode` request keeps its blocks under a lease
(`request_finished` returns delay_free and the params for D); the side channel serves D's
Reads of them; `Done` or expiry ends the lease and `get_finished` reports it in
`finished_sending`, so the scheduler frees the blocks (they stay in P's prefix cache).

D (consumer) side: a `do_remote_prefill` request with valid params is watched (heartbeats to
its P) from `on_new_request`; `get_num_new_matched_tokens` offers its prompt beyond the local
hit, asynchronously; `update_state_after_alloc` turns the allocation into a `Load` of the
blocks D lacks (those holding prompt tokens past the local hit, except a block holding only
the last prompt token, which D recomputes); `build_connector_meta` hands the step's loads to
`start_load_kv`, which gives them to the transfer thread; `get_finished` reports finished and
failed loads (failed ones with their unfilled blocks in `invalid_block_ids`).

Owner: the engine thread calls every method; the lease table, the side-channel server and the
transfer client own what they say they own. Both halves share one process with the runner,
so a lease is registered at once in `request_finished` (not via metadata), before the
engine sends the output carrying its params: no Read can find it missing.

Trust: the side channel needs the fleet secret (its CURVE keys: only fleet members talk, in
either direction); without one the connector refuses to start unless
`kv_connector_extra_config.insecure_side_channel` says so. `faults()` names a dead thread
(the engine process reports it; the worker's /health turns 503).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvloop.config import KVTransferConfig
from kvloop.core.kv_connector import KVBlockStore
from kvloop.core.outputs import KVConnectorOutput, SchedulerOutput
from kvloop.core.request import Request, RequestStatus
from kvloop.events.types import KVEvent
from kvloop.kv_transfer import shm
from kvloop.kv_transfer.client import Load, LoadResult, TransferClient
from kvloop.kv_transfer.leases import HEARTBEAT_INTERVAL, LeaseTable
from kvloop.kv_transfer.params import (
    RemotePrefill,
    parse_remote_prefill,
    producer_params,
    wants_remote_decode,
    wants_remote_prefill,
)
from kvloop.kv_transfer.protocol import PROTOCOL_VERSION, MetaReply, host_id
from kvloop.kv_transfer.server import SideChannelServer
from kvloop.kv_transfer.stats import TransferCounters
from kvloop.trust import (
    FLEET_SECRET_ENV,
    FLEET_SECRET_FILE_ENV,
    PURPOSE_KV_SIDE_CHANNEL,
    CurveKeys,
    FleetSecret,
    curve_authenticator,
)
from kvloop.wire import KV_FAILURE_ERROR, KV_FAILURE_MISMATCH, KVTransferInfo, KVTransferStats

logger = logging.getLogger("kvloop.kv_transfer")
_HOLDABLE = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


@dataclass
class KvloopConnectorMetadata:
    """One step's work for the worker side: the loads to start."""

    loads: list[Load] = field(default_factory=list)


class KvloopConnector:
    """Implements `kvloop.core.kv_connector.KVConnector` (see the module docstring).

    Construction binds the side channel (a producer's; `info` has the bound port); `start()`
    runs the threads. `clock` times leases and transfers (tests pass a fake one). `secret`:
    the fleet secret, whose derived CURVE keys guard the side channel; ValueError without
    one unless the config opts out (`insecure_side_channel`).
    """

    def __init__(self, config: KVTransferConfig, store: KVBlockStore,
                 clock: Callable[[], float] = time.monotonic, *,
                 secret: FleetSecret | None = None):
        self.config = config
        self.store = store
        self.block_size = store.block_size
        self.clock = clock
        extra = config.extra
        keys = _side_channel_keys(config, secret)
        shm.sweep_orphans()
        self._ctx = zmq.Context()
        self._auth = (curve_authenticator(self._ctx, [keys])
                      if keys is not None and config.is_kv_producer else None)
        self._wakeup: Callable[[], None] = _nothing
        self.counters = TransferCounters()
        self.leases = LeaseTable(extra.kv_lease_duration, clock)
        self.server: SideChannelServer | None = None
        self.client: TransferClient | None = None
        if config.is_kv_producer:
            meta = MetaReply(engine_id=config.engine_id, kv_fingerprint=store.fingerprint,
                             block_size=store.block_size, block_nbytes=store.block_nbytes,
                             version=PROTOCOL_VERSION, host_id=host_id())
            try:
                self.server = SideChannelServer(self._ctx, extra.side_channel_host,
                                                extra.side_channel_port, meta, self.leases,
                                                store, self.counters, self._notify, keys)
            except OSError:      # the port is taken: leave no authenticator thread behind
                self._stop_context()
                raise
        if config.is_kv_consumer:
            self.client = TransferClient(self._ctx, store, transport=extra.transport,
                                         transfer_timeout=extra.transfer_timeout,
                                         sim_bandwidth=extra.sim_bandwidth,
                                         wakeup=self._notify, counters=self.counters,
                                         keys=keys, clock=clock)
        self._remote: dict[str, RemotePrefill] = {}   # D: watched, not loading yet
        self._to_load: list[Load] = []                # D: allocated this step
        self._loading: set[str] = set()               # D: loads not reported yet
        self._early_results: list[LoadResult] = []    # D: loads failed before the network
        self._metadata: KvloopConnectorMetadata | None = None
        # hears each finished pull (kvloop/engine/spans.py: a trace's KV transfer span)
        self.on_transfer: Callable[[str, dict[str, Any]], None] | None = None

    @property
    def info(self) -> KVTransferInfo:
        extra = self.config.extra
        return KVTransferInfo(
            engine_id=self.config.engine_id, kv_role=self.config.kv_role,
            side_channel_host=extra.side_channel_host,
            side_channel_port=self.server.port if self.server else extra.side_channel_port,
            transport=extra.transport)

    def start(self) -> KVTransferInfo:
        if self.server is not None:
            self.server.start()
        if self.client is not None:
            self.client.start()
        logger.info("KV connector %s (%s) on %s:%d, transport %s", self.config.engine_id,
                    self.config.kv_role, self.info.side_channel_host,
                    self.info.side_channel_port, self.info.transport)
        return self.info

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        self._wakeup = wakeup

    def _notify(self) -> None:
        self._wakeup()

    # --- scheduler side: D ----------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        """Watch a valid `do_remote_prefill` request (heartbeats from now); an invalid one
        is logged and prefilled locally (vLLM's behaviour)."""
        params = request.kv_transfer_params
        if not wants_remote_prefill(params):
            return
        assert params is not None
        remote = parse_remote_prefill(params, request.num_prompt_tokens, self.block_size)
        if self.client is None or isinstance(remote, str):
            why = remote if isinstance(remote, str) else "this worker is a kv_producer"
            logger.warning("invalid kv_transfer_params: %s; prefilling request %s locally",
                           why, request.request_id)
            params["do_remote_prefill"] = False
            return
        self._remote[request.request_id] = remote
        lease = min(self.config.extra.kv_lease_duration, remote.lease_s or math.inf)
        self.client.watch(remote.peer, remote.request_id, lease * HEARTBEAT_INTERVAL)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """The prompt beyond the local hit, loaded asynchronously (side-effect free)."""
        if request.request_id not in self._remote:
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        remote = self._remote.pop(request.request_id, None)
        if remote is None:
            return
        assert request.kv_transfer_params is not None and self.client is not None
        request.kv_transfer_params["do_remote_prefill"] = False   # one transfer per request
        if num_external_tokens == 0:
            self.client.give_up(remote.peer, remote.request_id)
            return
        self._loading.add(request.request_id)
        load = self._make_load(request, block_ids, num_external_tokens, remote)
        if isinstance(load, LoadResult):
            self.client.give_up(remote.peer, remote.request_id)
            self.counters.add_failure(load.reason or KV_FAILURE_ERROR)
            self._early_results.append(load)
        else:
            self._to_load.append(load)

    def _make_load(self, request: Request, block_ids: list[int], num_external: int,
                   remote: RemotePrefill) -> Load | LoadResult:
        """Blocks to read: past the local hit, up to the one holding the token before last
        (the last prompt token is recomputed here)."""
        bs = self.block_size
        hit_blocks = (request.num_prompt_tokens - num_external) // bs
        needed = -(-(request.num_prompt_tokens - 1) // bs)
        rid = request.request_id
        if remote.block_size is not None and remote.block_size != bs:
            return LoadResult(rid, ok=False, reason=KV_FAILURE_MISMATCH,
                              message=f"block_size: P has {remote.block_size}, D has {bs}",
                              invalid_block_ids=block_ids[hit_blocks:needed])
        if len(remote.block_ids) < needed:
            return LoadResult(rid, ok=False, reason=KV_FAILURE_ERROR,
                              message=f"P holds {len(remote.block_ids)} blocks of the prompt, "
                                      f"D needs {needed}",
                              invalid_block_ids=block_ids[hit_blocks:needed])
        return Load(rid, remote.peer, remote.request_id, remote.block_ids[hit_blocks:needed],
                    block_ids[hit_blocks:needed], started=self.clock(),
                    trace_headers=request.trace_headers)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvloopConnectorMetadata:
        meta = KvloopConnectorMetadata(loads=self._to_load)
        self._to_load = []
        return meta

    # --- scheduler side: both -------------------------------------------------------------
    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """D: a load still running keeps its blocks (cancelled: Done now, freed when the
        transfer reports); a request that never loaded tells P to free. P: a `do_remote_decode`
        request finished length-capped or stopped holds its blocks under a lease and returns
        the params for D."""
        rid = request.request_id
        if rid in self._loading:
            if self.client is not None:
                self.client.cancel(rid)
            return True, None
        remote = self._remote.pop(rid, None)
        if remote is not None and self.client is not None:
            self.client.give_up(remote.peer, remote.request_id)
            return False, None
        if not wants_remote_decode(request.kv_transfer_params):
            return False, None
        if self.server is None:
            logger.warning("request %s asks for a remote decode, but this worker is a "
                           "kv_consumer: not holding its blocks", rid)
            return False, None
        if request.status not in _HOLDABLE or not block_ids:
            return False, None
        return True, self._hold(request, block_ids)

    def _hold(self, request: Request, block_ids: list[int]) -> dict[str, Any]:
        assert self.server is not None
        prompt_blocks = block_ids[:-(-request.num_prompt_tokens // self.block_size)]
        lease_s = self.leases.add(request.request_id, prompt_blocks)
        return producer_params(
            engine_id=self.config.engine_id, request_id=request.request_id,
            block_ids=prompt_blocks, host=self.config.extra.side_channel_host,
            port=self.server.port, num_tokens=request.num_prompt_tokens,
            block_size=self.block_size, fingerprint=self.store.fingerprint, lease_s=lease_s,
            cached_tokens=request.num_cached_tokens or 0)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Nothing to do: `get_finished` already moved this connector's state on."""

    # --- worker side ----------------------------------------------------------------------
    def bind_connector_metadata(self, metadata: object) -> None:
        assert metadata is None or isinstance(metadata, KvloopConnectorMetadata)
        self._metadata = metadata

    def start_load_kv(self) -> None:
        if self._metadata is None or self.client is None:
            return
        for load in self._metadata.loads:
            self.client.submit(load)

    def wait_for_save(self) -> None:
        """Nothing to wait for: P's blocks are written by the forward pass; D pulls them."""

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        out = KVConnectorOutput()
        self._release_leases(out)
        results, self._early_results = self._early_results, []
        if self.client is not None:
            results += self.client.take_results()
        for r in results:
            self._loading.discard(r.request_id)
            out.finished_recving.add(r.request_id)
            if self.on_transfer is not None and not r.cancelled:
                self.on_transfer(r.request_id, self._transfer_attributes(r))
            if not (r.ok or r.cancelled):
                out.invalid_block_ids.update(r.invalid_block_ids)
                out.failed_recving[r.request_id] = f"{r.reason}: {r.message}"
                if r.recompute:
                    out.recompute_recving.add(r.request_id)
        return out

    def _transfer_attributes(self, r: LoadResult) -> dict[str, Any]:
        """One pull as span attributes: bytes, transport, milliseconds, its failure."""
        return {"kvloop.kv_transfer.bytes": r.nbytes,
                "kvloop.kv_transfer.transport": r.transport,
                "kvloop.kv_transfer.ms": round(r.seconds * 1000, 3),
                "kvloop.kv_transfer.ok": r.ok, "kvloop.kv_transfer.failure": r.reason}

    def _release_leases(self, out: KVConnectorOutput) -> None:
        expired = self.leases.sweep()
        for lease in expired:
            logger.warning("Releasing expired KV blocks for request %s: no Done within its "
                           "lease (%.1f s held, %d read(s))", lease.request_id,
                           self.clock() - lease.created, lease.num_reads)
        if expired:
            self.counters.add_expired(len(expired))
        for released in self.leases.take_released():
            for path in released.lease.shm_files:
                shm.unlink(path)
            out.finished_sending.add(released.lease.request_id)

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    # --- the engine loop ------------------------------------------------------------------
    def take_events(self) -> list[KVEvent]:
        """None: this connector keeps no cache of its own."""
        return []

    def reset_cache(self) -> None:
        """Nothing to forget (held leases belong to their requests)."""

    def take_stats(self) -> KVTransferStats:
        stats = self.counters.take()
        stats.held_requests = self.leases.num_held()
        stats.loading_requests = len(self._loading)
        return stats

    def request_ids_in_transfer(self) -> set[str]:
        return self.leases.request_ids() | self._loading

    def faults(self) -> list[str]:
        """Why a thread of this connector died (empty while all live)."""
        threads = (self.server, self.client)
        return [t.fault for t in threads if t is not None and t.fault is not None]

    def has_news(self) -> bool:
        return (self.leases.has_news() or bool(self._early_results)
                or (self.client is not None and self.client.has_results()))

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.shutdown()
        if self.client is not None:
            self.client.shutdown()
        for released in self.leases.take_released():
            for path in released.lease.shm_files:
                shm.unlink(path)
        self._stop_context()

    def _stop_context(self) -> None:
        """Stop the authenticator, then terminate the context (every other socket of it
        closed before: `term()` waits for ever on an open one)."""
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()


def _nothing() -> None:
    pass


def _side_channel_keys(config: KVTransferConfig,
                       secret: FleetSecret | None) -> CurveKeys | None:
    """The side channel's CURVE keys; None for the insecure opt-out; ValueError when there
    is no secret and no opt-out."""
    if secret is not None:
        return secret.curve_keys(PURPOSE_KV_SIDE_CHANNEL)
    if config.extra.insecure_side_channel:
        logger.warning("KV side channel WITHOUT authentication or encryption "
                       "(insecure_side_channel): anyone who reaches it can read held KV "
                       "blocks, and this worker loads KV from anyone")
        return None
    raise ValueError("KvloopConnector needs the fleet secret to authenticate its side "
                     f"channel: give --fleet-secret-file PATH, ${FLEET_SECRET_FILE_ENV} or "
                     f"${FLEET_SECRET_ENV} (or, on a trusted network only, set "
                     f"kv_connector_extra_config.insecure_side_channel: true)")


def make_connector(config: KVTransferConfig, runner: object,
                   clock: Callable[[], float] = time.monotonic, *,
                   secret: FleetSecret | None = None) -> KvloopConnector:
    """The connector `config` names, over `runner`'s block store, keyed by the fleet
    `secret` (ValueError when the runner has no store, or there is no secret and no
    opt-out)."""
    store = getattr(runner, "kv_block_store", None)
    if store is None:
        raise ValueError(f"--kv-transfer-config: the runner ({type(runner).__name__}) has no "
                         f"KV block store to transfer blocks through")
    return KvloopConnector(config, store, clock, secret=secret)
