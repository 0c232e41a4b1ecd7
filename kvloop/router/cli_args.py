"""`kvloop router` and `kvloop fleet`: flags -> frozen configs -> run.

    kvloop router --worker URL[,role][,events=EP][,replay=EP] ... [--port P] [--policy NAME]
    kvloop router ... [--ext-proc-port PORT] [--discovery-file PATH]
    kvloop router --discover nats://HOST:PORT [--dyn-component C] [--index redis://HOST:PORT]
                  [--pd-policy cost|always|never]
    kvloop fleet [--workers N] [--prefill N --decode M] [--model sim|PATH] [--port P]
                 [--policy NAME] [--roles R,...] [--api-key KEY]
                 [--event-plane nats|nats://HOST:PORT] [-- WORKER FLAGS]
    kvloop fleet --ray auto|HOST:PORT [--workers N] ...   (the same fleet as Ray actors)
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from typing import TYPE_CHECKING

from kvloop.batch.cli_args import add_batch_args, batch_config
from kvloop.config import DEFAULT_BLOCK_SIZE, DEFAULT_HASH_ALGO, DEFAULT_ROLE, ROLES
from kvloop.events.cli_args import (
    NATS_CREDENTIAL_ENV,
    add_event_plane_args,
    event_plane_from_args,
)
from kvloop.events.config import NatsPlaneConfig
from kvloop.front.auth import add_auth_args, auth_config
from kvloop.front.http_limits import add_limit_args, http_limits
from kvloop.front.sockets import DEFAULT_PORT
from kvloop.front.tls import add_tls_args, add_worker_tls_args, tls_config, worker_tls
from kvloop.router.config import (
    DEFAULT_ROUTER_POLICY,
    PD_POLICIES,
    POLICIES,
    BusConfig,
    CostConfig,
    HashSpec,
    IndexConfig,
    LivenessConfig,
    PDConfig,
    RestartPolicy,
    RouterConfig,
)
from kvloop.router.flow_config import FlowConfig, load_objectives
from kvloop.router.limits import RouterLimits
from kvloop.router.registry import WorkerSpec
from kvloop.tracing import add_tracing_args, tracing_config
from kvloop.trust import FleetSecret, add_fleet_secret_arg, fleet_secret_from_args

if TYPE_CHECKING:
    from kvloop.router.fleet import FleetConfig

WORKER_API_KEY_ENV = "KVLOOP_WORKER_API_KEY"   # the key the router presents to workers


def register(subparsers: argparse._SubParsersAction) -> None:
    r = subparsers.add_parser("router", help="KV-cache-aware router in front of workers")
    r.add_argument("--worker", action="append", default=[], metavar="URL[,ROLE][,events=EP]",
                   help="a worker: URL, optional role (both|prefill|decode) and event "
                        "endpoint overrides events=EP, replay=EP (repeat the flag)")
    add_router_args(r)
    r.set_defaults(func=run_router_cmd)

    f = subparsers.add_parser("fleet", help="N workers and a router on this host",
                              description="N `kvloop serve` workers and a router on this "
                                          "host. --event-plane nats starts a nats-server of "
                                          "its own and puts the KV events on it "
                                          "(--event-plane nats://HOST:PORT: a running one). "
                                          "--ray ADDRESS: the router and the workers as "
                                          "actors of a Ray cluster (docs/deploy.md).")
    f.add_argument("--workers", type=int, default=0,
                   help="number of workers of --roles (default: none besides --prefill and "
                        "--decode)")
    f.add_argument("--prefill", type=int, default=0,
                   help="prefill workers: --role prefill with a kv_producer KvloopConnector")
    f.add_argument("--decode", type=int, default=0,
                   help="decode workers: --role decode with a kv_consumer KvloopConnector")
    f.add_argument("--kv-connector-extra-config", default=None, metavar="JSON",
                   help="kv_connector_extra_config of every P/D worker's "
                        "--kv-transfer-config (e.g. '{\"kv_lease_duration\": 5}')")
    f.add_argument("--model", default="sim",
                   help="'sim' (default), 'smollm2' (the embedded SmolLM2-135M-Instruct) or a "
                        "model path: each worker's `kvloop serve --model`")
    f.add_argument("--roles", default=DEFAULT_ROLE,
                   help="comma-separated roles, cycled over the workers (both|prefill|decode)")
    f.add_argument("--worker-start-timeout", type=float, default=300.0)
    f.add_argument("--max-worker-restarts", type=int, default=RestartPolicy.max_restarts,
                   metavar="N",
                   help="a worker whose process ends is started again (same flags, same "
                        "port), at most N times in a row (0: never; default %(default)s)")
    f.add_argument("--worker-restart-backoff", type=float, default=RestartPolicy.backoff_s,
                   metavar="S",
                   help="seconds before a dead worker's restart, doubling per restart in a "
                        f"row up to {RestartPolicy.max_backoff_s:g} (default %(default)s)")
    add_ray_args(f)
    add_router_args(f)
    f.add_argument("worker_args", nargs=argparse.REMAINDER,
                   help="after '--': flags passed to every `kvloop serve`")
    f.set_defaults(func=run_fleet_cmd)


def add_ray_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Ray (docs/deploy.md)")
    g.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="run the router and the workers as actors of the Ray cluster at "
                        "ADDRESS (auto: the one running on this host; else the head's "
                        "HOST:PORT); Ray restarts a dead worker (--max-worker-restarts). Run "
                        "again with another --workers: scales the running fleet (default: "
                        "no Ray, processes on this host)")
    g.add_argument("--ray-worker-cpus", type=float, default=1.0, metavar="N",
                   help="CPUs each worker actor reserves on its node (default %(default)s)")
    g.add_argument("--ray-drain-timeout", type=float, default=30.0, metavar="S",
                   help="a worker removed by a scale-down finishes its requests within S "
                        "seconds (its --shutdown-timeout; default %(default)s)")


def add_router_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("router")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help="port to listen on; 0 picks a free one (the URL is printed)")
    g.add_argument("--policy", choices=POLICIES, default=DEFAULT_ROUTER_POLICY)
    g.add_argument("--log-level", default="warning")
    g.add_argument("--random-seed", type=int, default=None, help="seed of --policy random")
    g.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="the workers' tokenizer: a .gguf file or a Hugging Face folder (as "
                        "vLLM's --tokenizer; default: the router's own copy of the model the "
                        "workers name, else fetched from a worker's GET /kvloop/tokenizer "
                        "with --worker-api-key)")
    add_tracing_args(p)
    h = p.add_argument_group("fleet hashing (default: learned from the first worker)")
    h.add_argument("--block-size", type=int, default=None)
    h.add_argument("--hash-algo", default=None)
    h.add_argument("--hash-seed", default=None)
    c = p.add_argument_group("cost model")
    d = CostConfig()
    c.add_argument("--decode-token-cost", type=float, default=d.decode_token_cost,
                   help="prefill tokens one active request costs each candidate")
    c.add_argument("--marginal-work-weight", type=float, default=d.marginal_work_weight)
    c.add_argument("--load-bound", type=float, default=d.load_bound,
                   help="bounded-load factor: a worker over this x the mean in-flight is "
                        "saturated and its hot prefixes are replicated elsewhere")
    c.add_argument("--saturation-floor", type=int, default=d.saturation_floor,
                   help="fewest in-flight requests that can make a worker saturated")
    c.add_argument("--eviction-weight", type=float, default=d.eviction_weight)
    c.add_argument("--router-host-cache-hit-weight", type=float,
                   default=d.host_cache_hit_weight,
                   help="credit of a block loaded from a worker's host-memory tier (device: "
                        "1; Dynamo's flag); 0 ignores the tier")
    c.add_argument("--router-disk-cache-hit-weight", type=float,
                   default=d.disk_cache_hit_weight,
                   help="credit of a block loaded from a worker's disk tier")
    c.add_argument("--router-shared-cache-hit-weight", type=float,
                   default=d.shared_cache_hit_weight,
                   help="credit of a block loaded from the shared store a worker reads")
    c.add_argument("--session-weight", type=float, default=d.session_weight,
                   help="session affinity (x-session-id or `user`): share of the session's "
                        "last prompt credited as cached on its last worker (0: off)")
    pd = p.add_argument_group("prefill/decode disaggregation (docs/router.md)")
    dp = PDConfig()
    pd.add_argument("--pd-policy", choices=PD_POLICIES, default=dp.policy,
                    help="remote prefill: by the estimated-TTFT cost model, always, or never")
    pd.add_argument("--pd-latency-file", default=None, metavar="JSON",
                    help="step-time coefficients of the cost model (default: the simulator's "
                         "fitted SmolLM2 CPU file)")
    pd.add_argument("--pd-speedup", type=float, default=dp.speedup,
                    help="divides the cost model's compute times (a fleet of --sim-speedup S "
                         "workers: S)")
    pd.add_argument("--pd-transfer-bandwidth", type=float, default=dp.transfer_bandwidth,
                    metavar="BYTES_PER_S", help="KV transfer bandwidth the cost model assumes")
    pd.add_argument("--pd-kv-bytes-per-token", type=float, default=dp.kv_bytes_per_token,
                    help="K and V bytes per token until a prefill worker's answer says")
    pd.add_argument("--prefill-timeout", type=float, default=dp.prefill_timeout_s,
                    metavar="SECONDS", help="a prefill leg unanswered this long falls back to "
                                            "decode-only; its prefill worker is left out for "
                                            "one liveness window")
    i = p.add_argument_group("index")
    di = IndexConfig()
    i.add_argument("--index-max-blocks", type=int, default=di.max_blocks)
    i.add_argument("--provisional-ttl", type=float, default=di.provisional_ttl_s,
                   help="seconds a routing decision's provisional entries live unconfirmed")
    lv = p.add_argument_group("liveness and self-verification")
    dl = LivenessConfig()
    lv.add_argument("--liveness-window", type=float, default=dl.window_s,
                    help="seconds a worker serving traffic may stay silent (no KV event, "
                         "no heartbeat) before an alarm")
    lv.add_argument("--poll-interval", type=float, default=dl.poll_interval_s,
                    help="seconds between reads of each worker's /metrics")
    lv.add_argument("--verify-window", type=int, default=dl.verify_window)
    lv.add_argument("--verify-min-samples", type=int, default=dl.verify_min_samples)
    lv.add_argument("--verify-miss-ratio", type=float, default=dl.verify_miss_ratio)
    lv.add_argument("--request-timeout", type=float, default=dl.request_timeout_s)
    _add_flow_args(p)
    add_batch_args(p)
    lv.add_argument("--migration-limit", type=int, default=0, metavar="N",
                    help="how many times a stream whose worker fails mid-stream moves to "
                         "another worker, with the tokens already sent (0: never)")
    _add_security_args(p)
    _add_bus_args(p)
    _add_gateway_args(p)


def _add_gateway_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("behind Envoy, and workers from a file (docs/gateway.md)")
    g.add_argument("--ext-proc-port", type=int, default=None, metavar="PORT",
                   help="also serve Envoy's ext_proc gRPC service on --host:PORT as the Gateway "
                        "API Inference Extension's endpoint picker (0: a free port, printed)")
    g.add_argument("--discovery-file", default=None, metavar="PATH",
                   help="a YAML list of workers (url, role) watched for changes: workers "
                        "added to it join, workers removed from it leave")


def _add_flow_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("flow control (docs/router.md \"Flow control\")")
    d = FlowConfig()
    g.add_argument("--flow-control", action="store_true",
                   help="queue requests at the router while every worker is saturated; "
                        "release them by priority band, tenants of a band in turn")
    g.add_argument("--flow-max-waiting", type=int, default=d.max_waiting, metavar="N",
                   help="requests waiting in a worker's engine at which it is saturated")
    g.add_argument("--flow-kv-usage-threshold", type=float, default=d.kv_usage_threshold,
                   metavar="FRACTION", help="KV usage at which a worker is saturated")
    g.add_argument("--flow-staleness", type=float, default=d.staleness_s, metavar="SECONDS",
                   help="a worker whose polled figures are older is saturated")
    g.add_argument("--flow-max-queue", type=int, default=d.max_queue, metavar="N",
                   help="requests the router's queue holds; more answer 503 + Retry-After")
    g.add_argument("--flow-queue-timeout", type=float, default=d.queue_timeout_s,
                   metavar="SECONDS", help="longest wait in the queue (unless the request's "
                                           "objective sets its own); then 503 + Retry-After")
    g.add_argument("--flow-max-queue-bytes", type=int, default=d.max_queue_bytes,
                   metavar="N", help="request body bytes the router's queue holds; more "
                                     "answer 503 + Retry-After")
    g.add_argument("--trusted-front", action="store_true",
                   help="trust x-gateway-inference-fairness-id and "
                        "x-gateway-inference-objective from every caller (only when a "
                        "gateway in front sets them and no client reaches the router; "
                        "otherwise only callers with the fleet token or the admin key)")
    g.add_argument("--objectives-file", default=None, metavar="JSON",
                   help="objectives (x-gateway-inference-objective) with their priorities: "
                        "{\"objectives\": [{\"name\": ..., \"priority\": ..., "
                        "\"queue_timeout_s\": ...}]}")


def flow_config(args: argparse.Namespace) -> FlowConfig:
    """Flow control from the flags (raises ValueError, naming a bad objectives file)."""
    objectives = load_objectives(args.objectives_file) if args.objectives_file else ()
    return FlowConfig(enabled=args.flow_control, max_waiting=args.flow_max_waiting,
                      kv_usage_threshold=args.flow_kv_usage_threshold,
                      staleness_s=args.flow_staleness, max_queue=args.flow_max_queue,
                      queue_timeout_s=args.flow_queue_timeout, objectives=objectives,
                      max_queue_bytes=args.flow_max_queue_bytes,
                      trusted_front=args.trusted_front)


def router_limits(args: argparse.Namespace) -> RouterLimits:
    return RouterLimits(max_inflight_body_bytes=args.max_inflight_body_bytes,
                        prompt_threads=args.prompt_threads)


def _add_bus_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("event plane, discovery and shared index (many hosts)")
    add_event_plane_args(g, consumer=True)
    d = BusConfig(plane=NatsPlaneConfig("nats://127.0.0.1:4222"))
    g.add_argument("--discover", default=None, metavar="nats://HOST:PORT",
                   help="register the workers that announce themselves on this NATS server "
                        "(no --worker needed); also the event plane unless --event-plane")
    g.add_argument("--discovery-ttl", type=float, default=d.discovery_ttl_s,
                   help="seconds without an announcement after which a discovered worker "
                        "is removed, unless its /health still answers")
    g.add_argument("--allow-unsigned-bus", action="store_true",
                   help="INSECURE: run on the bus without the fleet secret, admitting "
                        "announcements, withdrawals and KV events nobody signed (anyone who "
                        "can publish there adds or removes workers and writes the index)")
    g.add_argument("--bus-probe", type=float, default=d.probe_s,
                   help="seconds the bus watch listens to the namespace for a worker whose "
                        "events do not arrive")
    g.add_argument("--index", default=None, metavar="redis://HOST:PORT",
                   help="keep block -> workers in Redis (llm-d's layout), shared by router "
                        "replicas (default: in this process)")
    g.add_argument("--redis-password", default=None, help="Redis password (never logged)")
    g.add_argument("--index-timeout", type=float, default=IndexConfig().read_timeout_s,
                   metavar="SECONDS", help="a decision's read of the Redis index; on a "
                                           "timeout or error the router decides from its own "
                                           "view until Redis answers again")


def bus_config(args: argparse.Namespace) -> BusConfig | None:
    """The router's event plane and discovery from the flags (None: neither)."""
    if args.event_plane is None and args.discover is None:
        return None
    if args.event_plane is None:
        args = argparse.Namespace(**{**vars(args), "event_plane": args.discover})
    plane = event_plane_from_args(args, "*")
    assert plane is not None
    return BusConfig(plane=plane, discover=args.discover is not None,
                     discovery_ttl_s=args.discovery_ttl, probe_s=args.bus_probe,
                     allow_unsigned=args.allow_unsigned_bus)


