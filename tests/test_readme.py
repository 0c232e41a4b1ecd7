"""The README's "Using it" block, run line by line: each command as printed (its ports swapped
for free ones, `.venv/bin/` for this interpreter's bin folder), for a bounded time, with no
traceback and the effect its comment claims. A line the table below does not know fails the
test: a new example is covered the day it is added. Lines that need another host or run a
benchmark of minutes run their `--help` instead (HELP_ONLY says why, one reason each)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.processes, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# Commands run as `--help` only, and why (the rest run as printed).
HELP_ONLY = {
    "kvloop router --discover": "needs NATS and Redis on another host (10.0.0.9); "
                                "tests/test_netns_recipe.py runs docs/router.md's two-host "
                                "recipe",
    "kvloop.bench.offline": "a benchmark of minutes (the real model and transformers)",
    "kvloop.bench.llamacpp run": "builds llama.cpp first (10+ minutes)",
    "kvloop.bench.structured": "a benchmark of minutes on the real model",
    "kvloop.bench.spec": "a benchmark of minutes on the real model",
    "kvloop.bench.pd": "a benchmark of minutes (two simulated fleets, 200 requests each)",
    "kvloop.bench.pd_transfer": "a benchmark of minutes on the real model",
    "--enable-lora": "needs a PEFT adapter folder (tests/test_serve_lora.py makes one with "
                     "peft and serves it)",
    "kvloop.bench.lora": "a benchmark of minutes on the real model",
}


def readme_commands() -> list[str]:
    """The commands of the README's "Using it" block, comments dropped."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Using it\n.*?```sh\n(.*?)```", text, re.S)
    assert block is not None, "README.md has no ```sh block under ## Using it"
    return [re.split(r"\s{2,}# ", ln)[0].strip() for ln in block.group(1).splitlines()
            if ln.strip()]


