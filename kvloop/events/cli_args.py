"""Command-line surface of the events package.

- `register(subparsers)`: adds `kvloop events tail` (picked up by kvloop/cli.py).
- `add_publisher_args(parser)` / `publisher_config_from_args(args)`: the publisher's flags
  (`--enable-kv-cache-events`, `--kv-events-endpoint`, `--kv-events-replay-endpoint`,
  `--kv-events-topic`, ...) and the `KVEventsConfig` they make, for any command that runs an
  engine: `kvloop serve` takes them from here.

- `add_event_plane_args(group, consumer)` / `event_plane_from_args(args, component)`: the
  NATS event plane's flags (`--event-plane`, `--dyn-namespace`, `--dyn-component`,
  `--event-plane-format`, `--nats-user`, `--nats-password`, `--nats-token`, `--nats-tls-ca`),
  for a worker
  (`kvloop serve`, through `add_publisher_args`) and a router alike. NATS credentials also
  come from the environment (`NATS_CREDENTIAL_ENV`: $KVLOOP_NATS_USER, $KVLOOP_NATS_PASSWORD,
  $KVLOOP_NATS_TOKEN), where `ps` does not show them: what `kvloop fleet` hands its workers.

Nothing heavy is imported here: the subscriber and zmq load only when a command runs.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

from kvloop.events.config import (
    COMPONENT_ENV,
    COMPONENT_OF_ROLE,
    DEFAULT_NAMESPACE,
    NAMESPACE_ENV,
    PAYLOAD_FORMATS,
    PAYLOAD_VLLM,
    KVEventsConfig,
    NatsPlaneConfig,
)
from kvloop.trust import (
    PURPOSE_KV_EVENTS,
    CurveKeys,
    add_fleet_secret_arg,
    fleet_secret_from_args,
)

# Flag -> environment variable of each NATS credential (the flag wins when both are given).
NATS_CREDENTIAL_ENV = {"nats_user": "KVLOOP_NATS_USER", "nats_password": "KVLOOP_NATS_PASSWORD",
                       "nats_token": "KVLOOP_NATS_TOKEN"}


def nats_tls_args(plane: NatsPlaneConfig) -> list[str]:
    """The flag that hands `plane`'s CA file (a path, no secret) to a child `kvloop serve`."""
    return [] if plane.tls_ca is None else ["--nats-tls-ca", plane.tls_ca]


def nats_credential_env(plane: NatsPlaneConfig) -> dict[str, str]:
    """The environment that hands `plane`'s credentials (its fields, not its URL) to a child
    `kvloop serve` or `kvloop router`, instead of its command line."""
    values = {"nats_user": plane.user, "nats_password": plane.password,
              "nats_token": plane.token}
    return {NATS_CREDENTIAL_ENV[k]: v for k, v in values.items() if v is not None}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("events", help="KV-cache events: tools")
    sub = p.add_subparsers(dest="events_command", required=True)
    t = sub.add_parser("tail", help="print a worker's KV events as they arrive",
                       description="Subscribe to a worker's KV events (kvloop or vLLM) and "
                                   "print them; with a replay endpoint, the worker's current "
                                   "cache comes first (snapshot or replay).")
    src = t.add_mutually_exclusive_group(required=True)
    src.add_argument("--endpoint", help="the worker's PUB address, tcp://HOST:PORT")
    src.add_argument("--worker", metavar="URL",
                     help="a kvloop or vLLM worker's HTTP address: its PUB and replay addresses "
                          "are read from its GET /kv_event_sources (a kvloop worker publishes "
                          "with --enable-kv-cache-events, on an ephemeral port unless "
                          "--kv-events-endpoint)")
    t.add_argument("--replay-endpoint", default=None,
                   help="the worker's replay (ROUTER) address, for replay, snapshot and epochs")
    t.add_argument("--topic", default="", help="topic prefix (default: everything)")
    t.add_argument("--count", type=int, default=None, help="exit after N batches")
    t.add_argument("--timeout", type=float, default=None, help="exit after S seconds")
    t.add_argument("--json", action="store_true", help="one JSON object per line")
    t.add_argument("--heartbeats", action="store_true", help="print heartbeats too")
    t.add_argument("--recency", action="store_true", help="print recency (touch) notices too")
    t.add_argument("--idle-warn", type=float, default=10.0, metavar="S",
                   help="warn on stderr (endpoint, likely causes) when no batch came for S "
                        "seconds, then keep waiting; 0 = never (default 10)")
    t.add_argument("--exit-on-idle", action="store_true",
                   help="exit with status 1 after the --idle-warn warning")
    t.add_argument("--curve", action="store_true",
                   help="the worker's event sockets require CURVE (its /kvloop/worker says "
                        "kv_events.curve): connect with the fleet secret's keys")
    add_fleet_secret_arg(t)
    t.set_defaults(func=_cmd_tail)


