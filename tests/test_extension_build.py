"""kvloop.model.extension_build with real builders (subprocesses running torch's builder on a
one-file extension, a few seconds each): a builder killed midway blocks no later build, a
torch `lock` file left beside a library blocks nothing, and two builders starting at once
build once and both load.

The compiler is the real one behind a small wrapper script (`CXX`) that counts its compile
commands and, where asked, sleeps before each: so a test can kill a builder while it compiles,
or make two builders overlap, without depending on the machine's speed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvloop.model import extension_build

pytestmark = pytest.mark.processes

REPO = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT_S = 120     # a build here takes seconds: this bounds a hang, not a speed

# A Python module with no torch headers (compiles in a second), named as torch tells it.
SOURCE = r"""
#include <Python.h>
#define KV_CAT2(a, b) a##b
#define KV_CAT(a, b) KV_CAT2(a, b)
#define KV_STR2(x) #x
#define KV_STR(x) KV_STR2(x)
static struct PyModuleDef tiny = {PyModuleDef_HEAD_INIT, KV_STR(TORCH_EXTENSION_NAME), nullptr,
                                  -1, nullptr};
PyMODINIT_FUNC KV_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  PyObject* m = PyModule_Create(&tiny);
  if (m != nullptr) PyModule_AddIntConstant(m, "answer", 42);
  return m;
}
"""

BUILDER = """
import logging, sys
from pathlib import Path
from kvloop.model.extension_build import build_once
logging.basicConfig(level=logging.INFO, format="%(message)s")
module = build_once(sys.argv[1], Path(sys.argv[2]), [sys.argv[3]], [], [])
print("answer", module.answer)
"""

# Counts compile commands (one line each in $COUNT) and sleeps $DELAY s before each.
WRAPPER = """#!/bin/sh
case " $* " in *" -c "*) echo "$$" >> "$COUNT"; sleep "$DELAY" ;; esac
exec c++ "$@"
"""


class Builders:
    """Starts builders of one extension (`name`) into one directory (`directory`)."""

    def __init__(self, tmp_path: Path, name: str):
        self.name = name
        self.directory = tmp_path / "cache" / name
        self.source = tmp_path / "tiny.cpp"
        self.source.write_text(SOURCE)
        self.count = tmp_path / "compiles"
        self.wrapper = tmp_path / "g++-wrapper"
        self.wrapper.write_text(WRAPPER)
        self.wrapper.chmod(0o755)
        self.started: list[subprocess.Popen[str]] = []

    def start(self, delay_s: float = 0.0) -> subprocess.Popen[str]:
        """A builder in its own process group (its compilers with it), compiling after
        `delay_s`."""
        env = {**os.environ, "PYTHONPATH": str(REPO), "CXX": str(self.wrapper),
               "COUNT": str(self.count), "DELAY": str(delay_s)}
        proc = subprocess.Popen(
            [sys.executable, "-c", BUILDER, self.name, str(self.directory), str(self.source)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        self.started.append(proc)
        return proc

    def compiles(self) -> int:
        return len(self.count.read_text().splitlines()) if self.count.exists() else 0

    def finish(self, proc: subprocess.Popen[str]) -> tuple[str, str]:
        """`proc`'s stdout and stderr once it exits 0 within `BUILD_TIMEOUT_S`."""
        out, err = proc.communicate(timeout=BUILD_TIMEOUT_S)
        assert proc.returncode == 0, err
        return out, err

    def kill_all(self) -> None:
        """Every builder's process group: the builder and any compiler it left running."""
        for proc in self.started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                proc.communicate(timeout=10)


def _wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_builder_killed_midway_blocks_no_later_build(tmp_path):
    """SIGKILL to a builder while its compiler runs (the OOM killer, a test's timeout) leaves
    torch's `lock` file in its scratch directory, and its compiler running; the next builder
    removes the leftovers, builds and loads, and nothing is left but the library."""
    builders = Builders(tmp_path, "kvloop_tiny_killed")
    try:
        killed = builders.start(delay_s=60)
        _wait_for(lambda: builders.compiles() == 1, BUILD_TIMEOUT_S)
        killed.kill()                      # the builder alone: its compiler lives on
        killed.wait(timeout=10)
        scratch = list(builders.directory.glob(f"{extension_build.SCRATCH_PREFIX}*"))
        assert len(scratch) == 1 and (scratch[0] / extension_build.TORCH_LOCK_NAME).exists()

        out, err = builders.finish(builders.start())
        assert "answer 42" in out and "removing" in err
        assert sorted(p.name for p in builders.directory.iterdir()) == [
            extension_build.LOCK_NAME, "kvloop_tiny_killed.so"]
        assert builders.compiles() == 2
    finally:
        builders.kill_all()


def test_a_torch_lock_left_beside_the_library_blocks_nothing(tmp_path):
    """A `lock` file in the directory itself, as torch's builder leaves it when killed there
    (kvloop built there before extension_build): removed, and the build goes on."""
    builders = Builders(tmp_path, "kvloop_tiny_old_lock")
    builders.directory.mkdir(parents=True)
    os.close(os.open(builders.directory / extension_build.TORCH_LOCK_NAME,
                     os.O_CREAT | os.O_EXCL))      # torch's FileBaton.try_acquire
    try:
        out, _ = builders.finish(builders.start())
        assert "answer 42" in out
        assert not (builders.directory / extension_build.TORCH_LOCK_NAME).exists()
    finally:
        builders.kill_all()


def test_two_builders_at_once_build_once_and_both_load(tmp_path):
    """Two processes asking at once: one compiles (one compile command), the other waits,
    saying for whom, then loads that build."""
    builders = Builders(tmp_path, "kvloop_tiny_twice")
    try:
        first, second = builders.start(delay_s=5), builders.start(delay_s=5)
        results = [builders.finish(first), builders.finish(second)]
        assert all("answer 42" in out for out, _ in results)
        assert builders.compiles() == 1
        waited = [err for _, err in results if "waiting for process" in err]
        assert len(waited) == 1
    finally:
        builders.kill_all()


def test_a_built_library_is_loaded_not_compiled(tmp_path):
    """Where the library is built, `build_once` loads it and compiles nothing."""
    builders = Builders(tmp_path, "kvloop_tiny_again")
    try:
        builders.finish(builders.start())
        out, err = builders.finish(builders.start(delay_s=60))
        assert "answer 42" in out and builders.compiles() == 1 and "waiting" not in err
    finally:
        builders.kill_all()
