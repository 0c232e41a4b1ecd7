"""Command-line surface of the events package.

- `register(subparsers)`: adds `kvloop events tail` (picked up by kvloop/cli.py).
- `add_publisher_args(parser)` / `publisher_config_from_args(args)`: the publisher's flags
  (`--kv-events-endpoint`, `--kv-events-replay-endpoint`, `--kv-events-topic`, ...) for any
  command that runs an engine, e.g. `kvloop serve`.

Nothing heavy is imported here: the subscriber and zmq load only when a command runs.
"""

from __future__ import annotations

import argparse
from typing import Any


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
    """The KV-event publisher's flags (vLLM's names where vLLM has the concept)."""
    g = parser.add_argument_group("KV-cache events")
    g.add_argument("--kv-events-endpoint", default=None,
                   help="publish KV events on this PUB address (bound; '>' prefix = "
                        "connect); tcp://127.0.0.1:0 = ephemeral. Events are off without it")
    g.add_argument("--kv-events-replay-endpoint", default=None,
                   help="ROUTER address for replay, snapshots and epoch queries (bound)")
    g.add_argument("--kv-events-topic", default="", help="topic of the event frames")
    g.add_argument("--kv-events-buffer-steps", type=int, default=10_000,
                   help="batches kept for replay (vLLM's default 10000)")
    g.add_argument("--kv-events-heartbeat-interval", type=float, default=1.0,
                   help="seconds between heartbeats")
    g.add_argument("--kv-events-heartbeat", action=argparse.BooleanOptionalAction,
                   default=None, help="heartbeats on their own topic (default: on when the "
                                      "topic is non-empty)")
    g.add_argument("--kv-events-recency", action="store_true",
                   help="publish cache-hit (touch) notices on their own topic")
    g.add_argument("--kv-events-recency-interval", type=float, default=0.5,
                   help="seconds between recency notices")


def publisher_config_from_args(args: argparse.Namespace, data_parallel_rank: int = 0):
    """A KVEventsConfig from `add_publisher_args` flags, or None when events are off."""
    if args.kv_events_endpoint is None:
        return None
    from kvloop.events.publisher import KVEventsConfig

    return KVEventsConfig(
        endpoint=args.kv_events_endpoint, replay_endpoint=args.kv_events_replay_endpoint,
        topic=args.kv_events_topic, buffer_steps=args.kv_events_buffer_steps,
        heartbeat_interval_s=args.kv_events_heartbeat_interval,
        heartbeat=args.kv_events_heartbeat, recency=args.kv_events_recency,
        recency_interval_s=args.kv_events_recency_interval,
        data_parallel_rank=data_parallel_rank)
