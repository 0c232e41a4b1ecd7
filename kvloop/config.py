"""Frozen configuration objects, validated at construction.

Values discovered at run time (the number of KV blocks a model runner can fit, the EOS id of
a tokenizer) are never written back into these objects: they come back in result objects.
Every field keeps vLLM's name where the concept is the same.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
Role = Literal["both", "prefill", "decode"]   # what a router may send a worker (`--role`)
ROLES: tuple[Role, ...] = get_args(Role)
POLICIES = ("fcfs", "priority")

# Defaults named once (vLLM's where vLLM has one); every flag, config and trace format
# imports them.
DEFAULT_BLOCK_SIZE = 16
DEFAULT_HASH_ALGO = "sha256"
DEFAULT_POLICY = "fcfs"
DEFAULT_ROLE: Role = "both"
DEFAULT_MAX_MODEL_LEN = 8192   # until a model says otherwise (the engine's runner facts win)
# `--max-num-batched-tokens auto` (kvloop.core.budget): the step budget from the runner's step
# time. Never below the floor (a prefill chunk that still makes progress, and room for a token
# of every running request), never above the cap (nor the context length or the KV cache).
AUTO_BUDGET = "auto"
AUTO_BUDGET_FLOOR = 64
AUTO_BUDGET_CAP = 8192
DEFAULT_TARGET_TPOT_MS = 100.0

# The model runner's dtypes (alias -> torch name) and devices; torch-free, so the API server
# checks `--dtype` and `--device` (for `--model sim` too) before an engine starts.
DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "float": "float32",
                 "bfloat16": "bfloat16", "bf16": "bfloat16",
                 "float16": "float16", "fp16": "float16", "half": "float16"}
DEVICES = ("auto", "cpu", "cuda", "cuda:N")
GPU_MEMORY_UTILIZATION = 0.92   # vLLM's default fraction of a CUDA device's memory
DEFAULT_KV_CACHE_MEMORY = 1 << 30  # 1 GiB off CUDA: ~46k tokens of SmolLM2 in bf16, 23k in fp32
GPU_MEMORY_UTILIZATION_IGNORED = ("--gpu-memory-utilization is ignored without a CUDA device "
                                  "(as vLLM's CPU backend ignores it); size the KV cache with "
                                  "--kv-cache-memory")


def check_device(device: str) -> None:
    """ValueError unless `device` is one of `DEVICES` (N a device index)."""
    kind, _, index = device.partition(":")
    if device in DEVICES[:3] or (kind == "cuda" and index.isdigit()):
        return
    raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")


# `--kv-cache-dtype` (vLLM's names, plus int8). "auto": K and V in the activations' dtype
# (bf16 on `--dtype auto`'s mixed path: kvloop.model.precision.resolve_precision);
# "bfloat16": K and V in bf16 whatever the activations' dtype (fp32 or bf16: under fp32
# activations the kernels read the bf16 cache widened; kvloop.model.precision); the others:
# one-byte codes, each row (one token's K or V of one KV head) `head_dim` codes then the
# row's fp32 scale, `KV_SCALE_BYTES` (kvloop.model.kv_quant says why per row). "fp8" is
# "fp8_e4m3", as in vLLM.
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}
QUANTIZED_KV_CACHE_DTYPES = ("fp8_e4m3", "fp8_e5m2", "int8")
KV_SCALE_BYTES = 4


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {kv_cache_dtype!r}")


def resolve_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """The stored format a `--kv-cache-dtype` names: "auto", "bfloat16" or a
    `QUANTIZED_KV_CACHE_DTYPES`."""
    check_kv_cache_dtype(kv_cache_dtype)
    return KV_CACHE_DTYPE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)


def quantized_kv_row_bytes(head_dim: int) -> int:
    """Bytes of one quantized cache row: `head_dim` one-byte codes and the row's scale."""
    return head_dim + KV_SCALE_BYTES


def check_dtype(dtype: str) -> None:
    if dtype != "auto" and dtype not in DTYPE_ALIASES:
        raise ValueError(f"--dtype must be auto or one of {', '.join(DTYPE_ALIASES)}, "
                         f"got {dtype!r}")


# The runner factories, "module:function": the engine process imports the one a
# `RunnerConfig` names, so it never imports a model or a simulator it does not run.
REAL_RUNNER_FACTORY = "kvloop.model:load_runner"
SIM_RUNNER_FACTORY = "kvloop.sim.worker:make_sim_runner"
# Structured output's grammar backend of a real model, "module:function" called with the
# RunnerConfig and the runner's vocabulary size; the simulator has none.
GRAMMAR_BACKEND_FACTORY = "kvloop.structured:load_backend"
GRAMMAR_BACKEND = "xgrammar"