def _add_security_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("API keys and HTTP limits (the router's front)")
    add_auth_args(g)
    add_fleet_secret_arg(g)
    g.add_argument("--worker-api-key", default=None, metavar="KEY",
                   help=f"the key the router sends to every worker (default: "
                        f"${WORKER_API_KEY_ENV}, else none: the router's own keys are never "
                        "sent to workers; `kvloop fleet` makes one for its workers). Without "
                        "one, a client's Authorization header is passed through only when "
                        "the router itself requires no key")
    add_limit_args(g)
    dl = RouterLimits()
    g.add_argument("--max-inflight-body-bytes", type=int, default=dl.max_inflight_body_bytes,
                   metavar="N", help="request body bytes the router holds at once; a request "
                                     "with no room waits, then 503 (kvloop/router/limits.py)")
    g.add_argument("--prompt-threads", type=int, default=dl.prompt_threads, metavar="N",
                   help="threads that parse and tokenize prompts off the event loop")
    g = p.add_argument_group("TLS (the router's front, and https:// workers)")
    add_tls_args(g)
    add_worker_tls_args(g)


def router_config(args: argparse.Namespace,
                  default_secret: FleetSecret | None = None) -> RouterConfig:
    """Validated, frozen config from the parsed flags (raises ValueError). The key sent to
    workers is --worker-api-key, else $KVLOOP_WORKER_API_KEY, else none (never a key of the
    router's own: a worker, or anything posing as one, must not learn it)."""
    auth = auth_config(args)
    spec = None
    if args.block_size is not None or args.hash_algo is not None or args.hash_seed is not None:
        from kvloop.core.hashing import resolve_seed

        algo = args.hash_algo or DEFAULT_HASH_ALGO
        spec = HashSpec(args.block_size or DEFAULT_BLOCK_SIZE, algo,
                        resolve_seed(algo, args.hash_seed))
    return RouterConfig(
        host=args.host, port=args.port, policy=args.policy, random_seed=args.random_seed,
        hash_spec=spec,
        index=IndexConfig(max_blocks=args.index_max_blocks,
                          provisional_ttl_s=args.provisional_ttl, url=args.index,
                          password=args.redis_password, read_timeout_s=args.index_timeout),
        cost=CostConfig(decode_token_cost=args.decode_token_cost,
                        marginal_work_weight=args.marginal_work_weight,
                        load_bound=args.load_bound,
                        saturation_floor=args.saturation_floor,
                        eviction_weight=args.eviction_weight,
                        host_cache_hit_weight=args.router_host_cache_hit_weight,
                        disk_cache_hit_weight=args.router_disk_cache_hit_weight,
                        shared_cache_hit_weight=args.router_shared_cache_hit_weight,
                        session_weight=args.session_weight),
        liveness=LivenessConfig(window_s=args.liveness_window,
                                poll_interval_s=args.poll_interval,
                                verify_window=args.verify_window,
                                verify_min_samples=args.verify_min_samples,
                                verify_miss_ratio=args.verify_miss_ratio,
                                request_timeout_s=args.request_timeout),
        auth=auth,
        worker_api_key=args.worker_api_key or os.environ.get(WORKER_API_KEY_ENV) or None,
        http_limits=http_limits(args), tls=tls_config(args), worker_tls=worker_tls(args),
        bus=bus_config(args),
        pd=PDConfig(policy=args.pd_policy, latency_file=args.pd_latency_file,
                    speedup=args.pd_speedup, transfer_bandwidth=args.pd_transfer_bandwidth,
                    kv_bytes_per_token=args.pd_kv_bytes_per_token,
                    prefill_timeout_s=args.prefill_timeout),
        fleet_secret=fleet_secret_from_args(args) or default_secret,
        tokenizer=getattr(args, "tokenizer", None),
        flow=flow_config(args), migration_limit=args.migration_limit,
        ext_proc_port=args.ext_proc_port, discovery_file=args.discovery_file,
        batch=batch_config(args, http_limits(args).max_request_body_bytes, args.index,
                           args.redis_password),
        tracing=tracing_config(args),
        limits=router_limits(args))


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvloop.router").setLevel(min(logging.INFO,
                                                    logging.getLevelName(level.upper())))
    logging.getLogger("httpx").setLevel(logging.WARNING)


