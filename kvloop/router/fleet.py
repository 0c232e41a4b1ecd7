"""`kvloop fleet`: N `kvloop serve` workers and one router on this host.

    1. start every worker at once: `kvloop serve --model M --port 0 --kv-events-endpoint
       tcp://HOST:0 --kv-events-replay-endpoint tcp://HOST:0 --role R [WORKER FLAGS]`
       (flags after `--` come last, so they override these);
    2. read each worker's "kvloop serving on URL" line (its other output is relayed,
       prefixed with the worker's number);
    3. run the router in this process with those workers, print where everything listens;
    4. one Ctrl-C or SIGTERM stops the router, then every worker (SIGTERM, then SIGKILL
       after a grace period). Workers are also told to die with this process on Linux.

Owner: `Fleet` owns the worker processes; the router owns nothing of theirs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from types import FrameType

from kvloop.config import ROLES
from kvloop.router.config import RouterConfig
from kvloop.router.registry import WorkerSpec
from kvloop.server.auth import API_KEY_ENV

log = logging.getLogger("kvloop.router")

_READY = re.compile(r"kvloop serving on (http://\S+)")
# Runs `python -m kvloop ...` after asking Linux to SIGTERM this child when its parent dies.
_BOOTSTRAP = ("import ctypes, runpy, signal, sys\n"
              "try:\n"
              "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
              "except (OSError, AttributeError):\n"
              "    pass\n"
              "sys.argv = ['kvloop'] + sys.argv[1:]\n"
              "runpy.run_module('kvloop', run_name='__main__', alter_sys=True)\n")


@dataclass(frozen=True)
class FleetConfig:
    """The workers of a fleet. `roles` are cycled over the workers. With `worker_api_key`,
    every worker requires that key: it is handed to them as $VLLM_API_KEY (not on their
    command lines), and the router presents it (its `worker_api_key`)."""

    num_workers: int
    model: str = "sim"
    roles: tuple[str, ...] = ("both",)
    worker_args: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    start_timeout_s: float = 300.0
    stop_timeout_s: float = 10.0
    echo_output: bool = True
    worker_api_key: str | None = None

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.num_workers}")
        if not self.roles or any(r not in ROLES for r in self.roles):
            raise ValueError(f"roles must be chosen from {ROLES}, got {self.roles}")

    def role_of(self, i: int) -> str:
        return self.roles[i % len(self.roles)]

    def threads_per_worker(self) -> int | None:
        """Real models share this host's cores: each worker gets its slice (at least 1),
        unless the user set OMP_NUM_THREADS. Torch threads beyond a worker's share wait on
        each other's descheduled threads (measured: 4x slower steps; docs/serving.md)."""
        if self.model == "sim" or os.environ.get("OMP_NUM_THREADS"):
            return None
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else (os.cpu_count() or 1)
        return max(1, cores // self.num_workers)

    def env(self) -> dict[str, str] | None:
        """The workers' environment (None: this process's)."""
        if self.worker_api_key is None:
            return None
        return {**os.environ, API_KEY_ENV: self.worker_api_key}

    def argv(self, i: int) -> list[str]:
        h = self.host
        threads = self.threads_per_worker()
        return [sys.executable, "-c", _BOOTSTRAP, "serve", "--model", self.model,
                "--host", h, "--port", "0", "--kv-events-endpoint", f"tcp://{h}:0",
                "--kv-events-replay-endpoint", f"tcp://{h}:0", "--role", self.role_of(i),
                *(["--num-threads", str(threads)] if threads else []), *self.worker_args]


class WorkerProcess:
    """One `kvloop serve` child: started, watched for its URL, stopped."""

    def __init__(self, index: int, argv: list[str], role: str, echo: bool = True,
                 env: dict[str, str] | None = None):
        self.index = index
        self.argv = argv
        self.role = role
        self.echo = echo
        self.env = env
        self.url: str | None = None
        self.proc: subprocess.Popen[str] | None = None
        self.tail: deque[str] = deque(maxlen=40)
        self._ready = threading.Event()
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     env=self.env)
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name=f"kvloop-fleet-w{self.index}")
        self._reader.start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.tail.append(line)
            if self.url is None:
                m = _READY.search(line)
                if m:
                    self.url = m.group(1)
                    self._ready.set()
            if self.echo:
                print(f"[worker {self.index}] {line}", flush=True)
        self._ready.set()  # exited: wake the waiter

    def wait_ready(self, timeout: float) -> str:
        """The worker's URL; raises RuntimeError if it exits or times out first."""
        self._ready.wait(timeout)
        if self.url is None:
            code = self.proc.poll() if self.proc else None
            why = f"exited with code {code}" if code is not None else f"timed out ({timeout}s)"
            last = "\n    ".join(list(self.tail)[-15:])
            raise RuntimeError(f"worker {self.index} {why} before serving; last output:\n"
                               f"    {last}")
        return self.url

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.terminate()

    def wait_or_kill(self, deadline: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("worker %d did not stop in time: killing it", self.index)
            self.proc.kill()
            return self.proc.wait()


class Fleet:
    """N worker processes of one `FleetConfig`."""

    def __init__(self, config: FleetConfig):
        self.config = config
        self.workers = [WorkerProcess(i, config.argv(i), config.role_of(i), config.echo_output,
                                      config.env())
                        for i in range(config.num_workers)]

    def start(self) -> list[WorkerSpec]:
        """Start every worker and wait until all serve; on any failure stop them all."""
        try:
            for w in self.workers:
                w.start()
            deadline = time.monotonic() + self.config.start_timeout_s
            for w in self.workers:
                w.wait_ready(max(0.1, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        return self.specs()

    def specs(self) -> list[WorkerSpec]:
        return [WorkerSpec(w.url, w.role) for w in self.workers if w.url is not None]

    def stop(self) -> None:
        """SIGTERM every worker, then SIGKILL the ones still alive after the grace period."""
        for w in self.workers:
            w.terminate()
        deadline = time.monotonic() + self.config.stop_timeout_s
        for w in self.workers:
            w.wait_or_kill(deadline)


class _Stop(Exception):
    """A signal arrived while the workers were starting."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


def _ignore(signum: int, frame: FrameType | None) -> None:
    """After the router started, uvicorn handles signals; its re-raise is ignored."""


def run_fleet(fleet_cfg: FleetConfig, router_cfg: RouterConfig, log_level: str) -> int:
    """Start the workers, serve the router until a signal, stop everything; exit code."""
    from kvloop.router.server import RouterServer, announce

    fleet = Fleet(fleet_cfg)
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    try:
        print(f"kvloop fleet: starting {fleet_cfg.num_workers} workers "
              f"(model {fleet_cfg.model})", flush=True)
        specs = fleet.start()
        server = RouterServer(router_cfg, specs, log_level=log_level)
        signal.signal(signal.SIGTERM, _ignore)
        signal.signal(signal.SIGINT, _ignore)
        asyncio.run(server.serve(announce))
    except _Stop as e:
        print(f"kvloop fleet: {e} while starting; stopping", flush=True)
    except RuntimeError as e:
        print(f"kvloop fleet: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, _ignore)
        signal.signal(signal.SIGINT, _ignore)
        fleet.stop()
        print("kvloop fleet: stopped", flush=True)
    return 0
