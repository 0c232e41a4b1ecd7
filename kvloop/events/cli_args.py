"""Command-line surface of the events package.

- `register(subparsers)`: adds `kvloop events tail` (picked up by kvloop/cli.py).
- `add_publisher_args(parser)` / `publisher_config_from_args(args)`: the publisher's flags
  (`--enable-kv-cache-events`, `--kv-events-endpoint`, `--kv-events-replay-endpoint`,
  `--kv-events-topic`, ...) and the `KVEventsConfig` they make, for any command that runs an
  engine: `kvloop serve` takes them from here.

Nothing heavy is imported here: the subscriber and zmq load only when a command runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvloop.events.config import KVEventsConfig


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("events", help="KV-cache events: tools")
    sub = p.add_subparsers(dest="events_command", required=True)
    t = sub.add_parser("tail", help="print a worker's KV events as they arrive",
                       description="Subscribe to a worker's KV events (kvloop or vLLM) and "
                                   "print them; with a replay endpoint, the worker's current "
                                   "cache comes first (snapshot or replay).")
    t.add_argument("--endpoint", required=True, help="the worker's PUB address, tcp://HOST:PORT")
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
    t.set_defaults(func=_cmd_tail)


def _cmd_tail(args: argparse.Namespace) -> int:
    from kvloop.events.tail import run_tail

    if args.count is not None and args.count < 1:
        raise SystemExit("--count must be >= 1")
    if args.idle_warn < 0:
        raise SystemExit("--idle-warn must be >= 0")
    if args.exit_on_idle and not args.idle_warn:
        raise SystemExit("--exit-on-idle needs --idle-warn > 0")
    return run_tail(args.endpoint, args.replay_endpoint, args.topic, as_json=args.json,
                    count=args.count, timeout=args.timeout, heartbeats=args.heartbeats,
                    recency=args.recency, idle_warn=args.idle_warn or None,
                    exit_on_idle=args.exit_on_idle)


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


def publisher_config_from_args(args: argparse.Namespace) -> KVEventsConfig | None:
    """The `KVEventsConfig` of `add_publisher_args`' flags, or None when events are off.
    Raises ValueError for an endpoint the publisher cannot use."""
    if args.kv_events_endpoint is None and not args.enable_kv_cache_events:
        return None
    return KVEventsConfig(endpoint=args.kv_events_endpoint,
                          replay_endpoint=args.kv_events_replay_endpoint,
                          topic=args.kv_events_topic, recency=args.kv_events_recency,
                          heartbeat=args.kv_events_heartbeat)
