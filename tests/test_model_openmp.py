"""The engine bounds OpenMP spin-waiting before torch loads, and respects the user's choice.

Each case runs in a fresh interpreter: libgomp reads its environment once, when torch loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import json, os, sys
{pre}
import kvloop.engine.proc  # what the engine process imports before it loads the model
from kvloop.model import default_openmp_spin
changed = default_openmp_spin()
print(json.dumps({{"changed": changed, "spin": os.environ.get("GOMP_SPINCOUNT"),
                  "torch_loaded": "torch" in sys.modules}}))
"""


def _probe(env_extra: dict[str, str], pre: str = "") -> dict[str, object]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", PROBE.format(pre=pre)], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.processes
def test_default_spin_count_is_set_before_torch_loads() -> None:
    assert _probe({}) == {"changed": True, "spin": "10000", "torch_loaded": False}


@pytest.mark.processes
@pytest.mark.parametrize("env", [{"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "active"}])
def test_user_wait_policy_is_left_alone(env: dict[str, str]) -> None:
    assert _probe(env) == {"changed": False, "spin": None, "torch_loaded": False}


@pytest.mark.processes
def test_user_spin_count_is_left_alone() -> None:
    assert _probe({"GOMP_SPINCOUNT": "5"}) == {"changed": False, "spin": "5",
                                               "torch_loaded": False}


@pytest.mark.processes
def test_too_late_once_torch_is_loaded() -> None:
    assert _probe({}, pre="import torch") == {"changed": False, "spin": None,
                                              "torch_loaded": True}


def test_set_cpu_threads_respects_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from kvloop.model.setup import set_cpu_threads

    before = torch.get_num_threads()
    try:
        set_cpu_threads(1)
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        set_cpu_threads(None)                      # the user's choice stands
        assert torch.get_num_threads() == 1
        monkeypatch.delenv("OMP_NUM_THREADS")
        set_cpu_threads(None)                      # default: the cores we may use
        assert torch.get_num_threads() == len(os.sched_getaffinity(0))
        with pytest.raises(ValueError):
            set_cpu_threads(0)
    finally:
        torch.set_num_threads(before)