def run_router_cmd(args: argparse.Namespace) -> int:
    from kvloop.router.server import run_router

    try:
        cfg = router_config(args)
        workers = [WorkerSpec.parse(w) for w in args.worker]
        if cfg.tokenizer is not None:   # a wrong path is found now, not on the first request
            from kvloop.front.tokenizer import load_vocabulary

            load_vocabulary(cfg.tokenizer)
    except (ValueError, OSError) as e:
        raise SystemExit(f"kvloop router: {e}") from None
    _setup_logging(args.log_level)
    try:
        return run_router(cfg, workers, args.log_level)
    except OSError as e:   # the event plane or the index cannot be reached, the port is taken
        raise SystemExit(f"kvloop router: {e}") from None


LOCAL_NATS = "nats"   # `kvloop fleet --event-plane nats`: start a nats-server of its own


def _local_nats_port(args: argparse.Namespace) -> int | None:
    """With `--event-plane nats`: a free port for the fleet's own nats-server, the event
    plane set to it, and credentials for it (generated unless given; None otherwise)."""
    if args.event_plane != LOCAL_NATS:
        return None
    import secrets
    import socket

    with socket.socket() as s:
        s.bind((args.host, 0))
        port = int(s.getsockname()[1])
    args.event_plane = f"nats://{args.host}:{port}"
    given = any(getattr(args, k) or os.environ.get(v) for k, v in NATS_CREDENTIAL_ENV.items())
    if not given:
        args.nats_user, args.nats_password = "kvloop-fleet", secrets.token_urlsafe(24)
    return port


