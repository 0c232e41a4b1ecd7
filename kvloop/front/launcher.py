"""Start, watch and stop kvloop's server processes: one place for every launcher (tests,
benchmarks, `kvloop fleet`), and the one rule for stopping a child process
(`stop_processes`), which every part of kvloop that starts one uses.

    with ServeProcess(["--model", "sim", "--sim-speedup", "50"], log_path) as srv:
        httpx.get(srv.url + "/health")

A child's output goes to its log file (a file, not a pipe: a pipe nobody drains would block
the server once full); its URL is read back from the line it announces
(`kvloop.front.sockets`). `echo` also relays that output, line by line with a prefix, to
this process's stdout (`kvloop fleet` shows its workers' logs so). `kvloop_command(...,
die_with_parent=True)` asks Linux to SIGTERM the child when this process dies.
`ServeProcess` runs `kvloop serve` on an ephemeral port unless the arguments name one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx

from kvloop.front.prometheus_text import metric_value
from kvloop.front.sockets import ROUTER_ANNOUNCEMENT, SERVE_ANNOUNCEMENT, announced_url

logger = logging.getLogger("kvloop.front")

SERVE_URL_LINE = announced_url(SERVE_ANNOUNCEMENT)
ROUTER_URL_LINE = announced_url(ROUTER_ANNOUNCEMENT)
TAIL_LINES = 40   # of a child's log, in the error when it did not start
RELAY_JOIN_S = 5.0   # how long the relay may take to print what an ended process wrote
StopStep = signal.Signals | None   # a signal to send, or None: only wait
STOP_STEPS: tuple[StopStep, ...] = (signal.SIGTERM, signal.SIGKILL)   # unless told otherwise
KILLED_WAIT_S = 10.0   # how long a SIGKILLed child may take to be reaped
GROUP_POLL_S = 0.05   # how often a stopping process group is looked at
# Runs `python -m kvloop ...` after asking Linux to SIGTERM this child when its parent (pid
# {parent}) dies, and ends at once if the parent died before the request (the signal is
# never sent then: a `kvloop fleet` killed while its workers start left them running).
_DIE_WITH_PARENT = ("import ctypes, os, runpy, signal, sys\n"
                    "try:\n"
                    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
                    "except (OSError, AttributeError):\n"
                    "    pass\n"
                    "if os.getppid() != {parent}:\n"
                    "    os.kill(os.getpid(), signal.SIGTERM)\n"
                    "sys.argv = ['kvloop'] + sys.argv[1:]\n"
                    "runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n")


def stop_processes(named: Sequence[tuple[str, subprocess.Popen[Any]]], timeout_s: float, *,
                   steps: Sequence[StopStep] = STOP_STEPS,
                   group: bool = False) -> list[str]:
    """Stop child processes (named for the log), several at once: at each step its signal
    (None: none, they were asked to exit another way) goes to every one still running (with
    `group`, to its whole process group: children started in a new session), then they share
    `timeout_s` to end (with `group`: until no live member of the group is left), else the
    next step comes. A warning names each one still running at a later step. Every one that
    ended is reaped; returns the names of those still running when the last step came (with
    the default steps: the ones killed)."""
    late: list[str] = []
    for i, sig in enumerate(steps):
        running = [(n, p) for n, p in named if not _ended(p, group)]
        if not running:
            break
        if i == len(steps) - 1:
            late = [n for n, _ in running]
        if sig is not None:
            for n, p in running:
                if i > 0:
                    logger.warning("%s still running: sending %s", n, sig.name)
                _send(p, sig, group)
        _wait_ended([p for _, p in running], time.monotonic() + timeout_s, group)
    return late


def _send(proc: subprocess.Popen[Any], sig: signal.Signals, group: bool) -> None:
    with contextlib.suppress(ProcessLookupError):
        if group:
            os.killpg(proc.pid, sig)
        elif proc.poll() is None:
            os.kill(proc.pid, sig)


def _ended(proc: subprocess.Popen[Any], group: bool) -> bool:
    return proc.poll() is not None and not (group and group_members(proc.pid))


def _wait_ended(procs: list[subprocess.Popen[Any]], deadline: float, group: bool) -> None:
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
    while group and any(group_members(p.pid) for p in procs) and time.monotonic() < deadline:
        time.sleep(GROUP_POLL_S)


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`, read from /proc: orphans
    whose init never reaps them stay zombies, and `killpg(pgid, 0)` still finds those."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(stat.parent.name))
    return members


def kvloop_command(*args: str, die_with_parent: bool = False,
                   module: str = "kvloop") -> list[str]:
    """`python -m kvloop ARGS` (or another `module` of kvloop's) with this interpreter (told
    to die with this process)."""
    if die_with_parent:
        boot = _DIE_WITH_PARENT.format(parent=os.getpid(), module=module)
        return [sys.executable, "-c", boot, *args]
    return [sys.executable, "-m", module, *args]


class UrlProcess:
    """A server child process whose log announces its URL (matched by `url_pattern`, group 1);
    `url` is known once `start()` (or `launch()` then `wait_url()`) returns. `new_session`: in
    its own session and process group (with its children), so `signal_group` reaches them
    all, as a terminal's Ctrl-C would. `env` is added to this process's environment; `name`
    names it in errors; `echo`, a prefix: relay its output to stdout; `stdin`: bytes written
    to its standard input, which is then closed (what must reach it on no command line and in
    no environment)."""

    def __init__(self, cmd: list[str], log_path: str | Path, url_pattern: str,
                 env: dict[str, str] | None = None, new_session: bool = False, *,
                 name: str | None = None, echo: str | None = None,
                 stdin: bytes | None = None):
        self.cmd = list(cmd)
        self.log_path = Path(log_path)
        self.url_pattern = re.compile(url_pattern)
        self.env = env
        self.new_session = new_session
        self.name = name or shlex.join(self.cmd[:4])
        self.echo = echo
        self.stdin = stdin
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self._relay_thread: threading.Thread | None = None

    def start(self, timeout_s: float = 60.0) -> Self:
        """Launch and wait for the URL line; raises RuntimeError with the log on failure."""
        self.launch()
        return self.wait_url(timeout_s)

    def launch(self) -> None:
        """Start the process (without waiting for it to serve)."""
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **(self.env or {})},
                                         start_new_session=self.new_session,
                                         stdin=None if self.stdin is None else subprocess.PIPE)
        if self.stdin is not None:
            assert self.proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.write(self.stdin)
            self.proc.stdin.close()
        if self.echo is not None:
            self._relay_thread = threading.Thread(target=self._relay, daemon=True,
                                                  name=f"relay {self.name}")
            self._relay_thread.start()

    def wait_url(self, timeout_s: float) -> Self:
        """Wait for the URL line; if the process exits or `timeout_s` passes first, kill it
        and raise RuntimeError with the last lines of its log."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.poll_url():
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        code = self.proc.poll()
        why = f"exited with code {code}" if code is not None else f"no URL in {timeout_s:g} s"
        self.kill()
        self._join_relay()
        last = "\n    ".join(self.log().splitlines()[-TAIL_LINES:])
        raise RuntimeError(f"{self.name} did not start ({why}); last output:\n    {last}")

    def poll_url(self) -> bool:
        """Has the log announced the URL yet? (If so, `url` is set.) Never waits."""
        m = self.url_pattern.search(self.log())
        if m:
            self.url = m.group(1)
        return m is not None

    def _relay(self) -> None:
        """Print the log's lines, prefixed with `echo`, as they are written, until the
        process has exited and everything it wrote is printed."""
        assert self.proc is not None
        pending = b""
        with open(self.log_path, "rb") as log:
            while True:
                exited = self.proc.poll() is not None
                chunk = log.read()
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    print(f"{self.echo}{line.decode(errors='replace')}", flush=True)
                if not chunk:
                    if exited:
                        break
                    time.sleep(0.05)
        if pending:
            print(f"{self.echo}{pending.decode(errors='replace')}", flush=True)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)

    def signal_group(self, sig: int) -> None:
        """`sig` to the whole process group (needs `new_session`)."""
        assert self.proc is not None and self.new_session
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def wait(self, timeout_s: float) -> int:
        """Exit code once the process ends (and its output is relayed); raises
        subprocess.TimeoutExpired."""
        assert self.proc is not None
        code = self.proc.wait(timeout=timeout_s)
        self._join_relay()
        return code

    def stop(self, timeout_s: float = 20.0, *, group: bool = False) -> int | None:
        """SIGTERM (with `group`, to its whole process group: needs `new_session`), wait,
        then SIGKILL if needed (`stop_processes`); the exit code (None: killed)."""
        return self._stop(timeout_s, STOP_STEPS, group)

    def terminate(self) -> None:
        """SIGTERM, if it still runs (several processes can then stop at once)."""
        if self.alive():
            self.signal(signal.SIGTERM)

    def wait_or_kill(self, timeout_s: float) -> int | None:
        """The exit code within `timeout_s`, else SIGKILL (None: killed, or never started)."""
        return self._stop(timeout_s, (None, signal.SIGKILL))

    def kill(self) -> None:
        self._stop(KILLED_WAIT_S, (signal.SIGKILL,))

    def _stop(self, timeout_s: float, steps: Sequence[StopStep],
              group: bool = False) -> int | None:
        if self.proc is None:
            return None
        killed = stop_processes([(self.name, self.proc)], max(0.0, timeout_s), steps=steps,
                                group=group)
        self._join_relay()
        return None if killed else self.proc.returncode

    def _join_relay(self) -> None:
        """Once the process has ended: let the relay print its last lines."""
        if self._relay_thread is not None:
            self._relay_thread.join(RELAY_JOIN_S)

    def __enter__(self) -> Self:
        return self.start() if self.proc is None else self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def stop_all(procs: Sequence[UrlProcess], timeout_s: float) -> None:
    """Stop several `UrlProcess`es at once (`stop_processes`: they share `timeout_s`)."""
    stop_processes([(p.name, p.proc) for p in procs if p.proc is not None], timeout_s)
    for p in procs:
        p._join_relay()


