"""The shared test helpers of tests/conftest.py keep their contracts."""

from __future__ import annotations

import errno
import socket
import time
from collections.abc import Callable

import pytest
import zmq

from .conftest import WAIT_POLL_MAX_S, wait_until


def test_wait_until_returns_the_value_or_names_what_it_waited_for() -> None:
    calls: list[float] = []

    def later() -> list[float] | None:
        calls.append(time.monotonic())
        return calls if len(calls) == 3 else None

    assert wait_until(later, 5, "three calls") is calls
    calls.clear()
    timeout = 4 * WAIT_POLL_MAX_S   # an interval doubled without the cap would pass 3 times it
    message = rf"^timed out after {timeout} s waiting for the moon$"
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=message):
        wait_until(lambda: calls.append(time.monotonic()), timeout, "the moon")
    assert time.monotonic() - t0 >= timeout
    gaps = [b - a for a, b in zip(calls, calls[1:], strict=False)]
    # polled often, never much more than WAIT_POLL_MAX_S apart
    assert len(calls) >= 5 and max(gaps) < 3 * WAIT_POLL_MAX_S


def test_a_free_port_is_refused_until_a_server_binds_it_and_rebinds_it(
        free_port: Callable[[], int]) -> None:
    port = free_port()
    with socket.socket() as c:
        assert c.connect_ex(("127.0.0.1", port)) == errno.ECONNREFUSED
    with pytest.raises(OSError), socket.socket() as plain:   # nor can a bind without
        plain.bind(("127.0.0.1", port))                      # SO_REUSEADDR take it
    for _ in range(2):   # a publisher binds it, stops, and a restarted one binds it again
        ctx = zmq.Context()   # each its own, as each publisher: term() returns once closed
        pub, other = ctx.socket(zmq.PUB), ctx.socket(zmq.PUB)
        try:
            pub.bind(f"tcp://127.0.0.1:{port}")
            with pytest.raises(zmq.ZMQError, match="in use"):   # but only one at a time
                other.bind(f"tcp://127.0.0.1:{port}")
        finally:
            pub.close(0)
            other.close(0)
            ctx.term()


def test_the_modules_started_first_exist() -> None:
    """conftest's LONGEST_FIRST names modules of this folder (a renamed one would silently
    start last again)."""
    from pathlib import Path

    from .conftest import LONGEST_FIRST

    here = Path(__file__).parent
    assert [m for m in LONGEST_FIRST if not (here / f"{m}.py").is_file()] == []


def test_the_transformers_modules_are_one_unit_of_work() -> None:
    """conftest's TRANSFORMERS_MODULES name modules of this folder, and `make test-fast`'s
    scheduler gives their tests one unit of work and every other module its own."""
    from pathlib import Path

    from .conftest import TRANSFORMERS_MODULES, work_unit

    here = Path(__file__).parent
    assert [m for m in TRANSFORMERS_MODULES if not (here / f"{m}.py").is_file()] == []
    assert work_unit("tests/test_model_archs.py::test_x[qwen3-hf]") == "transformers"
    assert work_unit("tests/test_llm.py::test_y") == "transformers"
    assert work_unit("tests/test_helpers.py::test_z") == "tests/test_helpers.py"
