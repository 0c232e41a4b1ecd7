"""`kvloop serve`: flags (vLLM's names where the concept is the same) -> configs -> server.

The API server process never imports torch: the runner flags become one `RunnerConfig`, and
the engine core process builds the runner with the factory it names (`RunnerConfig.factory`:
the model's, or the simulator's for `--model sim`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import signal
import uuid
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from kvloop.batch.cli_args import add_batch_args, batch_config
from kvloop.config import (
    AUTO_BUDGET,
    AUTO_BUDGET_FLOOR,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_HASH_ALGO,
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_POLICY,
    DEFAULT_ROLE,
    DEFAULT_TARGET_TPOT_MS,
    DEVICES,
    DTYPE_ALIASES,
    GIB,
    GPU_MEMORY_UTILIZATION,
    GPU_MEMORY_UTILIZATION_IGNORED,
    HASH_ALGOS,
    KV_CACHE_DTYPES,
    KV_OFFLOADING_BACKENDS,
    KV_STORE_PASSWORD_ENV,
    POLICIES,
    AutoBudget,
    CacheConfig,
    EngineConfig,
    KVOffloadConfig,
    KVTransferConfig,
    RunnerConfig,
    SchedulerConfig,
    SimSettings,
    SpeculativeConfig,
    budget_floor,
)
from kvloop.events.cli_args import add_publisher_args, publisher_config_from_args
from kvloop.events.config import KVEventsConfig
from kvloop.front.advertise import advertised_host, is_loopback_host
from kvloop.front.auth import add_auth_args, auth_config
from kvloop.front.cli_help import HelpFormatter
from kvloop.front.http_limits import add_limit_args, http_limits
from kvloop.front.sockets import DEFAULT_PORT
from kvloop.front.tls import add_tls_args, tls_config
from kvloop.server.config import (
    DEFAULT_MAX_SPEC_BYTES,
    MAX_SPEC_FLAG,
    ROLES,
    TOOL_CALL_PARSERS,
    UVICORN_LOG_LEVELS,
    ServeConfig,
    log_stats_interval,
)
from kvloop.server.generation_config import AUTO, VLLM, DefaultSampling, default_sampling
from kvloop.server.lora import add_lora_args, lora_config, lora_serve
from kvloop.server.responses_store import add_store_args, store_config
from kvloop.sim.byte_vocab import BYTE_VOCAB
from kvloop.tracing import add_tracing_args, tracing_config
from kvloop.trust import add_fleet_secret_arg, fleet_secret_from_args
from kvloop.wire import EngineStartConfig

if TYPE_CHECKING:
    from kvloop.server.sim_model import SimModel

logger = logging.getLogger("kvloop.server")

SIM = "sim"
EMBEDDED_ALIAS = "smollm2"   # the embedded SmolLM2-135M-Instruct (a local path of that name wins)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?)[bB]?\s*$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
PER_REQUEST_SPEC_METRICS = ("none", "summary")   # vLLM's levels but `detailed`


def parse_size(text: str) -> int:
    """Bytes from "123", "512MiB", "2G", "1.5GB" (powers of 1024 with or without the i)."""
    m = _SIZE.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512MiB, 2GiB)")
    power = " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * 1024 ** power)


def budget_arg(text: str) -> int | str:
    """`--max-num-batched-tokens`: a number of tokens, or "auto"."""
    if text.strip().lower() == AUTO_BUDGET:
        return AUTO_BUDGET
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of tokens nor {AUTO_BUDGET!r}: "
                                         f"{text!r}") from None


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible server (API process + engine core process)",
        description="OpenAI-compatible server: an API server process and an engine core "
                    "process (docs/serving.md). Flags keep vLLM's names and meanings where "
                    "kvloop has the concept.", formatter_class=HelpFormatter)
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as in `vllm serve MODEL`: same as --model (default: "
                        "--model's)")
    _add_model_args(p)
    _add_engine_args(p)
    _add_server_args(p)
    add_publisher_args(p)
    _add_logging_args(p)
    _add_security_args(p)
    add_store_args(p)
    add_lora_args(p)
    add_tracing_args(p)
    p.set_defaults(func=run_serve)
    _add_export_tokenizer(subparsers)


def _add_export_tokenizer(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export-tokenizer", help="write a model's tokenizer as a Hugging Face folder",
        description="Write the model's tokenizer (from its GGUF: vocabulary, merges, special "
                    "tokens, chat template) as a Hugging Face tokenizer folder, so tools that "
                    "load a tokenizer by name (lm-eval's tokenizer=DIR, transformers' "
                    "AutoTokenizer) work offline with kvloop's exact token ids.")
    p.add_argument("out_dir", metavar="DIR", help="the folder to write (created if missing)")
    p.add_argument("--model", default=None,
                   help=f"a local GGUF file or Hugging Face folder, or '{EMBEDDED_ALIAS}' "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    p.set_defaults(func=run_export_tokenizer)


def run_export_tokenizer(args: argparse.Namespace) -> int:
    """`kvloop export-tokenizer DIR [--model M]`: one line naming the folder, or a one-line
    error (a model that is not found, or has no vocabulary)."""
    from kvloop.front.tokenizer import load_vocabulary  # type: ignore[import-not-found]
    from kvloop.front.tokenizer_files import gguf_special_ids, write_hf_folder
    from kvloop.gguf_format import read_gguf_metadata

    model = embedded_alias(args.model)
    if model == "sim":
        raise SystemExit("kvloop export-tokenizer: the simulator's byte tokenizer has no "
                         "vocabulary to export; pass --model with a real model")
    try:
        vocab = load_vocabulary(model)
        more = gguf_special_ids(read_gguf_metadata(vocab.source)) \
            if vocab.source.endswith(".gguf") else {}
        paths = write_hf_folder(vocab.tokenizer, args.out_dir, vocab.context_length, more)
    except (OSError, ValueError) as e:
        raise SystemExit(f"kvloop export-tokenizer: {e}") from None
    print(f"kvloop export-tokenizer: {vocab.tokenizer.model_name}'s tokenizer written to "
          f"{args.out_dir} ({', '.join(p.name for p in paths)})")
    return 0


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None,
                   help="a local GGUF file or Hugging Face folder (kvloop downloads nothing), "
                        f"'{EMBEDDED_ALIAS}' for the embedded SmolLM2-135M-Instruct, or 'sim' "
                        "for the simulator (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="names clients may use in 'model' (default: the model's name)")
    g.add_argument("--dtype", default="auto",
                   help=f"weights dtype: auto (bf16 where the device computes in it, else fp32 "
                        f"on CPU, fp16 on CUDA) or one of {', '.join(DTYPE_ALIASES)}")
    g.add_argument("--device", default="auto",
                   help=f"device of the model runner: {', '.join(DEVICES)} (auto: CUDA when "
                        f"torch sees one, else CPU)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="must be 1: kvloop runs a model on one device")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help=f"fraction of the CUDA device's memory for weights, activations and "
                        f"KV cache, as vLLM (default: {GPU_MEMORY_UTILIZATION} on CUDA; "
                        f"ignored with a warning elsewhere, where --kv-cache-memory sizes the "
                        f"KV cache)")
    g.add_argument("--generation-config", default=AUTO, metavar="auto|vllm|DIR",
                   help="default sampling parameters of requests that leave them out: auto: "
                        "the model's generation config (the embedded model: its recommended "
                        "temperature 0.2, top_p 0.9); vllm: vLLM's neutral defaults; DIR: the "
                        "generation config in folder DIR; docs/serving.md (default: auto)")
    g.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help="laid over --generation-config's, e.g. '{\"temperature\": 0.5}' "
                        "(default: none)")
    g.add_argument("--seed", type=int, default=0, help="runner random seed")
    g.add_argument("--num-threads", type=int, default=None,
                   help="torch threads of the engine core on CPU (default: OMP_NUM_THREADS if "
                        "set, else the cores it may use)")
    g.add_argument("--low-bit-max-tokens", type=int, default=None,
                   help="CPU: steps of at most this many tokens run a GGUF's 4-bit (and Q8_0) "
                        "weights as stored, larger ones the dense copy (default: the "
                        "crossover measured at start-up; 0: dense only)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's, capped by the KV cache)")
    g.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="KV cache size, e.g. 512MiB (default: from --gpu-memory-utilization "
                        "on CUDA, else 1GiB)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="how K and V are stored: auto (the activations' dtype; bf16 under --dtype "
                        "auto where it runs fp32 with bf16 layer matmuls), bfloat16 "
                        "(2 bytes per element, beside fp32 activations too), fp8 (= "
                        "fp8_e4m3), fp8_e5m2 or int8: one byte per element and a scale per "
                        "token and KV head, more blocks in the same memory; "
                        "docs/cpu-performance.md has their quality and speed (default: auto)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="fix the KV capacity in blocks, the null block included, as vLLM "
                        "(default: from the KV cache size)")
    g.add_argument("--sim-model", default=None,
                   help="--model sim: the model whose tokenizer, vocabulary, chat template and "
                        "context length the simulator presents: a GGUF file or Hugging Face "
                        f"directory, or '{BYTE_VOCAB}' for a byte-level tokenizer (259 ids) "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--sim-speedup", type=float, default=1.0,
                   help="--model sim: divide every modelled step time by this")
    g.add_argument("--sim-latency-file", default=None,
                   help="--model sim: latency coefficients JSON (default: "
                        "kvloop/sim/latency_smollm2_cpu.json)")
    g.add_argument("--sim-copy-rate", type=float, default=0.0,
                   help="--model sim: share of output positions where the simulated model "
                        "copies from its context (prompt lookup), so --speculative-config "
                        "drafts get accepted on text that repeats its prompt (0: never)")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    g.add_argument("--max-num-batched-tokens", type=budget_arg, default=AUTO_BUDGET,
                   metavar="N|auto",
                   help=f"token budget of one step; auto: the largest whose step the engine "
                        f"measures within --target-tpot-ms at start-up (never below "
                        f"{AUTO_BUDGET_FLOOR} nor --max-num-seqs; without chunked prefill the "
                        f"context length, as vLLM); docs/serving.md (default: auto)")
    g.add_argument("--target-tpot-ms", type=float, default=None,
                   help=f"--max-num-batched-tokens auto: the time per output token a step may "
                        f"take (every decode in a step waits for all of it; default "
                        f"{DEFAULT_TARGET_TPOT_MS:g}, and a machine too slow for the default "
                        f"gets the floor without a warning)")
    g.add_argument("--max-num-seqs", type=int, default=128,
                   help="requests in one step (at most the token budget)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="split long prompts across steps; without it a prompt waits until it "
                        "fits in one step's budget")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="cap on one request's prompt tokens per step (0: none)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="reuse the KV blocks of common prompt prefixes (default: on, except "
                        "with --role decode: a decode worker then publishes no blocks a "
                        "router could route on, unless this flag is given)")
    g.add_argument("--prefix-caching-hash-algo", choices=HASH_ALGOS, default=DEFAULT_HASH_ALGO,
                   help="block hash function")
    g.add_argument("--hash-seed", default=None,
                   help="NONE_HASH seed (default: vLLM's rule: PYTHONHASHSEED, else fixed for "
                        "sha256, random for xxhash)")
    g.add_argument("--scheduling-policy", choices=POLICIES, default=DEFAULT_POLICY,
                   help="order of waiting requests")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 5}' or "
                        "'{\"method\": \"suffix\", \"num_speculative_tokens\": 16}' "
                        "(ngram: prompt_lookup_min and _max default to 5, one given: both; "
                        "suffix: vLLM's suffix_decoding_* keys, docs/serving.md) "
                        "(default: off)")
    g.add_argument("--per-request-spec-decode-metrics", choices=PER_REQUEST_SPEC_METRICS,
                   default="none",
                   help="summary: completions and chat completions carry the request's "
                        "draft acceptance in metrics.speculative_decoding (vLLM's; n = 1 only; "
                        "streams: on the usage chunk)")
    g.add_argument("--trace-file", default=None,
                   help="append one JSON line per engine step to this file (default: none)")
    g.add_argument("--debug-check-invariants", action="store_true",
                   help="check scheduler and block-pool invariants after every step")
    g.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help="prefill/decode disaggregation, vLLM's KVTransferConfig as JSON, e.g. "
                        "'{\"kv_connector\":\"KvloopConnector\",\"kv_role\":\"kv_both\"}' "
                        "(keys: docs/disaggregation.md; engine_id: a UUID4 when unset) "
                        "(default: none, no KV transfer)")
    _add_tier_args(p)


def _add_tier_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV tiers below the block pool (docs/tiers.md)")
    g.add_argument("--kv-offloading-backend", choices=KV_OFFLOADING_BACKENDS, default=None,
                   help="vLLM's flag: 'native' keeps evicted KV blocks in host memory "
                        "(with --kv-offloading-size)")
    g.add_argument("--kv-offloading-size", type=float, default=None, metavar="GiB",
                   help="host-memory tier size in GiB (vLLM's flag)")
    g.add_argument("--kv-disk-path", default=None, metavar="DIR",
                   help="local disk tier: one file per block, found again after a restart")
    g.add_argument("--kv-disk-size", type=float, default=None, metavar="GiB",
                   help="disk tier size in GiB (required with --kv-disk-path)")
    g.add_argument("--kv-shared-store", default=None, metavar="URL",
                   help="a store several workers share: redis://HOST:PORT (password in "
                        f"${KV_STORE_PASSWORD_ENV}) or file:///DIR; needs the fleet secret")
    g.add_argument("--kv-offload-store-threshold", type=int, default=1, metavar="N",
                   help="store a block below only once its hash was looked up N times "
                        "(vLLM's store_threshold) (default: 1, every block)")


def _add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--advertise-host", default=None, metavar="HOST",
                   help="the address other hosts reach this worker at, announced for its "
                        "HTTP endpoint, KV events and P/D side channel (default: "
                        "$VLLM_HOST_IP, else --host, else for 0.0.0.0 the address of the "
                        "interface that routes outwards; start-up says which)")
    g.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help="port to listen on; 0 picks a free one (the URL is printed)")
    g.add_argument("--role", choices=ROLES, default=DEFAULT_ROLE,
                   help="what a router may send here")
    add_tls_args(g)
    g.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="requests not yet scheduled beyond which new ones get 503")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="most logprobs a request may ask for")
    g.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default="info",
                   help="kvloop's log level (API and engine processes); debug adds the "
                        "traceback to start-up errors")
    g.add_argument("--uvicorn-log-level", type=str.lower, choices=UVICORN_LOG_LEVELS,
                   default="info", help="uvicorn's log level")
    g.add_argument("--shutdown-timeout", type=float, default=0.0,
                   help="seconds a SIGTERM lets requests in flight finish while new ones, and "
                        "/health, get 503; 0 ends them at once, as vLLM")
    g.add_argument("--engine-start-timeout", type=float, default=900.0,
                   help="seconds the engine core may take to load the model")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice "auto": read tool calls out of the text with '
                        '--tool-call-parser (without it "auto" is a 400)')
    g.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="the tool-call format of the model's text (hermes: "
                        "<tool_call>{json}</tool_call>)")
    g.add_argument(MAX_SPEC_FLAG, type=int, default=DEFAULT_MAX_SPEC_BYTES, metavar="N",
                   help="the largest JSON schema, regex, grammar or tool schema a request may "
                        "constrain its output with (bytes; larger: 400)")
    g.add_argument("--structured-outputs-compile-timeout", type=float, default=30.0,
                   metavar="S", help="a grammar still compiling after S seconds fails its "
                                     "requests (400)")


def _add_logging_args(p: argparse.ArgumentParser) -> None:
    """vLLM's logging flags; what they log: kvloop/server/logs.py."""
    g = p.add_argument_group("logging")
    g.add_argument("--enable-log-requests", dest="log_requests",
                   action=argparse.BooleanOptionalAction, default=False,
                   help="log one line per request received, its prompt and token ids (off "
                        "unless given, as in current vLLM)")
    g.add_argument("--disable-log-requests", dest="disable_log_requests", action="store_true",
                   help="deprecated, as in vLLM: request lines are off unless "
                        "--enable-log-requests; accepted with a warning, changes nothing")
    g.add_argument("--max-log-len", type=int, default=None, metavar="N",
                   help="log at most N prompt characters and N prompt token ids (default: "
                        "all)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats line (throughput, queue, KV cache; every "
                        "$VLLM_LOG_STATS_INTERVAL s, 10 unless set, while busy)")


