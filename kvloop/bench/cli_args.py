"""`kvloop bench` and `kvloop trace`: argument parsing only; the work is imported lazily."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from typing import Any

from kvloop.bench.workloads import DEFAULT_TOKEN_RANGE, LENGTH_DISTS, WORKLOADS
from kvloop.front.cli_help import BenchHelpFormatter as HelpFormatter


def register(subparsers: argparse._SubParsersAction) -> None:
    _add_bench(subparsers)
    _add_trace(subparsers)


# --- bench ------------------------------------------------------------------------------------

def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="load-test an OpenAI-compatible server (kvloop, vLLM, llama-server...)",
        formatter_class=HelpFormatter,
        description="Streams /v1/completions with token-id prompts and reports TTFT, TPOT, "
                    "ITL, e2e, throughput and the share of prompt tokens served from cache.")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name to send (default: first id of /v1/models)")
    p.add_argument("--compare", metavar="URL2",
                   help="run the same workload against a second server and print ratios")
    p.add_argument("--compare-model", help="model name for the --compare server")
    p.add_argument("--label", help="name of the --url server in tables (default: its URL)")
    p.add_argument("--compare-label", help="name of the --compare server in tables")
    p.add_argument("--workload", choices=WORKLOADS, default="random")
    p.add_argument("--num-requests", type=int, default=64,
                   help="requests (random, shared-prefix), conversations (multi-turn), "
                        "or the most lines to replay (trace)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--len-dist", choices=LENGTH_DISTS, default="fixed",
                   help="length distribution of random requests (around --input-len/-output-len)")
    p.add_argument("--spread", type=float, default=0.0,
                   help="uniform: +-spread*len; normal: sd = spread*len")
    p.add_argument("--num-groups", type=int, default=8, help="shared-prefix: prefixes")
    p.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: prefix tokens")
    p.add_argument("--suffix-len", type=int, default=64, help="shared-prefix: unique tokens")
    p.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation")
    p.add_argument("--turn-len", type=int, default=64,
                   help="multi-turn: user tokens added per turn after the first "
                        "(the first has --input-len)")
    p.add_argument("--workload-file", help="trace: JSONL of arrivals and lengths")
    p.add_argument("--trace-speedup", type=float, default=1.0,
                   help="trace: divide arrival times by this")
    p.add_argument("--trace-block-tokens", type=int, default=512,
                   help="trace: tokens per hash_ids block")
    p.add_argument("--concurrency", type=int,
                   help="closed loop: clients (default 1); open loop: cap on sessions in flight")
    p.add_argument("--rate", type=float, help="open loop: Poisson arrivals, sessions per second")
    p.add_argument("--warmup", type=int, default=0, help="warm-up requests (not measured)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: exactly --output-len tokens)")
    p.add_argument("--no-return-token-ids", dest="return_token_ids", action="store_false",
                   help="do not ask for the answers' token ids")
    p.add_argument("--token-range", type=int, nargs=2, metavar=("LOW", "HIGH"),
                   default=list(DEFAULT_TOKEN_RANGE), help="prompt token ids in [LOW, HIGH)")
    p.add_argument("--extra-body", type=json.loads, default={},
                   help="JSON object merged into every request body")
    p.add_argument("--text-prompts", action="store_true",
                   help="send prompts as text (the ids decoded with the embedded model's "
                        "tokenizer): for routers that take no token-id prompt (SMG)")
    p.add_argument("--api-key", help="bearer token")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--json-out", help="write the figures as JSON here")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(func=_cmd_bench)


def build_workload(args: argparse.Namespace) -> Any:
    from kvloop.bench import workloads as w

    tr = tuple(args.token_range)
    if args.workload == "random":
        wl = w.random_workload(args.num_requests, args.input_len, args.output_len, args.seed,
                               args.len_dist, args.spread, tr)
    elif args.workload == "shared-prefix":
        wl = w.shared_prefix_workload(args.num_groups, args.prefix_len, args.suffix_len,
                                      args.output_len, args.num_requests, args.seed, tr)
    elif args.workload == "multi-turn":
        wl = w.multi_turn_workload(args.num_requests, args.num_turns, args.input_len,
                                   args.turn_len, args.output_len, args.seed, tr)
    else:
        if not args.workload_file:
            raise ValueError("--workload trace needs --workload-file FILE.jsonl")
        wl = w.load_trace_workload(args.workload_file, seed=args.seed,
                                   block_tokens=args.trace_block_tokens,
                                   speedup=args.trace_speedup, max_requests=args.num_requests,
                                   token_range=tr)
    if args.rate is not None:
        wl = w.with_poisson_arrivals(wl, args.rate, args.seed)
    return wl


def _configs(args: argparse.Namespace) -> list[Any]:
    from kvloop.bench.driver import BenchConfig

    if not isinstance(args.extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    common = dict(concurrency=args.concurrency, ignore_eos=args.ignore_eos,
                  temperature=args.temperature, return_token_ids=args.return_token_ids,
                  warmup=args.warmup, timeout_s=args.timeout, api_key=args.api_key,
                  extra_body=tuple(args.extra_body.items()), progress=args.progress,
                  seed=args.seed, token_range=tuple(args.token_range),
                  text_prompts=args.text_prompts)
    cfgs = [BenchConfig(args.url, args.model, label=args.label, **common)]
    if args.compare:
        cfgs.append(BenchConfig(args.compare, args.compare_model, label=args.compare_label,
                                **common))
    return cfgs


def _cmd_bench(args: argparse.Namespace) -> int:
    from kvloop.bench import report
    from kvloop.bench.driver import run_bench_sync

    try:
        workload = build_workload(args)
        cfgs = _configs(args)
    except (ValueError, OSError) as e:
        print(f"kvloop bench: {e}", file=sys.stderr)
        return 2
    summaries = []
    for cfg in cfgs:
        try:
            run = run_bench_sync(workload, cfg)
        except OSError as e:
            print(f"kvloop bench: cannot reach {cfg.url}: {e}", file=sys.stderr)
            return 1
        summaries.append(report.summarize(run))
        if len(cfgs) == 1:
            print(report.format_table(summaries[0]))
    if len(summaries) == 2:
        print(report.format_compare(summaries[0], summaries[1]))
    if args.json_out:
        report.write_json(args.json_out, summaries)
    return 0 if all(s["completed"] for s in summaries) else 1


# --- trace ------------------------------------------------------------------------------------

def _add_trace(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trace", help="draw the schedule recorded by `kvloop serve --trace-file`",
        formatter_class=HelpFormatter,
        description="One column per engine step, one row per request, each cell coloured by "
                    "what the request got (prefill chunk, recompute, decode, spec).")
    p.add_argument("trace_file", help="JSONL of StepRecords, one line per engine step")
    p.add_argument("--out", help="write a PNG here")
    p.add_argument("--html", help="write an interactive, self-contained HTML page here")
    p.add_argument("--steps", help="only steps A:B (record positions, Python slice style)")
    p.add_argument("--title", help="title of the picture (default: the file name)")
    p.set_defaults(func=_cmd_trace)


def _cmd_trace(args: argparse.Namespace) -> int:
    from kvloop.viz.schedule import format_summary, load_schedule, parse_steps

    try:
        window = parse_steps(args.steps)
        data = load_schedule(args.trace_file, window)
    except (ValueError, OSError) as e:
        print(f"kvloop trace: {e}", file=sys.stderr)
        return 2
    title = args.title or args.trace_file
    if args.out and importlib.util.find_spec("matplotlib") is None:
        print("kvloop trace --out: a PNG needs matplotlib: pip install matplotlib (`make serve` "
              "installs it; --html needs nothing)", file=sys.stderr)
        return 2
    if args.out:
        from kvloop.viz.png import render_png

        render_png(data, args.out, title)
        print(f"wrote {args.out}")
    if args.html:
        from kvloop.viz.html import render_html

        render_html(data, args.html, title)
        print(f"wrote {args.html}")
    print(format_summary(data))
    return 0
