"""The discovery file's format (kvloop/router/discovery_file.py): what it accepts, what it
refuses, in its own words."""

from __future__ import annotations

import pytest

from kvloop.router.discovery_file import parse_workers
from kvloop.router.registry import WorkerSpec


def test_every_accepted_shape_gives_the_same_workers():
    want = [WorkerSpec("http://10.0.0.5:8000"), WorkerSpec("http://10.0.0.6:8000", "decode"),
            WorkerSpec("http://10.0.0.7:8000", "prefill")]
    text = """
workers:
  - url: http://10.0.0.5:8000/
  - url: http://10.0.0.6:8000
    labels: {llm-d.ai/role: decode}
  - address: 10.0.0.7
    port: 8000
    role: prefill
"""
    assert parse_workers(text) == want
    assert parse_workers("- http://10.0.0.5:8000\n") == want[:1]
    assert parse_workers("endpoints:\n  - url: http://10.0.0.5:8000\n") == want[:1]
    assert parse_workers("") == [] and parse_workers("workers:\n") == []


@pytest.mark.parametrize(("text", "says"), [
    ("workers: {a: 1}", "expected a list"),
    ("workers: [{url: 'ftp://x'}]", "worker 0: worker URL must look like"),
    ("- url: http://a:1\n  role: chef\n", "worker 0: worker role must be one of"),
    ("- http://a:1\n- http://a:1\n", "listed twice"),
    ("- [1, 2]\n", "worker 0: expected a mapping"),
    ("workers: [\n", "not YAML"),
])
def test_a_bad_file_is_refused_saying_why(text, says):
    with pytest.raises(ValueError, match=says):
        parse_workers(text)
