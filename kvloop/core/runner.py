"""The runner protocol: anything that turns a `SchedulerOutput` into a `RunnerOutput`.

The model runner (`kvloop.model.runner`), the simulator (`kvloop.sim.runner`) and test
doubles implement it. A runner owns its KV tensors and whatever per-request state it caches;
it learns about requests only through `SchedulerOutput` (new, cached, finished, preempted).
"""

from __future__ import annotations

from typing import Protocol

from kvloop.core.outputs import RunnerOutput, SchedulerOutput


class Runner(Protocol):
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one step (forward pass and sampling) and return the sampled tokens."""
        ...

    def shutdown(self) -> None:
        """Release resources (threads, memory)."""
        ...