class Shell:
    """Runs README lines in one scratch folder: `.venv/bin/` and the README's ports
    rewritten, each process in its own group, all of them ended at the end."""

    def __init__(self, cwd: Path, ports: dict[str, int]) -> None:
        self.cwd, self.ports = cwd, ports
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def line(self, command: str) -> str:
        line = command.replace(".venv/bin/", f"{BIN}/").replace(
            "tests/data/", f"{ROOT}/tests/data/").replace("docs/", f"{ROOT}/docs/")
        for readme_port, port in self.ports.items():
            line = re.sub(rf"\b{readme_port}\b", str(port), line)
        return line

    def start(self, command: str) -> Path:
        log = self.cwd / f"proc{len(self.procs)}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(["bash", "-c", self.line(command)], cwd=self.cwd,
                                    stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs.append((proc, log))
        return log

    def run(self, command: str, timeout_s: float) -> str:
        r = subprocess.run(["bash", "-c", self.line(command)], cwd=self.cwd, timeout=timeout_s,
                           capture_output=True, text=True)
        out = r.stdout + r.stderr
        assert r.returncode == 0 and "Traceback" not in out, f"{command}\n{out[-3000:]}"
        return out

    def stop_all(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        for proc, log in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            assert "Traceback" not in log.read_text(errors="replace"), log.read_text()[-3000:]
        self.procs.clear()


@contextmanager
def shell(tmp_path: Path, free_port: Callable[[], int]) -> Iterator[Shell]:
    sh = Shell(tmp_path, {p: free_port() for p in ("8000", "8001", "8002")})
    try:
        yield sh
    finally:
        sh.stop_all()


def wait_http(url: str, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} not up in {timeout_s} s:\n{log.read_text()[-3000:]}")


def wait_log(log: Path, needle: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if needle in text:
            return text
        time.sleep(0.3)
    raise AssertionError(f"no {needle!r} in {timeout_s} s:\n{log.read_text()[-3000:]}")


def complete(port: int, prompt: str = "The capital of France is") -> dict:
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                   json={"prompt": prompt, "max_tokens": 4})
    assert r.status_code == 200, r.text
    return r.json()


def metric(port: int, pattern: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(pattern + r"\S* ([\d.e+]+)$", text, re.M))


# --- what each line claims --------------------------------------------------------------------
def serve_model(sh: Shell, cmd: str) -> None:
    log = sh.start(cmd)
    wait_http(f"http://127.0.0.1:{sh.ports['8000']}/health", 300, log)
    assert complete(sh.ports["8000"])["choices"][0]["text"]
    assert "default sampling parameters: temperature=0.2, top_p=0.9" in log.read_text()


def fleet_up(sh: Shell, cmd: str) -> None:
    log = sh.start(cmd)
    wait_http(f"http://127.0.0.1:{sh.ports['8000']}/health", 120, log)
    complete(sh.ports["8000"])


def pd_fleet(remote: bool) -> Callable[[Shell, str], None]:
    def check(sh: Shell, cmd: str) -> None:
        fleet_up(sh, cmd)
        decision = "remote" if remote else "local"
        assert metric(sh.ports["8000"],
                      rf'kvloop_router_pd_decisions_total\{{[^}}]*decision="{decision}"') >= 1
    return check


def fleet_key(sh: Shell, cmd: str) -> None:
    sh.run(cmd, 10)
    key = sh.cwd / "fleet.key"
    assert len(key.read_text().strip()) == 64 and stat.S_IMODE(key.stat().st_mode) == 0o600


def kv_transfer_worker(sh: Shell, cmd: str) -> None:
    if not (sh.cwd / "fleet.key").exists():
        fleet_key(sh, next(c for c in readme_commands() if c.endswith("fleet.key")))
    wait_log(sh.start(cmd + " --port 8000"), "KV connector: engine_id", 300)


def spec_worker(sh: Shell, cmd: str) -> None:
    wait_log(sh.start(cmd + " --port 8000"), "speculative decoding on: ngram, up to 4", 60)


def trace_file(sh: Shell, cmd: str) -> None:
    log = sh.start(cmd)
    wait_http(f"http://127.0.0.1:{sh.ports['8000']}/health", 120, log)
    complete(sh.ports["8000"])
    sh.stop_all()
    assert (sh.cwd / "steps.jsonl").read_text().count("\n") >= 2


def trace_png(sh: Shell, cmd: str) -> None:
    assert "wrote schedule.png" in sh.run(cmd, 120)
    assert (sh.cwd / "schedule.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def replay(sh: Shell, cmd: str) -> None:
    sh.run(cmd, 60)
    assert (sh.cwd / "STEPLOG.json").stat().st_size > 0


def scheduler_bench(sh: Shell, cmd: str) -> None:
    assert "median of 3 runs" in sh.run(cmd, 240)


def tiered_worker(sh: Shell, cmd: str) -> None:
    log = sh.start(cmd)
    wait_http(f"http://127.0.0.1:{sh.ports['8000']}/health", 120, log)
    complete(sh.ports["8000"], "a prompt long enough to fill a block of sixteen tokens " * 4)
    assert "KV offloading tiers: cpu (CPU), disk (STORAGE)" in log.read_text()
    deadline = time.monotonic() + 30
    while not any((sh.cwd / "kv-tier").glob("*")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert any((sh.cwd / "kv-tier").glob("*")), "no block written to the disk tier"


def tiers_bench(sh: Shell, cmd: str) -> None:
    out = sh.run(cmd, 240)
    assert "tier-aware" in out and "shared-document" in out


def by_hand_workers(sh: Shell, cmd: str) -> None:
    port = sh.ports["8001" if "8001" in cmd else "8002"]
    log = sh.start(cmd)
    wait_http(f"http://127.0.0.1:{port}/health", 120, log)
    assert httpx.get(f"http://127.0.0.1:{port}/kv_event_sources").json()["0"]["endpoint"]


def by_hand_router(sh: Shell, cmd: str) -> None:
    log = sh.start(cmd)
    wait_http(f"http://127.0.0.1:{sh.ports['8000']}/health", 60, log)
    health = httpx.get(f"http://127.0.0.1:{sh.ports['8000']}/health").text
    assert "no_event_source" not in health and "degraded" not in health, health


def events_tail(sh: Shell, cmd: str) -> None:
    log = sh.start(cmd)
    time.sleep(1.0)   # the subscription before the request
    complete(sh.ports["8001"], "a prompt long enough to fill a block of sixteen tokens " * 4)
    wait_log(log, "BlockStored", 30)


def export_tokenizer(sh: Shell, cmd: str) -> None:
    assert "tokenizer written to tokenizer" in sh.run(cmd, 120)
    config = (sh.cwd / "tokenizer" / "tokenizer_config.json").read_text()
    assert (sh.cwd / "tokenizer" / "tokenizer.json").is_file() and "chat_template" in config


def bench_router(sh: Shell, cmd: str) -> None:
    sh.run(cmd, 240)   # a shared prefix routed on the workers' events: hits foreseen and got
    assert metric(sh.ports["8000"], r"kvloop_router_predicted_hit_tokens_total") > 0
    assert metric(sh.ports["8000"], r"kvloop_router_actual_hit_tokens_total") > 0


CHECKS: dict[str, Callable[[Shell, str], None]] = {
    "kvloop serve smollm2": serve_model,
    "kvloop fleet --workers 4": fleet_up,
    "--flow-control": fleet_up,
    "kvloop serve sim --port 8001": by_hand_workers,
    "kvloop serve sim --port 8002": by_hand_workers,
    "kvloop router --port 8000 --worker": by_hand_router,
    "kvloop events tail --worker": events_tail,
    "kvloop bench --url": bench_router,
    "> fleet.key": fleet_key,
    "kvloop fleet --prefill 2": pd_fleet(remote=False),
    "--pd-policy always": pd_fleet(remote=True),
    "--kv-transfer-config": kv_transfer_worker,
    "--speculative-config": spec_worker,
    "--trace-file steps.jsonl": trace_file,
    "kvloop trace steps.jsonl": trace_png,
    "kvloop replay": replay,
    "kvloop.bench.scheduler": scheduler_bench,
    "kvloop.bench.tiers": tiers_bench,
    "--kv-disk-path": tiered_worker,
    "kvloop export-tokenizer": export_tokenizer,
}


def _names(key: str, cmd: str) -> bool:
    return re.search(re.escape(key) + r"(?![\w.])", cmd) is not None


def how(cmd: str) -> tuple[str, str]:
    """("help", reason) or ("run", key) for a README line: exactly one table entry."""
    keys = [k for k in (*HELP_ONLY, *CHECKS) if _names(k, cmd)]
    assert len(keys) == 1, (f"README line {cmd!r} matches {keys or 'no entry'} of "
                            f"tests/test_readme.py: say how to check it there")
    return ("help", HELP_ONLY[keys[0]]) if keys[0] in HELP_ONLY else ("run", keys[0])


def test_every_readme_line_has_exactly_one_check() -> None:
    commands = readme_commands()
    assert len(commands) >= 10
    used = {how(c)[1] if how(c)[0] == "run" else next(k for k in HELP_ONLY if _names(k, c))
            for c in commands}
    assert used == set(CHECKS) | set(HELP_ONLY), "entries no README line uses"


def _help_form(cmd: str) -> str:
    words = shlex.split(cmd.split(" >", 1)[0])
    prog = [w for w in words if "=" not in w.split("/")[0]]   # drop VAR=value
    if prog[0].endswith("python"):
        return shlex.join(prog[:3] + ["--help"])   # python -m MODULE --help
    return shlex.join(prog[:2] + ["--help"])       # kvloop SUBCOMMAND --help


@pytest.mark.parametrize("cmd", [c for c in readme_commands()
                                 if any(_names(k, c) for k in HELP_ONLY)])
def test_lines_run_as_help(cmd: str, tmp_path: Path, free_port: Callable[[], int]) -> None:
    with shell(tmp_path, free_port) as sh:
        out = sh.run(_help_form(cmd), 60)
    assert "usage:" in out and "default" in out


@pytest.mark.timeout(900)   # every README line in turn, two model loads among them: over 300 s
def test_the_readme_lines_run_as_printed(tmp_path: Path, free_port: Callable[[], int]) -> None:
    """In README order, in one folder: a line may use what an earlier one left (a worker
    still up, steps.jsonl, fleet.key); fleets end before the next fleet takes port 8000."""
    checked: list[str] = []
    with shell(tmp_path, free_port) as sh:
        for cmd in readme_commands():
            kind, key = how(cmd)
            if kind == "help":
                continue
            if key in ("kvloop fleet --workers 4", "--flow-control", "kvloop serve sim --port 8001",
                       "> fleet.key", "kvloop fleet --prefill 2", "--pd-policy always",
                       "--kv-transfer-config", "--speculative-config",
                       "--trace-file steps.jsonl", "--kv-disk-path") \
                    or key == "kvloop serve smollm2":
                sh.stop_all()   # port 8000 (and the workers) free again
            CHECKS[key](sh, cmd)   # each check asserts the effect its line claims
            checked.append(key)
    assert set(checked) == set(CHECKS), "a README line that runs went unchecked"