def _add_security_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("API keys and HTTP limits")
    add_auth_args(g)
    add_fleet_secret_arg(g)
    add_limit_args(g)
    add_batch_args(p, default_on=False)


# --- configs -------------------------------------------------------------------------------------
def model_arg(args: argparse.Namespace) -> str | None:
    """The model of `kvloop serve [MODEL] [--model MODEL]` (None: not given, or the embedded
    model's short name, `EMBEDDED_ALIAS`)."""
    tag, flag = args.model_tag, args.model
    if tag is not None and flag is not None and tag != flag:
        raise ValueError(f"two models given: {tag!r} and --model {flag!r}; pass one")
    return embedded_alias(tag if tag is not None else flag)


def embedded_alias(model: str | None) -> str | None:
    """`model`, or None for the embedded model's short name (`EMBEDDED_ALIAS`) unless a local
    path has that name."""
    return None if model == EMBEDDED_ALIAS and not Path(model).exists() else model


def load_tokenizer(model: str) -> Any:
    """A real model's tokenizer ('' for the embedded model); ValueError (naming the fix)
    when the model cannot be found."""
    from kvloop.front.tokenizer import Tokenizer  # type: ignore[import-not-found]

    try:
        return Tokenizer.from_model(model or None)
    except FileNotFoundError as e:
        raise ValueError(hub_id_hint(model) or str(e)) from e


