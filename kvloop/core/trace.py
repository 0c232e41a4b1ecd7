"""Per-step trace records: who got how many tokens, and what those tokens were.

One `StepRecord` per engine step, written as one JSON line by `TraceWriter`. Kinds of work a
request can get in a step:

    prefill    a chunk of its prompt
    recompute  tokens it had computed before a preemption, computed again
    decode     the one new token after its last sampled one
    spec       a decode token plus speculative drafts: `tokens` = 1 + `draft_tokens`, of
               which `accepted_tokens` were accepted (the gap of 1 + k the scheduler closes
               in one step)

A record also says where the step's time went around the forward pass (`StepTiming`):
the forward itself, the grammar bitmask the engine computed meanwhile, and how much of that
bitmask time the forward hid (the two ran at once).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from kvloop.core.outputs import RunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from kvloop.core.block_pool import BlockPool
    from kvloop.core.scheduler import Admission, Scheduler
    from kvloop.wire import EngineCoreOutput


@dataclass
class ScheduledWork:
    tokens: int
    kind: str
    num_computed_before: int
    draft_tokens: int = 0                 # drafts among `tokens` (kind "spec")
    accepted_tokens: int | None = None    # drafts accepted (None: no drafts, or no sample)


@dataclass(frozen=True)
class StepTiming:
    """Seconds: `forward_s` the forward pass (0.0: the runner did not say), `bitmask_s` the
    grammar bitmask computed on the engine thread while it ran (0.0: none needed),
    `bitmask_hidden_s` the part of `bitmask_s` that overlapped the forward pass."""

    forward_s: float = 0.0
    bitmask_s: float = 0.0
    bitmask_hidden_s: float = 0.0

    @classmethod
    def of(cls, forward: tuple[float, float] | None,
           bitmask: tuple[float, float] | None) -> StepTiming:
        """From the (start, end) times of the forward pass and of the bitmask."""
        fwd = forward[1] - forward[0] if forward else 0.0
        if bitmask is None:
            return cls(forward_s=fwd)
        hidden = 0.0
        if forward is not None:
            hidden = max(0.0, min(forward[1], bitmask[1]) - max(forward[0], bitmask[0]))
        return cls(fwd, bitmask[1] - bitmask[0], hidden)


@dataclass
class StepRecord:
    step: int
    time: float
    duration_s: float
    budget: int
    total_tokens: int
    scheduled: dict[str, ScheduledWork] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    admitted: dict[str, int] = field(default_factory=dict)   # id -> prefix-hit tokens
    finished: dict[str, str] = field(default_factory=dict)   # id -> finish reason
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    forward_s: float = 0.0            # StepTiming's three figures
    bitmask_s: float = 0.0
    bitmask_hidden_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """The record as JSON; the draft fields only where there were drafts."""
        doc = asdict(self)
        for work in doc["scheduled"].values():
            if not work["draft_tokens"]:
                del work["draft_tokens"], work["accepted_tokens"]
        return doc


def work_kind(num_computed_before: int, n: int, num_prompt: int, num_tokens: int,
              num_spec: int, was_preempted: bool) -> str:
    """Classify the tokens a request computes this step (see the module docstring)."""
    if num_spec:
        return "spec"
    if num_computed_before + n >= num_tokens and n == 1 and num_computed_before >= num_prompt:
        return "decode"
    if was_preempted and num_computed_before + n > num_prompt:
        return "recompute"
    if num_computed_before < num_prompt:
        return "recompute" if was_preempted else "prefill"
    return "decode"


def make_step_record(out: SchedulerOutput, admissions: list[Admission],
                     outputs: list[EngineCoreOutput], duration_s: float, budget: int,
                     pool: BlockPool, scheduler: Scheduler,
                     runner_output: RunnerOutput | None = None,
                     timing: StepTiming | None = None) -> StepRecord:
    timing = timing or StepTiming()
    rec = StepRecord(step=scheduler.step_index - 1, time=time.time(), duration_s=duration_s,
                     budget=budget, total_tokens=out.total_num_scheduled_tokens,
                     preempted=list(out.preempted_req_ids),
                     admitted={a.request_id: a.prefix_hit_tokens for a in admissions},
                     finished={o.request_id: o.finish_reason for o in outputs
                               if o.finish_reason is not None},
                     kv_blocks_used=pool.num_usable_blocks - pool.get_num_free_blocks(),
                     kv_blocks_total=pool.num_usable_blocks, forward_s=timing.forward_s,
                     bitmask_s=timing.bitmask_s, bitmask_hidden_s=timing.bitmask_hidden_s)
    before = {d.req_id: (d.num_computed_tokens, len(d.prompt_token_ids), len(d.all_token_ids),
                         d.resumed) for d in out.scheduled_new_reqs}
    for d in out.scheduled_cached_reqs:
        req = scheduler.requests.get(d.req_id)
        num_prompt = req.num_prompt_tokens if req else 0
        preempted = bool(req and req.num_preemptions)
        before[d.req_id] = (d.num_computed_tokens, num_prompt,
                            num_prompt + d.num_output_tokens, preempted)
    sampled = _num_sampled(runner_output)
    for rid, n in out.num_scheduled_tokens.items():
        c, num_prompt, num_tokens, preempted = before[rid]
        spec = len(out.scheduled_spec_decode_tokens.get(rid, ()))
        work = ScheduledWork(n, work_kind(c, n, num_prompt, num_tokens, spec, preempted), c,
                             draft_tokens=spec)
        if spec and sampled.get(rid):
            work.accepted_tokens = sampled[rid] - 1
        rec.scheduled[rid] = work
    return rec


def _num_sampled(runner_output: RunnerOutput | None) -> dict[str, int]:
    if runner_output is None:
        return {}
    return {rid: len(toks) for rid, toks in zip(runner_output.req_ids,
                                                runner_output.sampled_token_ids, strict=False)}


class TraceWriter:
    """Appends one JSON line per step to a file; thread-safe, flushed per line."""

    def __init__(self, path: str):
        self._f: TextIO = open(path, "a", encoding="utf-8")  # noqa: SIM115
        self._lock = threading.Lock()

    def write(self, record: StepRecord) -> None:
        line = json.dumps(record.to_json(), separators=(",", ":"))
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()

    def close(self) -> None:
        with self._lock:
            self._f.close()