@dataclass(frozen=True)
class SimSettings:
    """What only the simulator (`--model sim`) has: its latency model and the vocabulary it
    presents, whose facts the API process read from `--sim-model` (None and (): the byte
    vocabulary's, `kvloop.sim.byte_vocab`). `latency_file` None is
    kvloop/sim/latency_smollm2_cpu.json; `model_latency` False makes steps take no time.
    `copy_rate`: how often the simulated model copies from its context, so speculative
    decoding finds drafts it accepts (`kvloop.sim.runner`; 0: never). `lora_load_s`: with
    LoRA on, each step lasts this much longer per adapter it must load into a slot."""

    latency_file: str | None = None
    speedup: float = 1.0
    model_latency: bool = True
    vocab_size: int | None = None
    text_token_ids: tuple[int, ...] = ()
    copy_rate: float = 0.0
    lora_load_s: float = 0.005     # modelled time to copy one adapter into a slot

    def __post_init__(self) -> None:
        if self.lora_load_s < 0:
            raise ValueError(f"lora_load_s must be >= 0, got {self.lora_load_s}")
        if not self.speedup > 0:
            raise ValueError(f"--sim-speedup must be > 0, got {self.speedup}")
        if not 0.0 <= self.copy_rate <= 1.0:
            raise ValueError(f"--sim-copy-rate must be in [0, 1], got {self.copy_rate}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")