def check_architecture(model: str) -> None:
    """ValueError with the supported list when the model's config.json or GGUF header names
    an architecture kvloop's model code does not run (`kvloop.locate.hf_family`), before
    the engine process loads anything."""
    from kvloop.locate import find_model_path, gguf_family, hf_family

    path = Path(find_model_path(model))
    if path.suffix == ".gguf":
        from kvloop.gguf_format import read_gguf_metadata

        gguf_family(str(read_gguf_metadata(str(path)).get("general.architecture", "llama")))
    elif (path / "config.json").is_file():
        hf_family(json.loads((path / "config.json").read_text(encoding="utf-8")))


def hub_id_hint(model: str) -> str | None:
    """What to do instead, when `model` is no local path but looks like a hub id (org/name)."""
    if not _HUB_ID.match(model) or Path(model).expanduser().exists():
        return None
    return (f"{model!r} is not a local path; it looks like a Hugging Face hub id, and kvloop "
            f"downloads nothing: pass a local .gguf file or Hugging Face folder (config.json, "
            f"tokenizer.json, *.safetensors), e.g. one fetched with `huggingface-cli download "
            f"{model} --local-dir DIR`")


def check_flags(args: argparse.Namespace) -> None:
    """ValueError for flag values kvloop has no use for (the runner's own: `RunnerConfig`)."""
    if args.tensor_parallel_size != 1:
        raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size}: kvloop runs a "
                         f"model on one device; pass 1 (or run several workers behind "
                         f"`kvloop router`)")


