"""The Batch API's flags, shared by `kvloop serve`, `kvloop router` and `kvloop fleet`."""

from __future__ import annotations

import argparse

from kvloop.batch.config import BatchConfig, default_directory


def add_batch_args(p: argparse.ArgumentParser, default_on: bool = True) -> None:
    """`default_on`: served unless --no-batch-api (the router); else only with --batch-dir
    (`kvloop serve`: a worker behind a router must not run batches the router's flow control
    never sees)."""
    g = p.add_argument_group("Batch API (docs/batch.md)")
    d = BatchConfig(directory="unused")
    where = ("default: $XDG_DATA_HOME/kvloop/batch, made on first use" if default_on else
             "the routes are served only when it is given")
    g.add_argument("--batch-dir", default=None, metavar="DIR",
                   help="where /v1/files and /v1/batches keep files, results and (without "
                        f"Redis) metadata ({where})")
    if default_on:
        g.add_argument("--no-batch-api", action="store_true",
                       help="serve no /v1/files and /v1/batches routes")
    g.add_argument("--batch-concurrency", type=int, default=d.concurrency, metavar="N",
                   help="batch lines in flight at once, over all batches")
    g.add_argument("--batch-max-lines", type=int, default=d.max_lines, metavar="N",
                   help="request lines in one batch file")
    g.add_argument("--batch-quota-bytes", type=int, default=d.tenant_quota_bytes,
                   metavar="BYTES", help="bytes of files one API key may keep")


def batch_config(args: argparse.Namespace, max_file_bytes: int, redis_url: str | None = None,
                 redis_password: str | None = None) -> BatchConfig | None:
    """The flags' config (None: no Batch API). One upload is at most the front's body
    limit, `max_file_bytes`."""
    off = getattr(args, "no_batch_api", None)
    if off or (off is None and args.batch_dir is None):
        return None
    return BatchConfig(directory=args.batch_dir or default_directory(), redis_url=redis_url,
                       redis_password=redis_password, concurrency=args.batch_concurrency,
                       max_lines=args.batch_max_lines,
                       tenant_quota_bytes=args.batch_quota_bytes,
                       max_file_bytes=max(1, max_file_bytes))
