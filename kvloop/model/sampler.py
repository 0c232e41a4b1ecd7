"""Sampler: logits of the sampling rows -> one token id each (+ optional logprobs).

Before the sampler, the runner applies structured output's grammar bitmask
(`apply_token_bitmask`: disallowed tokens to -inf), so every step below, the logprobs
included, sees only the tokens the grammar allows (vLLM's order).

Order of operations (vLLM V1's):
1. raw logprobs (log-softmax of the model's logits) for rows that asked for `logprobs`;
2. token filters: `allowed_token_ids` (every other token to -inf), bad words (a word's last
   token to -inf when the output ends with the word's other tokens; a one-token word always),
   then `logit_bias` added;
3. min_tokens: EOS and `stop_token_ids` masked while fewer than `min_tokens` were generated;
4. penalties: repetition (prompt and output tokens), presence and frequency (output tokens);
5. greedy rows take the argmax; the others divide by temperature, apply min-p, top-k and
   top-p, and sample with the exponential-race trick (argmax of p / Exp(1) noise).

Seeds: a request with `seed` draws its noise from a generator seeded by (seed, number of
tokens generated so far), so its output does not depend on the batch it runs in, nor on a
preemption. Unseeded rows share the runner's generator.

Speculative decoding (`Sampler.rejection_sample`, vLLM's rejection sampler with n-gram
drafts, docs/vllm-facts.md#speculative-decoding): a request with k drafts owns k + 1
consecutive logits rows; row j scores the token after its known tokens and drafts[:j], and
steps 1-4 run on it with those drafts counted as generated (`draft_rows`), so a greedy
request gets exactly the tokens it would get one step at a time. Then, position by position
(`accept_drafts`): greedy accepts a draft equal to the argmax; random accepts draft d with
probability p(d) (n-gram drafts have no probabilities of their own: a draft probability of
1, vLLM's one-hot rule), against a uniform drawn per position (per request generator when
seeded). The first rejected position emits a token drawn from p with d taken out (greedy:
the argmax); when all are accepted, the last row's ordinary sample is the bonus token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvloop.core.outputs import Logprobs
from kvloop.core.request import SamplingParams

_SEED_STRIDE = 1_000_003
_SEED_MASK = (1 << 63) - 1
_UNIFORM_SALT = 0x5EED_ACCE     # seeded acceptance uniforms: a stream apart from the noise


@dataclass
class SamplingRow:
    """What the sampler needs to know about one sampling request."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]      # generated so far (before this sample)

    @property
    def needs_penalties(self) -> bool:
        p = self.params
        return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                or p.frequency_penalty != 0.0)

    @property
    def banned_ids(self) -> list[int]:
        """The last token of each bad word whose other tokens end the output now."""
        out = self.output_token_ids
        banned = []
        for word in self.params.bad_words_token_ids:
            prefix = word[:-1]
            if len(prefix) <= len(out) and (not prefix or tuple(out[-len(prefix):]) == prefix):
                banned.append(word[-1])
        return banned

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that reads or changes the logits before the argmax (no
        logprobs, token filters, min_tokens mask, penalties or grammar): its token is the
        argmax of the raw logits, which the runner may take fused with the LM head."""
        p = self.params
        return (p.greedy and p.logprobs is None and p.structured_outputs is None
                and not p.filters_tokens and not self.needs_penalties and not self.masked_ids)

    @property
    def masked_ids(self) -> list[int]:
        """Token ids forbidden now by min_tokens (EOS and stop ids)."""
        p = self.params
        if len(self.output_token_ids) >= p.min_tokens:
            return []
        ids = list(p.stop_token_ids)
        if p.eos_token_id is not None:
            ids.append(p.eos_token_id)
        return ids


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Logprobs | None]


@dataclass
class SpecSamplerOutput:
    """Per request: the accepted drafts and one more token, and (when asked for) one
    logprobs entry per token."""

    token_ids: list[list[int]]
    logprobs: list[list[Logprobs] | None]


@dataclass
class Draw:
    """The ordinary sample of every logits row, and what the random rows were drawn from."""

    tokens: list[int]               # [S] greedy argmax, or random exp-race winner
    random_index: dict[int, int]    # logits row -> row of `probs` / `noise` (random rows)
    probs: torch.Tensor | None      # [R, vocab] filtered probabilities of the random rows
    noise: torch.Tensor | None      # [R, vocab] their Exp(1) noise: token = argmax(p / noise)


def draft_rows(rows: Sequence[SamplingRow],
               drafts: Sequence[Sequence[int]]) -> list[SamplingRow]:
    """One SamplingRow per logits row: request i's row j (0 <= j <= len(drafts[i])) scores
    the token after its known tokens and drafts[i][:j], which count as generated."""
    out: list[SamplingRow] = []
    for row, ds in zip(rows, drafts, strict=True):
        out.append(row)
        out.extend(SamplingRow(row.params, row.prompt_token_ids,
                               [*row.output_token_ids, *ds[:j]])
                   for j in range(1, len(ds) + 1))
    return out


class Sampler:
    """Stateless apart from the generator shared by unseeded rows."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """logits: [S, vocab] fp32, one row per entry of `rows` (modified in place)."""
        raw_logprobs = self._process(logits, rows)
        token_list = self._draw(logits, rows).tokens
        return SamplerOutput(token_list, _logprobs_entries(raw_logprobs, token_list, rows))

    def rejection_sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                         drafts: Sequence[Sequence[int]]) -> SpecSamplerOutput:
        """Verify drafts (see the module docstring). `rows[i]` and `drafts[i]` are request
        i's; logits: [sum(1 + len(drafts[i])), vocab] fp32, request by request, its rows in
        position order (modified in place). A request without drafts gets its ordinary
        sample, exactly as `__call__` would give it."""
        targets = draft_rows(rows, drafts)
        raw_logprobs = self._process(logits, targets)
        draw = self._draw(logits, targets)
        uniforms = self._uniforms(draw, targets)
        out = SpecSamplerOutput([], [])
        start = 0
        for row, ds in zip(rows, drafts, strict=True):
            tokens = accept_drafts(draw, uniforms, start, ds)
            out.token_ids.append(tokens)
            n = row.params.logprobs
            out.logprobs.append(None if n is None else [
                logprob_entry(raw_logprobs[start + j], tok, n) for j, tok in enumerate(tokens)])
            start += len(ds) + 1
        return out

    # --- 1-4: logit processing ------------------------------------------------------------
    def _process(self, logits: torch.Tensor, rows: Sequence[SamplingRow]
                 ) -> dict[int, torch.Tensor]:
        """Steps 1-4, in place; returns the raw logprobs of the rows that asked for them."""
        raw_logprobs = self._raw_logprobs(logits, rows)
        for i, row in enumerate(rows):
            if row.params.filters_tokens:
                apply_token_filters(logits[i], row)
        self._apply_min_tokens(logits, rows)
        self._apply_penalties(logits, rows)
        return raw_logprobs

    @staticmethod
    def _raw_logprobs(logits: torch.Tensor, rows: Sequence[SamplingRow]
                      ) -> dict[int, torch.Tensor]:
        idx = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not idx:
            return {}
        lp = torch.log_softmax(logits[idx], dim=-1)
        return {i: lp[j] for j, i in enumerate(idx)}

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        vocab = logits.shape[1]
        for i, row in enumerate(rows):
            ids = [t for t in row.masked_ids if 0 <= t < vocab]
            if ids:
                logits[i, ids] = float("-inf")

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        for i, row in enumerate(rows):
            if row.needs_penalties:
                apply_penalties(logits[i], row)

    # --- 4: choosing tokens ---------------------------------------------------------------
    def _draw(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> Draw:
        tokens = logits.argmax(dim=-1)
        random_idx = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not random_idx:
            return Draw(tokens.tolist(), {}, None, None)
        probs = _filtered_probs(logits[random_idx], [rows[i].params for i in random_idx])
        noise = self._noise(probs, [rows[i] for i in random_idx])
        tokens[random_idx] = (probs / noise).argmax(dim=-1)
        return Draw(tokens.tolist(), {r: j for j, r in enumerate(random_idx)}, probs, noise)

    def _uniforms(self, draw: Draw, rows: Sequence[SamplingRow]) -> list[float]:
        """U(0, 1) per random row, for the acceptance test (seeded rows: their own
        generator at (seed, tokens generated), apart from the noise's)."""
        if draw.probs is None:
            return []
        u = torch.rand(len(draw.random_index), generator=self.generator,
                       device=draw.probs.device)
        for r, j in draw.random_index.items():
            seed = rows[r].params.seed
            if seed is not None:
                gen = torch.Generator(device=draw.probs.device)
                base = seed * _SEED_STRIDE + len(rows[r].output_token_ids)
                gen.manual_seed((base ^ _UNIFORM_SALT) & _SEED_MASK)
                u[j] = torch.rand(1, generator=gen, device=draw.probs.device)[0]
        return u.tolist()

    def _noise(self, probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Exp(1) noise [R, vocab]: per-request generators for seeded rows."""
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for j, row in enumerate(rows):
            seed = row.params.seed
            if seed is not None:
                gen = torch.Generator(device=probs.device)
                gen.manual_seed((seed * _SEED_STRIDE + len(row.output_token_ids)) & _SEED_MASK)
                noise[j].exponential_(generator=gen)
        return noise.clamp_min_(1e-10)


def accept_drafts(draw: Draw, uniforms: Sequence[float], start: int,
                  drafts: Sequence[int]) -> list[int]:
    """The tokens one request keeps: the accepted drafts, then the token at the first
    rejected position (or the bonus token after the last draft). Its logits rows are
    `start .. start + len(drafts)` of `draw`; `uniforms` is indexed like `draw.probs`."""
    out: list[int] = []
    for j, d in enumerate(drafts):
        r = start + j
        i = draw.random_index.get(r)
        if i is None:
            accepted = d == draw.tokens[r]
        else:
            assert draw.probs is not None
            accepted = (0 <= d < draw.probs.shape[1]
                        and float(draw.probs[i, d]) >= uniforms[i])
        if not accepted:
            out.append(_recovered(draw, r, d))
            return out
        out.append(d)
    out.append(draw.tokens[start + len(drafts)])
    return out


def _recovered(draw: Draw, r: int, draft: int) -> int:
    """Row r's token after rejecting `draft`: p with the draft taken out (greedy: argmax).
    The row's own sample wins unless it is the draft; then the exp race without it."""
    i = draw.random_index.get(r)
    if i is None or draw.tokens[r] != draft:
        return draw.tokens[r]
    assert draw.probs is not None and draw.noise is not None
    q = draw.probs[i].clone()
    q[draft] = 0.0
    if not bool((q > 0).any()):
        return draft
    return int((q / draw.noise[i]).argmax())


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """In place: `logits[rows[i]]` keeps the tokens whose bit is set in `bitmask[i]` and the
    others become -inf. `bitmask`: int32 `[len(rows), words]`, bit `b` of word `w` is token
    `32 * w + b`; tokens beyond `32 * words` are disallowed."""
    if not rows:
        return
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)   # [R, words * 32]
    if allowed.shape[1] < vocab:
        beyond = allowed.new_zeros((allowed.shape[0], vocab - allowed.shape[1]))
        allowed = torch.cat([allowed, beyond], dim=1)
    index = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    masked = logits.index_select(0, index).masked_fill(~allowed[:, :vocab], float("-inf"))
    logits.index_copy_(0, index, masked)


def apply_token_filters(logits: torch.Tensor, row: SamplingRow) -> None:
    """In place on one row [vocab]: allowed token ids, bad words, logit bias (step 2; ids
    beyond the row are ignored: the API server refuses them before)."""
    p = row.params
    vocab = logits.shape[0]
    if p.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
        keep[[t for t in p.allowed_token_ids if t < vocab]] = True
        logits.masked_fill_(~keep, float("-inf"))
    banned = [t for t in row.banned_ids if t < vocab]
    if banned:
        logits[banned] = float("-inf")
    if p.logit_bias:
        ids = [t for t in p.logit_bias if t < vocab]
        logits[ids] += torch.tensor([p.logit_bias[t] for t in ids], dtype=logits.dtype,
                                    device=logits.device)


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
    """In place on one row [vocab]: vLLM's repetition, presence and frequency penalties."""
    p = row.params
    vocab = logits.shape[0]
    output = torch.tensor(list(row.output_token_ids), dtype=torch.long, device=logits.device)
    counts = torch.zeros(vocab, dtype=logits.dtype, device=logits.device)
    if output.numel():
        ones = torch.ones_like(output, dtype=counts.dtype)
        counts.scatter_add_(0, output.clamp(0, vocab - 1), ones)
    if p.repetition_penalty != 1.0:
        seen = counts > 0
        prompt = torch.tensor(list(row.prompt_token_ids), dtype=torch.long, device=logits.device)
        seen[prompt.clamp(0, vocab - 1)] = True
        penalized = torch.where(logits > 0, logits / p.repetition_penalty,
                                logits * p.repetition_penalty)
        logits.copy_(torch.where(seen, penalized, logits))
    logits -= p.frequency_penalty * counts
    logits -= p.presence_penalty * (counts > 0).to(logits.dtype)


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[R, vocab] logits -> probabilities after temperature, min-p, top-k and top-p."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype,
                         device=logits.device)
    logits = logits / temps.unsqueeze(1)
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        logits = _top_k_top_p(logits, params)
    probs = torch.softmax(logits, dim=-1)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype,
                             device=probs.device).unsqueeze(1)
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


