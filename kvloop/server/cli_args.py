"""`kvloop serve`: flags (vLLM's names where the concept is the same) -> configs -> server.

The API server process never imports torch: the engine core process builds the runner from
a factory name (`kvloop.model:load_runner` for a real model, `kvloop.sim.worker:make_sim_runner`
for `--model sim`).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import re
import uuid
from typing import TYPE_CHECKING, Any

from kvloop.config import HASH_ALGOS, POLICIES, CacheConfig, EngineConfig, SchedulerConfig
from kvloop.server.auth import add_auth_args, auth_config
from kvloop.server.config import ROLES, ServeConfig, log_stats_interval
from kvloop.server.http_limits import add_limit_args, http_limits
from kvloop.sim.tokenizer import BYTE_VOCAB
from kvloop.wire import EngineStartConfig

if TYPE_CHECKING:
    from kvloop.server.sim_model import SimModel

logger = logging.getLogger("kvloop.server")

SIM = "sim"
REAL_FACTORY = "kvloop.model:load_runner"
SIM_FACTORY = "kvloop.sim.worker:make_sim_runner"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?)[bB]?\s*$")


def parse_size(text: str) -> int:
    """Bytes from "123", "512MiB", "2G", "1.5GB" (powers of 1024 with or without the i)."""
    m = _SIZE.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512MiB, 2GiB)")
    power = " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * 1024 ** power)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible server (API process + engine "
                                            "core process)")
    _add_model_args(p)
    _add_engine_args(p)
    _add_server_args(p)
    _add_events_args(p)
    _add_logging_args(p)
    _add_security_args(p)
    p.set_defaults(func=run_serve)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face directory; 'sim' for the simulator "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="names clients may use in 'model' (default: the model's name)")
    g.add_argument("--dtype", default="auto", help="weights dtype: auto, float32, bfloat16")
    g.add_argument("--device", default="auto", help="device of the model runner")
    g.add_argument("--seed", type=int, default=0, help="runner random seed")
    g.add_argument("--num-threads", type=int, default=None,
                   help="torch threads of the engine core on CPU (default: OMP_NUM_THREADS if "
                        "set, else the cores it may use)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's)")
    g.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="KV cache size, e.g. 512MiB (default: the runner's rule)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="fix the KV capacity in blocks (including the null block, as vLLM)")
    g.add_argument("--sim-model", default=None,
                   help="--model sim: the model whose tokenizer, vocabulary, chat template and "
                        "context length the simulator presents: a GGUF file or Hugging Face "
                        f"directory, or '{BYTE_VOCAB}' for a byte-level tokenizer (259 ids) "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--sim-speedup", type=float, default=1.0,
                   help="--model sim: divide every modelled step time by this")
    g.add_argument("--sim-latency-file", default=None,
                   help="--model sim: latency coefficients JSON (default: the fitted file)")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="token budget of one step (default 512 on CPU; see DESIGN.md)")
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--long-prefill-token-threshold", type=int, default=0)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True)
    g.add_argument("--prefix-caching-hash-algo", choices=HASH_ALGOS, default="sha256")
    g.add_argument("--hash-seed", default=None,
                   help="NONE_HASH seed (default: vLLM's rule: PYTHONHASHSEED, else fixed for "
                        "sha256, random for xxhash)")
    g.add_argument("--scheduling-policy", choices=POLICIES, default="fcfs")
    g.add_argument("--trace-file", default=None,
                   help="append one JSON line per engine step to this file")
    g.add_argument("--debug-check-invariants", action="store_true",
                   help="check scheduler and block-pool invariants after every step")


def _add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=0, help="0 = an ephemeral port (printed)")
    g.add_argument("--role", choices=ROLES, default="both")
    g.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="requests not yet scheduled beyond which new ones get 503")
    g.add_argument("--max-logprobs", type=int, default=20)
    g.add_argument("--log-level", default="info")
    g.add_argument("--engine-start-timeout", type=float, default=900.0)


def _add_events_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV-cache events")
    g.add_argument("--enable-kv-cache-events", action="store_true",
                   help="publish KV-cache events (on an ephemeral port unless "
                        "--kv-events-endpoint says where)")
    g.add_argument("--kv-events-endpoint", default=None,
                   help="ZMQ PUB endpoint of the KV events (implies --enable-kv-cache-events), "
                        "e.g. tcp://127.0.0.1:0")
    g.add_argument("--kv-events-replay-endpoint", default=None,
                   help="ZMQ ROUTER endpoint serving replays of recent batches")
    g.add_argument("--kv-events-topic", default="")
    g.add_argument("--kv-events-recency", action="store_true",
                   help="also publish the hashes of prefix-cache hits (recency topic)")
    g.add_argument("--kv-events-heartbeat", action=argparse.BooleanOptionalAction,
                   default=None, help="heartbeats on their own topic (default: on when "
                                      "--kv-events-topic is not empty)")


def _add_logging_args(p: argparse.ArgumentParser) -> None:
    """vLLM's logging flags; what they log: kvloop/server/logs.py."""
    g = p.add_argument_group("logging")
    g.add_argument("--enable-log-requests", dest="log_requests", action="store_true",
                   default=True, help="log one line per request received (the default)")
    g.add_argument("--disable-log-requests", dest="log_requests", action="store_false",
                   help="do not log requests")
    g.add_argument("--max-log-len", type=int, default=None, metavar="N",
                   help="log at most N prompt characters and N prompt token ids (default: "
                        "all)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats line (throughput, queue, KV cache; every "
                        "$VLLM_LOG_STATS_INTERVAL s, default 10, while busy)")


