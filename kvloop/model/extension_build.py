"""Build a torch C++ extension once per directory, whichever processes ask at the same time
and whatever killed an earlier build.

`build_once(name, directory, sources, ...)` returns the module `name` whose library is
`directory/<name>.so`, compiling it first where absent. The directory holds one build (its
name keys the sources and flags: `kvloop.model.cpu_ops.build_key`); this module owns what
lies in it:

- `build.lock`: an OS lock (`fcntl.flock`) held around the check and the build, so that two
  processes starting at once build once and both load. The kernel releases it when its holder
  dies, however it dies (SIGKILL, the OOM killer), so a dead builder never blocks the next one;
  a live one is waited for, and the waiter says so in the log (with the holder's pid);
- `scratch-*/`: each build's own directory, where torch's builder (ninja) runs, with its own
  `lock` file (torch's `FileBaton`: a file that a killed builder leaves behind, and that
  every later builder of the directory would wait on for ever). Nobody but its builder uses
  one, so no leftover can block a build; the leftovers of killed builds are removed by the
  next build, under the OS lock (a builder killed alone may leave its compilers running: they
  write into their own scratch directory, never into another build's);
- `<name>.so`: moved in from the scratch directory (`os.replace`, atomic) only once built
  whole: a half-written library is never found by `load`.

A `lock` file beside the library is torch's, from a build in the directory itself before this
module existed: removed under the OS lock like the scratch leftovers.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

LOCK_NAME = "build.lock"
SCRATCH_PREFIX = "scratch-"
TORCH_LOCK_NAME = "lock"      # torch.utils.cpp_extension's FileBaton in a build directory


def library_path(name: str, directory: Path) -> Path:
    """Where the built library of `name` lies."""
    return directory / f"{name}.so"


def import_library(name: str, library: Path) -> Any:
    """The module `name` from its built library (no compiler run)."""
    spec = importlib.util.spec_from_file_location(name, library)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_once(name: str, directory: Path, sources: list[str], cflags: list[str],
               include_paths: list[str]) -> Any:
    """The module `name`, from `directory/<name>.so`, compiled there first (from `sources`
    with `cflags` and `include_paths`) where absent. Blocks while another live process builds
    it, then loads that build. Raises where the build or the load fails."""
    directory.mkdir(parents=True, exist_ok=True)
    library = library_path(name, directory)
    with build_lock(directory):
        if library.is_file():
            return import_library(name, library)
        remove_leftovers(directory)
        return _compile(name, directory, sources, cflags, include_paths)


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Hold `directory`'s OS build lock (waiting, and saying so, while another process
    holds it); the kernel releases it when this process dies."""
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for process %s, which is building %s", _holder(fd), directory)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)     # releases the lock


def _holder(fd: int) -> str:
    """The pid the lock's holder wrote, or "?" (it has not written it yet)."""
    return os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"


def remove_leftovers(directory: Path) -> None:
    """Remove the scratch directories and torch `lock` file of builds that died (call under
    the build lock: no live builder uses them)."""
    for scratch in directory.glob(f"{SCRATCH_PREFIX}*"):
        logger.info("removing %s, left by a build that was stopped", scratch)
        shutil.rmtree(scratch, ignore_errors=True)
    (directory / TORCH_LOCK_NAME).unlink(missing_ok=True)


def _compile(name: str, directory: Path, sources: list[str], cflags: list[str],
             include_paths: list[str]) -> Any:
    from torch.utils.cpp_extension import load  # noqa: PLC0415 - torch only where building

    scratch = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=directory))
    try:
        module = load(name=name, sources=sources, extra_cflags=cflags,
                      extra_include_paths=include_paths, build_directory=str(scratch),
                      verbose=False)
        _install(library_path(name, scratch), library_path(name, directory))
        return module
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _install(built: Path, library: Path) -> None:
    """Move the whole library in. torch names it `<name>_v<n>.so` where this process built
    `name` before (another directory): that one serves this process only."""
    if built.is_file():
        os.replace(built, library)
    else:
        logger.warning("%s was built under another name (built before in this process); "
                       "this process uses it, the next one builds it again", library.name)
