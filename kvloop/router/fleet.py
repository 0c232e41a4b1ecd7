"""`kvloop fleet`: N `kvloop serve` workers and one router on this host.

    1. start every worker at once: `kvloop serve --model M --port 0 --kv-events-endpoint
       tcp://HOST:0 --kv-events-replay-endpoint tcp://HOST:0 --role R [WORKER FLAGS]`
       (flags after `--` come last, so they override these); a prefill worker (`--prefill
       N`) also gets `--kv-transfer-config` with a kv_producer KvloopConnector, a decode
       worker (`--decode M`) one with a kv_consumer, so a P/D fleet runs with one command;
    2. read each worker's "kvloop serving on URL" line from its log (`kvloop.front.launcher`
       starts, watches and stops them; their other output is relayed, prefixed with the
       worker's number);
    3. run the router in this process with those workers, print where everything listens;
    4. while it runs, a worker whose process ends (a crash, a kill -9) is started again
       (`RestartPolicy`: same arguments, on the port it had, after a backoff that doubles
       per consecutive restart, at most `max_restarts` in a row; each exit is printed with
       its code). The router's poller marks it down meanwhile and up once it answers;
    5. one Ctrl-C or SIGTERM stops the router, then every worker (SIGTERM, then SIGKILL
       after a grace period). Workers are also told to die with this process on Linux.

With `--event-plane nats` (a local nats-server, started first on `nats_port` and stopped
last) or `--event-plane nats://HOST:PORT` (a running one), the workers publish their KV
events there (`--event-plane URL` instead of the ZMQ endpoints) and the router reads them
from it. The local nats-server refuses anonymous clients: it gets a generated user and
password in a config file only this user can read.

Secrets never go on a command line (`ps` shows every process's): the worker key, the fleet
secret and the NATS credentials reach the workers in their environment (`FleetConfig.env`);
an --event-plane URL carrying credentials is refused.

Owner: `Fleet` owns the worker processes; the router owns nothing of theirs.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from kvloop.config import KV_ROLE_OF, ROLES, Role
from kvloop.events.cli_args import nats_credential_env, nats_tls_args
from kvloop.events.config import NatsPlaneConfig, redact_url
from kvloop.front.auth import API_KEY_ENV
from kvloop.front.launcher import SERVE_URL_LINE, UrlProcess, kvloop_command, stop_all
from kvloop.router.config import RestartPolicy, RouterConfig
from kvloop.router.registry import WorkerSpec
from kvloop.trust import FleetSecret, secret_env

if TYPE_CHECKING:
    from kvloop.router.services import LocalService


WATCH_S = 0.2   # how often the fleet looks for ended workers


@dataclass
class _Restarts:
    """One worker's restart state (owned by `Fleet`, under its lock)."""

    port: int
    in_a_row: int = 0
    due: float | None = None      # when the next start is due (None: none pending)
    started: float = 0.0          # when the current process was started
    serving: bool = True          # the current process announced its URL
    gave_up: bool = False


