"""`--max-num-batched-tokens auto`: the step's token budget from the runner's step time.

A step of b scheduled tokens takes t(b), and every decoding request riding in it waits the
whole step for its next token: t(b) is the TPOT such steps give. So the budget is the
largest b with t(b) <= the target TPOT (`kvloop.config.AutoBudget`). Whoever owns the runner
(the engine core process of `kvloop serve`, or `LLM` in process) calls `resolve_budget` once,
after the model is loaded and before any request:

1. candidates (`candidate_sizes`): the floor (`kvloop.config.budget_floor`: 64, or
   `max_num_seqs` if larger), the powers of two above it, and the cap (`budget_cap`: the
   least of `AUTO_BUDGET_CAP`, the context length and what the KV cache holds);
2. timings (`step_timings`): one real step of the runner per candidate, smallest first,
   until one exceeds the target (that one measured twice, the faster kept: noise only adds
   time), or until the next, predicted from the last one's time per token, would take the
   steps past `CALIBRATION_TIME_LIMIT_S`; so no large step runs once a smaller one is over.
   When the floor's step is over the default target already, no budget can meet it, and
   measuring goes on past it (each step timed twice) until a step's time per token is more
   than `NEAR_BEST_PER_TOKEN` times the least so far, or the time limit. A `ModelledRunner`
   (the simulator) is asked its modelled time instead, under the same limit: nothing runs
   and no clock is read, so a simulated worker's budget is deterministic;
3. choice (`choose_budget`): the largest candidate within the target on a monotone
   (isotonic) fit of the timings. When even the floor's step is over (flagged
   `misses_target`), decodes wait more than the target whatever the budget. A target the
   user set keeps the floor, the nearest to it; the default target (no promise the user
   asked for) gives way to throughput: the largest candidate whose fitted time per token
   is within `NEAR_BEST_PER_TOKEN` of the least. A step's fixed cost (the decodes riding in
   it, the head, the engine's own work) is spread over more prompt tokens, up to where
   attention's quadratic cost, or the calibration limit, ends the gain. Near the least the
   larger step is taken: step times carry a few per cent of noise, and a served step
   carries more fixed cost than the synthetic one (every running decode, not one). What this
   rule bought where the floor was kept: docs/serving.md, "The step budget".

4. attention's cost (`attention_keys_per_token`, for a measured runner only): a step of the
   chosen budget timed with its chunk after `CONTEXT_PROBE_TOKENS` computed tokens and with
   it fresh (`ATTENTION_ROUNDS` of each, alternated, the fastest kept); the difference,
   per attended key, against the fresh step's time per token gives K,
   the keys that cost one budget token (`kvloop.core.chunk_cost`), so a chunk late in a long
   prompt is shortened until its step fits the target too. None when the context adds no
   time (or no such context fits), and for a `ModelledRunner` (its model has no such term).

Without chunked prefill nothing is measured: a prompt must fit in one step, so the budget
covers the context length (vLLM's rule, `non_chunked_budget`). The choice is logged (INFO,
what was measured and why this budget; WARNING when the floor misses a target the user
set, INFO when it misses the default one: a machine too slow for it is no fault).

Each measured step is one fresh prompt of b - 1 random token ids plus one decode riding
along (a request with `DECODE_CONTEXT` tokens computed), greedy (no random draw: the runner's
generator is untouched), in KV blocks 1..n (the null block 0 is never written) of a pool no
request uses yet: the engine and its block pool are built afterwards, so no prefix cache can
hold them. The last step finishes every synthetic request: the runner keeps no state of them.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvloop.config import AUTO_BUDGET_CAP, AutoBudget, SchedulerConfig, budget_floor
from kvloop.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from kvloop.core.request import SamplingParams
from kvloop.core.runner import LoadedRunner, ModelledRunner

logger = logging.getLogger(__name__)

CALIBRATION_TIME_LIMIT_S = 2.0   # measured steps stop before their total would pass this
NEAR_BEST_PER_TOKEN = 1.05       # a missed target: time per token counted as the least's
CONTEXT_PROBE_TOKENS = 1024      # computed tokens before the chunk that times attention
ATTENTION_ROUNDS = 3             # fresh and late steps timed, alternated
DECODE_CONTEXT = 31              # tokens computed for the decode that rides along
_PREFIX = "kvloop-budget-"       # ids of the synthetic requests
_DECODE_ID = _PREFIX + "decode"
_LATE_ID = _PREFIX + "late"      # the long prompt of `attention_timings`
_GREEDY = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

Timings = Mapping[int, float] | Iterable[tuple[int, float]]


@dataclass(frozen=True)
class BudgetChoice:
    """What `choose_budget` (or the non-chunked rule) decided, and from what: `timings` are
    the (tokens, seconds) it saw, ascending; `misses_target`: even the floor's step exceeds
    the target (the floor is chosen, or with `for_throughput` the largest near the least
    time per token);
    `rule`: why nothing was measured (None: measured)."""

    budget: int
    timings: tuple[tuple[int, float], ...]
    target_s: float
    floor: int
    cap: int
    misses_target: bool = False
    rule: str | None = None
    for_throughput: bool = False

    @property
    def step_s(self) -> float:
        """The chosen budget's measured step time (0.0 when it was not measured)."""
        return dict(self.timings).get(self.budget, 0.0)

    def describe(self, how: str = "measured") -> str:
        """The log line: each candidate's step time, the choice and why."""
        if self.rule is not None:
            return f"max_num_batched_tokens auto: {self.budget} ({self.rule})"
        steps = ", ".join(f"{b} -> {t * 1e3:.1f} ms" for b, t in self.timings) or "none"
        return (f"max_num_batched_tokens auto: step time per token budget ({how}) {steps}; "
                f"chose {self.budget}, {self._why()}")

    def _why(self) -> str:
        target = f"target TPOT {self.target_s * 1e3:g} ms"
        if self.misses_target and not self.for_throughput:
            return f"the floor: even its step is over the {target}"
        if self.misses_target:
            per_token = self.step_s / self.budget * 1e3
            return (f"the largest near the least time per token ({per_token:.2f} ms here): "
                    f"even the floor's step is over the {target}, so no budget meets it")
        if not self.timings:
            return f"the floor (the cap {self.cap} is below it: nothing to measure)"
        over = [(b, t) for b, t in self.timings if b > self.budget]
        if self.budget == self.cap:
            return (f"the cap (the least of {AUTO_BUDGET_CAP}, the context length and the KV "
                    f"cache), within the {target}")
        if over:
            return f"the largest within the {target} ({over[0][0]} is over)"
        return (f"the largest measured (the next would pass the {CALIBRATION_TIME_LIMIT_S:g} s "
                f"calibration limit), within the {target}")


