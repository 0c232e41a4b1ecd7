"""The core <-> runner contract: `SchedulerOutput` goes to the runner, `RunnerOutput` comes back.

The real model runner, the simulated runner and the tests speak only these two objects.

`SchedulerOutput` describes one engine step:
- `scheduled_new_reqs`: requests the runner has not seen (first admission, or resumed after a
  preemption: the runner must forget what it had and re-prefill `all_token_ids`), with their
  full data and block ids;
- `scheduled_cached_reqs`: requests the runner already holds, as diffs (new block ids);
- `num_scheduled_tokens[req_id]`: how many tokens to compute for it this step, starting at
  its `num_computed_tokens` (the value *before* this step);
- `scheduled_spec_decode_tokens[req_id]`: draft tokens appended after the known tokens
  (`num_scheduled_tokens` counts them; absent key: no drafts);
- `finished_req_ids` / `preempted_req_ids`: requests whose state the runner must drop;
- `kv_connector_metadata`: what the KV connector's worker side does this step (opaque to the
  core: the connector's scheduler side builds it, its worker side reads it).

Token ids to compute for request r this step are
`all_token_ids[num_computed : num_computed + n]` for the known part (given explicitly in
`token_ids`), followed by the scheduled drafts. A request *samples* only when its chunk
reaches the end of its known tokens; a partial prefill chunk samples nothing. A pooling
request (`pooling_params` set) never samples: in the step whose chunk reaches the end of its
prompt it pools instead (`RunnerOutput.pooler_output`). A request
with k drafts samples from k + 1 positions (its last known token and each draft) and keeps
1 + the number of drafts accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvloop.core.request import PoolingParams, SamplingParams


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
    pooling_params: PoolingParams | None = None   # a pooling request (it never samples)
    lora_name: str | None = None      # the LoRA adapter it runs with (None: the base model)
    # block ids of KV-cache groups 1.. (`block_ids` is group 0's); empty for one group
    group_block_ids: list[list[int]] = field(default_factory=list)


@dataclass
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]          # blocks allocated this step (often empty)
    num_computed_tokens: int          # before this step
    token_ids: list[int]              # the known tokens this step computes
    num_output_tokens: int
    new_group_block_ids: list[list[int]] = field(default_factory=list)   # groups 1..


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: list[str] = field(default_factory=list)
    # ids whose chunk reaches the end of their known tokens: they sample this step (a
    # pooling request pools instead)
    sampling_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: object | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class GrammarOutput:
    """The step's grammar bitmask, for the runner to apply before it samples.

    Made by `StructuredOutputManager.grammar_bitmask` on the engine thread while the forward
    pass runs. Request `request_ids[i]` owns `num_rows[i]` consecutive rows of `bitmask`,
    starting after the rows of the requests before it: one row per logits row it samples
    from this step, in position order, i.e. one row per scheduled draft token and one for the
    bonus token after them (1 + k rows; 1 without speculative decoding). Only requests that
    sample this step and use structured output have rows.

    `bitmask` is an int32 array `[sum(num_rows), ceil(vocab_size / 32)]` (NumPy): bit `b` of
    word `w` of a row is set iff token `32 * w + b` may be sampled there. It is a view of a
    buffer the manager reuses: valid until the next step.
    """

    request_ids: list[str]
    num_rows: list[int]
    bitmask: Any

    def row_ranges(self) -> dict[str, range]:
        """request id -> its rows of `bitmask`."""
        ranges: dict[str, range] = {}
        start = 0
        for rid, n in zip(self.request_ids, self.num_rows, strict=True):
            ranges[rid] = range(start, start + n)
            start += n
        return ranges


@dataclass
class Logprobs:
    """Top-n log probabilities of one sampled position."""

    sampled_logprob: float
    sampled_rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class PromptLogprobs:
    """Prompt logprobs of one request's chunk: `entries[i]` is prompt token
    `first_position + i` given the tokens before it (`sampled_*` name that prompt token),
    with the top-n at its position. Chunks arrive in order; a chunk computed again (after a
    preemption) repeats its positions with the same values."""

    first_position: int
    entries: list[Logprobs]


def prompt_logprob_positions(num_prompt_tokens: int, num_computed: int,
                             num_tokens: int) -> range:
    """The positions of a step's chunk whose logits score a prompt token: position p scores
    token p + 1, so the last prompt position scores the first output token, not the prompt.

        prompt    | t0 t1 t2 t3 t4 |           5 prompt tokens, chunk = positions 2..4
        chunk           [ 2  3  4 ]            scores t3 t4 (position 4 scores an output)
    """
    return range(num_computed, max(num_computed, min(num_computed + num_tokens,
                                                     num_prompt_tokens - 1)))


@dataclass
class KVConnectorOutput:
    """What the KV connector's worker side reports after a step (vLLM's names).

    - `finished_sending`: requests whose held blocks may be freed now (P: `Done` arrived or
      the lease expired);
    - `finished_recving`: requests whose load ended, done or failed (D);
    - `invalid_block_ids`: blocks a failed load did not fill (reported no later than the
      request's id in `finished_recving`);
    - `failed_recving`: request id -> why its load failed (a message for the log and for the
      request's error output);
    - `recompute_recving`: failed loads that are a cache miss whatever the load-failure
      policy (their bytes failed a checksum): the request prefills here.
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    failed_recving: dict[str, str] = field(default_factory=dict)
    recompute_recving: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids)


@dataclass
class RunnerOutput:
    """What the runner returns for one `SchedulerOutput`.

    `sampled_token_ids[i]` is the list of tokens request `req_ids[i]` sampled (empty for a
    partial prefill chunk; the accepted drafts and one more token with speculative
    decoding). `logprobs[i]`, when asked for, has one entry per sampled token.
    `pooler_output[i]` is the vector of pooling request `req_ids[i]` in the step that computed
    its last prompt token (None otherwise; the whole list None when no request pooled).
    `prompt_logprobs[req_id]`: the prompt logprobs of the request's chunk this step (only
    requests that asked for them, and whose chunk scores prompt tokens). Drafts for
    the next step are the engine's (`kvloop.core.spec_decode`), not the runner's.
    `forward_time` is when the forward pass ran, `(start, end)` in `time.perf_counter()`
    seconds (None: the runner does not say), so the engine can tell how much of its own work
    overlapped it.
    """

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[Logprobs] | None] | None = None
    pooler_output: list[list[float] | None] | None = None
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None   # set by the engine, not the runner
    forward_time: tuple[float, float] | None = None

    def index(self) -> dict[str, int]:
        return {rid: i for i, rid in enumerate(self.req_ids)}
