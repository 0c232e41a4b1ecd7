"""Frozen configuration of the Batch API (docs/batch.md)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MIB = 1024 * 1024
COMPLETION_WINDOWS = {"24h": 24 * 3600}   # OpenAI accepts only 24h
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/messages")


def default_directory() -> str:
    """$XDG_DATA_HOME/kvloop/batch (else ~/.local/share/kvloop/batch): made on first use."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return str(Path(base) / "kvloop" / "batch")


@dataclass(frozen=True)
class BatchConfig:
    """Where batch files live and how much each tenant may keep.

    `directory` holds every file's bytes and each batch's results journal (and, without
    `redis_url`, the metadata too); with `redis_url` the metadata (files, batches, claims) is
    in Redis, so router replicas sharing the directory see the same batches. One upload is at
    most `max_file_bytes` and `max_lines` lines; one tenant (API key) keeps at most
    `tenant_quota_bytes` in at most `max_files_per_tenant` files and
    `max_batches_per_tenant` batches. `concurrency`: lines in flight per process, over all
    batches (with flow control on, the ones beyond the fleet's room wait in its lowest band);
    `retry_after_s`: how long a line refused before it ran (429/503) waits to be sent again.
    """

    directory: str
    redis_url: str | None = None
    redis_password: str | None = None
    max_file_bytes: int = 32 * MIB
    max_lines: int = 50_000
    tenant_quota_bytes: int = 1024 * MIB
    max_files_per_tenant: int = 1000
    max_batches_per_tenant: int = 1000
    concurrency: int = 32
    retry_after_s: float = 1.0
    claim_ttl_s: float = 15.0

    def __post_init__(self) -> None:
        if not self.directory:
            raise ValueError("the batch directory must be set")
        for name in ("max_file_bytes", "max_lines", "tenant_quota_bytes",
                     "max_files_per_tenant", "max_batches_per_tenant", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"batch {name} must be >= 1, got {getattr(self, name)}")
        if not self.retry_after_s > 0 or not self.claim_ttl_s > 0:
            raise ValueError("batch retry_after_s and claim_ttl_s must be > 0")
