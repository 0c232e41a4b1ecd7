"""`python -m kvloop.bench.steps`: each policy's steps timed part by part on a tiny 4-bit model
(which parts ran, not how fast), and the model left as it was found."""

from __future__ import annotations

import pytest

from kvloop.bench import steps
from kvloop.model import llama
from kvloop.model.quant import LowBitPolicy

from .test_low_bit import write_q4_gguf


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    from kvloop import LLM

    llm = LLM(str(write_q4_gguf(tmp_path_factory.mktemp("steps"))), dtype="float32",
              num_threads=1, low_bit_max_tokens=0)
    yield llm
    llm.shutdown()


@pytest.mark.slow
def test_each_policy_s_steps_are_timed_in_the_parts_that_ran(tiny_llm):
    model = tiny_llm.runner.model
    before = model.low_bit
    originals = (llama.Linear.forward, llama.Linear.argmax, llama.FusedDecode.forward,
                 llama.paged_attention, type(tiny_llm.runner)._timed_forward)
    policies = {"fused": LowBitPolicy(64, 64, 64), "dense": LowBitPolicy(0, 0, 0)}
    figures = steps.measure_rows(tiny_llm, rows=3, context=12, steps=2, policies=policies,
                                 seed=0)
    fused, dense = figures["fused"], figures["dense"]
    assert dense["fused"] == 0 and dense["linears"] > 0 and dense["attention"] > 0
    assert model.fused_decode is not None
    assert fused["fused"] > 0 and fused["linears"] == 0 and fused["attention"] == 0
    for f in figures.values():
        assert f["head"] > 0 and f["step"] >= f["forward"] > 0
    assert (llama.Linear.forward, llama.Linear.argmax, llama.FusedDecode.forward,
            llama.paged_attention, type(tiny_llm.runner)._timed_forward) == originals
    assert model.low_bit == before and not tiny_llm.engine.has_unfinished_requests()
    table = steps.report({3: figures}, 12)
    assert "| 3 | fused |" in table and "| 3 | dense |" in table


def test_a_policy_is_three_whole_numbers():
    assert steps.parse_policy("f=4,8,16") == ("f", LowBitPolicy(4, 8, 16))
    for bad in ("f=4,8", "=4,8,16", "f4,8,16", "f=4,x,16"):
        with pytest.raises(SystemExit, match="NAME=T,H,D"):
            steps.parse_policy(bad)
