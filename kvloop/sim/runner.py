"""SimRunner: a runner with no model. Real scheduler and block pool, fake tokens.

Tokens are deterministic: by default token k of request r is a hash of (r, k) folded into
`vocab_size`, so two runs of the same workload produce the same outputs. A `token_source`
callable replaces that (the conformance replay feeds the trace's tokens). An optional
`step_time` callable (from `kvloop.sim.latency`) makes each step last the modelled time.

Copying (`copy_rate` > 0), so speculative decoding has something to find: at each output
position, with probability `copy_rate` (decided by a hash of the position and the token the
source would give, so deterministic), the simulated model continues its context as prompt
lookup would (`propose_ngram`: the token after the earliest longest earlier match of the
context's last 1 to 5 tokens, `COPY_NGRAM`), unless there is no match or that token is the
request's EOS or one of its stop token ids; otherwise it emits the source's token. Text is
then copied in runs, as models copy what they are asked to repeat; a run ends at a token
that is not copied, and the next starts as soon as the context's last token occurred
before (ordinary words do).

Drafts are verified exactly (the greedy rule) against the tokens the simulated model would
emit one step at a time: draft j is accepted iff it equals the model's token after the
known tokens and drafts[:j]; the first mismatch emits the model's token, and all accepted
add the bonus token. So a request's output never depends on speculation, and acceptance
comes from the workload (copy-heavy prompts with copying on), not from a dial.

A pooling request (`pooling_params`) pools instead of sampling, in the step that computes its
last prompt token: its vector is `sim_embedding` of its prompt (`SIM_EMBED_DIM` numbers drawn
from a hash of the token ids, L2-normalized unless its params say not), so equal prompts get
equal vectors.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Sequence

from kvloop.core.outputs import NewRequestData, RunnerOutput, SchedulerOutput
from kvloop.core.spec_decode import propose_ngram

TokenSource = Callable[[str, int], int]
StepTime = Callable[[SchedulerOutput], float]
COPY_NGRAM = (1, 5)          # the simulated model copies after a match of 1 to 5 tokens
_NO_LIMIT = 1 << 62
SIM_EMBED_DIM = 16           # the length of the simulated model's pooled vectors


def default_token(request_id: str, k: int, vocab_size: int = 32000, offset: int = 256) -> int:
    """A stable pseudo-random token id in [offset, vocab_size) for output index k."""
    digest = hashlib.blake2b(f"{request_id}:{k}".encode(), digest_size=8).digest()
    return offset + int.from_bytes(digest, "little") % (vocab_size - offset)


def _unit(*parts: object) -> float:
    """A stable number in [0, 1) for `parts`."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0 ** 64


def sim_embedding(prompt_token_ids: Sequence[int], normalize: bool = True) -> list[float]:
    """The simulated model's vector of a prompt: `SIM_EMBED_DIM` numbers in [-1, 1) from a
    hash of its token ids, L2-normalized when `normalize`."""
    digest = hashlib.blake2b(",".join(map(str, prompt_token_ids)).encode(),
                             digest_size=4 * SIM_EMBED_DIM).digest()
    vec = [int.from_bytes(digest[4 * j:4 * j + 4], "little") / 2.0 ** 31 - 1.0
           for j in range(SIM_EMBED_DIM)]
    if not normalize:
        return vec
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [v / norm for v in vec]


