"""One batch's results: a JSON line per input line, `{"i": line index, "out": output line}`,
appended and fsynced before the line counts as done.

A line is run again after a restart only if its result never reached the disk; a result is
never written twice (`load` keeps the first of an index, and the runner never sends a line
whose index is loaded). A torn last line (the process killed mid-write) is dropped on load.
Appends are grouped: whoever takes the lock writes every pending line with one fsync.
Owner: the runner's task of that batch.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any


def load(path: Path) -> dict[int, dict[str, Any]]:
    """Index -> output line of every result on disk; a torn tail is cut off the file."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    done: dict[int, dict[str, Any]] = {}
    good = 0
    for raw in data.splitlines(keepends=True):
        if not raw.endswith(b"\n"):
            break
        try:
            rec = json.loads(raw)
        except ValueError:
            break
        done.setdefault(int(rec["i"]), rec["out"])
        good += len(raw)
    if good < len(data):
        with open(path, "r+b") as f:
            f.truncate(good)
    return done


class Journal:
    def __init__(self, path: Path):
        self.path = path
        self._pending: list[bytes] = []
        self._lock = asyncio.Lock()
        self._written = 0    # lines on disk (of those appended here)
        self._queued = 0

    async def append(self, index: int, out: dict[str, Any]) -> None:
        """Returns once the line is on disk."""
        self._pending.append(json.dumps({"i": index, "out": out}).encode() + b"\n")
        self._queued += 1
        mine = self._queued
        async with self._lock:
            if self._written >= mine:
                return           # an earlier holder wrote it
            lines, self._pending = self._pending, []
            await asyncio.to_thread(self._write, b"".join(lines))
            self._written += len(lines)

    def _write(self, data: bytes) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
