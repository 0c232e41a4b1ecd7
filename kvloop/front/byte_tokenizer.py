"""A byte-level tokenizer for simulated workers (`kvloop serve --model sim --sim-model bytes`).

It speaks the byte vocabulary of `kvloop.sim.byte_vocab` (ids 0-255 are the bytes of the UTF-8
text; a few special ids follow) with the interface of `kvloop.front.tokenizer.Tokenizer`
(encode, decode, apply_chat_template, special ids), so the API server serves text prompts and
chat to a simulator exactly as to a real model, and `new_detokenizer` gives the matching
incremental detokenizer. No model files, no downloads. `kvloop serve --model sim` speaks a
real model's vocabulary by default; `--sim-model bytes` (`BYTE_VOCAB`) chooses this one, for
tests that count bytes. `kvloop.front.tokenizer.load_vocabulary` loads it by that name.

Non-goals: merges, normalization, anything a real tokenizer learns.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

from kvloop.sim.byte_vocab import NUM_BYTES, SPECIAL_TOKENS, VOCAB_SIZE


class ByteIncrementalDetokenizer:
    """Turns a stream of byte-token ids into text deltas (UTF-8 safe across token borders)."""

    def __init__(self, tokenizer: ByteTokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""

    def push(self, new_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete (may be empty mid-character)."""
        parts: list[str] = []
        for i in new_ids:
            if i < NUM_BYTES:
                parts.append(self._decoder.decode(bytes([i])))
            elif not self._skip:
                parts.append(self._decoder.decode(b"", final=True))
                parts.append(self._tok.special_text(i))
        delta = "".join(parts)
        self.text += delta
        return delta

    def flush(self) -> str:
        """End of stream: an unfinished character becomes U+FFFD."""
        delta = self._decoder.decode(b"", final=True)
        self.text += delta
        return delta


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus `SPECIAL_TOKENS` after them."""

    def __init__(self, model_name: str = "sim"):
        self.model_name = model_name
        self.vocab_size = VOCAB_SIZE
        self.eos_token_id = NUM_BYTES
        self.bos_token_id = NUM_BYTES + 1
        self.all_special_ids = list(range(NUM_BYTES, self.vocab_size))

    @classmethod
    def from_model(cls, model: str | None = None) -> ByteTokenizer:
        return cls(model or "sim")

    def special_text(self, token_id: int) -> str:
        if not NUM_BYTES <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is out of range [0, {self.vocab_size})")
        return SPECIAL_TOKENS[token_id - NUM_BYTES]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The UTF-8 bytes of `text` (no BOS is added: the simulator needs none)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        det = ByteIncrementalDetokenizer(self, (), skip_special_tokens)
        return det.push(ids) + det.flush()

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """ChatML as plain text: `<|im_start|>role\\ncontent<|im_end|>\\n` per message (other
        template variables, `tools`, are not shown)."""
        parts = [f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n"
                 for m in messages]
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    def new_detokenizer(self, prompt_ids: Sequence[int],
                        skip_special_tokens: bool = True) -> ByteIncrementalDetokenizer:
        return ByteIncrementalDetokenizer(self, prompt_ids, skip_special_tokens)