def _cmd_tail(args: argparse.Namespace) -> int:
    from kvloop.events.tail import run_tail

    if args.count is not None and args.count < 1:
        raise SystemExit("--count must be >= 1")
    if args.idle_warn < 0:
        raise SystemExit("--idle-warn must be >= 0")
    if args.exit_on_idle and not args.idle_warn:
        raise SystemExit("--exit-on-idle needs --idle-warn > 0")
    endpoint, replay = args.endpoint, args.replay_endpoint
    if args.worker is not None:
        endpoint, found = worker_event_sources(args.worker)
        replay = replay or found
    return run_tail(endpoint, replay, args.topic, as_json=args.json,
                    count=args.count, timeout=args.timeout, heartbeats=args.heartbeats,
                    recency=args.recency, idle_warn=args.idle_warn or None,
                    exit_on_idle=args.exit_on_idle, curve_keys=_tail_keys(args))


def worker_event_sources(url: str, timeout_s: float = 10.0) -> tuple[str, str | None]:
    """(PUB, replay) addresses a worker at `url` lists in `GET /kv_event_sources`;
    SystemExit naming the fix when it lists none or cannot be asked."""
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/kv_event_sources",
                                    timeout=timeout_s) as r:
            sources = json.loads(r.read(1 << 20))
    except (OSError, ValueError) as e:
        raise SystemExit(f"--worker {url}: cannot read its /kv_event_sources: {e}") from None
    first = next(iter(sources.values()), None) if isinstance(sources, dict) else None
    if not isinstance(first, dict) or not first.get("endpoint"):
        raise SystemExit(f"--worker {url} publishes no KV events over ZMQ: start it with "
                         f"--enable-kv-cache-events (or pass --endpoint)")
    return str(first["endpoint"]), first.get("replay_endpoint") or None


def _tail_keys(args: argparse.Namespace) -> CurveKeys | None:
    """The fleet's KV-event CURVE keys when --curve asks for them (SystemExit: no secret)."""
    if not args.curve:
        return None
    try:
        secret = fleet_secret_from_args(args)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if secret is None:
        raise SystemExit("--curve needs the fleet secret: --fleet-secret-file PATH (or "
                         "$KVLOOP_FLEET_SECRET_FILE / $KVLOOP_FLEET_SECRET)")
    return secret.curve_keys(PURPOSE_KV_EVENTS)


def add_publisher_args(parser: argparse.ArgumentParser) -> None:
    """The KV-event publisher's flags (vLLM's names where vLLM has the concept); read them
    with `publisher_config_from_args`."""
    g = parser.add_argument_group("KV-cache events")
    g.add_argument("--enable-kv-cache-events", action="store_true",
                   help="publish KV-cache events (on an ephemeral port unless "
                        "--kv-events-endpoint says where)")
    g.add_argument("--kv-events-endpoint", default=None,
                   help="ZMQ PUB endpoint of the KV events (implies --enable-kv-cache-events), "
                        "e.g. tcp://127.0.0.1:0 (default: an ephemeral loopback port)")
    g.add_argument("--kv-events-replay-endpoint", default=None,
                   help="ZMQ ROUTER endpoint serving replays of recent batches (default: none)")
    g.add_argument("--kv-events-topic", default="",
                   help="topic of the event messages (default: empty)")
    g.add_argument("--kv-events-recency", action="store_true",
                   help="also publish the hashes of prefix-cache hits (recency topic)")
    g.add_argument("--kv-events-heartbeat", action=argparse.BooleanOptionalAction,
                   default=None, help="heartbeats on their own topic (default: on when "
                                      "--kv-events-topic is not empty)")
    g.add_argument("--kv-events-curve", action=argparse.BooleanOptionalAction, default=None,
                   help="the event sockets (PUB and replay) admit only CURVE clients holding "
                        "the fleet secret (--fleet-secret-file); others receive nothing "
                        "(default: on whenever the worker has the fleet secret and publishes "
                        "over ZMQ)")
    g.add_argument("--kv-events-omit-token-ids", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="publish BlockStored events with empty token_ids (block hashes only; "
                        "docs/events.md says which consumers still work); default: on unless "
                        "every subscriber authenticates (CURVE, or a NATS plane with "
                        "credentials), so no keyless local user reads prompt tokens"),
    add_event_plane_args(g, consumer=False)