def _fleet_worker_key(cfg: RouterConfig) -> RouterConfig:
    """A fleet whose router requires keys gets a worker key of its own (never the router's
    keys: its workers, or anything posing as one, must not learn those)."""
    if cfg.worker_api_key is not None or not cfg.auth.api_keys:
        return cfg
    import secrets

    return dataclasses.replace(cfg, worker_api_key=secrets.token_urlsafe(32))


def run_fleet_cmd(args: argparse.Namespace) -> int:
    from kvloop.router.fleet import FleetConfig, run_fleet

    try:
        roles = tuple(r.strip() for r in args.roles.split(",") if r.strip())
        extra = list(args.worker_args)
        if extra and extra[0] == "--":
            extra = extra[1:]
        nats_port = _local_nats_port(args)
        # a fleet of its own: a secret of its own (unless given)
        cfg = _fleet_worker_key(router_config(args, default_secret=FleetSecret.generate()))
        fleet = FleetConfig(num_workers=args.workers, model=args.model, roles=roles,
                            worker_args=(*cfg.tracing.to_args(), *extra),
                            start_timeout_s=args.worker_start_timeout,
                            worker_api_key=cfg.worker_api_key,
                            event_plane=cfg.bus.plane if cfg.bus is not None else None,
                            nats_port=nats_port, num_prefill=args.prefill,
                            num_decode=args.decode,
                            kv_connector_extra_config=args.kv_connector_extra_config,
                            fleet_secret=cfg.fleet_secret,
                            restart=RestartPolicy(args.max_worker_restarts,
                                                  args.worker_restart_backoff)
                            if args.max_worker_restarts else None)
    except ValueError as e:
        raise SystemExit(f"kvloop fleet: {e}") from None
    if any(r not in ROLES for r in roles):
        raise SystemExit(f"kvloop fleet: --roles must be chosen from {ROLES}")
    _setup_logging(args.log_level)
    if args.ray is not None:
        return _run_ray_fleet(args, fleet, cfg)
    return run_fleet(fleet, cfg, args.log_level)


def _run_ray_fleet(args: argparse.Namespace, fleet: FleetConfig, cfg: RouterConfig) -> int:
    from kvloop.router.ray_fleet import RayFleetConfig, run_ray_fleet

    try:
        ray_cfg = RayFleetConfig(args.ray, worker_cpus=args.ray_worker_cpus,
                                 drain_timeout_s=args.ray_drain_timeout)
        return run_ray_fleet(fleet, cfg, ray_cfg, args.log_level)
    except ValueError as e:
        raise SystemExit(f"kvloop fleet: {e}") from None
