"""The engine's one assembly: `build_engine` turns a runner config and an engine config
template into a running `EngineCore`, for the engine core process (`kvloop.engine.proc`) and
the offline `LLM` (`kvloop.llm`) alike (vLLM has one `EngineCore` behind one client
factory; kvloop has one builder behind its two owners).

    runner     = the factory `RunnerConfig.factory` names (or the caller's loaded runner)
    config     = the template with the runner's facts      (`engine_config_for`)
    grammar    = `RunnerConfig.grammar_backend_factory`     (a SplitRunner only)
    connector  = P/D, then the tiers: one, or a `MultiConnector` of both   (`make_connectors`)
    engine     = EngineCore(config, runner, grammar, connector); the connectors started

The runner and the grammar backend are found by factory name ("module:function"), so this
module imports no model, no simulator and no grammar engine. What building finds out (KV
blocks, context length, the resolved budget and hash seed, the side channel's address) comes
back in `BuiltEngine`, never written into the caller's config.

Owner: nothing after it returns; the engine owns the runner and the connector.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvloop.config import EngineConfig, RunnerConfig
from kvloop.core.budget import resolve_budget
from kvloop.core.engine import EngineCore
from kvloop.core.hashing import resolve_seed
from kvloop.core.kv_connector import KVConnector
from kvloop.core.runner import HybridRunner, LoadedRunner, SplitRunner
from kvloop.trust import FleetSecret
from kvloop.wire import KVTransferInfo

logger = logging.getLogger("kvloop.engine")


@dataclass(frozen=True)
class BuiltEngine:
    """What `build_engine` made: the engine (its `config` the resolved one), the runner it
    drives, and the P/D side channel's address (None: no P/D connector)."""

    engine: EngineCore
    runner: LoadedRunner
    kv_transfer: KVTransferInfo | None

    @property
    def config(self) -> EngineConfig:
        return self.engine.config


def resolve_factory(name: str) -> Callable[..., Any]:
    """Import "module:function" and return the function."""
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"a factory must look like 'module:function', got {name!r}")
    return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]


def build_engine(runner_config: RunnerConfig, template: EngineConfig, *,
                 runner: LoadedRunner | None = None, tokenizer: Any = None,
                 num_gpu_blocks: int | None = None, kv_events: bool = False,
                 secret: FleetSecret | None = None) -> BuiltEngine:
    """Build and start one engine (module docstring).

    `runner`: an already loaded runner (tests and benchmarks share one model), else the
    factory's; `tokenizer`: the grammar backend's tokenizer when the caller has loaded one
    (else the backend loads the model's); `num_gpu_blocks`: use at most this many of the
    runner's KV blocks; `kv_events`: the pool (and the tiers) record KV events for a
    publisher; `secret`: the fleet secret (P/D side channel, shared-store records)."""
    if runner is None:
        runner = resolve_factory(runner_config.factory)(runner_config)
    assert runner is not None
    config = engine_config_for(template, runner, runner_config, num_gpu_blocks, kv_events)
    connector = make_connectors(config, runner, secret)
    engine = EngineCore(config, runner, num_gpu_blocks=config.cache.num_gpu_blocks,
                        grammar_backend=_grammar_backend(runner_config, runner, tokenizer),
                        connector=connector)
    _log_engine_config(config)
    info = connector.start() if connector is not None else None
    return BuiltEngine(engine, runner, info)