# A PEFT adapter folder's two files (what kvloop reads of an adapter).
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_folder_problem(path: str) -> str | None:
    """Why folder `path` cannot be a PEFT adapter (not a folder, a file missing), or None.
    Checked before a model loads (`--lora-modules`) and again when the adapter is read."""
    if not os.path.isdir(path):
        return f"{path} is not a directory"
    missing = [f for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
               if not os.path.isfile(os.path.join(path, f))]
    return f"no {' or '.join(missing)} in {path}" if missing else None


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA serving (vLLM's `--enable-lora` and its limits; None on `RunnerConfig`: off).

    - `max_loras`: adapters resident in the runner's slots at once, so at most this many
      distinct adapters share one step (vLLM's `--max-loras`, default 1);
    - `max_lora_rank`: the largest rank an adapter may have (vLLM's `--max-lora-rank`,
      default 16); the slots are sized for it;
    - `max_cpu_loras`: adapters kept decoded in host memory, LRU, reread from their folder
      when evicted (vLLM's `--max-cpu-loras`; None: `max_loras`);
    - `max_adapters`: how many names may be registered at once (kvloop's bound on
      `/v1/load_lora_adapter`, so a client cannot grow the registry without limit).
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    max_adapters: int = 64

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"--max-loras must be >= 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ValueError(f"--max-lora-rank must be in [1, {MAX_LORA_RANK}], got "
                             f"{self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be >= "
                             f"--max-loras ({self.max_loras})")
        if self.max_adapters < 1:
            raise ValueError(f"max_adapters must be >= 1, got {self.max_adapters}")

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


MAX_LORA_RANK = 512   # vLLM's largest supported --max-lora-rank


@dataclass(frozen=True)
class RunnerConfig:
    """How to build the engine's runner: the model runner's settings (vLLM's names), plus
    `sim` for the simulator.

    One config for both runners, not two: the simulator runs with the settings a model would
    get (KV capacity `num_gpu_blocks_override`, context length `max_model_len`, `seed`), so
    they are written once, and the rest is validated whichever runner serves; `sim` holds the
    few settings only the simulator has, and its presence picks the `factory`. Built once,
    from `kvloop serve`'s flags or `LLM`'s keyword arguments, and handed down whole:
    `kvloop.wire.EngineStartConfig.runner` carries it to the engine process (msgspec decodes
    it by these annotations, types checked and `__post_init__` run, as it does `EngineConfig`
    beside it), which calls `factory` with it. What building finds out (KV blocks, context
    length, vocabulary size, model name) comes back on the runner
    (`kvloop.core.runner.LoadedRunner`), never written in here.

    - `model`: None (the embedded SmolLM2-135M-Instruct), a `.gguf` path or a Hugging Face
      folder (the simulator opens no model file: the API process reads `--sim-model`);
    - `dtype`: "auto" (bf16 where the device computes in it, else fp32 on CPU, fp16 on CUDA)
      or one of `DTYPE_ALIASES`; `device`: one of `DEVICES`;
    - `block_size`: tokens per KV block, the engine's `CacheConfig.block_size` (whoever
      builds both fills them from one value; `EngineStartConfig` checks they agree);
    - `kv_cache_memory`: bytes for the KV cache (default: on CUDA `gpu_memory_utilization` of
      the device's memory, default `GPU_MEMORY_UTILIZATION`, minus weights and activations;
      elsewhere `DEFAULT_KV_CACHE_MEMORY`); `num_gpu_blocks_override` fixes the
      number of blocks (null block included) instead;
    - `max_model_len`: cap on the context length (default: the model's, capped by the KV
      cache);
    - `num_threads`: torch intra-op threads on CPU (default: OMP_NUM_THREADS if set, else
      the cores the process may use);
    - `low_bit_max_tokens`: steps of at most this many tokens run a GGUF's 4-bit (and Q8_0)
      weights as they are, larger ones the dense copy (CPU only; None: the crossover measured
      at start-up, `kvloop.model.crossover`; 0: dense only, e.g. for exact fp32 comparisons);
    - `lora`: LoRA adapters served (`LoRAConfig`; None: `--enable-lora` not given);
    - `kv_cache_dtype`: how K and V are stored (`KV_CACHE_DTYPES`; "auto": the activations'
      dtype, bf16 on the mixed path (`kvloop.model.precision`); "bfloat16": bf16, under fp32
      activations too; fp8 and int8: one byte per element and a scale per row,
      `kvloop.model.kv_quant`).
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory: int | None = None
    num_gpu_blocks_override: int | None = None
    max_model_len: int | None = None
    seed: int = 0
    num_threads: int | None = None
    gpu_memory_utilization: float | None = None
    low_bit_max_tokens: int | None = None
    sim: SimSettings | None = None
    lora: LoRAConfig | None = None
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        check_kv_cache_dtype(self.kv_cache_dtype)
        check_device(self.device)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        util = self.gpu_memory_utilization
        if util is not None and not 0 < util <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {util}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"--num-threads must be >= 1, got {self.num_threads}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if self.low_bit_max_tokens is not None and self.low_bit_max_tokens < 0:
            raise ValueError(f"--low-bit-max-tokens must be >= 0, got "
                             f"{self.low_bit_max_tokens}")
        blocks = self.num_gpu_blocks_override
        if blocks is not None and blocks < 2:
            raise ValueError(f"--num-gpu-blocks-override must be >= 2 (one is the null "
                             f"block), got {blocks}")

    @property
    def factory(self) -> str:
        """The "module:function" that builds this runner from this config."""
        return REAL_RUNNER_FACTORY if self.sim is None else SIM_RUNNER_FACTORY

    @property
    def grammar_backend_factory(self) -> str | None:
        """The "module:function" that builds structured output's grammar backend for this
        runner's model (None: the simulator serves no structured output)."""
        return GRAMMAR_BACKEND_FACTORY if self.sim is None else None


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache and its prefix cache.

    `num_gpu_blocks` counts every block of the pool *including* the null block (id 0), as
    vLLM does, so `num_gpu_blocks - 1` blocks are usable. `hash_seed` is the NONE_HASH seed
    string; None means vLLM's rule (PYTHONHASHSEED if set, else the algorithm's default).
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    num_gpu_blocks: int = 1024
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = DEFAULT_HASH_ALGO
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
    policy: str = DEFAULT_POLICY
    enable_chunked_prefill: bool = True
    scheduler_reserve_full_isl: bool = True
    num_lookahead_tokens: int = 0
    max_loras: int | None = None       # LoRA served: adapters per step (None: LoRA off)
    # attended keys that cost one budget token (kvloop.core.chunk_cost; None: each token 1)
    attention_keys_per_token: int | None = None

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
        if self.max_loras is not None and self.max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        if self.attention_keys_per_token is not None and self.attention_keys_per_token < 1:
            raise ValueError(f"attention_keys_per_token must be >= 1 or None, "
                             f"got {self.attention_keys_per_token}")


def budget_floor(max_num_seqs: int) -> int:
    """The smallest budget `--max-num-batched-tokens auto` picks: `AUTO_BUDGET_FLOOR`, or
    `max_num_seqs` if larger (a step must have a token for every request it runs)."""
    return max(AUTO_BUDGET_FLOOR, max_num_seqs)


@dataclass(frozen=True)
class AutoBudget:
    """`--max-num-batched-tokens auto`: the owner of the runner (the engine core process;
    `LLM` in process) times the runner's steps once it is loaded, before any request, and
    picks the largest budget whose step stays within `target_tpot_ms` (every decode riding
    in a step waits for the whole step): `kvloop.core.budget.resolve_budget`. Until then the
    template's `SchedulerConfig.max_num_batched_tokens` holds the floor (`budget_floor`).
    `target_tpot_ms` None: the default target (`DEFAULT_TARGET_TPOT_MS`), which a machine
    too slow for it may miss without a warning (the user asked for nothing)."""

    target_tpot_ms: float | None = None

    def __post_init__(self) -> None:
        t = self.target_tpot_ms
        if t is not None and (isinstance(t, bool) or not t > 0):
            raise ValueError(f"--target-tpot-ms must be > 0, got {t}")

    @property
    def explicit(self) -> bool:
        return self.target_tpot_ms is not None

    @property
    def target_s(self) -> float:
        t = self.target_tpot_ms
        return (DEFAULT_TARGET_TPOT_MS if t is None else t) / 1000.0


# Speculative decoding (`--speculative-config`, `LLM(speculative_config=...)`): the methods
# kvloop runs, vLLM's default n-gram window and suffix-decoding settings, and the keys its
# JSON may hold (each method's own keys are refused with the other method).
SPEC_METHODS = ("ngram", "suffix")
DEFAULT_PROMPT_LOOKUP = 5      # vLLM's prompt_lookup_min and _max when neither is given
NGRAM_KEYS = ("prompt_lookup_min", "prompt_lookup_max")
SUFFIX_KEYS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
               "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")