def monotone_fit(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in least squares (isotonic regression,
    pool adjacent violators): a noisy dip or bump is averaged with its neighbours."""
    pools: list[tuple[float, int]] = []   # (sum, count) of each pooled run
    for v in values:
        pools.append((v, 1))
        while len(pools) > 1 and pools[-2][0] / pools[-2][1] > pools[-1][0] / pools[-1][1]:
            s, n = pools.pop()
            pools[-1] = (pools[-1][0] + s, pools[-1][1] + n)
    return [s / n for s, n in pools for _ in range(n)]


def choose_budget(timings: Timings, target_s: float, floor: int, cap: int, *,
                  for_throughput: bool = False) -> BudgetChoice:
    """The largest token count whose step, on the monotone fit of `timings` ((tokens,
    seconds) pairs or a dict), takes at most `target_s`, capped at `cap`. When none does
    (flagged `misses_target`): `floor`, or with `for_throughput` the largest whose fitted
    time per token is within `NEAR_BEST_PER_TOKEN` of the least. `floor` when there are no
    timings; never below `floor`."""
    points = sorted(dict(timings).items())
    fitted = monotone_fit([t for _, t in points])
    within = [b for (b, _), t in zip(points, fitted, strict=True) if t <= target_s]
    if within:
        budget = max(floor, min(max(within), cap))
    elif points and for_throughput:
        per_token = [t / b for (b, _), t in zip(points, fitted, strict=True)]
        near = [b for (b, _), p in zip(points, per_token, strict=True)
                if p <= min(per_token) * NEAR_BEST_PER_TOKEN]
        budget = max(floor, min(max(near), cap))
    else:
        budget = floor
    return BudgetChoice(budget, tuple(points), target_s, floor, cap,
                        misses_target=bool(points) and not within,
                        for_throughput=for_throughput)


def non_chunked_budget(max_model_len: int, max_num_seqs: int) -> BudgetChoice:
    """Without chunked prefill a prompt must fit in one step: the budget covers the context
    length (vLLM's rule for its default) and `max_num_seqs`; no step is measured."""
    budget = max(max_model_len, max_num_seqs)
    rule = (f"no chunked prefill: a prompt must fit in one step, so the budget covers the "
            f"context length {max_model_len}, vLLM's rule; nothing measured")
    return BudgetChoice(budget, (), 0.0, budget, budget, rule=rule)


def budget_cap(max_model_len: int, num_gpu_blocks: int, block_size: int) -> int:
    """The largest candidate: `AUTO_BUDGET_CAP`, the context length, and what the KV cache
    holds beside the decode that rides along (blocks 1.., the null block 0 excluded)."""
    kv_tokens = (num_gpu_blocks - 1 - _num_blocks(DECODE_CONTEXT + 1, block_size)) * block_size
    return min(AUTO_BUDGET_CAP, max_model_len, kv_tokens + 1)


def candidate_sizes(floor: int, cap: int) -> list[int]:
    """The floor, the powers of two above it up to `cap`, and `cap` ([] if cap < floor)."""
    if cap < floor:
        return []
    sizes = [floor]
    size = 1 << floor.bit_length()
    while size < cap:
        sizes.append(size)
        size *= 2
    return sizes if sizes[-1] == cap else [*sizes, cap]


# --- measuring --------------------------------------------------------------------------------
def step_timings(runner: LoadedRunner, sizes: Sequence[int], target_s: float, *,
                 block_size: int, time_limit_s: float = CALIBRATION_TIME_LIMIT_S,
                 for_throughput: bool = False, seed: int = 0) -> list[tuple[int, float]]:
    """(tokens, seconds) of one step per size in `sizes` (ascending, each >= 2), as far as
    `timings_until` goes (the module docstring). Runs real steps through `runner.execute`
    (the first after an untimed warm-up step), or asks a `ModelledRunner` (nothing runs, the
    same limit on its modelled times); leaves the runner with no synthetic request."""
    if not sizes:
        return []
    steps = _SyntheticSteps(runner.vocab_size, block_size, random.Random(seed))
    if isinstance(runner, ModelledRunner):   # nothing runs: the limit is on modelled time
        modelled = runner.modelled_step_time
        return timings_until(lambda b: modelled(steps.step(b)), sizes, target_s, time_limit_s,
                             for_throughput=for_throughput)
    runner.execute(steps.warm_up())
    try:
        return timings_until(lambda b: _timed(runner, steps.step(b)), sizes, target_s,
                             time_limit_s, for_throughput=for_throughput)
    finally:
        runner.execute(steps.finish())


def attention_timings(runner: LoadedRunner, budget: int, context: int, *, block_size: int,
                      rounds: int = ATTENTION_ROUNDS, seed: int = 1) -> tuple[float, float]:
    """(fresh, late): the seconds of one step of `budget` tokens (a chunk of `budget - 1`
    and the decode riding along) with the chunk fresh, and with it after at least `context`
    computed tokens of one long prompt (computed first, untimed); `rounds` of each,
    alternated so a change of load hits both, the fastest of each kept (noise only adds
    time). Leaves the runner with no synthetic request."""
    steps = _SyntheticSteps(runner.vocab_size, block_size, random.Random(seed))
    runner.execute(steps.warm_up())
    try:
        runner.execute(steps.context(context, budget - 1, rounds, after=budget))
        fresh, late = [], []
        for i in range(rounds):
            fresh.append(_timed(runner, steps.step(budget)))
            late.append(_timed(runner, steps.late_chunk(i, last=i == rounds - 1)))
        return min(fresh), min(late)
    finally:
        runner.execute(steps.finish())


def keys_per_token(budget: int, context: int, fresh_s: float, late_s: float) -> int | None:
    """K of `kvloop.core.chunk_cost` from `attention_timings`: a step costs a * (n + keys /
    K), the late chunk attends `(budget - 1) * context` more keys than the fresh one, so
    a / K = (late - fresh) / that; a from the fresh step (its own keys counted). None when
    the context added no time."""
    n = budget - 1
    extra = late_s - fresh_s
    if n < 1 or context < 1 or extra <= 0:
        return None
    per_key = extra / (n * context)                          # a / K
    per_token = (fresh_s - per_key * n * (n + 1) / 2) / n    # a (the decode's token ignored)
    return max(1, round(per_token / per_key))


def timings_until(step_time: Callable[[int], float], sizes: Sequence[int], target_s: float,
                  time_limit_s: float, *, for_throughput: bool = False
                  ) -> list[tuple[int, float]]:
    """(b, step_time(b)) for `sizes` in order, a step over `target_s` timed twice (the faster
    kept), until one is over `target_s`; or, `for_throughput` when the first is over
    already (no size can meet the target), until one's time per token is more than
    `NEAR_BEST_PER_TOKEN` times the least so far; and before one that would take the total
    time past `time_limit_s` (predicted from the last step's time per token)."""
    out: list[tuple[int, float]] = []
    spent = 0.0
    for b in sizes:
        if out and spent + out[-1][1] * b / out[-1][0] > time_limit_s:
            break
        t = step_time(b)
        spent += t
        if t > target_s:
            again = step_time(b)   # confirm: noise only adds time
            spent += again
            t = min(t, again)
        out.append((b, t))
        if _measured_enough(out, target_s, for_throughput):
            break
    return out


def _measured_enough(out: Sequence[tuple[int, float]], target_s: float,
                     for_throughput: bool) -> bool:
    """Whether `timings_until` stops after the last of `out`: it is over the target and
    the first was not (or not `for_throughput`), or the first was over and the last's time
    per token is past `NEAR_BEST_PER_TOKEN` of the least."""
    b, t = out[-1]
    if out[0][1] <= target_s or not for_throughput:
        return t > target_s
    return t / b > min(bt / bb for bb, bt in out) * NEAR_BEST_PER_TOKEN


def _timed(runner: LoadedRunner, so: SchedulerOutput) -> float:
    start = time.perf_counter()
    runner.execute(so)
    return time.perf_counter() - start


def _num_blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class _SyntheticSteps:
    """The SchedulerOutputs of one calibration: a decode request prefilled once
    (`warm_up`), then per step a fresh prompt of b - 1 tokens beside that decode (the
    previous prompt finished in the same step), then `finish`."""

    def __init__(self, vocab_size: int, block_size: int, rng: random.Random):
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.rng = rng
        self.decode_blocks = list(range(1, 1 + _num_blocks(DECODE_CONTEXT + 1, block_size)))
        self.live: set[str] = set()
        self._count = 0
        self._late_prompt: list[int] = []       # set by `context`
        self._late_start = self._late_chunk = 0

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab_size) for _ in range(n)]

    def warm_up(self) -> SchedulerOutput:
        prompt = self._tokens(DECODE_CONTEXT)
        new = NewRequestData(_DECODE_ID, prompt, prompt, _GREEDY, self.decode_blocks, 0, prompt)
        self.live.add(_DECODE_ID)
        return SchedulerOutput(scheduled_new_reqs=[new],
                               num_scheduled_tokens={_DECODE_ID: DECODE_CONTEXT},
                               total_num_scheduled_tokens=DECODE_CONTEXT,
                               sampling_req_ids={_DECODE_ID})

    def step(self, num_tokens: int) -> SchedulerOutput:
        """A fresh prompt of `num_tokens - 1` tokens and one decode token."""
        finished = self.live - {_DECODE_ID, _LATE_ID}
        rid = f"{_PREFIX}{self._count}"
        self._count += 1
        self.live = {_DECODE_ID, rid} | (self.live & {_LATE_ID})
        prompt = self._tokens(num_tokens - 1)
        first = self.decode_blocks[-1] + 1
        blocks = list(range(first, first + _num_blocks(len(prompt), self.block_size)))
        new = NewRequestData(rid, prompt, prompt, _GREEDY, blocks, 0, prompt)
        decode = CachedRequestData(_DECODE_ID, [], DECODE_CONTEXT, self._tokens(1), 1)
        return SchedulerOutput(scheduled_new_reqs=[new], scheduled_cached_reqs=[decode],
                               num_scheduled_tokens={rid: len(prompt), _DECODE_ID: 1},
                               total_num_scheduled_tokens=num_tokens,
                               finished_req_ids=finished, sampling_req_ids={rid, _DECODE_ID})

    def context(self, num_computed: int, chunk: int, rounds: int, *,
                after: int) -> SchedulerOutput:
        """A long prompt of `num_computed + rounds * chunk` tokens, its first `num_computed`
        computed (no decode rides along), in blocks past those of a fresh step of `after`
        tokens; `late_chunk(i)` computes its i-th chunk. `step` leaves it running."""
        finished = self.live - {_DECODE_ID}
        self.live = {_DECODE_ID, _LATE_ID}
        self._late_prompt = prompt = self._tokens(num_computed + rounds * chunk)
        self._late_start, self._late_chunk = num_computed, chunk
        first = self.decode_blocks[-1] + 1 + _num_blocks(after, self.block_size)
        blocks = list(range(first, first + _num_blocks(len(prompt), self.block_size)))
        new = NewRequestData(_LATE_ID, prompt, prompt, _GREEDY, blocks, 0,
                             prompt[:num_computed])
        return SchedulerOutput(scheduled_new_reqs=[new],
                               num_scheduled_tokens={_LATE_ID: num_computed},
                               total_num_scheduled_tokens=num_computed,
                               finished_req_ids=finished)

    def late_chunk(self, i: int, *, last: bool) -> SchedulerOutput:
        """The i-th chunk of `context`'s prompt (the `last` one ends it and samples) and one
        decode token."""
        start = self._late_start + i * self._late_chunk
        tokens = self._late_prompt[start:start + self._late_chunk]
        late = CachedRequestData(_LATE_ID, [], start, tokens, 0)
        decode = CachedRequestData(_DECODE_ID, [], DECODE_CONTEXT, self._tokens(1), 1)
        return SchedulerOutput(scheduled_cached_reqs=[late, decode],
                               num_scheduled_tokens={_LATE_ID: len(tokens), _DECODE_ID: 1},
                               total_num_scheduled_tokens=len(tokens) + 1,
                               sampling_req_ids={_LATE_ID, _DECODE_ID} if last else {_DECODE_ID})

    def finish(self) -> SchedulerOutput:
        finished, self.live = self.live, set()
        return SchedulerOutput(finished_req_ids=finished)


