"""Shared test helpers."""

from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
CONFORMANCE = DATA / "conformance"


@pytest.fixture
def conformance_dir() -> Path:
    return CONFORMANCE
