"""Shared test helpers."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvloop.server.launcher import ServeProcess

DATA = Path(__file__).parent / "data"
CONFORMANCE = DATA / "conformance"


@pytest.fixture
def conformance_dir() -> Path:
    return CONFORMANCE


@contextmanager
def serving(tmp_path_factory: pytest.TempPathFactory, name: str, args: Sequence[str],
            timeout_s: float = 60.0, env: dict[str, str] | None = None
            ) -> Iterator[ServeProcess]:
    """A real `kvloop serve ARGS` for a module's tests; its log must end without a traceback."""
    log = tmp_path_factory.mktemp(name) / "serve.log"
    with ServeProcess(list(args), log, env).start(timeout_s=timeout_s) as srv:
        yield srv
    assert "Traceback" not in srv.log(), srv.log()