def max_num_batched_tokens(args: argparse.Namespace) -> int:
    """The step budget of the flag's N; with auto the floor, which the engine process raises
    to the budget it measures (`auto_budget`)."""
    if args.max_num_batched_tokens == AUTO_BUDGET:
        return budget_floor(args.max_num_seqs)
    return int(args.max_num_batched_tokens)


def auto_budget(args: argparse.Namespace) -> AutoBudget | None:
    """`--max-num-batched-tokens auto`'s settings (None for a number); `--target-tpot-ms` is
    checked either way."""
    auto = AutoBudget(target_tpot_ms=args.target_tpot_ms)
    return auto if args.max_num_batched_tokens == AUTO_BUDGET else None


def enable_prefix_caching(args: argparse.Namespace) -> bool:
    """The flag when given; else on, except for `--role decode` without a KV tier (Dynamo's
    guidance: a decode worker keeps no prefix cache, so it publishes no `BlockStored` a router
    would route on; docs/disaggregation.md). A decode worker with a tier keeps it: the tiers'
    keys are the block hashes."""
    if args.enable_prefix_caching is not None:
        return bool(args.enable_prefix_caching)
    tiers = (args.kv_offloading_size is not None or args.kv_disk_path is not None
             or args.kv_shared_store is not None)
    return bool(args.role != "decode" or tiers)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    budget = max_num_batched_tokens(args)
    seqs = min(args.max_num_seqs, budget)
    cache = CacheConfig(block_size=args.block_size,
                        enable_prefix_caching=enable_prefix_caching(args),
                        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
                        hash_seed=args.hash_seed)
    sched = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs,
                            max_model_len=args.max_model_len or DEFAULT_MAX_MODEL_LEN,
                            long_prefill_token_threshold=args.long_prefill_token_threshold,
                            policy=args.scheduling_policy,
                            enable_chunked_prefill=args.enable_chunked_prefill,
                            max_loras=args.max_loras if args.enable_lora else None)
    spec = (SpeculativeConfig.parse(args.speculative_config)
            if args.speculative_config is not None else None)
    return EngineConfig(cache=cache, scheduler=sched,
                        check_invariants=args.debug_check_invariants, speculative=spec,
                        kv_transfer=kv_transfer_config(args), auto_budget=auto_budget(args),
                        kv_offload=kv_offload_config(args),
                        grammar_compile_timeout_s=args.structured_outputs_compile_timeout)


