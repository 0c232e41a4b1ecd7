"""Prompt -> token ids, exactly as the worker will see them, so the router's block hashes
equal the engine's.

Token-id prompts are taken as they are. Text prompts and chat messages use the worker's
tokenizer, found by the model path (else the model name) the worker reports: `bytes` is the
simulator's byte-level tokenizer (`--sim-model bytes`); the embedded model's name, `sim` (a
simulator wears the embedded model's vocabulary unless told otherwise) or nothing is the
embedded model's; a path goes through `kvloop.server.tokenizer.Tokenizer.from_model`. The
rules follow vLLM's OpenAI server: completions add special tokens unless
`add_special_tokens` is false; chat renders the template (with the generation prompt) and
adds no special tokens of its own.

Owner: one `PromptTokenizer` per router; it caches one tokenizer per model name.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger("kvloop.router")

EMBEDDED_ALIASES = ("", "sim")   # names whose tokenizer is the embedded model's


class PromptError(ValueError):
    """The request's prompt cannot be understood (the router answers 400)."""


class PromptTokenizer:
    """Token ids of a completions or chat request body (None: cannot tokenize locally)."""

    def __init__(self) -> None:
        self._tokenizers: dict[str, Any] = {}
        self._failed: dict[str, str] = {}
        self._lock = threading.Lock()

    def token_ids(self, path: str, body: dict[str, Any], model: str | None) -> list[int] | None:
        """The prompt of `body` as the worker serving `model` will tokenize it."""
        if path.endswith("/chat/completions"):
            return self._chat_ids(body, model)
        return self._completion_ids(body, model)

    def _completion_ids(self, body: dict[str, Any], model: str | None) -> list[int] | None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
            prompt = prompt[0]  # a batch of prompts: route by the first
        if isinstance(prompt, list):
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                       for t in prompt):
                raise PromptError("a token-id prompt must be a list of non-negative ints")
            return list(prompt)
        if not isinstance(prompt, str):
            raise PromptError("'prompt' must be a string, a list of token ids, or a list "
                              "of those")
        tok = self._tokenizer(model)
        if tok is None:
            return None
        return list(tok.encode(prompt, add_special_tokens=body.get("add_special_tokens",
                                                                    True)))

    def _chat_ids(self, body: dict[str, Any], model: str | None) -> list[int] | None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise PromptError("'messages' must be a non-empty list")
        plain = [_plain(m) for m in messages]
        tok = self._tokenizer(model)
        if tok is None:
            return None
        add_gen = (body.get("add_generation_prompt", True)
                   and not body.get("continue_final_message", False))
        try:
            text = tok.apply_chat_template(plain, add_generation_prompt=add_gen)
        except Exception as e:  # a template error is the worker's to report, not ours
            log.debug("chat template failed locally (%s); routing by load", e)
            return None
        return list(tok.encode(text, add_special_tokens=body.get("add_special_tokens",
                                                                  False)))

    def _tokenizer(self, model: str | None) -> Any:
        key = model or ""
        with self._lock:
            if key in self._tokenizers:
                return self._tokenizers[key]
            if key in self._failed:
                return None
            try:
                tok = _load(model)
            except Exception as e:
                self._failed[key] = str(e)
                log.warning("no local tokenizer for model %r (%s): text prompts are routed "
                            "by load only", model, e)
                return None
            self._tokenizers[key] = tok
            return tok


def _plain(message: Any) -> dict[str, Any]:
    """A chat message as the worker renders it: its role and its text (parts joined)."""
    if not isinstance(message, dict) or "role" not in message:
        raise PromptError(f"each message needs a 'role', got {message!r}")
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return {"role": message["role"], "content": content or ""}


def _load(model: str | None) -> Any:
    from kvloop.sim.tokenizer import BYTE_VOCAB, ByteTokenizer

    if model == BYTE_VOCAB:
        return ByteTokenizer()
    from kvloop.server.tokenizer import EMBEDDED_NAME, Tokenizer

    embedded = model is None or model in EMBEDDED_ALIASES or model == EMBEDDED_NAME
    return Tokenizer.from_model(None if embedded else model)