SUFFIX_DEFAULTS: dict[str, Any] = dict(zip(SUFFIX_KEYS, (24, 10000, 1.0, 0.1), strict=True))
SPEC_CONFIG_KEYS = ("method", "num_speculative_tokens", *NGRAM_KEYS, "model", *SUFFIX_KEYS)


def _spec_int(name: str, value: object, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"speculative config: {name} must be an integer >= {low}, "
                         f"got {value!r}")
    return value


def _spec_float(name: str, value: object, low: float, high: float | None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < low \
            or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"speculative config: {name} must be a number {bound}, "
                         f"got {value!r}")
    return float(value)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, vLLM's `SpeculativeConfig` for the methods kvloop runs, both
    model-free (docs/vllm-facts.md#speculative-decoding, docs/serving.md):

    - `ngram` (prompt lookup): drafts copied from the request's own context after the last
      n-gram (between `prompt_lookup_min` and `prompt_lookup_max` tokens) that occurred
      before;
    - `suffix` (suffix decoding, kvloop.core.suffix_tree): drafts from suffix trees over the
      request's prompt and output and over the responses of the last
      `suffix_decoding_max_cached_requests` requests (0: none), the most frequent
      continuation of the longest useful match; a draft is at most
      `suffix_decoding_max_spec_factor` times the match length, keeps only tokens whose
      estimated probability is >= `suffix_decoding_min_token_prob`, and match plus draft
      fit in `suffix_decoding_max_tree_depth` tokens.

    Each decoding request proposes up to `num_speculative_tokens` (k) drafts after each
    step (suffix decoding: a variable number, at most k); the next step schedules 1 + drafts
    tokens for it and verifies them in one forward pass.

    Build it from vLLM's keys with `from_dict` (or `parse` for the flag's JSON text), which
    fills the defaults as vLLM does; the constructor only validates.
    """

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    suffix_decoding_max_tree_depth: int = SUFFIX_DEFAULTS["suffix_decoding_max_tree_depth"]
    suffix_decoding_max_cached_requests: int = SUFFIX_DEFAULTS[
        "suffix_decoding_max_cached_requests"]
    suffix_decoding_max_spec_factor: float = SUFFIX_DEFAULTS["suffix_decoding_max_spec_factor"]
    suffix_decoding_min_token_prob: float = SUFFIX_DEFAULTS["suffix_decoding_min_token_prob"]

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported; kvloop "
                             f"supports: {', '.join(SPEC_METHODS)}")
        _spec_int("num_speculative_tokens", self.num_speculative_tokens)
        _spec_int("prompt_lookup_min", self.prompt_lookup_min)
        _spec_int("prompt_lookup_max", self.prompt_lookup_max)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} must be <= "
                             f"prompt_lookup_max={self.prompt_lookup_max}")
        _spec_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth)
        _spec_int("suffix_decoding_max_cached_requests",
                  self.suffix_decoding_max_cached_requests, low=0)
        _spec_float("suffix_decoding_max_spec_factor", self.suffix_decoding_max_spec_factor,
                    0.0, None)
        _spec_float("suffix_decoding_min_token_prob", self.suffix_decoding_min_token_prob,
                    0.0, 1.0)

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> SpeculativeConfig:
        """vLLM's rules for its keys: `method` "ngram" (or "[ngram]", or left out with
        `model` "ngram") or "suffix"; `num_speculative_tokens` required for ngram, and for
        suffix defaulting to `suffix_decoding_max_tree_depth`; neither lookup bound given:
        both `DEFAULT_PROMPT_LOOKUP`; one given: the other copies it; suffix keys left out:
        `SUFFIX_DEFAULTS`. ValueError naming the key for anything else (unknown keys, keys
        of the other method, draft models, other methods)."""
        if not isinstance(spec, Mapping):
            raise ValueError(f"speculative config must be a JSON object, got {spec!r}")
        unknown = sorted(set(spec) - set(SPEC_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"speculative config: unknown key(s) {', '.join(unknown)}; "
                             f"kvloop knows {', '.join(SPEC_CONFIG_KEYS)}")
        method = _spec_method(spec.get("method"), spec.get("model"))
        _refuse_other_methods_keys(spec, method)
        if method == "suffix":
            return _suffix_config(spec)
        if spec.get("num_speculative_tokens") is None:
            raise ValueError("speculative config: num_speculative_tokens is required")
        lo: Any = spec.get("prompt_lookup_min")
        hi: Any = spec.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        return cls(num_speculative_tokens=spec["num_speculative_tokens"], method=method,
                   prompt_lookup_min=hi if lo is None else lo,
                   prompt_lookup_max=lo if hi is None else hi)

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """`--speculative-config`'s JSON text."""
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not JSON ({e}): {text!r}") from None
        return cls.from_dict(spec)

    def describe(self) -> str:
        """For the start-up log: the method, its draft bound and where drafts come from."""
        head = f"{self.method}, up to {self.num_speculative_tokens} draft tokens per step"
        if self.method == "suffix":
            return (f"{head} (suffix trees of depth {self.suffix_decoding_max_tree_depth} "
                    f"over the request's own context and the last "
                    f"{self.suffix_decoding_max_cached_requests} responses)")
        return (f"{head} (n-grams of {self.prompt_lookup_min}-{self.prompt_lookup_max} "
                f"tokens from the request's own context)")


