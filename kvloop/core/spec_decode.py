"""Speculative decoding's proposer: n-gram (prompt lookup) drafts for the next step.

Where it runs and how drafts travel (vLLM's synchronous engine,
docs/vllm-facts.md#speculative-decoding):

    step N   schedule -> execute -> update_from_output      (tokens appended, stops checked)
             propose: for every request that sampled in step N and is still running,
                      `propose_ngram(all_token_ids)` -> `Scheduler.update_draft_token_ids`
                      sets `request.spec_token_ids` (the engine's post-step, in the engine
                      process, on CPU; it reads only token ids, so the real runner and the
                      simulator get the same drafts)
    step N+1 schedule: `num_tokens_with_spec` = tokens + drafts, so the running loop gives
                      the request 1 + k tokens; the drafts go to the runner in
                      `SchedulerOutput.scheduled_spec_decode_tokens` and `spec_token_ids`
                      is cleared; the runner verifies them in one forward pass and returns
                      1 + accepted tokens; `update_from_output` takes the rejected drafts
                      back from `num_computed_tokens`

Owner: the proposer holds no request state; the scheduler owns `spec_token_ids`.
Drafts are never hashed or cached: a request's block hashes grow only from appended
(sampled) tokens and the KV cache manager caches only known tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvloop.config import SpeculativeConfig
from kvloop.core.request import Request


def propose_ngram(tokens: Sequence[int], min_n: int, max_n: int, k: int,
                  max_model_len: int) -> list[int]:
    """vLLM's prompt-lookup proposal for a context `tokens` (everything known, no drafts).

    The longest n in [min_n, max_n] such that the last n tokens also occur earlier (an
    occurrence may overlap the suffix, but is not the suffix itself); of the occurrences of
    that length, the earliest; the drafts are the (up to) k tokens after it, never past the
    context's end nor past `max_model_len`. [] when the context is shorter than min_n, when
    there is no room left, or when nothing matches.

    Every earlier occurrence of the suffix ends on an earlier copy of the last token, so
    only those positions are tried (found with `list.index`), each extended backwards.
    """
    total = len(tokens)
    k = min(k, max_model_len - total)
    if total < min_n or k <= 0:
        return []
    seq = list(tokens)
    last = seq[-1]
    best_len, best_end = 0, -1
    end = _find(seq, last, 0, total - 1)
    while end >= 0:
        length = _match_back(seq, end, max_n)
        if length > best_len:
            best_len, best_end = length, end
        end = _find(seq, last, end + 1, total - 1)
    if best_len < min_n:
        return []
    return seq[best_end + 1:best_end + 1 + k]


def _find(seq: list[int], value: int, start: int, stop: int) -> int:
    """First index of `value` in seq[start:stop], or -1."""
    try:
        return seq.index(value, start, stop)
    except ValueError:
        return -1


def _match_back(seq: list[int], end: int, max_n: int) -> int:
    """How many tokens ending at `end` equal the context's last ones (at most max_n)."""
    last = len(seq) - 1
    n = 0
    while n < max_n and end - n >= 0 and seq[end - n] == seq[last - n]:
        n += 1
    return n


class NgramProposer:
    """Drafts for the requests that sampled in the step just accounted (see the module
    docstring); built from the engine's `SpeculativeConfig`."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len

    def propose(self, requests: Iterable[Request]) -> dict[str, list[int]]:
        """Request id -> its drafts (requests with none are left out). Requests at
        `max_model_len` get none. Mutates nothing."""
        cfg = self.config
        drafts: dict[str, list[int]] = {}
        for req in requests:
            if req.num_tokens >= self.max_model_len:
                continue
            ids = propose_ngram(req.all_token_ids, cfg.prompt_lookup_min,
                                cfg.prompt_lookup_max, cfg.num_speculative_tokens,
                                self.max_model_len)
            if ids:
                drafts[req.request_id] = ids
        return drafts
