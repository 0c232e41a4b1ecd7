"""The model package: the only part of kvloop that imports torch.

`load_runner(RunnerConfig(...))` reads a model (the embedded SmolLM2 GGUF by default, a
`.gguf` file or a Hugging Face folder), builds the Llama-family model on the chosen device
and dtype, sizes and allocates the paged KV cache, and returns a `ModelRunner` (the core's
`LoadedRunner` protocol).
The engine then builds `EngineCore(config, runner, num_gpu_blocks=runner.num_gpu_blocks)`.

Importing this package does not import torch; `load_runner` does.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from kvloop.config import DEFAULT_KV_CACHE_MEMORY, RunnerConfig

if TYPE_CHECKING:
    from kvloop.model.runner import ModelRunner

__all__ = ["DEFAULT_KV_CACHE_MEMORY", "load_runner"]

# How long an idle OpenMP thread spins before it sleeps, unless the user chose
# (OMP_WAIT_POLICY or GOMP_SPINCOUNT). libgomp's default (300,000 spins) is fast on an idle
# machine but collapses when another process wants a core: measured here on 2 CPUs with two
# busy processes beside it, a batch-1 decode step took 1.7 s at the default, 60 ms at 10,000
# spins and 64 ms fully passive, while on the idle machine 10,000 costs ~1 ms per step
# (25 vs 24 ms) where passive costs 15 ms. The API process, a benchmark client or another
# worker on the same host is exactly that other process.
OPENMP_SPINCOUNT = "10000"


def default_openmp_spin() -> bool:
    """Set GOMP_SPINCOUNT for torch's OpenMP runtime unless the user set a wait policy or
    torch (hence libgomp, which reads it once at load) is already imported. True if set."""
    if "torch" in sys.modules or "OMP_WAIT_POLICY" in os.environ \
            or "GOMP_SPINCOUNT" in os.environ:
        return False
    os.environ["GOMP_SPINCOUNT"] = OPENMP_SPINCOUNT
    return True


def load_runner(config: RunnerConfig | None = None) -> ModelRunner:
    """Load the model `config` names (default: `RunnerConfig()`, the embedded model on the
    best device) and return its runner; `kvloop.config.RunnerConfig` says what each setting
    does. The engine process calls it by name (`RunnerConfig.factory`).

    Loading torch here first bounds OpenMP's spin-waiting (`default_openmp_spin`).
    """
    default_openmp_spin()
    from kvloop.model.setup import build_runner

    return build_runner(config if config is not None else RunnerConfig())