def _refuse_other_methods_keys(spec: Mapping[str, Any], method: str) -> None:
    foreign = NGRAM_KEYS if method == "suffix" else SUFFIX_KEYS
    given = [k for k in foreign if spec.get(k) is not None]
    if given:
        owner = "ngram" if method == "suffix" else "suffix"
        raise ValueError(f"speculative config: {', '.join(given)} belong(s) to method "
                         f"{owner!r}, not {method!r}")


def _suffix_config(spec: Mapping[str, Any]) -> SpeculativeConfig:
    """Method "suffix": vLLM's defaults for the keys left out."""
    values = {k: spec[k] if spec.get(k) is not None else v for k, v in SUFFIX_DEFAULTS.items()}
    depth = values["suffix_decoding_max_tree_depth"]
    k = spec.get("num_speculative_tokens")
    return SpeculativeConfig(num_speculative_tokens=depth if k is None else k, method="suffix",
                             **values)


def _spec_method(method: object, model: object) -> str:
    """The method named by vLLM's `method` / `model` keys (a draft model is refused)."""
    if model is not None and model not in ("ngram", "[ngram]"):
        raise ValueError(f"speculative config: draft models are not supported (model "
                         f"{model!r}); kvloop supports: {', '.join(SPEC_METHODS)}")
    if method is None:
        if model is None:
            raise ValueError(f"speculative config needs a method; kvloop supports: "
                             f"{', '.join(SPEC_METHODS)}")
        return "ngram"
    if not isinstance(method, str):
        raise ValueError(f"speculative config: method must be a string, got {method!r}")
    return "ngram" if method == "[ngram]" else method
# --- prefill/decode disaggregation (docs/disaggregation.md section 1) ----------------------
KV_CONNECTORS = ("KvloopConnector",)
KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]   # vLLM's `kv_role`
KV_ROLES: tuple[KVRole, ...] = get_args(KVRole)
KV_HOLDS: tuple[KVRole, ...] = ("kv_producer", "kv_both")   # hold blocks for a decode worker
KV_LOADS: tuple[KVRole, ...] = ("kv_consumer", "kv_both")   # load blocks from a prefill worker
# The connector role that does what a router role needs (a fleet's P/D workers get these).
KV_ROLE_OF: dict[Role, KVRole] = {"prefill": "kv_producer", "decode": "kv_consumer",
                                  "both": "kv_both"}
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")     # vLLM's; "fail" is its default
KV_TRANSPORTS = ("auto", "tcp", "shm")
DEFAULT_KV_LEASE_DURATION = 30.0    # seconds, vLLM's NIXL `kv_lease_duration`
DEFAULT_TRANSFER_TIMEOUT = 10.0     # seconds D waits for an answer from P
DEFAULT_SIM_BANDWIDTH = 1.25e9      # bytes/s of a simulated transfer (10 Gb/s)
# vLLM's NCCL-era keys of KVTransferConfig: accepted, ignored with a warning
KV_IGNORED_KEYS = ("kv_ip", "kv_port", "kv_buffer_device", "kv_buffer_size", "kv_rank",
                   "kv_parallel_size")