def exit_text(code: int | None) -> str:
    """A process's exit status in words (a negative code: the signal that ended it)."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            pass
    return f"exit code {code}"


@dataclass(frozen=True)
class FleetConfig:
    """The workers of a fleet: `num_workers` with `roles` cycled over them, then
    `num_prefill` prefill and `num_decode` decode workers, each of those with a KvloopConnector
    (`kv_connector_extra_config`: the JSON object of its extra config, None: `{}`). With
    `worker_api_key`, every worker requires that key: it is handed to them as $VLLM_API_KEY
    (not on their command lines), and the router presents it (its `worker_api_key`).
    `fleet_secret` goes to every worker as $KVLOOP_FLEET_SECRET (kvloop/trust.py).
    `log_dir` keeps the workers' logs (`workerI.log`, a restarted one's `workerI.N.log`;
    None: a temporary folder, removed when they stop). `restart`: see `RestartPolicy`."""

    num_workers: int
    model: str = "sim"
    roles: tuple[Role, ...] = ("both",)
    worker_args: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    start_timeout_s: float = 300.0
    stop_timeout_s: float = 10.0
    echo_output: bool = True
    worker_api_key: str | None = None
    log_dir: str | None = None
    event_plane: NatsPlaneConfig | None = None
    nats_port: int | None = None       # start a nats-server on host:nats_port first
    num_prefill: int = 0
    num_decode: int = 0
    kv_connector_extra_config: str | None = None
    fleet_secret: FleetSecret | None = None
    restart: RestartPolicy | None = None   # None: a worker that ends stays dead

    def __post_init__(self) -> None:
        for flag, n in (("--workers", self.num_workers), ("--prefill", self.num_prefill),
                        ("--decode", self.num_decode)):
            if n < 0:
                raise ValueError(f"{flag} must be >= 0, got {n}")
        if self.total < 1:
            raise ValueError("a fleet needs at least one worker (--workers, --prefill or "
                             "--decode)")
        if not self.roles or any(r not in ROLES for r in self.roles):
            raise ValueError(f"roles must be chosen from {ROLES}, got {self.roles}")
        plane = self.event_plane
        if plane is not None and redact_url(plane.url) != plane.url:
            raise ValueError("give the fleet's NATS credentials in $KVLOOP_NATS_USER and "
                             "$KVLOOP_NATS_PASSWORD or $KVLOOP_NATS_TOKEN, not in the "
                             "--event-plane URL: its workers' command lines would show it")
        if self.kv_connector_extra_config is not None:
            try:
                extra = json.loads(self.kv_connector_extra_config)
            except ValueError as e:
                raise ValueError(f"--kv-connector-extra-config is not JSON: {e}") from None
            if not isinstance(extra, dict):
                raise ValueError("--kv-connector-extra-config must be a JSON object")

    @property
    def total(self) -> int:
        return self.num_workers + self.num_prefill + self.num_decode

    def role_of(self, i: int) -> Role:
        if i < self.num_workers:
            return self.roles[i % len(self.roles)]
        return "prefill" if i < self.num_workers + self.num_prefill else "decode"

    def kv_transfer_config(self, i: int) -> str | None:
        """Worker `i`'s --kv-transfer-config (None: it is no P/D worker)."""
        if i < self.num_workers:
            return None
        extra = json.loads(self.kv_connector_extra_config or "{}")
        return json.dumps({"kv_connector": "KvloopConnector",
                           "kv_role": KV_ROLE_OF[self.role_of(i)],
                           "kv_connector_extra_config": extra})

    def threads_per_worker(self) -> int | None:
        """Real models share this host's cores: each worker gets its slice (at least 1),
        unless the user set OMP_NUM_THREADS. Torch threads beyond a worker's share wait on
        each other's descheduled threads (measured: 4x slower steps; docs/serving.md)."""
        if self.model == "sim" or os.environ.get("OMP_NUM_THREADS"):
            return None
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else (os.cpu_count() or 1)
        return max(1, cores // self.total)

    def env(self) -> dict[str, str] | None:
        """What the workers' environment adds to this process's (None: nothing): the worker
        key and the fleet secret, which never go on a command line."""
        env = secret_env(self.fleet_secret)
        if self.worker_api_key is not None:
            env[API_KEY_ENV] = self.worker_api_key
        if self.event_plane is not None:
            env.update(nats_credential_env(self.event_plane))
        return env or None

    def argv(self, i: int) -> list[str]:
        h = self.host
        threads = self.threads_per_worker()
        kv = self.kv_transfer_config(i)
        return kvloop_command(
            "serve", "--model", self.model, "--host", h, "--port", "0", *self.events_args(),
            "--role", self.role_of(i), *(["--num-threads", str(threads)] if threads else []),
            *(["--kv-transfer-config", kv] if kv else []),
            *self.worker_args, die_with_parent=True)

    def events_args(self) -> list[str]:
        """Where the workers publish their KV events: ZMQ on ephemeral ports (CURVE-keyed by
        the fleet secret when there is one), or the plane."""
        plane = self.event_plane
        if plane is None:
            h = self.host
            curve = ["--kv-events-curve"] if self.fleet_secret is not None else []
            return ["--kv-events-endpoint", f"tcp://{h}:0",
                    "--kv-events-replay-endpoint", f"tcp://{h}:0", *curve]
        return ["--event-plane", plane.url, "--dyn-namespace", plane.namespace,
                "--event-plane-format", plane.payload_format, *nats_tls_args(plane)]


class Fleet:
    """N worker processes of one `FleetConfig` (`kvloop.front.launcher.UrlProcess`es; their
    logs in `config.log_dir`, else in a temporary folder removed by `stop()`). With
    `config.restart`, a thread started by `start()` restarts the ones that end (`workers[i]`
    is then the new process; read it under `lock`)."""

    def __init__(self, config: FleetConfig):
        self.config = config
        self._own_dir = config.log_dir is None
        self.log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="kvloop-fleet-"))
        self.workers = [self.worker(i) for i in range(config.total)]
        self.nats: LocalService | None = None
        self.lock = threading.Lock()
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._restarts: list[_Restarts] = []

    def worker(self, i: int, *extra_args: str, log_name: str | None = None) -> UrlProcess:
        """Worker `i`'s process, not started (`extra_args` come after the fleet's)."""
        cfg = self.config
        return UrlProcess(cfg.argv(i) + list(extra_args),
                          self.log_dir / (log_name or f"worker{i}.log"),
                          SERVE_URL_LINE, cfg.env(), name=f"worker {i}",
                          echo=f"[worker {i}] " if cfg.echo_output else None)

    def start(self) -> list[WorkerSpec]:
        """Start every worker and wait until all serve; on any failure stop them all."""
        try:
            self._start_nats()
            for w in self.workers:
                w.launch()
            deadline = time.monotonic() + self.config.start_timeout_s
            for w in self.workers:
                w.wait_url(max(0.1, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        if self.config.restart is not None:
            now = time.monotonic()
            self._restarts = [_Restarts(port=urlsplit(w.url).port or 0, started=now)
                              for w in self.workers]
            # prctl's death signal follows the thread that started a worker: this one lives
            # as long as the fleet does
            self._watcher = threading.Thread(target=self._watch, daemon=True,
                                             name="kvloop fleet restarts")
            self._watcher.start()
        return self.specs()

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_S):
            with self.lock:
                for i in range(len(self.workers)):
                    if not self._stopping.is_set():
                        self._tend(i, time.monotonic())

    def _tend(self, i: int, now: float) -> None:
        """Look after worker `i` once: restart it when due, note it serving again, or note
        that it ended and schedule its restart (or give up on it)."""
        policy, r, w = self.config.restart, self._restarts[i], self.workers[i]
        assert policy is not None and w.proc is not None
        if r.gave_up:
            return
        if r.due is not None:
            if now >= r.due:
                self._relaunch(i, now)
            return
        if w.alive():
            self._note_serving(i, w, r, now, policy)
            return
        code, pid = w.proc.returncode, w.pid
        if r.in_a_row >= policy.max_restarts:
            r.gave_up = True
            print(f"kvloop fleet: worker {i} (pid {pid}) ended, {exit_text(code)}; not "
                  f"restarted: --max-worker-restarts {policy.max_restarts} reached",
                  file=sys.stderr, flush=True)
            return
        delay = policy.delay_s(r.in_a_row)
        r.due = now + delay
        print(f"kvloop fleet: worker {i} (pid {pid}) ended, {exit_text(code)}; restart "
              f"{r.in_a_row + 1} of {policy.max_restarts} in {delay:g} s on port {r.port}",
              file=sys.stderr, flush=True)

    def _note_serving(self, i: int, w: UrlProcess, r: _Restarts, now: float,
                      policy: RestartPolicy) -> None:
        if not r.serving:
            if w.poll_url():
                r.serving = True
                print(f"kvloop fleet: worker {i} serving again on {w.url} (pid {w.pid})",
                      flush=True)
            elif now - r.started > self.config.start_timeout_s:
                print(f"kvloop fleet: worker {i} (pid {w.pid}) announced no URL in "
                      f"{self.config.start_timeout_s:g} s; killing it", file=sys.stderr,
                      flush=True)
                w.signal(signal.SIGKILL)
        elif r.in_a_row and now - r.started >= policy.reset_after_s:
            r.in_a_row = 0

    def _relaunch(self, i: int, now: float) -> None:
        r = self._restarts[i]
        r.in_a_row += 1
        r.due, r.serving, r.started = None, False, now
        w = self.worker(i, "--port", str(r.port), log_name=f"worker{i}.{r.in_a_row}.log")
        w.launch()
        self.workers[i] = w

    def _start_nats(self) -> None:
        cfg = self.config
        if cfg.nats_port is None:
            return
        from kvloop.router.services import local_nats

        plane = cfg.event_plane
        self.nats = local_nats(cfg.host, cfg.nats_port, self.log_dir / "nats.log",
                               user=plane.user if plane else None,
                               password=plane.password if plane else None,
                               token=plane.token if plane else None,
                               conf_path=self.log_dir / "nats.conf",
                               die_with_parent=True).start()
        print(f"kvloop fleet: nats-server on nats://{cfg.host}:{cfg.nats_port}", flush=True)

    def specs(self) -> list[WorkerSpec]:
        return [WorkerSpec(w.url, self.config.role_of(i))
                for i, w in enumerate(self.workers) if w.url]

    def stop(self) -> None:
        """Stop restarting; SIGTERM every worker, then SIGKILL the ones still alive after the
        grace period."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join()
        stop_all(self.workers, self.config.stop_timeout_s)
        if self.nats is not None:
            self.nats.stop()
        (self.log_dir / "nats.conf").unlink(missing_ok=True)
        if self._own_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)


class _Stop(Exception):
    """A signal arrived while the workers were starting."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


def _ignore(signum: int, frame: FrameType | None) -> None:
    """After the router started, uvicorn handles signals; its re-raise is ignored."""


def run_fleet(fleet_cfg: FleetConfig, router_cfg: RouterConfig, log_level: str) -> int:
    """Start the workers, serve the router until a signal, stop everything; exit code."""
    from kvloop.front.sockets import BindError, bind_tcp
    from kvloop.router.server import RouterServer, announce

    try:   # the router's port first: a port in use fails before any worker starts
        sock = bind_tcp(router_cfg.host, router_cfg.port)
    except BindError as e:
        print(f"kvloop fleet: {e}", file=sys.stderr, flush=True)
        return 2
    fleet = Fleet(fleet_cfg)
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    try:
        pd = (f", {fleet_cfg.num_prefill} prefill + {fleet_cfg.num_decode} decode"
              if fleet_cfg.num_prefill or fleet_cfg.num_decode else "")
        print(f"kvloop fleet: starting {fleet_cfg.total} workers{pd} "
              f"(model {fleet_cfg.model})", flush=True)
        specs = fleet.start()
        server = RouterServer(router_cfg, specs, log_level=log_level, sock=sock)
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
