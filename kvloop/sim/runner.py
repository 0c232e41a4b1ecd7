"""SimRunner: a runner with no model. Real scheduler and block pool, fake tokens.

Tokens are deterministic: by default token k of request r is a hash of (r, k) folded into
`vocab_size`, so two runs of the same workload produce the same outputs. A `token_source`
callable replaces that (the conformance replay feeds the trace's tokens). An optional
`step_time` callable (from `kvloop.sim.latency`) makes each step last the modelled time.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

from kvloop.core.outputs import RunnerOutput, SchedulerOutput

TokenSource = Callable[[str, int], int]
StepTime = Callable[[SchedulerOutput], float]


def default_token(request_id: str, k: int, vocab_size: int = 32000, offset: int = 256) -> int:
    """A stable pseudo-random token id in [offset, vocab_size) for output index k."""
    digest = hashlib.blake2b(f"{request_id}:{k}".encode(), digest_size=8).digest()
    return offset + int.from_bytes(digest, "little") % (vocab_size - offset)


class SimRunner:
    """Implements the `Runner` protocol without a model."""

    def __init__(self, token_source: TokenSource | None = None,
                 step_time: StepTime | None = None, sleep: Callable[[float], None] = time.sleep):
        self.token_source = token_source or default_token
        self.step_time = step_time
        self._sleep = sleep
        self.num_steps = 0

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        out = RunnerOutput()
        num_outputs = {d.req_id: len(d.all_token_ids) - len(d.prompt_token_ids)
                       for d in scheduler_output.scheduled_new_reqs}
        for d in scheduler_output.scheduled_cached_reqs:
            num_outputs[d.req_id] = d.num_output_tokens
        for rid in scheduler_output.num_scheduled_tokens:
            out.req_ids.append(rid)
            if rid in scheduler_output.sampling_req_ids:
                out.sampled_token_ids.append([self.token_source(rid, num_outputs[rid])])
            else:
                out.sampled_token_ids.append([])
        self.num_steps += 1
        if self.step_time is not None and not scheduler_output.is_empty:
            remaining = self.step_time(scheduler_output) - (time.perf_counter() - t0)
            if remaining > 0:
                self._sleep(remaining)
        return out

    def shutdown(self) -> None:
        pass
