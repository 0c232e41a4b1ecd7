"""The vocabulary a `kvloop serve --model sim` worker speaks: SmolLM2's by default (49,152 ids,
its chat template, its 8,192-token context), another model's with `--sim-model PATH` (a tiny
Hugging Face tokenizer folder built here), or bytes with `--sim-model bytes`; and the clear
errors of bad choices. Real servers on 127.0.0.1, started and stopped here."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvloop.front.launcher import ServeProcess
from kvloop.front.tokenizer import Tokenizer, find_model_path
from kvloop.server.sim_model import SIM_TEXT, load_sim_model

from .conftest import post, serving

TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")
TINY_MODEL_VOCAB = 512      # the model's embedding rows: more than its tokenizer has
TINY_CONTEXT = 2048


def tiny_tokenizer_folder(root: Path) -> Path:
    """A byte-level BPE trained on a few sentences, with a chat template and a config.json
    that states the model's vocabulary size and context length."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=TINY_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([SIM_TEXT, "hello there, how are you today?"] * 4, trainer)
    root.mkdir()
    backend.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "chat_template": TINY_TEMPLATE}))
    (root / "config.json").write_text(json.dumps(
        {"vocab_size": TINY_MODEL_VOCAB, "max_position_embeddings": TINY_CONTEXT}))
    return root


def completion(srv: ServeProcess, prompt: object, max_tokens: int = 6) -> httpx.Response:
    return post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                         "return_token_ids": True})


def models_max_len(srv: ServeProcess) -> int:
    (m,) = httpx.get(srv.url + "/v1/models").json()["data"]
    return int(m["max_model_len"])


# --- the default: the embedded SmolLM2's surface -----------------------------------------------
def test_the_fake_tokens_of_smollm2_are_words() -> None:
    sim = load_sim_model(None)
    assert (sim.vocab_size, sim.context_length) == (49152, 8192)
    assert sim.source == find_model_path(None)
    texts = [sim.tokenizer.decode([t]) for t in sim.text_token_ids]
    assert all(re.fullmatch(" [a-z]+", t) for t in texts), texts
    assert sorted(texts) == sorted({" " + w for w in SIM_TEXT.split()})


@pytest.mark.processes
def test_default_sim_presents_smollm2(tmp_path_factory: pytest.TempPathFactory) -> None:
    with serving(tmp_path_factory, "sim_default", ["--model", "sim", "--sim-speedup", "100"]) \
            as srv:
        assert models_max_len(srv) == 8192
        w = httpx.get(srv.url + "/kvloop/worker").json()
        assert w["max_model_len"] == 8192 and w["model_path"] == find_model_path(None)
        assert completion(srv, [49151]).status_code == 200
        bad = completion(srv, [49152])
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
        assert "Token id 49152 is out of vocabulary" in bad.json()["error"]["message"]


# --- another model's vocabulary ------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, Path]]:
    folder = tiny_tokenizer_folder(tmp_path_factory.mktemp("tiny") / "tiny-tok")
    with serving(tmp_path_factory, "sim_tiny", [
            "--model", "sim", "--sim-model", str(folder), "--sim-speedup", "100"]) as srv:
        yield srv, folder


@pytest.mark.processes
def test_sim_model_folder_sets_vocabulary_context_and_template(tiny) -> None:
    srv, folder = tiny
    ref = Tokenizer.from_hf_folder(str(folder))
    assert ref.vocab_size < TINY_MODEL_VOCAB
    assert models_max_len(srv) == TINY_CONTEXT
    w = httpx.get(srv.url + "/kvloop/worker").json()
    assert w["model_path"] == str(folder) and w["max_model_len"] == TINY_CONTEXT
    # ids up to the model's vocabulary are accepted (as vLLM: the larger of the two sizes)
    assert completion(srv, [0, TINY_MODEL_VOCAB - 1]).status_code == 200
    bad = completion(srv, [TINY_MODEL_VOCAB])
    assert bad.status_code == 400 and f"[0, {TINY_MODEL_VOCAB})" in bad.json()["error"]["message"]
    assert completion(srv, [1] * TINY_CONTEXT).status_code == 400
    msgs = [{"role": "user", "content": "hello there"}]
    chat = post(srv, "/tokenize", {"messages": msgs}).json()["tokens"]
    assert chat == ref.encode(ref.apply_chat_template(msgs))
    assert ref.decode(chat) == "[user] hello there\n[assistant] "
    assert post(srv, "/tokenize", {"prompt": "hello"}).json()["tokens"] == ref.encode("hello")


@pytest.mark.processes
def test_sim_model_folder_generates_its_own_words(tiny) -> None:
    srv, folder = tiny
    ref = Tokenizer.from_hf_folder(str(folder))
    r = completion(srv, ref.encode("how are you"), max_tokens=12).json()
    (c,) = r["choices"]
    assert len(c["token_ids"]) == 12 and c["finish_reason"] == "length"
    assert set(c["token_ids"]) <= set(ref.encode(SIM_TEXT, add_special_tokens=False))
    assert c["text"] == ref.decode(c["token_ids"]) and re.fullmatch(r"[a-z ]+", c["text"])
    chat = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 4}).json()
    assert chat["usage"]["completion_tokens"] == 4
    assert chat["usage"]["prompt_tokens"] == len(ref.encode("[user] hi\n[assistant] "))


# --- bytes, on request ---------------------------------------------------------------------------
@pytest.mark.processes
def test_sim_model_bytes(tmp_path_factory: pytest.TempPathFactory) -> None:
    with serving(tmp_path_factory, "sim_bytes", ["--model", "sim", "--sim-model", "bytes",
                                                 "--sim-speedup", "100"]) as srv:
        t = post(srv, "/tokenize", {"prompt": "héllo"}).json()
        assert t["tokens"] == list("héllo".encode())
        chat = post(srv, "/tokenize", {"messages": [{"role": "user", "content": "a"}]}).json()
        assert chat["count"] == len("<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n")
        r = completion(srv, "abc", max_tokens=9).json()["choices"][0]
        assert len(r["text"]) == 9 and set(r["text"]) <= set(SIM_TEXT)
        assert completion(srv, [258]).status_code == 200
        assert completion(srv, [259]).status_code == 400
        assert models_max_len(srv) == 8192
        assert httpx.get(srv.url + "/kvloop/worker").json()["model_path"] == "bytes"


# --- bad choices ---------------------------------------------------------------------------------
@pytest.mark.processes
@pytest.mark.parametrize(("flags", "message"), [
    (["--sim-model", "/no/such/model"], "neither a .gguf file nor a Hugging Face folder"),
    (["--max-model-len", "9000"], "--max-model-len 9000 exceeds the context length"),
])
def test_bad_sim_flags_exit_with_a_clear_error(flags: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "kvloop", "serve", "--model", "sim", *flags,
                           "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    out = done.stdout + done.stderr
    assert done.returncode == 2 and message in out and "Traceback" not in out, out