def events_beyond_loopback(kv_events: KVEventsConfig | None,
                           host: str) -> KVEventsConfig | None:
    """A worker listening beyond loopback (--host) publishes its KV events there too, on an
    ephemeral port, unless --kv-events-endpoint says where."""
    if kv_events is None or kv_events.endpoint is not None or kv_events.nats is not None \
            or is_loopback_host(host):
        return kv_events
    bind = f"[{host}]" if ":" in host else (host or "0.0.0.0")
    return dataclasses.replace(kv_events, endpoint=f"tcp://{bind}:0")


def side_channel_beyond_loopback(engine: EngineConfig, args: argparse.Namespace,
                                 advertised: str) -> EngineConfig:
    """A worker listening beyond loopback (--host) binds and announces its P/D side channel
    on its advertised host, unless kv_connector_extra_config names side_channel_host."""
    kv = engine.kv_transfer
    if kv is None or is_loopback_host(args.host):
        return engine
    extra = json.loads(args.kv_transfer_config).get("kv_connector_extra_config") or {}
    if "side_channel_host" in extra:
        return engine
    moved = dataclasses.replace(kv.kv_connector_extra_config, side_channel_host=advertised)
    return dataclasses.replace(engine, kv_transfer=dataclasses.replace(
        kv, kv_connector_extra_config=moved))