class ServeProcess(UrlProcess):
    """One `kvloop serve ARGS` child process (on an ephemeral port unless ARGS name one:
    `kvloop serve` alone listens on 8000)."""

    def __init__(self, args: list[str], log_path: str | Path, env: dict[str, str] | None = None,
                 new_session: bool = False):
        port = [] if "--port" in args else ["--port", "0"]
        super().__init__(kvloop_command("serve", *args, *port), log_path, SERVE_URL_LINE, env,
                         new_session)

    # --- looking inside a running server ------------------------------------------------------
    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of Prometheus metric `name` whose labels include `labels`."""
        return metric_value(httpx.get(self.url + "/metrics").text, name, **labels)

    def engine_stats(self) -> dict[str, Any]:
        """The engine's block and queue counts (GET /kvloop/stats)."""
        return httpx.get(self.url + "/kvloop/stats").json()  # type: ignore[no-any-return]

    def wait_idle(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """Engine stats once no request is left and every block is back in the free pool
        (or the last stats seen when `timeout_s` runs out)."""
        deadline = time.monotonic() + timeout_s
        while True:
            s = self.engine_stats()
            if (s["num_requests"] == 0 and s["num_free_blocks"] == s["num_total_blocks"]
                    or time.monotonic() > deadline):
                return s
            time.sleep(0.05)
