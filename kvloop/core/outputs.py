"""The core <-> runner contract: `SchedulerOutput` goes to the runner, `RunnerOutput` comes back.

The real model runner, the simulated runner and the tests speak only these two objects.

`SchedulerOutput` describes one engine step:
- `scheduled_new_reqs`: requests the runner has not seen (first admission, or resumed after a
  preemption: the runner must forget what it had and re-prefill `all_token_ids`), with their
  full data and block ids;
- `scheduled_cached_reqs`: requests the runner already holds, as diffs (new block ids);
- `num_scheduled_tokens[req_id]`: how many tokens to compute for it this step, starting at
  its `num_computed_tokens` (the value *before* this step);
- `scheduled_spec_decode_tokens[req_id]`: draft tokens appended after the known tokens;
- `finished_req_ids` / `preempted_req_ids`: requests whose state the runner must drop;
- `kv_connector_metadata`: what the KV connector's worker side does this step (opaque to the
  core: the connector's scheduler side builds it, its worker side reads it).

Token ids to compute for request r this step are
`all_token_ids[num_computed : num_computed + n]` for the known part (given explicitly in
`token_ids`), followed by the scheduled drafts. A request *samples* only when its chunk
reaches the end of its known tokens; a partial prefill chunk samples nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvloop.core.request import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    all_token_ids: list[int]          # prompt + outputs so far (outputs only after preemption)
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int          # prefix-cache hit length, before this step
    token_ids: list[int]              # the known tokens this step computes
    resumed: bool = False


@dataclass
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]          # blocks allocated this step (often empty)
    num_computed_tokens: int          # before this step
    token_ids: list[int]              # the known tokens this step computes
    num_output_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: list[str] = field(default_factory=list)
    # ids whose chunk reaches the end of their known tokens: they sample this step
    sampling_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: object | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class Logprobs:
    """Top-n log probabilities of one sampled position."""

    sampled_logprob: float
    sampled_rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class KVConnectorOutput:
    """What the KV connector's worker side reports after a step (vLLM's names).

    - `finished_sending`: requests whose held blocks may be freed now (P: `Done` arrived or
      the lease expired);
    - `finished_recving`: requests whose load ended, done or failed (D);
    - `invalid_block_ids`: blocks a failed load did not fill (reported no later than the
      request's id in `finished_recving`);
    - `failed_recving`: request id -> why its load failed (a message for the log and for the
      request's error output).
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    failed_recving: dict[str, str] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids)


@dataclass
class RunnerOutput:
    """What the runner returns for one `SchedulerOutput`.

    `sampled_token_ids[i]` is the list of tokens request `req_ids[i]` sampled (empty for a
    partial prefill chunk; 1 + accepted drafts with speculative decoding). `logprobs[i]`,
    when asked for, has one entry per sampled token. `draft_token_ids` proposes drafts for
    the next step.
    """

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[Logprobs] | None] | None = None
    draft_token_ids: dict[str, list[int]] | None = None
    kv_connector_output: KVConnectorOutput | None = None   # set by the engine, not the runner

    def index(self) -> dict[str, int]:
        return {rid: i for i, rid in enumerate(self.req_ids)}
