"""`kvloop fleet --ray ADDRESS`: the fleet's router and workers as Ray actors.

    1. connect to the Ray cluster at ADDRESS (`auto`: the one running on this host) as a
       driver, in the Ray namespace `kvloop`; if a fleet already runs there (its control
       actor, named `fleet`, answers), tell it the new number of workers and wait until it
       has that many (scale up or down, with drain) instead of starting another;
    2. start the control actor, the router's actor (pinned to this host's node: the router
       listens on --host/--port here, as `kvloop fleet` does) and one actor per worker
       (Ray's SPREAD scheduling places them across the nodes, each reserving
       `worker_cpus` CPUs);
    3. each actor runs the real process (`RouterHost`: the router, `WorkerHost`: `kvloop
       serve` on its node's IP address) and watches it: when it ends unasked (a crash, a
       kill -9) the actor exits with it, and Ray restarts the actor (its `max_restarts`:
       --max-worker-restarts), which starts the process again (on a port of its own);
    4. the router finds the workers as `kvloop router --discovery-file` does: this driver
       asks every worker actor for its URL every `TICK_S` and hands the list to the router's
       actor, which writes the file its router watches; a restarted worker's new URL
       replaces its old one there, and the router admits it;
    5. scale-down drains: the last worker's process gets SIGTERM with --shutdown-timeout
       (`drain_timeout_s`: it refuses new requests, finishes those it holds), then its actor
       is killed for good and its URL leaves the router's file;
    6. one Ctrl-C or SIGTERM stops the workers, then the router, kills every actor and
       disconnects.

The fleet secret and the worker key never go on a command line nor into an environment that
Ray shows: they travel inside the actors' constructor arguments (Ray's own channels in the
cluster), then into each `kvloop serve`'s environment (as `kvloop fleet` hands them over),
and to the router on its standard input (its whole `RouterConfig`, pickled).

`ray` is imported only here, only when --ray is given (`pip install kvloop[ray]`).

Owner: `RayFleet` (the driver) owns the actors and the worker list; `RouterHost` owns its
discovery file; each host actor owns its one process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from kvloop.front.launcher import (
    ROUTER_URL_LINE,
    SERVE_URL_LINE,
    TAIL_LINES,
    UrlProcess,
    kvloop_command,
)
from kvloop.front.sockets import ROUTER_ANNOUNCEMENT
from kvloop.router.fleet import FleetConfig, exit_text

if TYPE_CHECKING:
    from kvloop.router.config import RouterConfig

NAMESPACE = "kvloop"          # the Ray namespace of a fleet's actors
CONTROL_NAME = "fleet"        # the control actor's name in it (one fleet per namespace)
TICK_S = 0.5                  # how often the driver looks at its actors
CONNECT_TIMEOUT_S = 10.0      # the head's address must answer a TCP connect within this
CALL_TIMEOUT_S = 30.0         # a short actor call (stop, set_workers) answers within this
EXIT_CODE_DIED = 1            # an actor whose process ended unasked exits with this


@dataclass(frozen=True)
class RayFleetConfig:
    """Where and how the fleet runs on Ray: `address` (`auto`, or the head's HOST:PORT),
    the CPUs each worker actor reserves, the drain granted to a worker on scale-down, and
    how long a scaling `kvloop fleet --ray` waits for the running fleet to reach its size."""

    address: str
    worker_cpus: float = 1.0
    drain_timeout_s: float = 30.0
    scale_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.address:
            raise ValueError("--ray needs an address: auto, or the head's HOST:PORT")
        if self.worker_cpus < 0:
            raise ValueError(f"--ray-worker-cpus must be >= 0, got {self.worker_cpus:g}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"the drain timeout must be >= 0, got {self.drain_timeout_s:g}")


def check_supported(fleet: FleetConfig) -> None:
    """What --ray does not run yet (ValueError saying so)."""
    if fleet.num_prefill or fleet.num_decode:
        raise ValueError("--ray runs --workers of --roles; --prefill and --decode are not "
                         "supported with it yet")
    if fleet.nats_port is not None:
        raise ValueError("--ray with --event-plane nats: give a running nats-server "
                         "(--event-plane nats://HOST:PORT) that every node reaches")


def start_error(text: str) -> str:
    """A process's start failure in one line: `UrlProcess`'s first line, without the log
    it quotes, and that log's last line (a parser's error, a traceback's exception)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return "did not start"
    head = lines[0].removesuffix("; last output:")
    return head if len(lines) == 1 else f"{head}: {lines[-1]}"


def worker_host(fleet_host: str, node_ip: str) -> str:
    """Where a worker listens: its node's IP address (as Ray knows it: the router, on
    another node maybe, reaches it there), or the loopback address when the fleet's --host
    is one (a one-node cluster whose processes stay on the host)."""
    try:
        loopback = ipaddress.ip_address(fleet_host).is_loopback
    except ValueError:   # a host name
        loopback = fleet_host == "localhost"
    return fleet_host if loopback else node_ip


# --- the actors (plain classes: `ray.remote` wraps them at run time) ------------------------


def _scratch_root() -> str | None:
    """Where an actor keeps its process's log (and the router's file): under the Ray
    session's folder on its node, which Ray's own clean-up covers, so an actor killed
    without a word leaves nothing elsewhere (None: the system's temporary folder)."""
    try:
        from ray._private.worker import global_worker

        node: Any = global_worker.node
        path = Path(node.get_session_dir_path()) / "kvloop"
        path.mkdir(exist_ok=True)
        return str(path)
    except Exception:   # a private Ray API: only a nicer place, never a reason to fail
        return None


class _ProcessHost:
    """One child process, started and watched by a thread of this actor's (Linux's death
    signal follows the thread that started a child: this one lives as long as the child).
    When the child ends unasked the actor process exits, and Ray restarts the actor."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.dir = Path(tempfile.mkdtemp(prefix="kvloop-", dir=_scratch_root()))
        self.proc: UrlProcess | None = None
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._failed: str | None = None

    def _run(self, make: Any, timeout_s: float) -> None:
        """Start `make()`'s process from the watching thread; return once it serves or
        failed to (`where()` then says why: a constructor that raised would fill the
        driver's output with Ray's tracebacks)."""
        threading.Thread(target=self._watch, args=(make, timeout_s), daemon=True,
                         name=f"kvloop ray {self.name}").start()
        if not self._ready.wait(timeout_s + 30.0):
            self._failed = f"{self.name} did not start in {timeout_s:g} s"

    def _watch(self, make: Any, timeout_s: float) -> None:
        try:
            self.proc = make()
            assert self.proc is not None
            self.proc.start(timeout_s)
        except Exception as e:   # said by `where()`
            self._failed = start_error(str(e))
            shutil.rmtree(self.dir, ignore_errors=True)
            self._ready.set()
            return
        self._ready.set()
        code = self.proc.proc.wait() if self.proc.proc is not None else None
        if self._stopping.is_set():
            return
        tail = "" if self.proc.echo is not None else "; its last output:\n    " + \
            "\n    ".join(self.proc.log().splitlines()[-TAIL_LINES:])
        print(f"kvloop fleet: {self.name} (pid {self.proc.pid}) ended, {exit_text(code)}; "
              f"its actor exits for Ray to restart it{tail}", file=sys.stderr, flush=True)
        shutil.rmtree(self.dir, ignore_errors=True)
        os._exit(EXIT_CODE_DIED)

    def where(self) -> dict[str, Any]:
        """Its URL, its process id and the node it runs on; or {"error": why it did not
        start}."""
        import ray

        if self._failed is not None or self.proc is None:
            return {"error": self._failed or f"{self.name} did not start"}
        return {"url": self.proc.url, "pid": self.proc.pid,
                "node_ip": ray.util.get_node_ip_address()}

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM the process, SIGKILL it after `timeout_s`; its exit code (None: killed).
        The actor then stays up, idle, until it is killed."""
        self._stopping.set()
        code = self.proc.stop(timeout_s) if self.proc is not None else None
        shutil.rmtree(self.dir, ignore_errors=True)
        return code


class WorkerHost(_ProcessHost):
    """Worker `index` of a fleet: `kvloop serve` on this node's IP address (its flags:
    `FleetConfig.argv`, with --shutdown-timeout `drain_s` before the user's worker flags,
    which win); the fleet secret and the worker key reach it in its environment."""

    def __init__(self, fleet: FleetConfig, index: int, ray_cfg: RayFleetConfig) -> None:
        import ray

        super().__init__(f"worker {index}")
        host = worker_host(fleet.host, ray.util.get_node_ip_address())
        threads = ([] if fleet.model == "sim" or os.environ.get("OMP_NUM_THREADS")
                   else ["--num-threads", str(max(1, int(ray_cfg.worker_cpus)))])
        cfg = dataclasses.replace(
            fleet, host=host, worker_args=("--shutdown-timeout", f"{ray_cfg.drain_timeout_s:g}",
                                           *threads, *fleet.worker_args))

        def make() -> UrlProcess:
            return UrlProcess(cfg.argv(index), self.dir / "worker.log", SERVE_URL_LINE,
                              cfg.env(), name=self.name,
                              echo=f"[worker {index}] " if cfg.echo_output else None)

        self._run(make, fleet.start_timeout_s)


class RouterHost(_ProcessHost):
    """The fleet's router: `kvloop router` in a child process that reads its `RouterConfig`
    (the fleet secret and keys inside) from its standard input, with `--discovery-file` set
    to a file of this actor's that `set_workers` writes. Its output stays in its log (its
    own "kvloop router on" line must not reach the driver's output before the driver's),
    whose last lines are printed if it ends unasked."""

    def __init__(self, router_cfg: RouterConfig, log_level: str, timeout_s: float) -> None:
        super().__init__("router")
        self.file = self.dir / "workers.yaml"
        self.file.write_text("workers: []\n")
        self._written: list[dict[str, str]] = []
        cfg = dataclasses.replace(router_cfg, discovery_file=str(self.file))
        payload = pickle.dumps((cfg, log_level))

        def make() -> UrlProcess:
            return UrlProcess(kvloop_command(die_with_parent=True, module=__name__),
                              self.dir / "router.log", ROUTER_URL_LINE, name=self.name,
                              stdin=payload)

        self._run(make, timeout_s)

    def set_workers(self, workers: list[dict[str, str]]) -> bool:
        """Make the discovery file list `workers` (each {url, role}); True if it changed.
        Written whole to a temporary file, then renamed over it (the router never reads half
        a list)."""
        if workers == self._written:
            return False
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump({"workers": workers}))
        tmp.replace(self.file)
        self._written = list(workers)
        return True


class FleetControl:
    """The running fleet's desired and actual number of workers: `kvloop fleet --ray` run
    again on the cluster sets `wanted`; the driver reads it and reports back."""

    def __init__(self, wanted: int) -> None:
        self.wanted = wanted
        self.state: dict[str, Any] = {"workers": 0, "serving": 0, "draining": 0,
                                      "router": ""}

    def scale(self, n: int) -> None:
        self.wanted = n

    def get_wanted(self) -> int:
        return self.wanted

    def report(self, state: dict[str, Any]) -> None:
        self.state = state

    def get_state(self) -> dict[str, Any]:
        return {**self.state, "wanted": self.wanted}


def router_child() -> int:
    """The router actor's child: its config from standard input, then `run_router` with no
    fixed workers (the discovery file brings them)."""
    from kvloop.router.server import run_router

    cfg, log_level = pickle.loads(sys.stdin.buffer.read())
    try:
        return run_router(cfg, [], log_level)
    except OSError as e:   # the port taken meanwhile, the index or the plane out of reach
        print(f"kvloop router: {e}", file=sys.stderr, flush=True)
        return 2


# --- the driver ------------------------------------------------------------------------------


@dataclass
class _Worker:
    """One worker actor as the driver sees it (owned by `RayFleet`)."""

    index: int
    actor: Any
    url: str = ""
    pid: int = 0
    pending: Any = None          # the outstanding `where()` call
    drain: Any = None            # the outstanding `stop()` call of a scale-down


class RayFleet:
    """The driver: starts the actors, keeps the router's worker list, scales, stops."""

    def __init__(self, fleet: FleetConfig, router_cfg: RouterConfig, ray_cfg: RayFleetConfig,
                 log_level: str) -> None:
        import ray

        self.ray = ray
        self.fleet, self.router_cfg, self.ray_cfg = fleet, router_cfg, ray_cfg
        self.log_level = log_level
        self.workers: list[_Worker] = []
        self.draining: list[_Worker] = []
        self.router: Any = None
        self.router_url = ""
        self.control: Any = None
        self._next_index = 0
        self._wanted = fleet.num_workers
        self.lost = 0                # workers gone for good since `_wanted` was set
        self._router_pending: Any = None

    # -- start ----------------------------------------------------------------------------
    def start(self) -> str:
        """Start the control actor, the router, the workers; wait until each serves; the
        router's URL."""
        ray = self.ray
        self.control = ray.remote(FleetControl).options(
            name=CONTROL_NAME, namespace=NAMESPACE, num_cpus=0,
            max_concurrency=4).remote(self.fleet.num_workers)
        here = ray.get_runtime_context().get_node_id()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.router = ray.remote(RouterHost).options(
            num_cpus=0, max_restarts=-1, max_task_retries=-1, max_concurrency=4,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
        ).remote(self.router_cfg, self.log_level, self.fleet.start_timeout_s)
        for _ in range(self.fleet.num_workers):
            self._add_worker()
        deadline = time.monotonic() + self.fleet.start_timeout_s + 60.0
        self.router_url = _served(ray.get(self.router.where.remote(),
                                          timeout=self._left(deadline)))["url"]
        for w in self.workers:
            self._note(w, _served(ray.get(w.pending, timeout=self._left(deadline))))
            w.pending = None
        self._push()
        self._report()
        return self.router_url

    @staticmethod
    def _left(deadline: float) -> float:
        return max(1.0, deadline - time.monotonic())

    def _add_worker(self) -> None:
        i = self._next_index
        self._next_index += 1
        actor: Any = self.ray.remote(WorkerHost).options(
            num_cpus=self.ray_cfg.worker_cpus, max_restarts=self._max_restarts(),
            max_task_retries=-1, max_concurrency=4, scheduling_strategy="SPREAD",
        ).remote(self.fleet, i, self.ray_cfg)
        w = _Worker(i, actor)
        w.pending = actor.where.remote()
        self.workers.append(w)

    def _max_restarts(self) -> int:
        return self.fleet.restart.max_restarts if self.fleet.restart is not None else 0

    def _note(self, w: _Worker, where: dict[str, Any]) -> None:
        if where["url"] != w.url or where["pid"] != w.pid:
            again = " again" if w.url else ""
            print(f"kvloop fleet: worker {w.index} serving{again} on {where['url']} "
                  f"(pid {where['pid']}, node {where['node_ip']})", flush=True)
        w.url, w.pid = where["url"], where["pid"]

    # -- the loop ---------------------------------------------------------------------------
    def tick(self) -> None:
        """Look at every actor once: new URLs, ended drains, the wanted size, the router."""
        self._poll_workers()
        self._poll_drains()
        self._scale(self.ray.get(self.control.get_wanted.remote(), timeout=CALL_TIMEOUT_S))
        self._poll_router()
        self._push()
        self._report()

    def _poll_workers(self) -> None:
        for w in list(self.workers):
            if w.pending is None:
                w.pending = w.actor.where.remote()
            ready, _ = self.ray.wait([w.pending], timeout=0)
            if not ready:
                continue
            ref, w.pending = w.pending, None
            try:
                self._note(w, _served(self.ray.get(ref)))
            except self.ray.exceptions.ActorUnavailableError:
                continue   # restarting, or out of reach for a moment: asked again
            except self.ray.exceptions.RayActorError as e:
                self._lose(w, f"Ray restarts it no more (--max-worker-restarts "
                              f"{self._max_restarts()}): {_first_line(e)}")
            except RuntimeError as e:   # restarted, it did not start
                self._lose(w, str(e))

    def _lose(self, w: _Worker, why: str) -> None:
        print(f"kvloop fleet: worker {w.index} is gone for good: {why}", file=sys.stderr,
              flush=True)
        self.ray.kill(w.actor, no_restart=True)
        self.workers.remove(w)
        self.lost += 1

    def _poll_router(self) -> None:
        if self._router_pending is None:
            self._router_pending = self.router.where.remote()
        ready, _ = self.ray.wait([self._router_pending], timeout=0)
        if ready:
            ref, self._router_pending = self._router_pending, None
            url = _served(self.ray.get(ref))["url"]
            if url != self.router_url:
                print(f"kvloop fleet: router restarted; "
                      f"{ROUTER_ANNOUNCEMENT.format(url=url)}", flush=True)
            self.router_url = url

    def _scale(self, wanted: int) -> None:
        """Start or drain workers to reach `wanted` less those lost for good since it was
        last set (a worker whose restarts are spent is not replaced by a new one until the
        fleet is scaled again)."""
        if wanted != self._wanted:
            self._wanted, self.lost = wanted, 0
        wanted = max(0, wanted - self.lost)
        while len(self.workers) < wanted:
            self._add_worker()
            print(f"kvloop fleet: scaling up: worker {self.workers[-1].index} starting",
                  flush=True)
        while len(self.workers) > wanted:
            w = self.workers.pop()
            print(f"kvloop fleet: scaling down: draining worker {w.index} ({w.url}, up to "
                  f"{self.ray_cfg.drain_timeout_s:g} s)", flush=True)
            w.drain = w.actor.stop.remote(self.ray_cfg.drain_timeout_s + 5.0)
            self.draining.append(w)

    def _poll_drains(self) -> None:
        for w in list(self.draining):
            ready, _ = self.ray.wait([w.drain], timeout=0)
            if not ready:
                continue
            try:
                code = self.ray.get(w.drain)
                how = exit_text(code) if code is not None else "killed after the drain timeout"
            except self.ray.exceptions.RayActorError as e:
                how = f"its actor died: {_first_line(e)}"
            self.ray.kill(w.actor, no_restart=True)
            self.draining.remove(w)
            print(f"kvloop fleet: worker {w.index} drained and removed ({how})", flush=True)

    def _push(self) -> None:
        """The router's file: every worker with a URL, the draining ones too (a draining
        worker says so itself; the router sends it nothing new and lets it finish)."""
        listed = [{"url": w.url, "role": self.fleet.role_of(w.index)}
                  for w in self.workers + self.draining if w.url]
        with contextlib.suppress(self.ray.exceptions.GetTimeoutError,
                                 self.ray.exceptions.RayActorError):
            self.ray.get(self.router.set_workers.remote(listed), timeout=CALL_TIMEOUT_S)

    def _report(self) -> None:
        self.control.report.remote({"workers": len(self.workers),
                                    "serving": sum(1 for w in self.workers if w.url),
                                    "draining": len(self.draining),
                                    "router": self.router_url})

    # -- stop -------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop every worker (SIGTERM, their drain), then the router; kill every actor."""
        ray = self.ray
        everyone = self.workers + self.draining
        refs = [w.actor.stop.remote(self.fleet.stop_timeout_s) for w in everyone]
        wait_s = self.fleet.stop_timeout_s + CALL_TIMEOUT_S
        # an actor that cannot answer (dead, restarting, its node gone) is killed below
        with contextlib.suppress(Exception):
            ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        if self.router is not None:
            with contextlib.suppress(Exception):
                ray.wait([self.router.stop.remote(self.fleet.stop_timeout_s)], timeout=wait_s)
        for actor in [w.actor for w in everyone] + [self.router, self.control]:
            if actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)


def _served(where: dict[str, Any]) -> dict[str, Any]:
    """A host actor's `where()`, or RuntimeError saying why its process did not start."""
    if "error" in where:
        raise RuntimeError(where["error"])
    return where


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# --- the command -----------------------------------------------------------------------------


def _connect(ray: Any, address: str | None) -> None:
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=True,
             logging_level="WARNING", configure_logging=True)


def _reachable(address: str) -> None:
    """OSError unless something listens at the head's HOST:PORT (Ray itself would retry a
    dead address for minutes); `auto` is Ray's to find."""
    if address == "auto":
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError("give auto or the head's HOST:PORT")
    with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S):
        pass


def _port_free(router_cfg: RouterConfig) -> bool:
    """The router's port, checked here before anything starts (its actor runs on this node):
    a port in use is the line every kvloop front says (`BindError`)."""
    from kvloop.front.sockets import BindError, bind_tcp

    if router_cfg.port == 0:
        return True
    try:
        bind_tcp(router_cfg.host, router_cfg.port).close()
    except BindError as e:
        print(f"kvloop fleet: {e}", file=sys.stderr, flush=True)
        return False
    return True


def _running_control(ray: Any) -> Any:
    """The control actor of a fleet already running in the namespace, or None."""
    try:
        return ray.get_actor(CONTROL_NAME, namespace=NAMESPACE)
    except ValueError:
        return None


def scale_running(ray: Any, control: Any, n: int, timeout_s: float) -> int:
    """Set a running fleet's worker count to `n` and wait until it has them, each serving,
    none draining; exit code."""
    state = ray.get(control.get_state.remote(), timeout=CALL_TIMEOUT_S)
    print(f"kvloop fleet: a fleet runs on this cluster (router {state['router']}); scaling "
          f"its workers from {state['workers']} to {n}", flush=True)
    ray.get(control.scale.remote(n), timeout=CALL_TIMEOUT_S)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = ray.get(control.get_state.remote(), timeout=CALL_TIMEOUT_S)
        if (state["workers"] == state["serving"] == state["wanted"] == n
                and state["draining"] == 0):
            print(f"kvloop fleet: the fleet has {n} worker{'s' if n != 1 else ''}, each "
                  "serving", flush=True)
            return 0
        time.sleep(TICK_S)
    print(f"kvloop fleet: the fleet did not reach {n} workers in {timeout_s:g} s (now "
          f"{state['workers']}, {state['draining']} draining)", file=sys.stderr, flush=True)
    return 1


class _Stop(Exception):
    """SIGTERM or SIGINT arrived."""


def _raise_stop(signum: int, frame: Any) -> None:
    raise _Stop(signal.Signals(signum).name)


def run_ray_fleet(fleet: FleetConfig, router_cfg: RouterConfig, ray_cfg: RayFleetConfig,
                  log_level: str) -> int:
    """`kvloop fleet --ray`: scale the fleet running on the cluster, or start one and run it
    until a signal; the exit code."""
    try:
        import ray
    except ModuleNotFoundError:
        print("kvloop fleet: --ray needs Ray: pip install 'kvloop[ray]'", file=sys.stderr)
        return 2
    check_supported(fleet)
    if not _port_free(router_cfg):
        return 2
    try:
        _reachable(ray_cfg.address)
        _connect(ray, None if ray_cfg.address == "auto" else ray_cfg.address)
    except (ConnectionError, RuntimeError, ValueError, OSError) as e:
        print(f"kvloop fleet: cannot connect to Ray at {ray_cfg.address}: {_first_line(e)} "
              "(is a cluster running there? `ray start --head` starts one)", file=sys.stderr)
        return 2
    control = None
    try:
        control = _running_control(ray)
        if control is not None:
            return scale_running(ray, control, fleet.num_workers, ray_cfg.scale_timeout_s)
        return _serve(RayFleet(fleet, router_cfg, ray_cfg, log_level))
    finally:
        ray.shutdown()   # after it, no actor's output is relayed: "stopped" is the last line
        if control is None:
            print("kvloop fleet: stopped", flush=True)


def _serve(rf: RayFleet) -> int:
    old = {s: signal.signal(s, _raise_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    code = 0
    try:
        print(f"kvloop fleet: starting {rf.fleet.num_workers} workers on Ray "
              f"({rf.ray_cfg.address}, model {rf.fleet.model})", flush=True)
        url = rf.start()
        print(ROUTER_ANNOUNCEMENT.format(url=url), flush=True)
        while True:
            time.sleep(TICK_S)
            rf.tick()
    except _Stop as e:
        print(f"kvloop fleet: {e}; stopping", flush=True)
    except (RuntimeError, rf.ray.exceptions.RayError) as e:
        print(f"kvloop fleet: {_first_line(e)}", file=sys.stderr, flush=True)
        code = 1
    finally:
        for s in old:
            signal.signal(s, signal.SIG_IGN)
        rf.stop()
        for s, h in old.items():
            signal.signal(s, h)
    return code


if __name__ == "__main__":
    sys.exit(router_child())
