"""The runner protocol: anything that turns a `SchedulerOutput` into a `RunnerOutput`.

The model runner (`kvloop.model.runner`), the simulator (`kvloop.sim.runner`) and test
doubles implement it. A runner owns its KV tensors and whatever per-request state it caches;
it learns about requests only through `SchedulerOutput` (new, cached, finished, preempted).

A runner factory (`kvloop.model.load_runner`, `kvloop.sim.worker.make_sim_runner`, called
with a `kvloop.config.RunnerConfig`) returns a `LoadedRunner`: a Runner that also carries
the facts found while building it, which the engine and the API server take from it rather
than from any config. A runner whose KV blocks can move between engines (prefill/decode
disaggregation) also has `kv_block_store`, a `kvloop.core.kv_connector.KVBlockStore`.
A runner whose step time is a model (the simulator) is a `ModelledRunner`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kvloop.core.kv_cache_groups import KVCacheGroupSpec
from kvloop.core.outputs import GrammarOutput, RunnerOutput, SchedulerOutput


class Runner(Protocol):
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one step (forward pass and sampling) and return the sampled tokens."""
        ...

    def shutdown(self) -> None:
        """Release resources (threads, memory)."""
        ...


@runtime_checkable
class SplitRunner(Runner, Protocol):
    """A runner whose step is two calls, so the engine can work while the forward runs (vLLM's
    `execute_model(non_block=True)` then `sample_tokens(grammar_output)`): the engine computes
    the grammar bitmask between them. `execute(so)` must equal
    `execute_model(so); sample_tokens(None)`. Only a SplitRunner can serve structured output.
    """

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Start the step's forward pass and return at once (it runs in the background)."""
        ...

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> RunnerOutput:
        """Wait for the forward pass started by `execute_model`, apply `grammar_output`'s
        bitmask to the logits (disallowed tokens to -inf, before any other sampling step) and
        sample."""
        ...


@runtime_checkable
class LoadedRunner(Runner, Protocol):
    """What a runner factory returns: a Runner and the facts of what it built (`isinstance`
    checks that they are there)."""

    num_gpu_blocks: int   # KV blocks allocated, the null block 0 included (vLLM's count)
    max_model_len: int    # the longest sequence it serves (the engine clamps it to the KV cache)
    vocab_size: int       # token ids it accepts: 0 .. vocab_size - 1
    model_name: str       # what it loaded ("sim" for the simulator)


@runtime_checkable
class HybridRunner(Runner, Protocol):
    """A runner whose model has several KV-cache groups (full-attention and sliding-window
    layers, `kvloop.core.kv_cache_groups`): the engine's KV cache manager keeps one block
    table per group. A runner without this attribute has one full-attention group."""

    kv_cache_groups: tuple[KVCacheGroupSpec, ...]


@runtime_checkable
class ModelledRunner(Runner, Protocol):
    """A runner whose step time comes from a model, not a clock (the simulator): what
    `--max-num-batched-tokens auto` asks instead of timing steps (`kvloop.core.budget`)."""

    def modelled_step_time(self, scheduler_output: SchedulerOutput) -> float:
        """Seconds the step `scheduler_output` describes would take (nothing runs)."""
        ...


@runtime_checkable
class LoRARunner(Runner, Protocol):
    """A runner that serves LoRA adapters by name (the model runner with `--enable-lora`, the
    simulator). Called by the engine between steps; a request's `lora_name` in
    `NewRequestData` names one registered here."""

    def add_lora(self, name: str, path: str) -> None:
        """Register adapter `name` from folder `path` (ValueError: it can never be served)."""
        ...

    def remove_lora(self, name: str) -> None:
        """Forget adapter `name` (ValueError: not registered)."""
        ...

    def prepare_lora(self, name: str) -> None:
        """Make registered adapter `name` ready for the next steps (read again from its
        folder if it left host memory); ValueError: it cannot be read now."""
        ...

    def list_loras(self) -> list[str]:
        ...
