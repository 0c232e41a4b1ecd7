"""The model `kvloop serve --model sim` speaks: a real model's vocabulary, without its weights.

`--sim-model` names it, as `--model` names a real one:

- unset: the embedded SmolLM2-135M-Instruct (its GGUF, found by `find_model_path(None)`);
- a `.gguf` file or a Hugging Face folder (`tokenizer.json`; `config.json` for the vocabulary
  size and context length when it has one);
- `bytes` (`BYTE_VOCAB`): the byte-level tokenizer of `kvloop.sim.tokenizer` (259 ids), for
  tests that count bytes.

The API process loads it once (`load_sim_model`): the tokenizer, chat template and special
ids serve requests as for the real model, and three plain facts go to the engine process,
which never opens a model file: the ids the model accepts (`vocab_size`: as vLLM, the larger
of the model's and the tokenizer's vocabulary), its context length (the default
`max_model_len`) and the ids of the simulator's fake tokens (`text_token_ids`: the tokens of
an ordinary English sentence, so generated text reads as words and is never EOS or another
special token; a simulated request runs to `max_tokens` unless a stop string or a stop
token id ends it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvloop.config import DEFAULT_MAX_MODEL_LEN
from kvloop.server.gguf_metadata import read_gguf_metadata
from kvloop.server.tokenizer import Tokenizer, find_model_path, model_name_for
from kvloop.sim.tokenizer import BYTE_VOCAB, VOCAB_SIZE, ByteTokenizer

# Each word (with its space) is one token of SmolLM2's vocabulary, as of most BPE vocabularies.
SIM_TEXT = (" the quick brown fox jumps over the lazy dog while a small cat lies in the warm "
            "sun near an old wooden door and two birds sing in the green tree above the quiet "
            "river where people walk every morning to work or to school")


@dataclass(frozen=True)
class SimModel:
    """What a simulated worker presents. `source` is what it reports as its model path (and
    what a router loads to tokenize as it does): a file or folder, or `BYTE_VOCAB`."""

    tokenizer: Any
    source: str
    vocab_size: int
    context_length: int
    text_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.vocab_size < 1 or self.context_length < 1:
            raise ValueError(f"{self.source}: vocab_size and context_length must be >= 1")
        if not self.text_token_ids:
            raise ValueError(f"{self.source}: its tokenizer encodes ordinary text into "
                             "special tokens only")

    def max_model_len(self, requested: int | None) -> int:
        """`--max-model-len` (default: the context length); above the context length is an
        error, as for the real model."""
        if requested is None:
            return self.context_length
        if requested > self.context_length:
            raise ValueError(f"--max-model-len {requested} exceeds the context length of "
                             f"{self.source} ({self.context_length})")
        return requested


def load_sim_model(spec: str | None) -> SimModel:
    """The model named by `--sim-model` (None: the embedded one); ModelNotFoundError or
    ValueError when it cannot be read."""
    if spec == BYTE_VOCAB:
        return _sim_model(ByteTokenizer(), BYTE_VOCAB, VOCAB_SIZE, DEFAULT_MAX_MODEL_LEN)
    path = find_model_path(spec)
    tok: Tokenizer
    if path.endswith(".gguf"):
        meta = read_gguf_metadata(path)
        tok = Tokenizer.from_gguf_metadata(meta, model_name_for(spec))
        vocab, context = _gguf_limits(meta)
    else:
        tok = Tokenizer.from_hf_folder(path, model_name_for(spec))
        vocab, context = _hf_limits(Path(path))
    return _sim_model(tok, path, max(vocab, tok.vocab_size),
                      context or DEFAULT_MAX_MODEL_LEN)


def _sim_model(tok: Any, source: str, vocab_size: int, context_length: int) -> SimModel:
    return SimModel(tok, source, vocab_size, context_length, text_token_ids(tok))


def text_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """The distinct ids of `SIM_TEXT` in `tokenizer`, special ids left out, ascending."""
    special = set(tokenizer.all_special_ids)
    ids = tokenizer.encode(SIM_TEXT, add_special_tokens=False)
    return tuple(sorted(set(ids) - special))


def _gguf_limits(meta: dict[str, Any]) -> tuple[int, int]:
    """(vocabulary size, context length) from the metadata; 0 for one it does not state."""
    arch = meta.get("general.architecture", "llama")
    return (int(meta.get(f"{arch}.vocab_size") or 0),
            int(meta.get(f"{arch}.context_length") or 0))


def _hf_limits(root: Path) -> tuple[int, int]:
    """(vocab_size, max_position_embeddings) of config.json; 0 for one it lacks."""
    config = root / "config.json"
    cfg = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
    return int(cfg.get("vocab_size") or 0), int(cfg.get("max_position_embeddings") or 0)