def add_event_plane_args(g: Any, consumer: bool) -> None:
    """The NATS event plane's flags on argument group `g` (`consumer`: a router's words)."""
    what = ("read the workers' KV events from this NATS server" if consumer else
            "publish the KV events on this NATS server instead of ZMQ (implies "
            "--enable-kv-cache-events), on Dynamo's subject")
    g.add_argument("--event-plane", default=None, metavar="nats://HOST:PORT",
                   help=f"{what}: namespace.NS.component.C.kv-events (credentials may be "
                        "in the URL: nats://USER:PASSWORD@HOST:PORT or nats://TOKEN@HOST:PORT)")
    g.add_argument("--dyn-namespace", default=None, metavar="NS",
                   help=f"the event plane's namespace (default: ${NAMESPACE_ENV}, else "
                        f"{DEFAULT_NAMESPACE!r})")
    comp = ("the component to listen to: backend, prefill, decode... (default: "
            f"${COMPONENT_ENV}, else every component, '*')" if consumer else
            f"the component to publish as (default: ${COMPONENT_ENV}, else by --role: "
            + ", ".join(f"{r} -> {c}" for r, c in COMPONENT_OF_ROLE.items()) + ")")
    g.add_argument("--dyn-component", default=None, metavar="C", help=comp)
    g.add_argument("--event-plane-format", choices=PAYLOAD_FORMATS, default=PAYLOAD_VLLM,
                   help="payload on the event plane: vLLM's msgpack batches, or Dynamo's "
                        "RouterEvent JSON (one per event)")
    env = NATS_CREDENTIAL_ENV
    g.add_argument("--nats-user", default=None,
                   help=f"NATS user (with a password; default: ${env['nats_user']})")
    g.add_argument("--nats-password", default=None,
                   help=f"NATS password, never logged (prefer ${env['nats_password']}: a "
                        "command line is visible to every local user)")
    g.add_argument("--nats-token", default=None,
                   help=f"NATS token, never logged (prefer ${env['nats_token']})")
    g.add_argument("--nats-tls-ca", default=None, metavar="PEM",
                   help="connect to NATS over TLS, verifying the server's certificate (and "
                        "host name) against this CA bundle (a tls:// URL without it: the "
                        "system's roots; default: plain TCP)")


def event_plane_from_args(args: argparse.Namespace, component: str,
                          environ: Mapping[str, str] = os.environ) -> NatsPlaneConfig | None:
    """The `NatsPlaneConfig` of `add_event_plane_args`' flags (None without --event-plane);
    `component` is used unless --dyn-component or $DYN_COMPONENT says otherwise; credentials
    not given as flags come from `NATS_CREDENTIAL_ENV`. Raises ValueError for a value NATS
    cannot use."""
    if args.event_plane is None:
        return None
    cred = {k: getattr(args, k) or environ.get(v) or None for k, v in NATS_CREDENTIAL_ENV.items()}
    return NatsPlaneConfig(
        url=args.event_plane,
        namespace=args.dyn_namespace or environ.get(NAMESPACE_ENV) or DEFAULT_NAMESPACE,
        component=args.dyn_component or environ.get(COMPONENT_ENV) or component,
        payload_format=args.event_plane_format, user=cred["nats_user"],
        password=cred["nats_password"], token=cred["nats_token"],
        tls_ca=args.nats_tls_ca)


def publisher_config_from_args(args: argparse.Namespace,
                               has_secret: bool = False) -> KVEventsConfig | None:
    """The `KVEventsConfig` of `add_publisher_args`' flags, or None when events are off;
    `has_secret`: the worker holds the fleet secret (CURVE then defaults on). Token ids are
    published only to authenticated subscribers unless the flags say otherwise. Raises
    ValueError for an endpoint the publisher cannot use."""
    role = getattr(args, "role", "both")
    nats = event_plane_from_args(args, COMPONENT_OF_ROLE.get(role, COMPONENT_OF_ROLE["both"]))
    if args.kv_events_endpoint is None and not args.enable_kv_cache_events and nats is None:
        return None
    curve = args.kv_events_curve
    if curve is None:
        curve = has_secret and nats is None
    omit = args.kv_events_omit_token_ids
    if omit is None:
        omit = not (curve or (nats is not None and nats.authenticated))
    return KVEventsConfig(endpoint=args.kv_events_endpoint,
                          replay_endpoint=args.kv_events_replay_endpoint,
                          topic=args.kv_events_topic, recency=args.kv_events_recency,
                          heartbeat=args.kv_events_heartbeat, nats=nats,
                          curve=curve, omit_token_ids=omit)
