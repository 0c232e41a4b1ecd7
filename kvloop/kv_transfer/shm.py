"""The shared-memory transport: D names a file, P writes a Read's frames into it, D maps it,
copies the frames out and unlinks it.

Who may touch what (docs/security.md):

- D alone chooses the name (`new_name`: kvloop's prefix, D's pid, 128 random bits) and sends
  it in its Read; P creates only names of that form, `O_CREAT | O_EXCL | O_NOFOLLOW`, mode
  0600 (a file already there, a squatter's, makes P send the frames over TCP instead);
- D opens only the name it asked for (`O_NOFOLLOW`, a regular file of the expected size) and
  unlinks only that name, whatever P answers; P unlinks only files it created;
- `sweep_orphans` removes files of kvloop's form whose naming process (D) is dead and that
  this user owns (what a killed D left); a killed P's half-written file is unlinked by its D,
  which knows the name.

File layout: the frames back to back, all of one size (one per layer).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

SHM_DIR = "/dev/shm"
PREFIX = "kvloop-kv-"
_NAME = re.compile(r"^kvloop-kv-(\d{1,10})-[0-9a-f]{32}$")
logger = logging.getLogger("kvloop.kv_transfer")


def new_name() -> str:
    """A fresh file name for one Read, chosen by D (unguessable; carries D's pid)."""
    return f"{PREFIX}{os.getpid()}-{secrets.token_hex(16)}"


def is_valid_name(name: str) -> bool:
    """Is `name` of the form `new_name` makes (the only names P creates)?"""
    return _NAME.match(name) is not None


def shm_path(name: str) -> str:
    if not is_valid_name(name):
        raise ValueError(f"bad shared-memory name {name[:80]!r}")
    return os.path.join(SHM_DIR, name)


def write_frames(name: str, frames: Sequence[Any]) -> str:
    """Create the file `name` (it must not exist: FileExistsError) and write `frames`
    (buffers) into it; returns its path. A failed write leaves no file."""
    path = shm_path(name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
    try:
        for frame in frames:
            view = memoryview(frame).cast("B")
            while view:
                view = view[os.write(fd, view):]
    except BaseException:
        unlink(path)
        raise
    finally:
        os.close(fd)
    return path


@contextmanager
def mapped_frames(name: str, num_frames: int, nbytes: int) -> Iterator[list[memoryview]]:
    """Map the file D named, yield its `num_frames` frames (valid inside the block), then
    unmap it. ValueError when it is not a regular file of `nbytes` bytes. (The caller unlinks
    the name it chose, whatever happens: `unlink_own`.)"""
    fd = os.open(shm_path(name), os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        size = st.st_size
        if not stat.S_ISREG(st.st_mode) or size != nbytes or num_frames < 1 \
                or nbytes % num_frames:
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


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def unlink_own(name: str) -> None:
    """Unlink the file D named for a Read, if it exists and this user owns it."""
    path = shm_path(name)
    try:
        if os.lstat(path).st_uid == os.getuid():
            os.unlink(path)
    except FileNotFoundError:
        pass


def sweep_orphans(directory: str = SHM_DIR) -> list[str]:
    """Unlink the files of kvloop's form whose naming process is gone and that this user
    owns; returns their names."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in names:
        m = _NAME.match(name)
        if m is None or _alive(int(m.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
            if st.st_uid == os.getuid() and stat.S_ISREG(st.st_mode):
                os.unlink(path)
                removed.append(name)
        except OSError:
            continue
    if removed:
        logger.info("removed %d shared-memory file(s) left by dead processes", len(removed))
    return removed


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM   # someone else's process: alive
    return True
