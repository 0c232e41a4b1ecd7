"""The model `kvloop serve --model sim` speaks: a real model's vocabulary, without its weights.

`--sim-model` names it, as `--model` names a real one:

- unset: the embedded SmolLM2-135M-Instruct (its GGUF, found by `kvloop.locate`);
- a `.gguf` file or a Hugging Face folder (`tokenizer.json`; `config.json` for the vocabulary
  size and context length when it has one);
- `bytes` (`BYTE_VOCAB`): the byte-level tokenizer of `kvloop.front.byte_tokenizer` (259
  ids), for tests that count bytes.

The API process loads it once (`load_sim_model`, with `kvloop.front.tokenizer.load_vocabulary`,
the loader a router applies to the model path the worker reports): the tokenizer, chat template
and special ids serve requests as for the real model, and three plain facts go to the engine
process, which never opens a model file: the ids the model accepts (`vocab_size`: as vLLM,
the larger of the model's and the tokenizer's vocabulary), its context length (the default
`max_model_len`) and the ids of the simulator's fake tokens (`text_token_ids`: the tokens of
an ordinary English sentence, so generated text reads as words and is never EOS or another
special token; a simulated request runs to `max_tokens` unless a stop string or a stop
token id ends it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvloop.config import DEFAULT_MAX_MODEL_LEN
from kvloop.front.tokenizer import load_vocabulary

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
    """The model named by `--sim-model` (None: the embedded one), loaded as a router loads
    it (`load_vocabulary`); ModelNotFoundError or ValueError when it cannot be read."""
    vocab = load_vocabulary(spec)
    return SimModel(vocab.tokenizer, vocab.source, vocab.vocab_size,
                    vocab.context_length or DEFAULT_MAX_MODEL_LEN,
                    text_token_ids(vocab.tokenizer))


def text_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """The distinct ids of `SIM_TEXT` in `tokenizer`, special ids left out, ascending."""
    special = set(tokenizer.all_special_ids)
    ids = tokenizer.encode(SIM_TEXT, add_special_tokens=False)
    return tuple(sorted(set(ids) - special))
