"""Messages between processes: msgspec Structs, defined here and nowhere else.

Version: bump `WIRE_VERSION` on any incompatible change; the engine core's handshake checks it.
"""

from __future__ import annotations

import msgspec

WIRE_VERSION = 1


class PrefixCacheStats(msgspec.Struct, omit_defaults=True):
    """Prefix-cache lookups at admission, in tokens (vLLM's counting)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    reset: bool = False


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_stats: PrefixCacheStats = msgspec.field(default_factory=PrefixCacheStats)
    num_preemptions: int = 0
    step_index: int = 0


class TopLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of one sampled token: its own, its rank, and the top-n alternatives."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


class EngineCoreOutput(msgspec.Struct, omit_defaults=True):
    """New tokens of one request after one step (only sent when there is news)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    new_logprobs: list[TopLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