def kv_offload_config(args: argparse.Namespace) -> KVOffloadConfig | None:
    """The tier flags as a `KVOffloadConfig` (None: no tier); ValueError on a bad set."""
    size = args.kv_offloading_size
    if (args.kv_offloading_backend is None) != (size is None):
        raise ValueError("--kv-offloading-backend and --kv-offloading-size go together")
    if args.kv_disk_size is not None and args.kv_disk_path is None:
        raise ValueError("--kv-disk-size needs --kv-disk-path")
    flags = size is not None or args.kv_disk_path is not None or args.kv_shared_store is not None
    if args.kv_transfer_config is not None:
        json_tiers = KVOffloadConfig.from_kv_transfer_json(args.kv_transfer_config,
                                                           args.block_size)
        if json_tiers is not None and flags:
            raise ValueError("give the tiers with the flags or with --kv-transfer-config's "
                             "OffloadingConnector, not both")
        if json_tiers is not None:
            return json_tiers
    if not flags:
        return None
    return KVOffloadConfig(cpu_bytes=int((size or 0) * GIB), disk_path=args.kv_disk_path,
                           disk_bytes=int((args.kv_disk_size or 0) * GIB),
                           shared_store=args.kv_shared_store,
                           store_threshold=args.kv_offload_store_threshold)