# --- resolving --------------------------------------------------------------------------------
def resolve_budget(sched: SchedulerConfig, auto: AutoBudget, runner: LoadedRunner,
                   block_size: int) -> SchedulerConfig:
    """`sched` with the budget `auto` picks for `runner` (its `max_model_len` the context the
    engine will serve, already clamped to the KV cache); logs the choice."""
    if not sched.enable_chunked_prefill:
        choice = non_chunked_budget(sched.max_model_len, sched.max_num_seqs)
        logger.info("%s", choice.describe())
        return dataclasses.replace(sched, max_num_batched_tokens=choice.budget)
    floor = budget_floor(sched.max_num_seqs)
    cap = budget_cap(sched.max_model_len, runner.num_gpu_blocks, block_size)
    for_throughput = not auto.explicit     # a missed default target gives way to throughput
    timings = step_timings(runner, candidate_sizes(floor, cap), auto.target_s,
                           block_size=block_size, for_throughput=for_throughput)
    choice = choose_budget(timings, auto.target_s, floor, cap, for_throughput=for_throughput)
    how = "modelled" if isinstance(runner, ModelledRunner) else "measured"
    if choice.misses_target and auto.explicit:
        logger.warning("%s; decodes will see about %.0f ms per token (raise --target-tpot-ms, "
                       "or give --max-num-batched-tokens N)", choice.describe(how),
                       choice.step_s * 1e3)
    else:
        logger.info("%s", choice.describe(how))
    keys = None if isinstance(runner, ModelledRunner) else _measure_keys(
        runner, choice.budget, sched.max_model_len, block_size)
    return dataclasses.replace(sched, max_num_batched_tokens=choice.budget,
                               attention_keys_per_token=keys)


def _measure_keys(runner: LoadedRunner, budget: int, max_model_len: int,
                  block_size: int) -> int | None:
    """`keys_per_token` measured at `CONTEXT_PROBE_TOKENS` of context (less where the
    context length or the KV cache holds less); logs what it found."""
    decode_blocks = _num_blocks(DECODE_CONTEXT + 1, block_size)
    kv_tokens = (runner.num_gpu_blocks - 1 - decode_blocks) * block_size
    room = min(max_model_len, kv_tokens) - (ATTENTION_ROUNDS + 1) * budget
    context = min(CONTEXT_PROBE_TOKENS, room)
    if budget < 2 or context < budget:
        return None
    fresh, late = attention_timings(runner, budget, context, block_size=block_size)
    keys = keys_per_token(budget, context, fresh, late)
    logger.info("attention cost: a %d-token step took %.1f ms fresh, %.1f ms after %d computed "
                "tokens: %s", budget, fresh * 1e3, late * 1e3, context,
                "no extra time, chunks counted by tokens" if keys is None else
                f"{keys} attended keys cost one budget token (chunks late in a long prompt "
                f"shorten to keep the step within the target)")
    return keys
