"""Turning a `RunnerConfig` into a ready ModelRunner: device, dtype, KV cache size.

Scope: choices made once at start-up. `--dtype` and `--kv-cache-dtype` become a `Precision`
(what each tensor class runs in, the KV cache's values included: `kvloop.model.precision`)
and, for fp8 / int8, a `KVQuant` (the cache's codes: `kvloop.model.kv_quant`). The number of
KV blocks comes from a memory budget (or an override) and includes the null block 0:
`--kv-cache-memory`, else on CUDA vLLM's `--gpu-memory-utilization` rule (`kv_cache_bytes`),
else `DEFAULT_KV_CACHE_MEMORY`.
"""

from __future__ import annotations

import logging
import os

import torch

from kvloop.config import (
    DEFAULT_KV_CACHE_MEMORY,
    GPU_MEMORY_UTILIZATION,
    GPU_MEMORY_UTILIZATION_IGNORED,
    RunnerConfig,
    check_device,
)
from kvloop.model import cpu_ops
from kvloop.model.crossover import cached_policy
from kvloop.model.gemma3 import Gemma3Model
from kvloop.model.kv_quant import KVQuant, kv_quant_for, kv_row_bytes
from kvloop.model.llama import LlamaModel
from kvloop.model.loader import ModelConfig, load_model
from kvloop.model.precision import resolve_precision
from kvloop.model.quant import LowBitPolicy
from kvloop.model.runner import ModelRunner

logger = logging.getLogger(__name__)

# architectures whose model class is not the Llama family's `LlamaModel`
MODEL_CLASSES: dict[str, type[LlamaModel]] = {"gemma3": Gemma3Model}

# What a step's activations may take on CUDA beside weights and KV cache (vLLM measures it
# with a profiling run; kvloop reserves this much instead).
CUDA_ACTIVATION_RESERVE = 1 << 30


def build_runner(rc: RunnerConfig) -> ModelRunner:
    dev = resolve_device(rc.device)
    precision = resolve_precision(rc.dtype, dev, rc.kv_cache_dtype)
    torch_dtype = precision.kv_cache
    if dev.type == "cpu":
        set_cpu_threads(rc.num_threads)
    loaded = load_model(rc.model)
    config = loaded.config
    kv_cache_memory = rc.kv_cache_memory
    if rc.num_gpu_blocks_override is None:
        kv_cache_memory = kv_cache_bytes(dev, kv_cache_memory, rc.gpu_memory_utilization,
                                         model_weight_bytes(loaded.weights,
                                                            precision.activations))
    kv_quant = kv_quant_for(rc.kv_cache_dtype)
    if kv_quant is not None and any(g.sliding_window for g in config.kv_cache_groups):
        raise ValueError(f"--kv-cache-dtype {rc.kv_cache_dtype}: {config.architecture} has "
                         "sliding-window layers, whose KV stays unquantized "
                         "(use --kv-cache-dtype auto or bfloat16)")
    num_blocks = num_kv_blocks(config, rc.block_size, torch_dtype, kv_cache_memory,
                               rc.num_gpu_blocks_override, kv_quant)
    max_len = resolve_max_model_len(config, rc.block_size, num_blocks, rc.max_model_len)
    torch.manual_seed(rc.seed)
    model_class = MODEL_CLASSES.get(config.architecture, LlamaModel)
    net = model_class(config, loaded.weights, precision, dev, max_positions=max_len + 1,
                      quantized=loaded.quantized)
    del loaded.weights, loaded.quantized
    net.low_bit = low_bit_policy(net, rc.low_bit_max_tokens,
                                 {"model": _file_identity(loaded.path),
                                  "precision": precision.describe(), "device": str(dev)})
    logger.info("loaded %s (%s, %s on %s): %d KV blocks of %d tokens (%s), max_model_len %d",
                loaded.name, config.architecture, precision.describe(), dev, num_blocks,
                rc.block_size, kv_quant.name if kv_quant else f"KV in {precision.kv_cache}",
                max_len)
    runner = ModelRunner(net, config, num_gpu_blocks=num_blocks, block_size=rc.block_size,
                         max_model_len=max_len, device=dev, model_name=loaded.name,
                         seed=rc.seed, kv_quant=kv_quant)
    if rc.lora is not None:
        runner.enable_lora(rc.lora)
    return runner