_config_logger = logging.getLogger("kvloop.config")


@dataclass(frozen=True)
class KVConnectorExtraConfig:
    """`kv_connector_extra_config` of KvloopConnector (docs/disaggregation.md section 1):

    - `side_channel_host`: the address D is told to connect to (vLLM's
      `VLLM_NIXL_SIDE_CHANNEL_HOST`), and the one P's side channel binds;
    - `side_channel_port`: 0 is an ephemeral port, reported back in the engine's facts;
    - `transport`: "auto" (shared memory when P and D share a host, else TCP), "tcp", "shm";
    - `kv_lease_duration`: how long P holds a finished request's blocks without a heartbeat;
    - `transfer_timeout`: how long D waits for an answer from P before the load fails;
    - `sim_bandwidth`: bytes/s the simulator's transfers take;
    - `insecure_side_channel`: run the side channel without the fleet secret's CURVE keys
      (plaintext, unauthenticated; trusted networks only: docs/security.md).
    """

    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    transport: str = "auto"
    kv_lease_duration: float = DEFAULT_KV_LEASE_DURATION
    transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT
    sim_bandwidth: float = DEFAULT_SIM_BANDWIDTH
    insecure_side_channel: bool = False

    def __post_init__(self) -> None:
        if not self.side_channel_host:
            raise ValueError("kv_connector_extra_config.side_channel_host must not be empty")
        if not 0 <= self.side_channel_port <= 65535:
            raise ValueError(f"kv_connector_extra_config.side_channel_port must be in "
                             f"[0, 65535], got {self.side_channel_port}")
        if self.transport not in KV_TRANSPORTS:
            raise ValueError(f"kv_connector_extra_config.transport must be one of "
                             f"{', '.join(KV_TRANSPORTS)}, got {self.transport!r}")
        for name in ("kv_lease_duration", "transfer_timeout", "sim_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"kv_connector_extra_config.{name} must be > 0, "
                                 f"got {getattr(self, name)}")