def _top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) what falls outside each row's top-k and top-p nucleus."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                      device=logits.device)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = ranks >= ks.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs          # mass strictly above each token
    drop = before >= top_p.unsqueeze(1)            # the top token always stays
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def _logprobs_entries(raw: dict[int, torch.Tensor], tokens: list[int],
                      rows: Sequence[SamplingRow]) -> list[Logprobs | None]:
    entries: list[Logprobs | None] = [None] * len(rows)
    for i, lp in raw.items():
        entries[i] = logprob_entry(lp, tokens[i], rows[i].params.logprobs or 0)
    return entries


_PROMPT_LOGPROBS_ROWS = 256     # rows per log-softmax: bounds the scratch of a long chunk


def prompt_logprob_entries(logits: torch.Tensor, targets: Sequence[int], n: int
                           ) -> list[Logprobs]:
    """Raw logprobs of `targets[i]` under `logits[i]` ([R, vocab] fp32, unprocessed: vLLM's
    prompt logprobs see no sampling parameter), with its rank and the top `n`."""
    out: list[Logprobs] = []
    for start in range(0, len(targets), _PROMPT_LOGPROBS_ROWS):
        lp = torch.log_softmax(logits[start:start + _PROMPT_LOGPROBS_ROWS], dim=-1)
        ids = torch.tensor(list(targets[start:start + lp.shape[0]]), dtype=torch.long,
                           device=lp.device)
        chosen = lp.gather(1, ids.unsqueeze(1))                    # [r, 1]
        ranks = ((lp > chosen).sum(dim=1) + 1).tolist()
        top_lp, top_ids = lp.topk(n, dim=1) if n else (lp[:, :0], lp[:, :0].long())
        for lp_i, rank, t_ids, t_lps in zip(chosen[:, 0].tolist(), ranks, top_ids.tolist(),
                                            top_lp.tolist(), strict=True):
            out.append(Logprobs(sampled_logprob=lp_i, sampled_rank=rank,
                                top_token_ids=t_ids, top_logprobs=t_lps))
    return out


def logprob_entry(lp: torch.Tensor, token: int, n: int) -> Logprobs:
    """The logprobs entry of `token` sampled from the raw logprobs `lp` [vocab], top `n`."""
    sampled = lp[token]
    rank = int((lp > sampled).sum().item()) + 1
    top_lp, top_ids = lp.topk(n) if n else (lp[:0], lp[:0].long())
    return Logprobs(sampled_logprob=float(sampled), sampled_rank=rank,
                    top_token_ids=top_ids.tolist(), top_logprobs=top_lp.tolist())
