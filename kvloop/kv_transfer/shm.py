"""The shared-memory transport: P writes a Read's frames into one `/dev/shm` file, D maps it,
copies the frames out and unlinks it (P unlinks what is left when the lease ends).

File layout: the frames back to back, all of one size (one per layer).
"""

from __future__ import annotations

import itertools
import mmap
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

SHM_DIR = "/dev/shm"
_counter = itertools.count()


def shm_name(engine_id: str) -> str:
    """A fresh file name, unique per engine process and Read."""
    tag = "".join(c for c in engine_id if c.isalnum())[:12] or "engine"
    return f"kvloop-{tag}-{os.getpid()}-{next(_counter)}"


def shm_path(name: str) -> str:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"bad shared-memory name {name!r}")
    return os.path.join(SHM_DIR, name)


def write_frames(name: str, frames: Sequence[Any]) -> str:
    """Write `frames` (buffers) into a new file; returns its path."""
    path = shm_path(name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        for frame in frames:
            view = memoryview(frame).cast("B")
            while view:
                view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    return path


@contextmanager
def mapped_frames(name: str, num_frames: int, nbytes: int) -> Iterator[list[memoryview]]:
    """Map the file P wrote, yield its `num_frames` frames (valid inside the block), then
    unmap and unlink it. ValueError when its size is not `nbytes`."""
    path = shm_path(name)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size != nbytes or num_frames < 1 or nbytes % num_frames:
            raise ValueError(f"shared-memory file {name} holds {size} bytes, expected {nbytes}"
                             f" in {num_frames} frames")
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
            view = memoryview(mm)
            step = nbytes // num_frames
            frames = [view[i * step:(i + 1) * step] for i in range(num_frames)]
            try:
                yield frames
            finally:
                for f in frames:
                    f.release()
                view.release()
    finally:
        os.close(fd)
        unlink(path)


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
