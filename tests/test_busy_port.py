"""A port in use is the same one-line error from every entry point that listens, before
anything slow starts (no worker, no model load), never a traceback."""

from __future__ import annotations

import subprocess

import pytest

from kvloop.front.launcher import kvloop_command
from kvloop.front.sockets import bind_tcp

SAYS = "the port is in use; pass another --port (--port 0 picks a free one)"


@pytest.mark.processes
@pytest.mark.parametrize("args", [
    ["serve", "sim"],
    ["router"],
    ["fleet", "--workers", "1", "--", "--model", "sim"],
    ["fleet", "--ray", "127.0.0.1:9", "--workers", "1"],   # before connecting to Ray
], ids=["serve", "router", "fleet", "fleet-ray"])
def test_every_front_says_the_same_line_for_a_busy_port(args: list[str]) -> None:
    held = bind_tcp("127.0.0.1", 0)
    held.listen()
    port = held.getsockname()[1]
    try:
        done = subprocess.run(kvloop_command(*args[:1], "--port", str(port), *args[1:]),
                              capture_output=True, text=True, timeout=120)
    finally:
        held.close()
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}: {SAYS}" in out
    assert "Traceback" not in out and "starting" not in out   # no fleet worker was started
