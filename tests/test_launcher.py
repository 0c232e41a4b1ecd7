"""The one process launcher (`kvloop.front.launcher.UrlProcess`), on tiny child processes:
the URL read from the announcement, the output relayed with a prefix, clear errors for a
child that exits or never serves, and stopping one that ignores SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvloop
from kvloop.front.launcher import SERVE_URL_LINE, UrlProcess, kvloop_command
from kvloop.front.sockets import SERVE_ANNOUNCEMENT

pytestmark = pytest.mark.processes   # every test here starts processes or servers


def child(code: str) -> list[str]:
    return [sys.executable, "-u", "-c", code]


ANNOUNCE = (f"print({SERVE_ANNOUNCEMENT.format(url='http://127.0.0.1:9')!r}); "
            "import time; time.sleep(60)")
HELLO = "import os; print('hello', os.environ['KVLOOP_TEST'], 'PATH' in os.environ); "


def test_url_from_the_announcement_and_output_relayed(tmp_path: Path,
                                                      capfd: pytest.CaptureFixture[str]) -> None:
    p = UrlProcess(child(HELLO + ANNOUNCE), tmp_path / "c.log", SERVE_URL_LINE,
                   env={"KVLOOP_TEST": "on"}, echo="[c] ")
    p.launch()
    assert p.alive() and p.url == ""
    assert p.wait_url(30) is p and p.url == "http://127.0.0.1:9"
    assert p.stop(10) == -signal.SIGTERM and not p.alive()
    out = capfd.readouterr().out.splitlines()
    assert out == ["[c] hello on True", "[c] kvloop serving on http://127.0.0.1:9"]
    assert p.log() == "hello on True\nkvloop serving on http://127.0.0.1:9\n"


def test_a_child_that_exits_or_never_serves_is_named_with_its_last_output(
        tmp_path: Path) -> None:
    lines = "; ".join(f"print('line {i}')" for i in range(50))
    exits = UrlProcess(child(lines + "; raise SystemExit(3)"), tmp_path / "a.log",
                       SERVE_URL_LINE, name="worker 7")
    with pytest.raises(RuntimeError) as e:
        exits.start(30)
    message = str(e.value)
    assert message.startswith("worker 7 did not start (exited with code 3); last output:\n"
                              "    line 10\n")
    assert message.endswith("    line 49") and "line 9\n" not in message
    silent = UrlProcess(child("import time; time.sleep(60)"), tmp_path / "b.log",
                        SERVE_URL_LINE)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"did not start \(no URL in 0.5 s\)"):
        silent.start(0.5)
    assert time.monotonic() - t0 < 10 and not silent.alive()   # killed, not left behind


def test_a_child_that_ignores_sigterm_is_killed(tmp_path: Path) -> None:
    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                + ANNOUNCE)
    p = UrlProcess(child(stubborn), tmp_path / "s.log", SERVE_URL_LINE).start(30)
    p.terminate()
    assert p.wait_or_kill(0.5) is None and not p.alive()
    assert p.proc is not None and p.proc.returncode == -signal.SIGKILL


def test_kvloop_command_runs_the_cli_with_or_without_the_parent_death_signal() -> None:
    for die in (False, True):
        out = subprocess.run(kvloop_command("--version", die_with_parent=die),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and kvloop.__version__ in out.stdout, out.stderr


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for a reaper that may never come)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_a_child_whose_parent_died_before_it_asked_for_the_signal_ends_at_once() -> None:
    """The parent-death signal is never sent for a parent already gone when the child asks
    for it (a `kvloop fleet` killed while its workers start): the child sees it has another
    parent and ends. Here a shell starts the child and exits at once, so the child's parent
    is never the process that built its command; without the check it would serve on."""
    cmd = kvloop_command("serve", "--model", "sim", "--port", "0", die_with_parent=True)
    out = subprocess.run(["sh", "-c", '"$@" >/dev/null 2>&1 & echo $!', "sh", *cmd],
                         capture_output=True, text=True, timeout=10, check=True)
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + 15
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    still = _running(pid)
    if still:
        os.kill(pid, signal.SIGKILL)
    assert not still, "the orphaned child went on running"
