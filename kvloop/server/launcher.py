"""Start and stop `kvloop serve` processes (for tests, benchmarks and fleets on one host).

    with ServeProcess(["--model", "sim", "--sim-speedup", "50"], log_path) as srv:
        httpx.get(srv.url + "/health")

The server gets `--port 0` (an ephemeral port) unless the arguments name one; its
"kvloop serving on URL" line is read from its log file (a file, not a pipe: a pipe nobody drains would block the server once full).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx

from kvloop.server.prometheus_text import metric_value

SERVE_URL_LINE = r"kvloop serving on (http://\S+)"


class UrlProcess:
    """A server child process whose log announces its URL (matched by `url_pattern`, group 1);
    `url` is known once `start()` returns. `new_session`: in its own session and process group
    (with its children), so `signal_group` reaches them all, as a terminal's Ctrl-C would."""

    def __init__(self, cmd: list[str], log_path: str | Path, url_pattern: str,
                 env: dict[str, str] | None = None, new_session: bool = False):
        self.cmd = list(cmd)
        self.log_path = Path(log_path)
        self.url_pattern = re.compile(url_pattern)
        self.env = env
        self.new_session = new_session
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self, timeout_s: float = 60.0) -> Self:
        """Launch and wait for the URL line; raises RuntimeError with the log on failure."""
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **(self.env or {})},
                                         start_new_session=self.new_session)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = self.url_pattern.search(self.log())
            if m:
                self.url = m.group(1)
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"{shlex.join(self.cmd[:4])} did not start; log:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

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
        """Exit code once the process ends; raises subprocess.TimeoutExpired."""
        assert self.proc is not None
        return self.proc.wait(timeout=timeout_s)

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM, wait, then SIGKILL if needed; returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.signal(signal.SIGTERM)
        try:
            return self.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Self:
        return self.start() if self.proc is None else self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class ServeProcess(UrlProcess):
    """One `kvloop serve ARGS` child process (on an ephemeral port unless ARGS name one:
    `kvloop serve` alone listens on 8000)."""

    def __init__(self, args: list[str], log_path: str | Path, env: dict[str, str] | None = None,
                 new_session: bool = False):
        port = [] if "--port" in args else ["--port", "0"]
        super().__init__([sys.executable, "-m", "kvloop", "serve", *args, *port], log_path,
                         SERVE_URL_LINE, env, new_session)

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