def kv_transfer_config(args: argparse.Namespace) -> KVTransferConfig | None:
    """`--kv-transfer-config`'s JSON as a `KVTransferConfig` (its `engine_id` a fresh UUID4
    when unset, fixed here once for the engine); ValueError naming the key at fault."""
    if args.kv_transfer_config is None or KVOffloadConfig.from_kv_transfer_json(
            args.kv_transfer_config, args.block_size) is not None:
        return None     # no JSON, or vLLM's OffloadingConnector: the tiers (kv_offload_config)
    return KVTransferConfig.from_json(args.kv_transfer_config)


def runner_config(args: argparse.Namespace, model: str) -> RunnerConfig:
    """The runner flags for `model` ('' the embedded one): ValueError, naming the flag, for a
    value no runner can use, real or simulated (checked before any model is read)."""
    return RunnerConfig(model=model or None, dtype=args.dtype, device=args.device,
                        block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                        num_gpu_blocks_override=args.num_gpu_blocks_override,
                        max_model_len=args.max_model_len, seed=args.seed,
                        num_threads=args.num_threads,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        low_bit_max_tokens=args.low_bit_max_tokens, lora=lora_config(args),
                        kv_cache_dtype=args.kv_cache_dtype)


def sim_runner_config(args: argparse.Namespace, runner: RunnerConfig,
                      sim: SimModel) -> RunnerConfig:
    """`runner` for the simulator presenting `sim`: its context length and vocabulary's
    facts, the latency flags."""
    if args.gpu_memory_utilization is not None:
        logger.warning("%s", GPU_MEMORY_UTILIZATION_IGNORED)  # the simulator has no GPU
    return dataclasses.replace(
        runner, model=None, max_model_len=sim.max_model_len(args.max_model_len),
        sim=SimSettings(latency_file=args.sim_latency_file, speedup=args.sim_speedup,
                        vocab_size=sim.vocab_size, text_token_ids=sim.text_token_ids,
                        copy_rate=args.sim_copy_rate))