@dataclass(frozen=True)
class KVTransferConfig:
    """`--kv-transfer-config`: vLLM's `KVTransferConfig` keys for KvloopConnector.

    `engine_id` defaults to a fresh UUID4 (vLLM's rule), so whoever builds the config (the
    API server, at start) fixes it once and the engine process receives it. `kv_role` is a
    placeholder as in vLLM's NIXL connector (each request's `kv_transfer_params` decide the
    leg), except that `kv_producer` never loads and `kv_consumer` never holds. Build it from
    the flag's JSON with `KVTransferConfig.from_json` (unknown keys are errors naming them).
    """

    kv_connector: str
    kv_role: str
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    kv_load_failure_policy: str = "fail"
    kv_connector_extra_config: KVConnectorExtraConfig = field(
        default_factory=KVConnectorExtraConfig)

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_connector must be one of {', '.join(KV_CONNECTORS)}, "
                             f"got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, "
                             f"got {self.kv_role!r}")
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise ValueError(f"engine_id must be a non-empty string, got {self.engine_id!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of "
                             f"{', '.join(KV_LOAD_FAILURE_POLICIES)}, "
                             f"got {self.kv_load_failure_policy!r}")

    @property
    def is_kv_producer(self) -> bool:
        """May hold finished requests' blocks for a decode worker (vLLM's name)."""
        return self.kv_role in KV_HOLDS

    @property
    def is_kv_consumer(self) -> bool:
        """May load blocks from a prefill worker (vLLM's name)."""
        return self.kv_role in KV_LOADS

    @property
    def extra(self) -> KVConnectorExtraConfig:
        return self.kv_connector_extra_config

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> KVTransferConfig:
        """Validate a decoded `--kv-transfer-config` object. ValueError (naming the key) on
        anything unknown, missing or mistyped; vLLM's NCCL-era keys (`KV_IGNORED_KEYS`) are
        dropped with a warning."""
        if not isinstance(raw, dict):
            raise ValueError(f"--kv-transfer-config must be a JSON object, got "
                             f"{type(raw).__name__}")
        raw = dict(raw)
        ignored = sorted(k for k in raw if k in KV_IGNORED_KEYS)
        if ignored:
            _config_logger.warning("--kv-transfer-config: ignoring %s (vLLM's NCCL-era keys; "
                                   "KvloopConnector does not use them)", ", ".join(ignored))
            for k in ignored:
                del raw[k]
        _check_keys("--kv-transfer-config", raw, cls, required=("kv_connector", "kv_role"))
        extra = raw.pop("kv_connector_extra_config", None)
        extra = {} if extra is None else extra
        if not isinstance(extra, dict):
            raise ValueError("kv_connector_extra_config must be a JSON object")
        _check_keys("kv_connector_extra_config", extra, KVConnectorExtraConfig)
        _check_types("kv_connector_extra_config", extra,
                     {"side_channel_host": str, "side_channel_port": int, "transport": str,
                      "kv_lease_duration": float, "transfer_timeout": float,
                      "sim_bandwidth": float, "insecure_side_channel": bool})
        _check_types("--kv-transfer-config", raw,
                     {"kv_connector": str, "kv_role": str, "engine_id": str,
                      "kv_load_failure_policy": str})
        if raw.get("engine_id") is None:
            raw.pop("engine_id", None)
        return cls(**raw, kv_connector_extra_config=KVConnectorExtraConfig(**extra))

    @classmethod
    def from_json(cls, text: str) -> KVTransferConfig:
        """Parse `--kv-transfer-config`'s JSON (see `from_dict`)."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-transfer-config is not valid JSON: {e}") from e
        return cls.from_dict(raw)


def _check_keys(where: str, raw: dict[str, Any], cls: type,
                required: tuple[str, ...] = ()) -> None:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(sorted(known))}")
    missing = [k for k in required if raw.get(k) is None]
    if missing:
        raise ValueError(f"{where}: missing required key(s) {', '.join(map(repr, missing))}")


_TYPE_WORDS = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}


def _check_types(where: str, raw: dict[str, Any], types: dict[str, type]) -> None:
    """Check (in place) that each present key has its type; numbers become floats."""
    for key, want in types.items():
        value = raw.get(key)
        if value is None:
            continue
        number = want is float and isinstance(value, int | float)
        if isinstance(value, bool) != (want is bool) or not (number or isinstance(value, want)):
            raise ValueError(f"{where}: {key} must be {_TYPE_WORDS[want]}, got {value!r}")
        if number:
            raw[key] = float(value)


KV_STORE_PASSWORD_ENV = "KVLOOP_KV_STORE_PASSWORD"   # the shared store's password (never a flag)
KV_OFFLOADING_BACKENDS = ("native",)
KV_OFFLOAD_EVICTION_POLICIES = ("lru",)
GIB = 1 << 30


@dataclass(frozen=True)
class KVOffloadConfig:
    """Tiers below the block pool (docs/tiers.md), each optional, at least one set:

    - `cpu_bytes`: host memory (`--kv-offloading-backend native --kv-offloading-size GiB`,
      vLLM's `cpu_bytes_to_use`);
    - `disk_path` + `disk_bytes`: local files that survive a restart;
    - `shared_store`: `redis://HOST:PORT[/DB]` (password from $KVLOOP_KV_STORE_PASSWORD, never in
      the URL) or `file:///DIR`, read and written by every worker configured with it;
      `shared_bytes` bounds what this worker keeps in a `file://` store (a redis server
      bounds itself: its `maxmemory`), `shared_ttl_s` the life of a redis key.

    `compress`: records are zlib-compressed (level 1) in every tier (off by default: fp32 KV
    shrinks 6 % for a 3x slower load, docs/tiers.md).
    `store_threshold`: a block is written below only once its hash was looked up that many
    times (vLLM's reuse gate; 1: every sealed block), remembered for `max_tracker_size`
    hashes. `eviction_policy`: per tier, "lru" (vLLM's "arc" is not implemented).
    `max_block_bytes` bounds one stored record (a larger read is a miss)."""

    cpu_bytes: int = 0
    compress: bool = False
    disk_path: str | None = None
    disk_bytes: int = 0
    shared_store: str | None = None
    shared_bytes: int = 0
    shared_ttl_s: float = 3600.0
    store_threshold: int = 1
    max_tracker_size: int = 64_000
    eviction_policy: str = "lru"
    max_block_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if self.cpu_bytes < 0 or self.disk_bytes < 0 or self.shared_bytes < 0:
            raise ValueError("tier sizes must be >= 0")
        if not (self.cpu_bytes or self.disk_path or self.shared_store):
            raise ValueError("KV offloading needs a tier: a host size, a disk path or a "
                             "shared store")
        if self.disk_path is not None and self.disk_bytes <= 0:
            raise ValueError("--kv-disk-path needs --kv-disk-size GiB > 0")
        if self.store_threshold < 1 or self.max_tracker_size < 1:
            raise ValueError("store_threshold and max_tracker_size must be >= 1")
        if self.eviction_policy not in KV_OFFLOAD_EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of "
                             f"{', '.join(KV_OFFLOAD_EVICTION_POLICIES)}, "
                             f"got {self.eviction_policy!r}")
        if not self.shared_ttl_s > 0 or self.max_block_bytes <= 0:
            raise ValueError("shared_ttl_s and max_block_bytes must be > 0")
        if self.shared_store is not None:
            check_shared_store_url(self.shared_store)

    @classmethod
    def from_kv_transfer_json(cls, text: str, block_size: int) -> KVOffloadConfig | None:
        """vLLM's spelling of a host tier, `--kv-transfer-config '{"kv_connector":
        "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config":
        {"cpu_bytes_to_use": N}}'` (also `eviction_policy`, `store_threshold`,
        `max_tracker_size`, and `block_size` equal to the pool's); None when the JSON names
        another connector. ValueError naming an unknown or mistyped key."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-transfer-config is not valid JSON: {e}") from e
        if not isinstance(raw, dict) or raw.get("kv_connector") != OFFLOADING_CONNECTOR:
            return None
        where = f"--kv-transfer-config ({OFFLOADING_CONNECTOR})"
        unknown = sorted(set(raw) - {"kv_connector", "kv_role", "kv_connector_extra_config"})
        extra = raw.get("kv_connector_extra_config") or {}
        if unknown or not isinstance(extra, dict):
            raise ValueError(f"{where}: unknown key(s) {unknown} or a non-object extra config")
        unknown = sorted(set(extra) - set(_OFFLOADING_EXTRA))
        if unknown:
            raise ValueError(f"{where}: unknown kv_connector_extra_config key(s) {unknown}; "
                             f"known: {', '.join(sorted(_OFFLOADING_EXTRA))}")
        extra = dict(extra)
        _check_types(where, extra, _OFFLOADING_EXTRA)
        if extra.pop("block_size", block_size) != block_size:
            raise ValueError(f"{where}: block_size must equal the pool's ({block_size}): "
                             f"offloading in units of several blocks is not supported")
        if not extra.get("cpu_bytes_to_use"):
            raise ValueError(f"{where}: cpu_bytes_to_use is required")
        return cls(cpu_bytes=extra.pop("cpu_bytes_to_use"), **extra)


OFFLOADING_CONNECTOR = "OffloadingConnector"      # vLLM's name for its tiers' connector
_OFFLOADING_EXTRA = {"cpu_bytes_to_use": int, "eviction_policy": str, "store_threshold": int,
                     "max_tracker_size": int, "block_size": int}


def check_shared_store_url(url: str) -> None:
    """ValueError unless `url` is `redis://HOST:PORT[/DB]` without credentials, or
    `file:///ABSOLUTE/DIR`."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme == "redis":
        if parts.password is not None or parts.username:
            raise ValueError(f"--kv-shared-store: no credentials in the URL; give the "
                             f"password in ${KV_STORE_PASSWORD_ENV}")
        if not parts.hostname or parts.port is None:
            raise ValueError("--kv-shared-store: redis://HOST:PORT")
    elif parts.scheme == "file":
        if parts.netloc or not parts.path.startswith("/"):
            raise ValueError("--kv-shared-store: file:///ABSOLUTE/DIR")
    else:
        raise ValueError(f"--kv-shared-store: redis://HOST:PORT or file:///DIR, got {url!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine core needs: cache, scheduler, speculative decoding (None: off),
    debugging switches, the KV connectors (`kv_transfer`: prefill/decode, None: none;
    `kv_offload`: tiers below the pool, None: none; both: one MultiConnector,
    `kvloop.engine.build.make_connectors`), and `auto_budget` (None:
    `scheduler.max_num_batched_tokens` as given; else `kvloop.engine.build_engine` resolves
    it on the loaded runner, `AutoBudget`).
    `grammar_compile_timeout_s`: a structured-output grammar still compiling after this long
    fails its requests (`kvloop.core.compile_queue`)."""

    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    check_invariants: bool = False
    log_stats: bool = True
    speculative: SpeculativeConfig | None = None
    kv_transfer: KVTransferConfig | None = None
    auto_budget: AutoBudget | None = None
    grammar_compile_timeout_s: float = 30.0
    kv_offload: KVOffloadConfig | None = None

    def __post_init__(self) -> None:
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError("grammar_compile_timeout_s must be > 0")
        if self.kv_offload is not None and not self.cache.enable_prefix_caching:
            raise ValueError("KV offloading tiers need prefix caching (their keys are the "
                             "block hashes)")
