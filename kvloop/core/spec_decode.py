"""Speculative decoding's proposers: drafts for the next step, model-free.

One `Proposer` per engine, chosen by `SpeculativeConfig.method` (`make_proposer`):

- `ngram` (`NgramProposer`): prompt lookup, the tokens after the earliest longest earlier
  occurrence of the context's last n-gram; stateless;
- `suffix` (`SuffixProposer`): suffix decoding (kvloop.core.suffix_tree), the most frequent
  continuation in suffix trees over the request's own prompt and output and over earlier
  responses; it keeps a tree per request it has seen and the global tree of responses.

Where it runs and how drafts travel (vLLM's synchronous engine,
docs/vllm-facts.md#speculative-decoding):

    step N   schedule -> execute -> update_from_output      (tokens appended, stops checked)
             propose: for every request that sampled in step N and is still running
                      (the proposer also sees those that just finished, and which
                      requests are live), `proposer.propose(...)` ->
                      `Scheduler.update_draft_token_ids`
                      sets `request.spec_token_ids` (the engine's post-step, in the engine
                      process, on CPU; it reads only token ids, so the real runner and the
                      simulator get the same drafts)
    step N+1 schedule: `num_tokens_with_spec` = tokens + drafts, so the running loop gives
                      the request 1 + k tokens; the drafts go to the runner in
                      `SchedulerOutput.scheduled_spec_decode_tokens` and `spec_token_ids`
                      is cleared; the runner verifies them in one forward pass and returns
                      1 + accepted tokens; `update_from_output` takes the rejected drafts
                      back from `num_computed_tokens`

Owner: the scheduler owns `spec_token_ids`; a proposer owns only what it learned from the
token ids it was shown (the suffix proposer: its trees, and how many tokens of each request
they hold). Both read the context `all_token_ids` (known tokens, never drafts).
Drafts are never hashed or cached: a request's block hashes grow only from appended
(sampled) tokens and the KV cache manager caches only known tokens.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Protocol

from kvloop.config import SpeculativeConfig
from kvloop.core.request import Request
from kvloop.core.suffix_tree import SuffixCache


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request],
                live: Container[str]) -> dict[str, list[int]]:
        """Request id -> drafts for `requests`, the requests that sampled in the step just
        accounted (those that finished in it included, for their final tokens; they get no
        drafts). `live`: the ids the engine still holds; a proposer may forget any other."""
        ...


def make_proposer(config: SpeculativeConfig, max_model_len: int) -> Proposer:
    """The proposer of `config.method`."""
    if config.method == "suffix":
        return SuffixProposer(config, max_model_len)
    return NgramProposer(config, max_model_len)


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

    def propose(self, requests: Sequence[Request],
                live: Container[str] = ()) -> dict[str, list[int]]:
        """Request id -> its drafts (requests with none are left out). Finished requests and
        those at `max_model_len` get none. Mutates nothing."""
        cfg = self.config
        drafts: dict[str, list[int]] = {}
        for req in requests:
            if req.is_finished or req.num_tokens >= self.max_model_len:
                continue
            ids = propose_ngram(req.all_token_ids, cfg.prompt_lookup_min,
                                cfg.prompt_lookup_max, cfg.num_speculative_tokens,
                                self.max_model_len)
            if ids:
                drafts[req.request_id] = ids
        return drafts


class SuffixProposer:
    """Suffix decoding's drafts (vLLM's `method: "suffix"`): a request's tree starts with its
    prompt the first time it sampled, takes its output tokens as they come (into the global
    tree too), and is dropped when the request finishes or leaves; its response stays in
    the global tree until `suffix_decoding_max_cached_requests` newer ones push it out.

    The context matched is the request's last `suffix_decoding_max_tree_depth` tokens; a
    draft has at most min(num_speculative_tokens, room before max_model_len) tokens."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.cache = SuffixCache(config.suffix_decoding_max_tree_depth,
                                 config.suffix_decoding_max_cached_requests)
        self._num_seen: dict[str, int] = {}     # request id -> its tokens in the trees

    def propose(self, requests: Sequence[Request],
                live: Container[str]) -> dict[str, list[int]]:
        """Learn the requests' new tokens, then draft for each unfinished one; forget the
        requests that finished or are not `live`."""
        drafts: dict[str, list[int]] = {}
        for req in requests:
            self._learn(req)
            if req.is_finished:
                self._forget(req.request_id)
                continue
            ids = self._draft(req)
            if ids:
                drafts[req.request_id] = ids
        for rid in [r for r in self._num_seen if r not in live]:
            self._forget(rid)
        return drafts

    def _learn(self, req: Request) -> None:
        """Start the request's tree with its prompt (first time), then add new outputs."""
        rid = req.request_id
        seen = self._num_seen.get(rid)
        if seen is None:
            self.cache.start(rid, req.prompt_token_ids)
            seen = req.num_prompt_tokens
        new = req.output_token_ids[seen - req.num_prompt_tokens:]
        if new:
            self.cache.extend(rid, new)
        self._num_seen[rid] = req.num_tokens

    def _draft(self, req: Request) -> list[int]:
        cfg = self.config
        room = min(cfg.num_speculative_tokens, self.max_model_len - req.num_tokens - 1)
        if room <= 0:
            return []
        context = req.all_token_ids[-cfg.suffix_decoding_max_tree_depth:]
        return self.cache.speculate(req.request_id, context, room,
                                    cfg.suffix_decoding_max_spec_factor,
                                    cfg.suffix_decoding_min_token_prob).token_ids

    def _forget(self, request_id: str) -> None:
        if self._num_seen.pop(request_id, None) is not None:
            self.cache.stop(request_id)