def build_configs(args: argparse.Namespace) -> tuple[ServeConfig, EngineStartConfig, Any]:
    """Flags -> (server config, engine start config, tokenizer). Raises ValueError, or
    FileNotFoundError for a --sim-model that is not there."""
    check_flags(args)
    model = model_arg(args) or ""
    runner = runner_config(args, model)
    engine = engine_config(args)
    if args.sim_model is not None and model != SIM:
        raise ValueError("--sim-model needs --model sim")
    from kvloop.server.sim_model import load_sim_model

    sim = load_sim_model(args.sim_model) if model == SIM else None
    tokenizer = sim.tokenizer if sim is not None else load_tokenizer(model)
    if sim is None and model:
        check_architecture(model)
    names = tuple(args.served_model_name or [SIM if model == SIM else
                                             (tokenizer.model_name or model)])
    if sim is not None:
        runner = sim_runner_config(args, runner, sim)
    secret = fleet_secret_from_args(args)
    kv_events = publisher_config_from_args(args, has_secret=secret is not None)
    advertised = advertised_host(args.host, args.advertise_host)
    kv_events = events_beyond_loopback(kv_events, args.host)
    engine = side_channel_beyond_loopback(engine, args, advertised.host)
    if kv_events is not None and kv_events.curve and secret is None:
        raise ValueError("--kv-events-curve needs the fleet secret: --fleet-secret-file PATH "
                         "(or $KVLOOP_FLEET_SECRET_FILE / $KVLOOP_FLEET_SECRET)")
    start = EngineStartConfig(engine=engine, runner=runner,
                              input_address="", output_address="",
                              trace_file=args.trace_file, kv_events=kv_events,
                              epoch=uuid.uuid4().hex, log_level=args.log_level.upper(),
                              shutdown_timeout_s=args.shutdown_timeout,
                              fleet_secret=None if secret is None else secret.to_text(),
                              tracing=tracing_config(args))
    model_path = sim.source if sim is not None else (model or None)
    defaults = generation_defaults(args, model, sim)
    serve = ServeConfig(served_model_names=names, model_path=model_path, host=args.host,
                        advertise_host=advertised.host, advertise_how=advertised.how,
                        kv_shared_store=args.kv_shared_store,
                        port=args.port, role=args.role,
                        max_waiting_requests=args.max_waiting_requests,
                        max_logprobs=args.max_logprobs,
                        scheduling_policy=args.scheduling_policy, log_level=args.log_level,
                        uvicorn_log_level=args.uvicorn_log_level,
                        engine_start_timeout_s=args.engine_start_timeout,
                        shutdown_timeout_s=args.shutdown_timeout,
                        log_requests=args.log_requests, max_log_len=args.max_log_len,
                        log_stats=not args.disable_log_stats,
                        log_stats_interval_s=log_stats_interval(),
                        auth=auth_config(args), http_limits=http_limits(args),
                        tls=tls_config(args),
                        enable_auto_tool_choice=args.enable_auto_tool_choice,
                        tool_call_parser=args.tool_call_parser, fleet_secret=secret,
                        max_structured_output_bytes=args.structured_outputs_max_spec_bytes,
                        responses_store=store_config(args),
                        default_sampling=defaults, lora=lora_serve(args),
                        batch=batch_config(args, http_limits(args).max_request_body_bytes),
                        spec_decode_metrics_k=spec_decode_metrics_k(args, engine))
    return serve, start, tokenizer


def spec_decode_metrics_k(args: argparse.Namespace, engine: EngineConfig) -> int | None:
    """k for the per-request acceptance summary; None when off or nothing is drafted."""
    spec = engine.speculative
    if args.per_request_spec_decode_metrics == "none" or spec is None:
        return None
    return spec.num_speculative_tokens


def generation_defaults(args: argparse.Namespace, model: str,
                        sim: SimModel | None) -> DefaultSampling:
    """`--generation-config` and `--override-generation-config` for the model served: the
    simulator's are those of the model it presents (`--sim-model`; its byte vocabulary has
    none)."""
    if sim is not None:
        source = None if args.sim_model is None else args.sim_model
        if source == BYTE_VOCAB:
            return default_sampling(VLLM, None, args.override_generation_config)
        return default_sampling(args.generation_config, source,
                                args.override_generation_config)
    return default_sampling(args.generation_config, model or None,
                            args.override_generation_config)


def startup_lines(serve: ServeConfig, start: EngineStartConfig) -> list[str]:
    """What `kvloop serve` says before it loads the model: the default sampling parameters,
    speculative decoding when on, and request logging's state."""
    lines = [serve.default_sampling.describe()]
    spec = start.engine.speculative
    if spec is not None:
        lines.append(f"speculative decoding on: {spec.describe()}")
    if serve.log_requests:
        lines.append("request logging on (--enable-log-requests): every prompt and its "
                     "token ids are logged")
    return lines


def _exit_0(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def run_serve(args: argparse.Namespace) -> int:
    for sig in (signal.SIGTERM, signal.SIGINT):  # while the tokenizer loads: just exit
        signal.signal(sig, _exit_0)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s api[%(process)d] %(message)s")
    try:
        serve, start, tokenizer = build_configs(args)
    except (ValueError, OSError) as e:  # one line naming the fix; the traceback on debug
        logger.error("%s", e, exc_info=logger.isEnabledFor(logging.DEBUG))
        return 2
    if args.disable_log_requests:
        logger.warning("--disable-log-requests is deprecated (as in vLLM) and changes nothing: "
                       "request logging is off unless --enable-log-requests")
    for line in startup_lines(serve, start):
        logger.info("%s", line)
    from kvloop.server.serve import run_server

    return run_server(serve, start, tokenizer)