def model_weight_bytes(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> int:
    """What the loaded weights take beside the KV cache in the memory plan: every parameter
    at `dtype`'s size, a mixture of experts' every expert included (all stay resident,
    whichever a step routes to)."""
    return sum(t.numel() for t in weights.values()) * _elem_size(dtype)


def low_bit_policy(net: LlamaModel, max_tokens: int | None,
                   identity: dict[str, object]) -> LowBitPolicy:
    """`RunnerConfig.low_bit_max_tokens`: a fixed threshold for layers and LM head alike,
    else (None) the measured crossover (`cached_policy`: measured once per model, precision
    and machine); never where the model has no low-bit weights."""
    if not any(m.low_bit is not None for m in net.linears()):
        return LowBitPolicy()
    if max_tokens is not None:
        return LowBitPolicy(max_tokens, max_tokens)
    return cached_policy(net, identity)


def _file_identity(path: str) -> list[object]:
    """A model file by path, size and modification time (a rewritten file is another)."""
    st = os.stat(path)
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns]


def resolve_device(device: str) -> torch.device:
    check_device(device)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA device")
    return dev


def set_cpu_threads(num_threads: int | None = None) -> None:
    """torch intra-op threads = `num_threads`; by default OMP_NUM_THREADS when the user set
    it (torch already read it), else the cores this process may use. kvloop's own thread
    pool (`cpu_ops.set_pool_threads`) gets as many."""
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    if num_threads is not None or not os.environ.get("OMP_NUM_THREADS"):
        cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count())
        threads = num_threads or cores
        if threads and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
    cpu_ops.set_pool_threads(torch.get_num_threads())   # kvloop's own pool: as many


def _elem_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_cache_bytes(device: torch.device, kv_cache_memory: int | None,
                   gpu_memory_utilization: float | None, weight_bytes: int) -> int:
    """The KV cache budget: `kv_cache_memory` if given; on CUDA `cuda_kv_budget` of the
    device's memory (`gpu_memory_utilization`, default vLLM's); else the default budget
    (`gpu_memory_utilization` is then ignored, with a warning, as vLLM's CPU backend does)."""
    if kv_cache_memory is not None:
        return kv_cache_memory
    if device.type != "cuda":
        if gpu_memory_utilization is not None:
            logger.warning("%s", GPU_MEMORY_UTILIZATION_IGNORED)
        return DEFAULT_KV_CACHE_MEMORY
    free, total = torch.cuda.mem_get_info(device)
    return cuda_kv_budget(total, free, gpu_memory_utilization or GPU_MEMORY_UTILIZATION,
                          weight_bytes)


def cuda_kv_budget(total: int, free: int, utilization: float, weight_bytes: int,
                   reserve: int = CUDA_ACTIVATION_RESERVE) -> int:
    """vLLM's rule: `utilization` x the device's memory holds this engine's weights,
    activations (`reserve`, where vLLM profiles) and KV cache; the device must have that much
    free at start-up. ValueError (naming the flag) when it does not, or nothing is left."""
    gib = 1 << 30
    requested = int(total * utilization)
    if free < requested:
        raise ValueError(f"the CUDA device has {free / gib:.1f} GiB free of {total / gib:.1f} "
                         f"GiB, less than --gpu-memory-utilization {utilization} asks for "
                         f"({requested / gib:.1f} GiB); lower it or free the device")
    budget = requested - weight_bytes - reserve
    if budget <= 0:
        raise ValueError(f"--gpu-memory-utilization {utilization} ({requested / gib:.1f} GiB) "
                         f"leaves no room for the KV cache beside {weight_bytes / gib:.1f} GiB "
                         f"of weights and {reserve / gib:.1f} GiB for activations; raise it")
    return budget


def num_kv_blocks(config: ModelConfig, block_size: int, dtype: torch.dtype,
                  kv_cache_memory: int | None, override: int | None,
                  kv_quant: KVQuant | None = None) -> int:
    """Blocks in the pool, the null block included: as many as `kv_cache_memory` holds,
    a block weighing its rows in the cache's format (`dtype`, or `kv_quant`'s codes and
    scales: more blocks in the same memory by the rows' byte ratio)."""
    if override is not None:
        if override < 2:
            raise ValueError(f"num_gpu_blocks_override must be >= 2, got {override}")
        return override
    memory = DEFAULT_KV_CACHE_MEMORY if kv_cache_memory is None else kv_cache_memory
    rows_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads
    block_bytes = rows_per_token * kv_row_bytes(kv_quant, config.head_dim, dtype) * block_size
    blocks = memory // block_bytes
    if blocks < 2:
        raise ValueError(f"kv_cache_memory={memory} bytes holds {blocks} blocks of "
                         f"{block_bytes} bytes; at least 2 are needed")
    return int(blocks)


def resolve_max_model_len(config: ModelConfig, block_size: int, num_blocks: int,
                          requested: int | None) -> int:
    capacity = (num_blocks - 1) // len(config.kv_cache_groups) * block_size
    limit = min(config.max_position_embeddings, capacity)
    if requested is not None:
        if requested > config.max_position_embeddings:
            raise ValueError(f"max_model_len={requested} exceeds the model's context length "
                             f"{config.max_position_embeddings}")
        limit = min(limit, requested)
    return limit
