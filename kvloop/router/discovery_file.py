"""Discovery from a file: the workers a YAML file lists join the router, and leave it when the
file stops listing them (llm-d's and SMG's file discovery, without Kubernetes).

    kvloop router --discovery-file workers.yaml

    workers:                                  # or the list itself at the top level
      - url: http://10.0.0.5:8000             # a kvloop worker (or any OpenAI server)
        role: both                            # both | prefill | decode (default: both)
      - url: http://10.0.0.6:8000
        labels: {llm-d.ai/role: decode}       # llm-d's label, the same as role: decode
      - address: 10.0.0.7                     # or address + port (http)
        port: 8000

The file is read at start and again whenever its size or modification time changes (looked
at every `interval_s`). A worker it adds is registered as a `--worker` is (probed; down and
re-probed by the poller if it does not answer yet); one it drops is deregistered (its index
entries dropped); one whose role changes is registered anew. A file that does not parse, or
lists a bad entry, changes nothing (counted, logged, shown in /health under `discovery_file`)
until it is fixed. Workers named with `--worker` are never touched by the file.

Owner: `FileDiscovery` runs on the router's event loop and owns the set of workers the file
brought; the registry never learns where a worker came from.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from kvloop.config import DEFAULT_ROLE
from kvloop.router.registry import WorkerSpec

if TYPE_CHECKING:
    from kvloop.router.proxy import RouterApp

log = logging.getLogger("kvloop.router")

ROLE_LABEL = "llm-d.ai/role"
MAX_FILE_BYTES = 1 << 20
MAX_WORKERS = 4096
DEFAULT_INTERVAL_S = 1.0


def parse_workers(text: str) -> list[WorkerSpec]:
    """The workers a discovery file lists (module docstring); ValueError naming what is
    wrong."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"not YAML: {e}") from None
    if isinstance(data, dict):
        data = data.get("workers", data.get("endpoints"))
    if data is None:
        return []
    if not isinstance(data, list):
        raise ValueError("expected a list of workers (or {workers: [...]})")
    if len(data) > MAX_WORKERS:
        raise ValueError(f"more than {MAX_WORKERS} workers")
    specs = [_spec(i, entry) for i, entry in enumerate(data)]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("a worker is listed twice")
    return specs


def _spec(i: int, entry: Any) -> WorkerSpec:
    if isinstance(entry, str):
        entry = {"url": entry}
    if not isinstance(entry, dict):
        raise ValueError(f"worker {i}: expected a mapping with url (or address and port)")
    url = entry.get("url")
    if url is None and "address" in entry:
        url = f"http://{entry['address']}:{entry.get('port', '')}"
    labels = entry.get("labels") or {}
    role = entry.get("role") or (labels.get(ROLE_LABEL) if isinstance(labels, dict) else None)
    try:
        return WorkerSpec(str(url).rstrip("/"), str(role or DEFAULT_ROLE))
    except ValueError as e:
        raise ValueError(f"worker {i}: {e}") from None


class FileDiscovery:
    """Keeps the router's workers equal to the file's (besides the `--worker` ones)."""

    def __init__(self, app: RouterApp, path: str, interval_s: float = DEFAULT_INTERVAL_S):
        self.app = app
        self.path = Path(path)
        self.interval_s = interval_s
        self.brought: dict[str, WorkerSpec] = {}   # name -> spec, the workers the file added
        self.joined = self.left = self.bad_reads = 0
        self.last_error: str | None = None
        self._seen: tuple[int, int] | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Watch (call from the router's event loop)."""
        self._task = asyncio.get_running_loop().create_task(self._watch(),
                                                            name="kvloop-discovery-file")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _watch(self) -> None:
        while True:
            try:
                await self.check()
            except Exception:   # the watch must outlive any one bad read
                log.exception("discovery file %s: check failed", self.path)
            await asyncio.sleep(self.interval_s)

    async def check(self) -> bool:
        """Re-read the file if it changed and apply it; True when it was applied."""
        try:
            st = os.stat(self.path)
        except OSError as e:
            return self._bad(f"cannot read it: {e}")
        seen = (st.st_mtime_ns, st.st_size)
        if seen == self._seen:
            return False
        self._seen = seen
        if st.st_size > MAX_FILE_BYTES:
            return self._bad(f"larger than {MAX_FILE_BYTES} bytes")
        try:
            specs = parse_workers(self.path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            return self._bad(str(e))
        self.last_error = None
        await self.apply(specs)
        return True

    def _bad(self, why: str) -> bool:
        if why != self.last_error:
            log.warning("discovery file %s: %s (workers unchanged)", self.path, why)
            self.bad_reads += 1
        self.last_error = why
        return False

    async def apply(self, specs: Iterable[WorkerSpec]) -> None:
        """Register the listed workers the router lacks, drop those the file no longer lists."""
        router = self.app.router
        fixed = {s.name for s in self.app.initial_workers}
        wanted = {s.name: s for s in specs if s.name not in fixed}
        for name, spec in list(self.brought.items()):
            if wanted.get(name) != spec:
                del self.brought[name]
                if router.deregister(name):
                    self.left += 1
                    log.warning("discovery file: worker %s left", name)
        for name, spec in wanted.items():
            if name in self.brought or router.registry.get(name) is not None:
                continue
            self.brought[name] = spec
            await self.app.register(spec)
            self.joined += 1
            log.warning("discovery file: worker %s joined (role %s)", name, spec.role)

    def describe(self) -> dict[str, Any]:
        """The `discovery_file` part of /health."""
        return {"path": str(self.path), "workers": sorted(self.brought),
                "joined": self.joined, "left": self.left, "bad_reads": self.bad_reads,
                "last_error": self.last_error}