def _add_security_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("API keys and HTTP limits")
    add_auth_args(g)
    add_limit_args(g)


# --- configs -------------------------------------------------------------------------------------
def embedded_model_available() -> bool:
    """The real model path exists in this checkout (tokenizer and model packages)."""
    model = importlib.util.find_spec("kvloop.model")
    return (model is not None and model.origin is not None
            and importlib.util.find_spec("kvloop.server.tokenizer") is not None)


def resolve_model(model: str | None) -> str:
    """'sim', or the model to load; falls back to 'sim' while no model package exists."""
    if model is None and not embedded_model_available():
        logger.warning("the embedded model is not available in this checkout; serving "
                       "--model sim instead")
        return SIM
    return model if model is not None else ""


def load_tokenizer(model: str) -> Any:
    """A real model's tokenizer ('' for the embedded model)."""
    from kvloop.server.tokenizer import Tokenizer  # type: ignore[import-not-found]

    return Tokenizer.from_model(model or None)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    seqs = min(args.max_num_seqs, args.max_num_batched_tokens)
    cache = CacheConfig(block_size=args.block_size,
                        enable_prefix_caching=args.enable_prefix_caching,
                        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
                        hash_seed=args.hash_seed)
    sched = SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                            max_num_seqs=seqs, max_model_len=args.max_model_len or 8192,
                            long_prefill_token_threshold=args.long_prefill_token_threshold,
                            policy=args.scheduling_policy,
                            max_waiting_requests=args.max_waiting_requests)
    return EngineConfig(cache=cache, scheduler=sched,
                        check_invariants=args.debug_check_invariants)


def runner_spec(args: argparse.Namespace, model: str,
                sim: SimModel | None = None) -> tuple[str, dict[str, Any]]:
    """The engine's runner factory and its keyword arguments (the simulator's when `sim`)."""
    if sim is not None:
        return SIM_FACTORY, {"num_gpu_blocks_override": args.num_gpu_blocks_override,
                             "max_model_len": sim.max_model_len(args.max_model_len),
                             "vocab_size": sim.vocab_size,
                             "text_token_ids": list(sim.text_token_ids),
                             "latency_file": args.sim_latency_file,
                             "speedup": args.sim_speedup, "seed": args.seed}
    return REAL_FACTORY, {"model": model or None, "dtype": args.dtype, "device": args.device,
                          "block_size": args.block_size,
                          "kv_cache_memory": args.kv_cache_memory,
                          "num_gpu_blocks_override": args.num_gpu_blocks_override,
                          "max_model_len": args.max_model_len, "seed": args.seed,
                          "num_threads": args.num_threads}


def kv_events_kwargs(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.kv_events_endpoint is None and not args.enable_kv_cache_events:
        return None
    return {"endpoint": args.kv_events_endpoint,
            "replay_endpoint": args.kv_events_replay_endpoint,
            "topic": args.kv_events_topic, "recency": args.kv_events_recency,
            "heartbeat": args.kv_events_heartbeat}


def build_configs(args: argparse.Namespace) -> tuple[ServeConfig, EngineStartConfig, Any]:
    """Flags -> (server config, engine start config, tokenizer). Raises ValueError, or
    FileNotFoundError for a model that is not there."""
    if args.sim_speedup <= 0:
        raise ValueError("--sim-speedup must be > 0")
    if args.num_threads is not None and args.num_threads < 1:
        raise ValueError("--num-threads must be >= 1")
    model = resolve_model(args.model)
    if args.sim_model is not None and model != SIM:
        raise ValueError("--sim-model needs --model sim")
    from kvloop.server.sim_model import load_sim_model

    sim = load_sim_model(args.sim_model) if model == SIM else None
    tokenizer = sim.tokenizer if sim is not None else load_tokenizer(model)
    names = tuple(args.served_model_name or [SIM if model == SIM else
                                             (tokenizer.model_name or model)])
    factory, kwargs = runner_spec(args, model, sim)
    start = EngineStartConfig(engine=engine_config(args), runner_factory=factory,
                              input_address="", output_address="", runner_kwargs=kwargs,
                              trace_file=args.trace_file, kv_events=kv_events_kwargs(args),
                              epoch=uuid.uuid4().hex, log_level=args.log_level.upper())
    model_path = sim.source if sim is not None else (model or None)
    serve = ServeConfig(served_model_names=names, model_path=model_path, host=args.host,
                        port=args.port, role=args.role,
                        max_waiting_requests=args.max_waiting_requests,
                        max_logprobs=args.max_logprobs,
                        scheduling_policy=args.scheduling_policy, log_level=args.log_level,
                        engine_start_timeout_s=args.engine_start_timeout,
                        log_requests=args.log_requests, max_log_len=args.max_log_len,
                        log_stats=not args.disable_log_stats,
                        log_stats_interval_s=log_stats_interval(),
                        auth=auth_config(args), http_limits=http_limits(args))
    return serve, start, tokenizer


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s api[%(process)d] %(message)s")
    try:
        serve, start, tokenizer = build_configs(args)
    except (ValueError, FileNotFoundError) as e:  # bad flags; a model that is not there
        logger.error("%s", e)
        return 2
    from kvloop.server.serve import run_server

    return run_server(serve, start, tokenizer)
