"""The offline `LLM` API (vLLM-shaped) on a tiny random model: fast and exact."""

from __future__ import annotations

import json

import pytest
import torch

from kvloop import LLM, SamplingParams
from kvloop.core.request import ContextLengthError, TokenIdError
from kvloop.llm import CompletionOutput, RequestOutput
from tests.test_model_tiny import tiny_hf_model, write_hf_folder, write_tiny_gguf

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = write_tiny_gguf(tiny_hf_model(seed=11), tmp_path_factory.mktemp("llm") / "t.gguf")
    # fp32: a tiny random model's top logits sit close together; exact tokens are compared
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=4, num_threads=1,
              num_gpu_blocks_override=64, check_invariants=True)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def eos_llm(tmp_path_factory):
    """A model whose logits are all zero (final norm weight 0): greedy always picks id 0,
    which its tokenizer_config names as EOS."""
    model = tiny_hf_model(seed=12)
    with torch.no_grad():
        model.model.norm.weight.zero_()
    folder = write_hf_folder(model, tmp_path_factory.mktemp("eos") / "zero")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["eos_token"] = "<|endoftext|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    llm = LLM(str(folder), dtype="float32", device="cpu", num_gpu_blocks_override=32,
              num_threads=1)
    yield llm
    llm.shutdown()


