"""MultiConnector: several KV connectors as one, with vLLM's `MultiConnector` semantics, so
prefill/decode (`KvloopConnector`) and the tiers below the pool (`OffloadingConnector`)
serve one engine (docs/tiers.md, "P/D and tiers on one worker").

- **Load from the first that has the blocks.** `get_num_new_matched_tokens` asks every
  connector, in order; the first offering tokens is the request's loader (any that says
  "ask again", None, makes the answer None). `update_state_after_alloc` gives the allocation
  and the external token count to the loader and the same blocks with 0 to the others
  (kvloop's contract decides by the count: a P/D connector not chosen tells its prefill
  worker to free; the tiers count the hashes for their reuse gate and track the blocks).
- **Save to all.** Every connector sees every step's metadata (a tuple, one item each) and
  `wait_for_save`: the tiers store the blocks a P/D load filled as any other.
- **Finishing.** `request_finished` asks all; the blocks are held while any connector holds
  them, and the request id is reported in `finished_sending`/`finished_recving` only when
  the last holder reports it (vLLM's `_extra_async_saves`). At most one connector gives
  `kv_transfer_params` (a second is logged and dropped).
- **The loop.** Events are each connector's in order (the tiers' after P/D's: none);
  stats are summed; news, faults and transfers are the union; wakeup, reset, start and
  shutdown go to all (`start` returns the first address given: the P/D side channel's).

Owner: the engine thread calls every method (as for any connector); this object owns only
its two request tables (`_loader`, `_holds`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvloop.core.kv_connector import KVConnector
from kvloop.core.outputs import KVConnectorOutput, SchedulerOutput
from kvloop.core.request import Request
from kvloop.events.types import KVEvent
from kvloop.wire import KVTransferInfo, KVTransferStats

logger = logging.getLogger("kvloop.kv_transfer")


class MultiConnector:
    """Implements `kvloop.core.kv_connector.KVConnector` over `connectors` (module docstring);
    the order is the load preference."""

    def __init__(self, connectors: Sequence[KVConnector]):
        if len(connectors) < 2:
            raise ValueError("a MultiConnector joins two connectors or more")
        self.connectors = list(connectors)
        self._loader: dict[str, int] = {}   # request id -> the connector offering its tokens
        self._holds: dict[str, int] = {}    # finished request id -> connectors still holding

    # --- scheduler side -------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        for c in self.connectors:
            c.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """The first connector's offer that is not 0 (None while any is still looking);
        the choice is kept for `update_state_after_alloc` (each call replaces it)."""
        offer: tuple[int | None, bool] = (0, False)
        self._loader.pop(request.request_id, None)
        for i, c in enumerate(self.connectors):
            count, load_async = c.get_num_new_matched_tokens(request, num_computed_tokens)
            if count is None:
                self._loader.pop(request.request_id, None)
                return None, False
            if count > 0 and offer[0] == 0:
                self._loader[request.request_id] = i
                offer = (count, load_async)
        return offer

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        loader = self._loader.pop(request.request_id, None)
        for i, c in enumerate(self.connectors):
            c.update_state_after_alloc(request, block_ids,
                                       num_external_tokens if i == loader else 0)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> tuple[object, ...]:
        return tuple(c.build_connector_meta(scheduler_output) for c in self.connectors)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._loader.pop(rid, None)
        holders, params = 0, None
        for c in self.connectors:
            delay, given = c.request_finished(request, block_ids)
            holders += delay
            if given is not None and params is not None:
                logger.warning("request %s: two connectors gave kv_transfer_params; keeping "
                               "the first", rid)
            elif given is not None:
                params = given
        if holders:
            self._holds[rid] = holders
        return holders > 0, params

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for c in self.connectors:
            c.update_connector_output(output)

    # --- worker side ----------------------------------------------------------------------
    def bind_connector_metadata(self, metadata: object) -> None:
        assert isinstance(metadata, tuple) and len(metadata) == len(self.connectors)
        for c, meta in zip(self.connectors, metadata, strict=True):
            c.bind_connector_metadata(meta)

    def start_load_kv(self) -> None:
        for c in self.connectors:
            c.start_load_kv()

    def wait_for_save(self) -> None:
        for c in self.connectors:
            c.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        """The union of the connectors' reports, a held request's id passed on once its
        last holder reports it."""
        out = KVConnectorOutput()
        for c in self.connectors:
            part = c.get_finished(finished_req_ids)
            out.finished_sending.update(r for r in part.finished_sending if self._release(r))
            out.finished_recving.update(r for r in part.finished_recving if self._release(r))
            out.invalid_block_ids.update(part.invalid_block_ids)
            out.failed_recving.update(part.failed_recving)
            out.recompute_recving.update(part.recompute_recving)
        return out

    def _release(self, request_id: str) -> bool:
        """One holder of a finished request reported it: True when none is left (a live
        request's finished load holds nothing: True)."""
        left = self._holds.get(request_id, 1) - 1
        if left > 0:
            self._holds[request_id] = left
            return False
        self._holds.pop(request_id, None)
        return True

    def clear_connector_metadata(self) -> None:
        for c in self.connectors:
            c.clear_connector_metadata()

    # --- the engine loop ------------------------------------------------------------------
    def reset_cache(self) -> None:
        for c in self.connectors:
            c.reset_cache()

    def take_events(self) -> list[KVEvent]:
        return [e for c in self.connectors for e in c.take_events()]

    def take_stats(self) -> KVTransferStats:
        return merge_stats([c.take_stats() for c in self.connectors])

    def request_ids_in_transfer(self) -> set[str]:
        ids: set[str] = set()
        for c in self.connectors:
            ids |= c.request_ids_in_transfer()
        return ids

    def has_news(self) -> bool:
        return any(c.has_news() for c in self.connectors)

    def faults(self) -> list[str]:
        return [f for c in self.connectors for f in c.faults()]

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        for c in self.connectors:
            c.set_wakeup(wakeup)

    def start(self) -> KVTransferInfo | None:
        infos = [c.start() for c in self.connectors]
        return next((i for i in infos if i is not None), None)

    def shutdown(self) -> None:
        for c in self.connectors:
            c.shutdown()


def merge_stats(parts: Sequence[KVTransferStats]) -> KVTransferStats:
    """One step's stats of several connectors: counters and gauges summed, durations joined,
    failures added by reason."""
    total = KVTransferStats()
    for part in parts:
        for name in KVTransferStats.__struct_fields__:
            mine, theirs = getattr(total, name), getattr(part, name)
            if isinstance(mine, list):
                mine.extend(theirs)
            elif isinstance(mine, dict):
                for reason, n in theirs.items():
                    mine[reason] = mine.get(reason, 0) + n
            else:
                setattr(total, name, mine + theirs)
    return total
