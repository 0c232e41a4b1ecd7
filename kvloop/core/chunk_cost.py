"""What a chunk of scheduled tokens costs against the step's token budget.

vLLM counts every scheduled token as 1: a step of `max_num_batched_tokens` tokens takes about
the same time wherever its tokens sit. On a CPU that holds only near the start of a prompt:
a chunk of n query tokens after p computed ones attends to about n * (p + n / 2) keys, and
late in a long prompt that attention outweighs everything else the step does (measured on
SmolLM2-135M, 2 cores: a 128-token chunk at position 7,000 takes about 10x the step of 128
fresh tokens). Every decode riding in that step waits for all of it, so one long embeddings,
`prompt_logprobs` or plain prompt gave the others a token every second or more (issue 37,
item 6).

With `SchedulerConfig.attention_keys_per_token` set (K: how many attended keys cost as much
as one token's own work; `--max-num-batched-tokens auto` measures it), a chunk of more than
one token is charged

    n + ceil(n * (p + (n + 1) / 2) / K)        (n tokens after p computed ones)

and the scheduler gives a request the longest chunk whose charge fits what is left of the
budget: a step stays within the time the budget was chosen for, at any context length.
A single token (a decode) is charged 1: decodes attend through their own kernel, at a cost
per key far below a chunk's. A speculative decode's 1 + k tokens are a chunk (they attend
through the chunk's path), so late in a long context its drafts may be cut. `K` None: every
token costs 1 (vLLM's rule, the default).

Pure functions: the scheduler owns the budget they are applied to.
"""

from __future__ import annotations


def chunk_cost(num_tokens: int, num_computed: int, keys_per_token: int | None) -> int:
    """The budget a chunk of `num_tokens` after `num_computed` computed tokens uses."""
    if keys_per_token is None or num_tokens <= 1:
        return num_tokens
    keys_x2 = num_tokens * (2 * num_computed + num_tokens + 1)   # twice the keys attended
    return num_tokens + -(-keys_x2 // (2 * keys_per_token))


def fit_chunk(wanted: int, budget: int, num_computed: int, keys_per_token: int | None) -> int:
    """The largest n <= `wanted` with `chunk_cost(n, ...)` <= `budget` (0 if `budget` < 1).
    A single token always fits a budget of 1 or more, so a running request never starves."""
    if wanted <= 0 or budget <= 0:
        return 0
    if keys_per_token is None:
        return min(wanted, budget)
    lo, hi = 1, min(wanted, budget)            # cost(1) == 1 <= budget; cost(n) >= n
    while lo < hi:                             # the cost grows with n: bisect
        mid = (lo + hi + 1) // 2
        if chunk_cost(mid, num_computed, keys_per_token) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo
