"""kvloop against llama.cpp on the same GGUF: the engine alone, then the served workloads.

    python -m kvloop.bench.llamacpp build        # once: llama-server and llama-bench (~10 min)
    python -m kvloop.bench.llamacpp run [--quick] [--repeats 3] [--scale 1] [--json-out F]

`build` fetches the `llama-cpp-python` sdist with pip (the package registry is the one way to
llama.cpp's sources here), unpacks it and builds `llama-server` and `llama-bench` from its
vendored `vendor/llama.cpp` in `--build-dir` (default ~/.cache/kvloop/llama.cpp); it does
nothing when both binaries are there, and writes the llama.cpp commit it built to
`build-info.json` there. `run` builds first when needed, then:

1. the engine alone: `python -m kvloop.bench.offline --skip-hf` (prefill of one 512-token
   prompt, single-stream decode of 128 tokens) against `llama-bench` (pp512, tg128), the two
   alternating run by run;
2. serving: `kvloop serve` (its defaults) and `llama-server` (continuous batching, 32 slots)
   both up, then every case of `serving_cases` run as `kvloop bench` would run it against
   kvloop, then against llama-server, then kvloop again..., `--repeats` times, fresh prompts
   in every repetition (the same for both servers);
3. with `--contention`: random 256/128 at c=8 on each server, quiet and then with another
   process keeping one core busy (a Python spin loop), alternating, `--repeats` times; the
   share of its quiet throughput each server keeps (issue 15: kvloop's share must be at least
   llama-server's); requests of the busy runs time out after `--contention-timeout` s;
4. a markdown table of medians with the ratio kvloop / llama.cpp and the target of each
   figure, the machine's load average before every run, and (`--json-out`) all of it as JSON.

Both servers run in their own process groups and are stopped (SIGTERM, then SIGKILL) when
the run ends, fails or is interrupted. A benchmark script, not a test: it checks nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvloop.bench.cli_args import HelpFormatter

LLAMA_CPP_PYTHON = "0.3.36"   # the sdist whose vendored llama.cpp is built
DEFAULT_BUILD_DIR = "~/.cache/kvloop/llama.cpp"
BINARIES = ("llama-server", "llama-bench", "llama-perplexity")   # the last: bench.quality
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_BUILD_SERVER=ON",
               # llama.cpp 0c1e570's AMX kernels die of SIGILL on the Xeon guests here
               # (`tileloadd` in tinygemm_kernel_amx<block_q8_1, block_q4_1>, on any prompt of
               # more than one token): built without them it runs its AVX-512 VNNI kernels.
               # Explicit -mno-* flags win over -march=native's, whatever their order.
               f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")
# The second build, only on a CPU with AMX: native, AMX kernels on. Its one-row path uses no
# tiles and runs, so it gives llama.cpp's best single-stream decode (`llama-bench -p 0`);
# every prompt of more than one token dies of SIGILL there, so prefill and the servers stay
# on the build above (issue 26: both figures, each named by its build).
AMX_CMAKE_FLAGS = tuple(f for f in CMAKE_FLAGS if NO_AMX not in f)
FLAGS_RECORD = "\n".join(CMAKE_FLAGS)   # what `cmake-flags.txt` holds after a build
LLAMA_SERVER_ARGS = ("--no-webui", "-np", "32", "-c", "65536")   # 32 slots of 2048 tokens
LLAMA_LISTENING = r"listening on (http://\S+)"
KVLOOP, LLAMA, LLAMA_AMX = "kvloop", "llama.cpp", "llama.cpp AMX"
SERVERS = (KVLOOP, LLAMA)      # the order of every repetition


# --- settings -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Settings:
    """One `run`: where things are, what to run, how often."""

    build_dir: Path
    model: str | None = None        # GGUF; None: the embedded model
    out_dir: Path = Path("out/llamacpp")
    repeats: int = 3
    scale: float = 1.0
    quick: bool = False
    threads: int = 2
    jobs: int = 2
    host: str = "127.0.0.1"
    kvloop_port: int = 0            # 0: an ephemeral port
    llama_port: int = 0
    warmup: int = 2
    request_timeout_s: float = 600.0
    start_timeout_s: float = 900.0
    stop_timeout_s: float = 30.0
    serve_args: tuple[str, ...] = ()
    llama_args: tuple[str, ...] = ()
    engine: bool = True
    serving: bool = True
    contention: bool = False
    contention_timeout_s: float = 300.0
    json_out: str | None = None

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {self.repeats}")
        if self.scale <= 0:
            raise ValueError(f"--scale must be > 0, got {self.scale}")
        if self.threads < 1 or self.jobs < 1:
            raise ValueError("--threads and --jobs must be >= 1")
        if self.model is not None and not self.model.endswith(".gguf"):
            raise ValueError(f"llama.cpp needs a .gguf file, got --model {self.model}")

    def gguf(self) -> str:
        from kvloop.locate import find_model_path

        return find_model_path(self.model)


@dataclass(frozen=True)
class EngineLengths:
    prefill_len: int      # llama-bench -p
    decode_tokens: int    # llama-bench -n


def engine_lengths(quick: bool) -> EngineLengths:
    return EngineLengths(128, 32) if quick else EngineLengths(512, 128)


# --- subprocesses (every child of this script is started here) ------------------------------

def run_logged(cmd: list[str], cwd: Path, log: Path) -> None:
    """Run `cmd` to completion, its output appended to `log`; RuntimeError (with the log's
    tail) when it fails."""
    with open(log, "ab") as f:
        f.write(f"\n$ {' '.join(cmd)}   (in {cwd})\n".encode())
        f.flush()
        code = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = "\n    ".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{cmd[0]} failed with code {code}; last output:\n    {tail}")


def run_output(cmd: list[str], timeout_s: float, with_stderr: bool = False) -> str:
    """stdout (and stderr, if `with_stderr`) of `cmd`; RuntimeError (with its stderr's tail)
    when it fails."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} failed with code {done.returncode}: "
                           f"{done.stderr.strip()[-2000:]}")
    return done.stdout + done.stderr if with_stderr else done.stdout


def stop_group(proc: Any, timeout_s: float) -> None:
    """SIGTERM a server's process group (a `UrlProcess` started with `new_session`), SIGKILL
    whatever is left after `timeout_s`, and reap it (`kvloop.front.launcher.stop_processes`)."""
    proc.stop(timeout_s, group=True)


def wait_http_ok(url: str, timeout_s: float, proc: Any) -> None:
    """Poll GET `url` until it answers 200 (llama-server says 503 while it loads)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited; see {proc.log_path}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5.0).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s:g} s")


# --- build ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class BuildPaths:
    """Where `build` puts things under one build folder. `amx`: the second build (AMX
    kernels on, `llama-bench` only), in its own cmake folder of the same source."""

    root: Path
    amx: bool = False

    @property
    def cmake_flags(self) -> tuple[str, ...]:
        return AMX_CMAKE_FLAGS if self.amx else CMAKE_FLAGS

    @property
    def binaries(self) -> tuple[str, ...]:
        return ("llama-bench",) if self.amx else BINARIES

    @property
    def cmake_dir(self) -> str:
        return "build-amx" if self.amx else "build"

    @property
    def sdist_dir(self) -> Path:
        return self.root / "sdist"

    @property
    def source(self) -> Path:
        return self.root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"

    @property
    def info_file(self) -> Path:
        return self.root / "build-info.json"

    @property
    def log(self) -> Path:
        return self.root / "build.log"

    @property
    def bin_dir(self) -> Path:
        return self.source / self.cmake_dir / "bin"

    def binary(self, name: str) -> Path:
        return self.bin_dir / name

    @property
    def flags_file(self) -> Path:
        return self.root / ("cmake-flags-amx.txt" if self.amx else "cmake-flags.txt")

    def built(self) -> bool:
        """The binaries exist and were built with today's flags."""
        return (all(self.binary(b).is_file() for b in self.binaries)
                and self.flags_file.is_file()
                and self.flags_file.read_text() == "\n".join(self.cmake_flags))


def cpu_has_amx() -> bool:
    """Does this CPU advertise AMX tiles (then `run` builds and measures both builds)?"""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return any(line.startswith("flags") and "amx_tile" in line.split() for line in f)
    except OSError:
        return False


def download_sdist(paths: BuildPaths) -> Path:
    """The sdist tarball, fetched with pip unless already in `sdist_dir`."""
    tarball = paths.sdist_dir / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not tarball.is_file():
        paths.sdist_dir.mkdir(parents=True, exist_ok=True)
        run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                    ":all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d",
                    str(paths.sdist_dir)], paths.root, paths.log)
    return tarball


def unpack(tarball: Path, paths: BuildPaths) -> None:
    if not (paths.source / "CMakeLists.txt").is_file():
        with tarfile.open(tarball) as tar:
            tar.extractall(paths.root, filter="data")


def vendored_commit(source: Path) -> str | None:
    """The vendored llama.cpp's commit: the sdist keeps its git submodule's HEAD file."""
    git_file = source / ".git"
    if not git_file.is_file():
        return None
    head = source / git_file.read_text().strip().removeprefix("gitdir:").strip() / "HEAD"
    return head.read_text().strip() if head.is_file() else None


def binary_version(paths: BuildPaths) -> str:
    """The `version: N (commit)` line of `llama-server --version`."""
    text = run_output([str(paths.binary("llama-server")), "--version"], 60, True).strip()
    return next((ln for ln in text.splitlines() if ln.startswith("version")), text[:200])


def build(paths: BuildPaths, jobs: int) -> dict[str, str | None]:
    """Build llama-server and llama-bench unless built; the build info (also written to
    `build-info.json`)."""
    paths.root.mkdir(parents=True, exist_ok=True)
    if not paths.built():
        print(f"building llama.cpp's {' '.join(paths.binaries)} in {paths.source} "
              f"({paths.cmake_dir}): 10+ minutes on 2 cores; the log is {paths.log}",
              file=sys.stderr, flush=True)
        unpack(download_sdist(paths), paths)
        run_logged(["cmake", "-B", paths.cmake_dir, *paths.cmake_flags], paths.source,
                   paths.log)
        run_logged(["cmake", "--build", paths.cmake_dir, f"-j{jobs}", "--target",
                    *paths.binaries], paths.source, paths.log)
        paths.flags_file.write_text("\n".join(paths.cmake_flags))
    info = {"llama_cpp_python": LLAMA_CPP_PYTHON, "commit": vendored_commit(paths.source),
            "version": binary_version(paths) if not paths.amx else None,
            "bin_dir": str(paths.bin_dir)}
    if paths.amx:
        return info
    paths.info_file.write_text(json.dumps(info, indent=2) + "\n")
    return info


# --- records and medians --------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One served workload: `kvloop bench` arguments (without --url and --seed)."""

    key: str                      # names the case in records and table rows
    title: str
    bench_args: tuple[str, ...]


ENGINE_CASE = Case("engine", "the engine alone", ())


@dataclass
class Record:
    """One measured run of one side: the figures it gave and the load average before it."""

    phase: str            # "engine", "serving" or "contention"
    case: str             # Case.key, or "engine"
    rep: int
    server: str           # KVLOOP or LLAMA
    load_avg: tuple[float, float, float]
    figures: dict[str, float | None]
    detail: dict[str, Any] = field(default_factory=dict)


def alternate(repeats: int, cases: list[Case], servers: tuple[str, ...] = SERVERS
              ) -> Iterator[tuple[int, Case, str]]:
    """(rep, case, server) in run order: every case on kvloop then llama.cpp (then its AMX
    build where measured), rep by rep."""
    for rep in range(repeats):
        for case in cases:
            for server in servers:
                yield rep, case, server


def medians(records: list[Record]) -> dict[str, dict[str, dict[str, float | None]]]:
    """case -> server -> figure -> median over the repetitions (None: never measured)."""
    grouped: dict[str, dict[str, dict[str, list[float]]]] = {}
    for r in records:
        by_fig = grouped.setdefault(r.case, {}).setdefault(r.server, {})
        for name, value in r.figures.items():
            by_fig.setdefault(name, [])
            if value is not None:
                by_fig[name].append(value)
    return {case: {server: {name: statistics.median(v) if v else None
                            for name, v in figs.items()}
                   for server, figs in by_server.items()}
            for case, by_server in grouped.items()}


def measured(settings: Settings, run_one: Callable[[int, Case, str], dict[str, Any]],
             cases: list[Case], phase: str, servers: tuple[str, ...] = SERVERS
             ) -> list[Record]:
    """Run every (rep, case, server) of `alternate`, noting the load average before each."""
    records = []
    for rep, case, server in alternate(settings.repeats, cases, servers):
        load = os.getloadavg()
        print(f"[{phase}] rep {rep + 1}/{settings.repeats} {case.key} on {server} "
              f"(load {load[0]:.1f})", flush=True)
        out = run_one(rep, case, server)
        records.append(Record(phase, case.key, rep, server, load, out.pop("figures"), out))
    return records


# --- the engine alone -----------------------------------------------------------------------

def parse_llama_bench(text: str, with_prefill: bool = True) -> dict[str, Any]:
    """Figures of `llama-bench -o json`: prefill (the pp test; None without one, as the AMX
    build runs none) and decode (the tg test) in tokens per second, with the build
    llama-bench reports."""
    tests = json.loads(text)
    pp = [t for t in tests if t["n_prompt"] > 0 and t["n_gen"] == 0]
    tg = [t for t in tests if t["n_gen"] > 0 and t["n_prompt"] == 0]
    if len(pp) != int(with_prefill) or len(tg) != 1:
        raise ValueError("expected one prompt test and one generation test from llama-bench"
                         if with_prefill else "expected one generation test from llama-bench")
    return {"figures": {"prefill tok/s": pp[0]["avg_ts"] if pp else None,
                        "decode tok/s": tg[0]["avg_ts"]},
            "build_commit": tg[0].get("build_commit"), "n_threads": tg[0].get("n_threads"),
            "cpu_info": tg[0].get("cpu_info"), "type_k": tg[0].get("type_k")}


def llama_bench_cmd(paths: BuildPaths, gguf: str, lens: EngineLengths,
                    threads: int) -> list[str]:
    """pp and tg; the AMX build tg alone (`-p 0`: its prompt path dies of SIGILL)."""
    prefill = 0 if paths.amx else lens.prefill_len
    return [str(paths.binary("llama-bench")), "-m", gguf, "-p", str(prefill),
            "-n", str(lens.decode_tokens), "-t", str(threads), "-r", "1", "-o", "json"]


def offline_cmd(settings: Settings, lens: EngineLengths, json_path: Path) -> list[str]:
    model = [] if settings.model is None else ["--model", settings.model]
    return [sys.executable, "-m", "kvloop.bench.offline", "--skip-hf", "--skip-throughput",
            "--repeats", "1", "--threads", str(settings.threads),
            "--prefill-len", str(lens.prefill_len), "--decode-tokens", str(lens.decode_tokens),
            "--json-out", str(json_path), *model]


def parse_offline(doc: dict[str, Any]) -> dict[str, Any]:
    k = doc["kvloop"]
    return {"figures": {"prefill tok/s": k["prefill"], "decode tok/s": k["decode"]},
            "setup": doc["setup"]}


def engine_records(settings: Settings, paths: BuildPaths,
                   amx: BuildPaths | None = None) -> list[Record]:
    """offline (kvloop) and llama-bench (and the AMX build's tg, where there is one), one
    measurement each per repetition, alternating."""
    lens, gguf = engine_lengths(settings.quick), settings.gguf()
    builds = {LLAMA: paths} | ({LLAMA_AMX: amx} if amx is not None else {})

    def run_one(rep: int, _case: Case, server: str) -> dict[str, Any]:
        if server in builds:
            return parse_llama_bench(run_output(
                llama_bench_cmd(builds[server], gguf, lens, settings.threads), 1800),
                with_prefill=server == LLAMA)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "offline.json"
            run_output(offline_cmd(settings, lens, out), 1800)
            return parse_offline(json.loads(out.read_text()))

    return measured(settings, run_one, [ENGINE_CASE], "engine", (KVLOOP, *builds))


# --- serving --------------------------------------------------------------------------------

def _random(n: int, c: int, i: int, o: int) -> Case:
    return Case(f"random c={c}", f"random {i}/{o} c={c}",
                ("--workload", "random", "--num-requests", str(n), "--concurrency", str(c),
                 "--input-len", str(i), "--output-len", str(o)))


def _shared(n: int, c: int, groups: int, prefix: int, suffix: int, o: int) -> Case:
    return Case(f"shared-prefix c={c}", f"shared-prefix {groups}x{prefix}+{suffix}, {o} out, "
                f"c={c}", ("--workload", "shared-prefix", "--num-requests", str(n),
                           "--concurrency", str(c), "--num-groups", str(groups),
                           "--prefix-len", str(prefix), "--suffix-len", str(suffix),
                           "--output-len", str(o)))


def _multi(n: int, c: int, turns: int, first: int, per_turn: int, o: int) -> Case:
    return Case(f"multi-turn c={c}", f"multi-turn {turns} turns ({first} + {per_turn}/turn, "
                f"{o} out), c={c}", ("--workload", "multi-turn", "--num-requests", str(n),
                                     "--concurrency", str(c), "--num-turns", str(turns),
                                     "--input-len", str(first), "--turn-len", str(per_turn),
                                     "--output-len", str(o)))


def serving_cases(quick: bool, scale: float = 1.0) -> list[Case]:
    """The workloads of issue 15 (docs/benchmarking.md#kvloop-against-llamacpp); `quick`:
    the same concurrencies with tiny counts and short prompts, to check the script."""
    def n(k: int) -> int:
        return max(1, round(k * scale))
    if quick:
        return [_random(n(2), 1, 64, 16), _random(n(8), 8, 64, 16), _random(n(32), 32, 64, 16),
                _shared(n(16), 16, 4, 256, 16, 16), _multi(n(4), 4, 2, 64, 16, 16)]
    return [_random(n(8), 1, 256, 128), _random(n(32), 8, 256, 128),
            _random(n(64), 32, 256, 128), _shared(n(64), 16, 8, 1024, 64, 64),
            _multi(n(16), 4, 4, 256, 64, 64)]


def bench_namespace(case: Case, seed: int) -> argparse.Namespace:
    """`kvloop bench --url - CASE --seed SEED` parsed by kvloop bench's own parser."""
    from kvloop.bench import cli_args

    parser = argparse.ArgumentParser()
    cli_args.register(parser.add_subparsers())
    return parser.parse_args(["bench", "--url", "http://127.0.0.1:1", *case.bench_args,
                              "--seed", str(seed)])


def serving_figures(summary: dict[str, Any]) -> dict[str, float | None]:
    return {"output tok/s": summary["output_throughput"],
            "TTFT p50 ms": (summary["ttft_ms"] or {}).get("p50"),
            "TPOT p50 ms": (summary["tpot_ms"] or {}).get("p50")}


def bench_once(case: Case, seed: int, url: str, label: str,
               settings: Settings) -> dict[str, Any]:
    """One `kvloop bench` run of `case` against `url`: its figures and its summary."""
    from kvloop.bench.cli_args import build_workload
    from kvloop.bench.driver import BenchConfig, run_bench_sync
    from kvloop.bench.report import summarize

    ns = bench_namespace(case, seed)
    workload = build_workload(ns)
    cfg = BenchConfig(url, concurrency=ns.concurrency, ignore_eos=ns.ignore_eos,
                      temperature=ns.temperature, return_token_ids=ns.return_token_ids,
                      warmup=settings.warmup, timeout_s=settings.request_timeout_s,
                      progress=False, seed=seed, label=label,
                      token_range=tuple(ns.token_range))
    summary = summarize(run_bench_sync(workload, cfg))
    expected = sum(t.max_tokens for s in workload.sessions for t in s.turns)
    if summary["failed"] or summary["output_tokens"] != expected:
        print(f"  warning: {label}: {summary['failed']} failed, {summary['output_tokens']} of "
              f"{expected} output tokens; errors {summary['errors']}", flush=True)
    return {"figures": serving_figures(summary), "summary": summary,
            "expected_output_tokens": expected}


def llama_server_cmd(settings: Settings, paths: BuildPaths) -> list[str]:
    t = str(settings.threads)
    return [str(paths.binary("llama-server")), "-m", settings.gguf(), "-t", t, "-tb", t,
            *LLAMA_SERVER_ARGS, "--host", settings.host, "--port", str(settings.llama_port),
            *settings.llama_args]


def kvloop_serve_args(settings: Settings) -> list[str]:
    model = [] if settings.model is None else ["--model", settings.model]
    return [*model, "--host", settings.host, "--port", str(settings.kvloop_port),
            *settings.serve_args]


@contextlib.contextmanager
def servers(settings: Settings, paths: BuildPaths) -> Iterator[dict[str, str]]:
    """Both servers up and ready (server -> URL); both stopped on the way out."""
    from kvloop.front.launcher import ServeProcess, UrlProcess

    settings.out_dir.mkdir(parents=True, exist_ok=True)
    llama = UrlProcess(llama_server_cmd(settings, paths), settings.out_dir / "llama-server.log",
                       LLAMA_LISTENING, new_session=True, name="llama-server")
    kv = ServeProcess(kvloop_serve_args(settings), settings.out_dir / "kvloop-serve.log",
                      new_session=True)
    try:
        llama.launch()
        kv.launch()
        for proc in (llama, kv):
            proc.wait_url(settings.start_timeout_s)
            wait_http_ok(proc.url + "/health", settings.start_timeout_s, proc)
        yield {KVLOOP: kv.url, LLAMA: llama.url}
    finally:
        for proc in (kv, llama):
            stop_group(proc, settings.stop_timeout_s)


# --- contention -----------------------------------------------------------------------------

QUIET, BUSY = "quiet", "busy"
SPIN_LOOP = "while True: pass"     # the other process: one core kept busy


def contention_case(quick: bool, scale: float = 1.0) -> Case:
    """random 256/128 at c=8 (issue 15's contention workload), 16 requests at scale 1."""
    return _random(max(1, round(2 * scale)), 8, 64, 16) if quick else \
        _random(max(1, round(16 * scale)), 8, 256, 128)


@contextlib.contextmanager
def busy_core() -> Iterator[subprocess.Popen[bytes]]:
    """Another process spinning on one core while inside (killed on the way out)."""
    proc = subprocess.Popen([sys.executable, "-c", SPIN_LOOP])
    try:
        time.sleep(1.0)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def contention_seed(rep: int, condition: str) -> int:
    """The prompts' seed of one contention run: the same for both servers, fresh for every
    (rep, condition), so no run finds prompts that an earlier run left in a prefix cache
    (with one seed per rep, kvloop's busy runs hit the quiet runs' cached prompts)."""
    return 500 + 2 * rep + (condition == BUSY)


def contention_order(repeats: int) -> Iterator[tuple[int, str, str]]:
    """(rep, condition, server): each repetition quiet on both servers, then busy on both."""
    for rep in range(repeats):
        for condition in (QUIET, BUSY):
            for server in SERVERS:
                yield rep, condition, server


def contention_records(settings: Settings, paths: BuildPaths) -> list[Record]:
    case = contention_case(settings.quick, settings.scale)
    busy_settings = replace(settings, request_timeout_s=settings.contention_timeout_s)
    records = []
    with servers(settings, paths) as urls:
        for rep, condition, server in contention_order(settings.repeats):
            with busy_core() if condition == BUSY else contextlib.nullcontext():
                load = os.getloadavg()
                print(f"[contention] rep {rep + 1}/{settings.repeats} {condition} on {server} "
                      f"(load {load[0]:.1f})", flush=True)
                out = bench_once(case, contention_seed(rep, condition), urls[server], server,
                                 busy_settings if condition == BUSY else settings)
            records.append(Record("contention", f"contention {condition}", rep, server, load,
                                  out.pop("figures"), out))
    return records


def contention_rows(meds: dict[str, dict[str, dict[str, float | None]]]
                    ) -> list[dict[str, Any]]:
    """Per server: quiet and busy median output tok/s and the share kept; kvloop's row says
    whether its share is at least llama.cpp's."""
    figure = "output tok/s"
    rows: list[dict[str, Any]] = []
    for server in SERVERS:
        quiet = meds.get(f"contention {QUIET}", {}).get(server, {}).get(figure)
        busy = meds.get(f"contention {BUSY}", {}).get(server, {}).get(figure)
        share = None if quiet is None or busy is None or not quiet else busy / quiet
        rows.append({"server": server, QUIET: quiet, BUSY: busy, "share": share})
    ours, theirs = rows[0]["share"], rows[1]["share"]
    rows[0]["met"] = None if ours is None or theirs is None else ours >= theirs
    rows[1]["met"] = None
    return rows


def format_contention(rows: list[dict[str, Any]]) -> str:
    lines = ["| server | quiet tok/s | one core busy tok/s | share kept | at least llama's |",
             "|---|---|---|---|---|"]
    for r in rows:
        share = "-" if r["share"] is None else f"{100 * r['share']:.0f}%"
        met = {True: "yes", False: "no", None: "-"}[r["met"]]
        lines.append(f"| {r['server']} | {_fmt(r[QUIET])} | {_fmt(r[BUSY])} | {share} | "
                     f"{met} |")
    return "\n".join(lines)


def serving_records(settings: Settings, paths: BuildPaths) -> list[Record]:
    cases = serving_cases(settings.quick, settings.scale)
    with servers(settings, paths) as urls:
        print(f"kvloop {urls[KVLOOP]}, llama-server {urls[LLAMA]}", flush=True)

        def run_one(rep: int, case: Case, server: str) -> dict[str, Any]:
            seed = 100 * rep + cases.index(case)
            return bench_once(case, seed, urls[server], server, settings)

        return measured(settings, run_one, cases, "serving")


# --- the table ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    op: str        # ">=" or "<=": the ratio kvloop / llama.cpp must be at least / at most
    value: float

    def met(self, ratio: float | None) -> bool | None:
        if ratio is None:
            return None
        return ratio >= self.value if self.op == ">=" else ratio <= self.value

    def __str__(self) -> str:
        return f"{self.op} {self.value:g}"


@dataclass(frozen=True)
class Row:
    case: str      # Case.key or "engine"
    figure: str    # a key of the records' figures
    target: Target


ROWS = (  # issue 38's targets (c=1 and TTFT: issue 15's), as ratios kvloop / llama.cpp
    Row("random c=1", "output tok/s", Target(">=", 1.25)),
    Row("random c=8", "output tok/s", Target(">=", 3.0)),
    Row("random c=32", "output tok/s", Target(">=", 4.0)),
    Row("shared-prefix c=16", "output tok/s", Target(">=", 8.0)),
    Row("multi-turn c=4", "output tok/s", Target(">=", 3.0)),
    Row("random c=8", "TTFT p50 ms", Target("<=", 0.2)),
    Row("random c=1", "TPOT p50 ms", Target("<=", 0.8)),
    Row("engine", "decode tok/s", Target(">=", 1.0)),    # ambition: 1.25
    Row("engine", "prefill tok/s", Target(">=", 6.0)),
)


def row_label(row: Row, titles: dict[str, str], lens: EngineLengths, anchor: str) -> str:
    """The row's words, naming the llama.cpp build its figure comes from (`anchor`)."""
    if row.case == "engine" and row.figure.startswith("decode"):
        return (f"engine single-stream decode tok/s (offline vs tg{lens.decode_tokens}, "
                f"{BUILD_NAMES[anchor]})")
    if row.case == "engine":
        return (f"engine prefill tok/s, {lens.prefill_len} tokens (offline vs "
                f"pp{lens.prefill_len}, {BUILD_NAMES[anchor]})")
    return f"{titles.get(row.case, row.case)}: {row.figure} ({BUILD_NAMES[anchor]})"


BUILD_NAMES = {LLAMA: "build without AMX", LLAMA_AMX: "AMX build"}


def anchor_of(row: Row, meds: dict[str, dict[str, dict[str, float | None]]]) -> str:
    """Which build a row compares with: single-stream decode with the AMX build where it was
    measured (the hardware's best one-row pace), everything else with the build without."""
    amx = meds.get(row.case, {}).get(LLAMA_AMX, {}).get(row.figure)
    return LLAMA_AMX if row.figure == "decode tok/s" and amx is not None else LLAMA


def table_rows(meds: dict[str, dict[str, dict[str, float | None]]], titles: dict[str, str],
               lens: EngineLengths) -> list[dict[str, Any]]:
    """One dict per row of ROWS whose case was measured: label, both medians, ratio, target."""
    out = []
    for row in ROWS:
        if row.case not in meds:
            continue
        anchor = anchor_of(row, meds)
        ours = meds[row.case].get(KVLOOP, {}).get(row.figure)
        theirs = meds[row.case].get(anchor, {}).get(row.figure)
        ratio = None if ours is None or not theirs else ours / theirs
        out.append({"figure": row_label(row, titles, lens, anchor), KVLOOP: ours,
                    LLAMA: theirs, "ratio": ratio, "target": str(row.target),
                    "met": row.target.met(ratio)})
    return out


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| figure | kvloop | llama.cpp | ratio | target | met |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        met = {True: "yes", False: "no", None: "-"}[r["met"]]
        lines.append(f"| {r['figure']} | {_fmt(r[KVLOOP])} | {_fmt(r[LLAMA])} | "
                     f"{_fmt(r['ratio'])} | {r['target']} | {met} |")
    return "\n".join(lines)


def format_loads(records: list[Record]) -> str:
    lines = ["| phase | rep | case | server | load 1 min | 5 min | 15 min |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        a, b, c = r.load_avg
        lines.append(f"| {r.phase} | {r.rep + 1} | {r.case} | {r.server} | {a:.2f} | {b:.2f} "
                     f"| {c:.2f} |")
    return "\n".join(lines)


def report(settings: Settings, info: dict[str, Any], records: list[Record]) -> dict[str, Any]:
    """The markdown report and the JSON document of a run."""
    lens = engine_lengths(settings.quick)
    titles = {c.key: c.title for c in serving_cases(settings.quick, settings.scale)}
    meds = medians(records)
    rows = table_rows(meds, titles, lens)
    contention = contention_rows(meds) if settings.contention else None
    text = (f"kvloop vs llama.cpp (commit {info['commit']}, {info['version']}; AMX build: "
            f"{info.get('amx_build')}), model "
            f"{settings.gguf()}, {settings.threads} threads, {settings.repeats} repetition(s), "
            f"medians{' (--quick)' if settings.quick else ''}\n\n{format_table(rows)}\n\n")
    if contention is not None:
        text += (f"Under contention ({contention_case(settings.quick, settings.scale).title}, "
                 f"another process spinning on one core):\n\n{format_contention(contention)}"
                 f"\n\n")
    text += f"Load average before each run:\n\n{format_loads(records)}\n"
    doc = {"settings": {k: str(v) if isinstance(v, Path) else v
                        for k, v in asdict(settings).items()},
           "build": info, "medians": meds, "table": rows, "contention": contention,
           "runs": [asdict(r) for r in records]}
    return {"text": text, "doc": doc}


# --- command line ---------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvloop.bench.llamacpp",
                                description=__doc__.split("\n\n")[0] + " (the first run "
                                "builds llama.cpp: 10 minutes or more)",
                                formatter_class=HelpFormatter)
    p.add_argument("what", choices=("build", "run"))
    p.add_argument("--build-dir", default=DEFAULT_BUILD_DIR)
    p.add_argument("--jobs", type=int, default=2, help="build: parallel compile jobs")
    p.add_argument("--model", help="GGUF file (default: the embedded model)")
    p.add_argument("--out-dir", default="out/llamacpp", help="the servers' logs")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--scale", type=float, default=1.0, help="multiply the request counts")
    p.add_argument("--quick", action="store_true",
                   help="1 repetition, tiny counts, short prompts: checks the script")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's and kvloop's threads")
    p.add_argument("--kvloop-port", type=int, default=0, help="default: ephemeral")
    p.add_argument("--llama-port", type=int, default=0, help="default: ephemeral")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests per run")
    p.add_argument("--serve-args", default="", help="extra `kvloop serve` arguments")
    p.add_argument("--llama-args", default="", help="extra llama-server arguments")
    p.add_argument("--skip-engine", action="store_true", help="no offline / llama-bench runs")
    p.add_argument("--skip-serving", action="store_true", help="no served workloads")
    p.add_argument("--contention", action="store_true",
                   help="also c=8 with one core kept busy by another process")
    p.add_argument("--contention-timeout", type=float, default=300.0,
                   help="seconds per request of a busy run")
    p.add_argument("--json-out", help="write settings, every run, medians and table here")
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    import shlex

    return Settings(
        build_dir=Path(args.build_dir).expanduser(), model=args.model,
        out_dir=Path(args.out_dir), repeats=1 if args.quick else args.repeats,
        scale=args.scale, quick=args.quick, threads=args.threads, jobs=args.jobs,
        kvloop_port=args.kvloop_port, llama_port=args.llama_port,
        warmup=min(args.warmup, 1) if args.quick else args.warmup,
        serve_args=tuple(shlex.split(args.serve_args)),
        llama_args=tuple(shlex.split(args.llama_args)),
        engine=not args.skip_engine, serving=not args.skip_serving,
        contention=args.contention, contention_timeout_s=args.contention_timeout,
        json_out=args.json_out)


def run(settings: Settings) -> dict[str, Any]:
    paths = BuildPaths(settings.build_dir)
    info = build(paths, settings.jobs)
    amx = BuildPaths(settings.build_dir, amx=True) if cpu_has_amx() else None
    info["amx_build"] = (build(amx, settings.jobs)["bin_dir"] if amx is not None else
                         "none: this CPU has no AMX, the build without it is the anchor for "
                         "every figure")
    records = engine_records(settings, paths, amx) if settings.engine else []
    if settings.serving:
        records += serving_records(settings, paths)
    if settings.contention:
        records += contention_records(settings, paths)
    out = report(settings, info, records)
    print("\n" + out["text"])
    if settings.json_out:
        Path(settings.json_out).write_text(json.dumps(out["doc"], indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = settings_from(args)
    except ValueError as e:
        print(f"kvloop.bench.llamacpp: {e}", file=sys.stderr)
        return 2
    # SIGTERM ends the run like Ctrl-C: the servers are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.what == "build":
        print(json.dumps(build(BuildPaths(settings.build_dir), settings.jobs), indent=2))
        return 0
    run(settings)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
