"""The KV connector as the core sees it: vLLM V1's connector API, both halves, and the
runner's block store it moves bytes through (docs/disaggregation.md section 4).

The core never imports an implementation (kvloop's is `kvloop.kv_transfer.KvloopConnector`,
which owns the sockets and threads); whoever builds the engine passes one in.

Scheduler side (called by the scheduler, in the engine's loop):

- `on_new_request(req)`: a request entered the scheduler (D starts heartbeats to its P here);
- `get_num_new_matched_tokens(req, num_computed_tokens) -> (n | None, load_async)`: tokens
  loadable from outside beyond the local prefix hit; None: ask again next step; side-effect
  free; `load_async` is False when n is 0;
- `update_state_after_alloc(req, block_ids, num_external_tokens)`: right after the
  allocation (every admission); decide by `num_external_tokens`, not by `block_ids`;
- `build_connector_meta(scheduler_output) -> metadata`: once per `schedule()`, after the
  output is built (it must not change it);
- `request_finished(req, block_ids) -> (delay_free, kv_transfer_params)`: exactly once, before
  the blocks are freed; True: the connector owns the freeing until the id comes back in
  `finished_sending` (P) or `finished_recving` (D, a load cut short by an abort); the dict
  goes to the client on the finishing output;
- `update_connector_output(output)`: what the worker side reported this step.

Worker side (called by the engine around the runner's `execute`): `bind_connector_metadata`,
`start_load_kv`, `wait_for_save`, `get_finished(finished_req_ids) -> KVConnectorOutput`,
`clear_connector_metadata`.

And the KV events of the connector's own caches (vLLM's `take_events()`: an offloading
connector's tiers; the engine publishes them after the pool's, in the same batch), and
`reset_cache()` (vLLM's: the prefix cache was reset, the connector forgets its own).

And what an engine loop needs beyond vLLM's API: `take_stats()` (one step's
`KVTransferStats`), `request_ids_in_transfer()` (for the scheduler's invariants),
`has_news()` (something to report: the engine should step), `set_wakeup(fn)` (called from
the connector's threads when news arrives, so an idle engine need not poll) and `start()`
(run the threads, once the engine exists; a P/D connector returns its side channel's address).

Several connectors on one engine are one `kvloop.kv_transfer.multi.MultiConnector` (vLLM's):
the scheduler still sees one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec

from kvloop.core.outputs import KVConnectorOutput, SchedulerOutput
from kvloop.core.request import Request
from kvloop.events.types import KVEvent
from kvloop.wire import KVTransferInfo, KVTransferStats

# The shape of one transferred frame (a layer's blocks), the same for every runner
KV_BLOCK_LAYOUT = "per layer: [2 (key, value), num_kv_heads, blocks, block_size, head_dim]"
# ... of a quantized cache (`--kv-cache-dtype` fp8 or int8): each row its one-byte codes, then
# its fp32 scale (kvloop.model.kv_quant)
QUANTIZED_KV_BLOCK_LAYOUT = ("per layer: [2 (key, value), num_kv_heads, blocks, block_size, "
                             "head_dim codes + fp32 scale]")


class KVFingerprint(msgspec.Struct, frozen=True):
    """What two engines must share for one's KV blocks to be valid in the other's cache:
    the model, the element type, and the block bytes' shape (`layout` names the order of a
    block's dimensions in a transferred frame)."""

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: str

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


class KVBlockStore(Protocol):
    """A runner's KV blocks, read and written whole (the model runner's tensors; the
    simulator's modelled bytes, `has_payload` False: reads return no frames, writes take
    none, `block_nbytes` still says what a real block would weigh).

    `read_blocks(ids)` returns one frame per layer (layer order), each holding the blocks in
    the order given; `write_blocks(ids, frames)` takes the same shape. Both may run on a
    connector's thread while the runner computes other blocks.
    """

    fingerprint: KVFingerprint
    block_size: int
    block_nbytes: int     # one block over all layers, keys and values
    has_payload: bool

    def read_blocks(self, block_ids: Sequence[int]) -> list[Any]:
        ...

    def write_blocks(self, block_ids: Sequence[int], frames: Sequence[Any]) -> None:
        ...


class KVConnector(Protocol):
    """vLLM's `KVConnectorBase_V1`, both roles in one object (kvloop's runner shares the
    engine's process); the module docstring states each method's contract."""

    # --- scheduler side -------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None: ...

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]: ...

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None: ...

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> object: ...

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]: ...

    def update_connector_output(self, output: KVConnectorOutput) -> None: ...

    # --- worker side ----------------------------------------------------------------------
    def bind_connector_metadata(self, metadata: object) -> None: ...

    def start_load_kv(self) -> None: ...

    def wait_for_save(self) -> None: ...

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput: ...

    def clear_connector_metadata(self) -> None: ...

    # --- the engine loop ------------------------------------------------------------------
    def reset_cache(self) -> None: ...   # the pool was reset: forget the connector's cache

    def take_events(self) -> list[KVEvent]: ...

    def take_stats(self) -> KVTransferStats: ...

    def request_ids_in_transfer(self) -> set[str]: ...

    def has_news(self) -> bool: ...

    def faults(self) -> list[str]: ...   # why an internal thread died (empty: none did)

    def set_wakeup(self, wakeup: Callable[[], None]) -> None: ...

    def start(self) -> KVTransferInfo | None: ...

    def shutdown(self) -> None: ...


REMOTE_CACHED_TOKENS_KEY = "remote_prefill_cached_tokens"   # vLLM's key (P's own prefix hit)


def cached_tokens_after_load(request: Request, local_hit: int) -> int:
    """`num_cached_tokens` of a request whose prompt KV came from a prefill worker: D's local
    hit plus the part of P's hit (`remote_prefill_cached_tokens`) beyond it, never the
    transferred tokens (docs/disaggregation.md section 2; vLLM counts P's hit since
    docs/vllm-facts.md#disaggregation). An offloading connector sets the key to the hit plus
    the tier's blocks: cached tokens, loaded from below the pool (docs/tiers.md)."""
    params = request.kv_transfer_params or {}
    remote = params.get(REMOTE_CACHED_TOKENS_KEY)
    if not isinstance(remote, int) or isinstance(remote, bool) or remote < 0:
        remote = 0
    return min(max(local_hit, remote), request.num_prompt_tokens - 1)