def test_generate_text_and_token_prompts(llm):
    tok = llm.get_tokenizer()
    outs = llm.generate(["the cat", {"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
    assert [type(o) for o in outs] == [RequestOutput, RequestOutput]
    assert outs[0].prompt == "the cat" and outs[0].prompt_token_ids == tok.encode("the cat")
    assert outs[1].prompt is None and outs[1].prompt_token_ids == [5, 6, 7]
    for out in outs:
        (c,) = out.outputs
        assert isinstance(c, CompletionOutput) and out.finished
        assert len(c.token_ids) == 6 and c.finish_reason == "length"
        assert c.text == tok.decode(c.token_ids)
        assert c.logprobs is None and c.cumulative_logprob is None
    again = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)
    assert again[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_one_params_per_prompt_and_count_checked(llm):
    params = [SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)]
    outs = llm.generate(["a", "b"], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 4]
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate(["a", "b", "c"], params)
    with pytest.raises(ValueError, match="a prompt is a string"):
        llm.generate([{"text": "x"}])


def test_n_samples_with_seeds_are_reproducible_and_batch_independent(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    first = llm.generate("the cat", params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    samples = [c.token_ids for c in first.outputs]
    assert len({tuple(s) for s in samples}) > 1           # seeds 7, 8, 9 differ
    crowd = ["a b c", "the", {"prompt_token_ids": list(range(3, 40))}]
    mixed = llm.generate([*crowd, "the cat"], [SamplingParams(temperature=1.0, max_tokens=5)]
                         * 3 + [params], use_tqdm=False)[-1]
    assert [c.token_ids for c in mixed.outputs] == samples


def _ascii_prompt(llm):
    """A prompt whose greedy text starts with 3 printable ASCII characters (the random
    model also emits stray bytes of multi-byte characters)."""
    for first in range(3, 200):
        prompt = {"prompt_token_ids": [first, first + 1]}
        full = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
        if len(full.text) >= 3 and all(" " < ch < "~" for ch in full.text[:3]):
            return prompt, full
    raise AssertionError("no prompt gives printable text")


def test_stop_strings_truncate_and_abort(llm):
    prompt, full = _ascii_prompt(llm)
    stop = full.text[1:3]
    at = full.text.find(stop)
    cut = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.text == full.text[:at]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    assert len(cut.token_ids) < len(full.token_ids)
    keep = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, stop=stop,
                                               include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert keep.text == full.text[:at + len(stop)]
    assert not llm.engine.has_unfinished_requests()


def test_stop_strings_wait_for_min_tokens(llm):
    """As the API server and vLLM: a stop string completed within the first `min_tokens`
    tokens does not stop the request (the offline API used to stop at once)."""
    prompt, full = _ascii_prompt(llm)
    stop = full.text[0]
    early = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, stop=[stop],
                                                ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert (early.text, len(early.token_ids), early.stop_reason) == ("", 1, stop)
    late = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, stop=[stop],
                                               min_tokens=6, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert late.token_ids == full.token_ids and late.finish_reason == "length"


def test_logprobs(llm):
    c = llm.generate("the cat", SamplingParams(temperature=0.0, max_tokens=4, logprobs=3,
                                               ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == 4
    total = 0.0
    for token, entry in zip(c.token_ids, c.logprobs, strict=True):
        assert token in entry and entry[token].rank == 1      # greedy = top-1
        assert 3 <= len(entry) <= 4
        ranked = sorted(entry.values(), key=lambda lp: lp.rank)
        assert [lp.logprob for lp in ranked] == sorted((lp.logprob for lp in ranked),
                                                       reverse=True)
        assert entry[token].decoded_token == llm.get_tokenizer().decode([token], False)
        total += entry[token].logprob
    assert c.cumulative_logprob == pytest.approx(total)


def test_chat_applies_the_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)[0]
    assert out.prompt == ("<|im_start|>system\nYou are tiny.<|im_end|>\n<|im_start|>user\n"
                          "hi<|im_end|>\n<|im_start|>assistant\n")
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode(out.prompt, add_special_tokens=False)
    two = llm.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],
                   GREEDY, use_tqdm=False)
    assert len(two) == 2


def test_progress_bar(llm, capsys):
    llm.generate(["a", "b"], GREEDY, use_tqdm=True)
    assert "Processed prompts" in capsys.readouterr().err
    llm.generate(["a"], GREEDY, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


def test_prompt_longer_than_the_context_is_rejected(llm):
    """The server's check and message; a good prompt before the bad one is not left behind."""
    max_len = llm.runner.max_model_len
    too_long = list(range(3, 3 + max_len))
    with pytest.raises(ContextLengthError) as e:
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": too_long}], GREEDY)
    assert str(e.value) == (f"This model's maximum context length is {max_len} tokens. "
                            f"However, your request has {max_len} input tokens. Please reduce "
                            f"the length of the input messages.")
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_pool.get_num_free_blocks() == llm.engine.num_gpu_blocks - 1


@pytest.mark.parametrize("bad", [-1, "vocab"])
def test_a_prompt_token_outside_the_vocabulary_is_refused_and_the_engine_stays_usable(llm, bad):
    """The server's check and message (before, the step raised torch's IndexError and the
    request stayed unfinished forever); nothing is left behind and the next prompt runs."""
    vocab = llm.runner.vocab_size
    bad = vocab if bad == "vocab" else bad
    with pytest.raises(TokenIdError) as e:
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [5, bad, 6]}], GREEDY)
    assert str(e.value) == f"Token id {bad} is out of vocabulary [0, {vocab})"
    assert e.value.param == "prompt" and isinstance(e.value, ValueError)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_pool.get_num_free_blocks() == llm.engine.num_gpu_blocks - 1
    (out,) = llm.generate([{"prompt_token_ids": [5, vocab - 1]}], GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens


def test_eos_is_filled_from_the_tokenizer(eos_llm):
    assert eos_llm.get_tokenizer().eos_token_id == 0
    params = SamplingParams(temperature=0.0, max_tokens=5)
    assert params.eos_token_id is None
    (c,) = eos_llm.generate("the cat", params, use_tqdm=False)[0].outputs
    assert (c.token_ids, c.finish_reason) == ([0], "stop")
    (c,) = eos_llm.generate("the cat", SamplingParams(temperature=0.0, max_tokens=5,
                                                      min_tokens=3), use_tqdm=False)[0].outputs
    assert c.token_ids[:3] == [1, 1, 1] and c.token_ids[3] == 0   # EOS masked 3 times
    (c,) = eos_llm.generate("the cat", SamplingParams(temperature=0.0, max_tokens=5,
                                                      ignore_eos=True), use_tqdm=False)[0].outputs
    assert (c.token_ids, c.finish_reason) == ([0] * 5, "length")


def test_other_eos_ids_become_stop_tokens(eos_llm):
    from kvloop.front.tokenizer import Tokenizer

    base = eos_llm.get_tokenizer()
    tok = Tokenizer(base._tok, model_name="zero", chat_template=None, bos_token_id=None,
                    eos_token_id=0, extra_eos_ids=[0, 1])
    assert tok.stop_token_ids == {1}
    llm = LLM.from_runner(eos_llm.runner, tok, eos_llm.config, eos_llm.runner.num_gpu_blocks)
    (c,) = llm.generate("the cat", SamplingParams(temperature=0.0, max_tokens=5, min_tokens=2),
                        use_tqdm=False)[0].outputs
    assert c.token_ids == [2, 2, 0]      # 0 (EOS) and 1 (other EOS id) masked twice
