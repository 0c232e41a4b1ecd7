"""The `processes` marker cannot be forgotten: tests/conftest.py fails an unmarked test that
started a child process or a listening server, in its setup, call or teardown."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes   # runs an inner pytest session in a child process

ROOT = Path(__file__).resolve().parents[1]

INNER = '''
import socket
import subprocess
import sys

import pytest


def test_spawns():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_listens():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()


@pytest.fixture(scope="module")
def server():
    with subprocess.Popen([sys.executable, "-c", "pass"]) as p:
        yield p


def test_uses_a_server_fixture(server):
    pass


@pytest.mark.processes
def test_marked_may_do_both(server):
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()


def test_plain_bind_and_threads_are_fine():
    import threading

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))   # bound, never listening: a held port, not a server
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()
'''


def test_unmarked_tests_that_start_processes_or_servers_fail(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    pytester.makeconftest("from tests.conftest import (pytest_runtest_call,  # noqa: F401\n"
                          "    pytest_runtest_setup, pytest_runtest_teardown)\n")
    pytester.makeini("[pytest]\nmarkers =\n    processes: starts processes or servers\n"
                     "addopts = --strict-markers -p no:cacheprovider\n")
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=2, failed=2, errors=1)
    result.stdout.fnmatch_lines_random([
        "E * AssertionError: test_inner.py::test_spawns started subprocess.Popen [[]*'-c', "
        "'pass'[]] but is not marked `processes` (add @pytest.mark.processes*",
        "E * AssertionError: test_inner.py::test_listens started a server listening on "
        "('127.0.0.1', *) but is not marked `processes`*",
        "E * AssertionError: test_inner.py::test_uses_a_server_fixture started "
        "subprocess.Popen *",
    ])


@pytest.mark.parametrize(("text", "markexpr", "never"), [
    ("pytestmark = pytest.mark.processes\n", "not processes and not slow", True),
    ("pytestmark = pytest.mark.processes\n", "processes", False),
    ("pytestmark = pytest.mark.processes\n", "", False),
    ("pytestmark = [pytest.mark.processes, pytest.mark.slow]\n", "not slow", True),
    # a test of a slow module may add `processes`: `-m processes` must still import it
    ("pytestmark = pytest.mark.slow\n@pytest.mark.processes\n", "processes", False),
    ("pytestmark = pytest.mark.slow\n@pytest.mark.processes\n", "not slow", True),
    ("pytestmark = [pytest.mark.skipif(True, reason='x')]\n", "not processes", False),
    # a list over lines, a skipif first, a comment after it
    ("pytestmark = [pytest.mark.skipif(not X, reason='y'),\n"
     "              pytest.mark.slow]   # the real model\n", "not processes and not slow", True),
    ("pytestmark = [pytest.mark.skipif(not X, reason='y'),\n"
     "              pytest.mark.slow]\n@pytest.mark.processes\n", "processes", False),
    ("pytestmark = pytest.mark.skipif(not X, reason='y')\n@pytest.mark.slow\n", "not slow",
     False),
    ("import pytest\n", "not processes", False),
])
def test_a_module_is_left_unimported_only_when_no_test_of_it_can_be_selected(
        text: str, markexpr: str, never: bool) -> None:
    from .conftest import _never_selected

    assert _never_selected(text, markexpr) is never
