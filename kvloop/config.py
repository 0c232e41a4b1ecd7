"""Frozen configuration objects, validated at construction.

Values discovered at run time (the number of KV blocks a model runner can fit, the EOS id of
a tokenizer) are never written back into these objects: they come back in result objects.
Every field keeps vLLM's name where the concept is the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
Role = Literal["both", "prefill", "decode"]   # what a router may send a worker (`--role`)
ROLES: tuple[Role, ...] = get_args(Role)
POLICIES = ("fcfs", "priority")

# The model runner's dtypes (alias -> torch name) and devices; torch-free, so the API server
# checks `--dtype` and `--device` (for `--model sim` too) before an engine starts.
DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "float": "float32",
                 "bfloat16": "bfloat16", "bf16": "bfloat16",
                 "float16": "float16", "fp16": "float16", "half": "float16"}
DEVICES = ("auto", "cpu", "cuda", "cuda:N")
GPU_MEMORY_UTILIZATION = 0.92   # vLLM's default fraction of a CUDA device's memory
GPU_MEMORY_UTILIZATION_IGNORED = ("--gpu-memory-utilization is ignored without a CUDA device "
                                  "(as vLLM's CPU backend ignores it); size the KV cache with "
                                  "--kv-cache-memory")


def check_device(device: str) -> None:
    """ValueError unless `device` is one of `DEVICES` (N a device index)."""
    kind, _, index = device.partition(":")
    if device in DEVICES[:3] or (kind == "cuda" and index.isdigit()):
        return
    raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")


def check_dtype(dtype: str) -> None:
    if dtype != "auto" and dtype not in DTYPE_ALIASES:
        raise ValueError(f"--dtype must be auto or one of {', '.join(DTYPE_ALIASES)}, "
                         f"got {dtype!r}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache and its prefix cache.

    `num_gpu_blocks` counts every block of the pool *including* the null block (id 0), as
    vLLM does, so `num_gpu_blocks - 1` blocks are usable. `hash_seed` is the NONE_HASH seed
    string; None means vLLM's rule (PYTHONHASHSEED if set, else the algorithm's default).
    """

    block_size: int = 16
    num_gpu_blocks: int = 1024
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    hash_seed: str | None = None
    watermark: float = 0.0
    enable_kv_cache_events: bool = False
    kv_events_int_hashes: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be >= 2 (one is the null block), "
                             f"got {self.num_gpu_blocks}")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {HASH_ALGOS}, "
                             f"got {self.prefix_caching_hash_algo!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")


@dataclass(frozen=True)
class SchedulerConfig:
    """The token budget and admission limits of one engine step."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 4096
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    scheduler_reserve_full_isl: bool = True
    num_lookahead_tokens: int = 0
    max_waiting_requests: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})")
        if self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine core needs: cache, scheduler, and debugging switches."""

    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    check_invariants: bool = False
    log_stats: bool = True