class SimRunner:
    """Implements the `Runner` protocol without a model (see the module docstring)."""

    def __init__(self, token_source: TokenSource | None = None,
                 step_time: StepTime | None = None, sleep: Callable[[float], None] = time.sleep,
                 copy_rate: float = 0.0):
        if not 0.0 <= copy_rate <= 1.0:
            raise ValueError(f"copy_rate must be in [0, 1], got {copy_rate}")
        self.token_source = token_source or default_token
        self.step_time = step_time
        self.copy_rate = copy_rate
        self._sleep = sleep
        self._tokens: dict[str, list[int]] = {}        # known tokens (only when copying)
        self._stops: dict[str, frozenset[int]] = {}    # EOS and stop ids (only when copying)
        self._pooling: dict[str, NewRequestData] = {}  # pooling requests not yet pooled
        self.num_steps = 0

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        so = scheduler_output
        out = RunnerOutput()
        if self.copy_rate:
            self._update_tokens(so)
        self._update_pooling(so)
        pooled: dict[str, list[float]] = {}
        num_outputs = {d.req_id: len(d.all_token_ids) - len(d.prompt_token_ids)
                       for d in so.scheduled_new_reqs}
        for d in so.scheduled_cached_reqs:
            num_outputs[d.req_id] = d.num_output_tokens
        for rid in so.num_scheduled_tokens:
            out.req_ids.append(rid)
            if rid in so.sampling_req_ids and rid in self._pooling:
                pooled[rid] = self._pool(self._pooling.pop(rid))
                out.sampled_token_ids.append([])
            elif rid in so.sampling_req_ids:
                drafts = so.scheduled_spec_decode_tokens.get(rid, [])
                out.sampled_token_ids.append(self._verify(rid, num_outputs[rid], drafts))
            else:
                out.sampled_token_ids.append([])
        if pooled:
            out.pooler_output = [pooled.get(rid) for rid in out.req_ids]
        self.num_steps += 1
        if self.step_time is not None and not scheduler_output.is_empty:
            remaining = self.step_time(scheduler_output) - (time.perf_counter() - t0)
            if remaining > 0:
                self._sleep(remaining)
        return out

    def _update_pooling(self, so: SchedulerOutput) -> None:
        for rid in (*so.finished_req_ids, *so.preempted_req_ids):
            self._pooling.pop(rid, None)
        for d in so.scheduled_new_reqs:
            if d.pooling_params is not None:
                self._pooling[d.req_id] = d

    @staticmethod
    def _pool(d: NewRequestData) -> list[float]:
        assert d.pooling_params is not None
        return sim_embedding(d.prompt_token_ids, d.pooling_params.normalize)

    def _update_tokens(self, so: SchedulerOutput) -> None:
        for rid in (*so.finished_req_ids, *so.preempted_req_ids):
            self._tokens.pop(rid, None)
            self._stops.pop(rid, None)
        for d in so.scheduled_new_reqs:
            self._tokens[d.req_id] = list(d.all_token_ids)
            p = d.sampling_params
            eos = () if p.effective_eos is None else (p.effective_eos,)
            self._stops[d.req_id] = frozenset((*eos, *p.stop_token_ids))
        for c in so.scheduled_cached_reqs:
            self._tokens[c.req_id][c.num_computed_tokens:] = c.token_ids

    def _verify(self, rid: str, num_outputs: int, drafts: Sequence[int]) -> list[int]:
        """The model's tokens from output index `num_outputs` on, as far as `drafts` agree
        with them, plus one (the module docstring's rule)."""
        context = self._tokens.get(rid)
        out: list[int] = []
        for j in range(len(drafts) + 1):
            tok = self._model_token(rid, num_outputs + j, context)
            out.append(tok)
            if j == len(drafts) or drafts[j] != tok:
                break
            if context is not None:
                context = [*context, tok]
        return out

    def _model_token(self, rid: str, k: int, context: list[int] | None) -> int:
        """Output token k of `rid` after `context` (its known tokens; None: not copying)."""
        base = self.token_source(rid, k)
        if context is None or _unit("copy", base, k) >= self.copy_rate:
            return base
        copied = propose_ngram(context, COPY_NGRAM[0], COPY_NGRAM[1], 1, _NO_LIMIT)
        if copied and copied[0] not in self._stops.get(rid, frozenset()):
            return copied[0]
        return base

    def shutdown(self) -> None:
        self._tokens.clear()
        self._stops.clear()