def engine_config_for(template: EngineConfig, runner: LoadedRunner,
                      runner_config: RunnerConfig, num_gpu_blocks: int | None = None,
                      kv_events: bool = False) -> EngineConfig:
    """The template with the runner's facts: KV capacity (at most `num_gpu_blocks`), context
    length, resolved hash seed, adapters per step (`runner_config.lora`'s, when it has them),
    KV events on with `kv_events`, and with `auto_budget` the step budget measured on the
    runner (`kvloop.core.budget`).

    `max_model_len` is clamped to what the KV cache holds, so a lone request can always finish,
    and without chunked prefill to the step budget, so every prompt fits in one step.
    """
    cache, sched = template.cache, template.scheduler
    num_blocks = min(runner.num_gpu_blocks, num_gpu_blocks or runner.num_gpu_blocks)
    max_len = runner.max_model_len
    # a request holds blocks in every KV-cache group (a hybrid model's sliding-window ones
    # too: a one-step prefill writes all its tokens there)
    groups = len(runner.kv_cache_groups) if isinstance(runner, HybridRunner) else 1
    capacity = (num_blocks - 1) // groups * cache.block_size
    if capacity < max_len:
        logger.warning("max_model_len %d exceeds the KV cache (%d blocks of %d = %d tokens); "
                       "using %d", max_len, num_blocks - 1, cache.block_size, capacity, capacity)
        max_len = capacity
    lora = runner_config.lora
    sched = dataclasses.replace(sched, max_model_len=max_len,
                                max_loras=lora.max_loras if lora is not None else sched.max_loras)
    if template.auto_budget is not None:
        sched = resolve_budget(sched, template.auto_budget, runner, cache.block_size)
    budget = sched.max_num_batched_tokens
    if not sched.enable_chunked_prefill and budget < max_len:
        logger.warning("max_model_len %d exceeds max_num_batched_tokens %d without chunked "
                       "prefill (a prompt must fit in one step); using %d", max_len, budget,
                       budget)
        sched = dataclasses.replace(sched, max_model_len=budget)
    seed = resolve_seed(cache.prefix_caching_hash_algo, cache.hash_seed)
    cache = dataclasses.replace(cache, num_gpu_blocks=num_blocks, hash_seed=seed,
                                enable_kv_cache_events=cache.enable_kv_cache_events or kv_events)
    return dataclasses.replace(template, cache=cache, scheduler=sched)


def make_connectors(config: EngineConfig, runner: object,
                    secret: FleetSecret | None) -> KVConnector | None:
    """The engine's KV connector: the P/D connector (`config.kv_transfer`), the tiers
    (`config.kv_offload`), or both as a `MultiConnector` in that order (a request that names
    its prefill worker loads from it; any other from the tiers; every sealed block is saved
    to the tiers either way). None: neither is configured."""
    connectors: list[KVConnector] = []
    if config.kv_transfer is not None:
        from kvloop.kv_transfer import make_connector

        connectors.append(make_connector(config.kv_transfer, runner, secret=secret))
    if config.kv_offload is not None:
        from kvloop.kv_transfer.offloading import make_offloading_connector

        connectors.append(make_offloading_connector(config.kv_offload, runner, config.cache,
                                                    secret=secret))
    if len(connectors) < 2:
        return connectors[0] if connectors else None
    from kvloop.kv_transfer.multi import MultiConnector

    return MultiConnector(connectors)


def _grammar_backend(runner_config: RunnerConfig, runner: LoadedRunner,
                     tokenizer: Any) -> Callable[[], Any] | None:
    """Structured output's grammar backend factory (called on the first constrained request);
    None for a runner that cannot apply a bitmask (the simulator): constraints are refused."""
    name = runner_config.grammar_backend_factory
    if name is None or not isinstance(runner, SplitRunner):
        return None
    return functools.partial(resolve_factory(name), runner_config, runner.vocab_size,
                             tokenizer)


def _log_engine_config(config: EngineConfig) -> None:
    """The engine's step and cache settings, once, as it starts serving."""
    sched, cache = config.scheduler, config.cache
    logger.info("engine config: max_num_batched_tokens %d%s, max_num_seqs %d, max_model_len "
                "%d, chunked prefill %s, num_gpu_blocks %d of %d tokens, prefix caching %s",
                sched.max_num_batched_tokens, " (auto)" if config.auto_budget else "",
                sched.max_num_seqs, sched.max_model_len,
                "on" if sched.enable_chunked_prefill else "off", cache.num_gpu_blocks,
                cache.block_size, "on" if cache.enable_prefix_caching else "off")
