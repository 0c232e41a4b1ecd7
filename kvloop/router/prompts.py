"""Prompt -> token ids, exactly as the worker will see them, so the router's block hashes
equal the engine's.

The body is read and tokenized by the API server's own code, shared by every HTTP front
(`kvloop.front.prompts`), with the worker's tokenizer, loaded by the same loader
(`kvloop.front.tokenizer.load_vocabulary`) from the model path the worker reports, else from
its model name: the embedded model's name, `sim` (a simulator wears the embedded model's
vocabulary unless told otherwise) or nothing stand for the embedded model. A body the server
would refuse is routed by load: the worker answers it, in its own words.

Owner: one `PromptTokenizer` per router; it caches one tokenizer per model name.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from kvloop.front.embeddings import EmbeddingRequest, embedding_inputs
from kvloop.front.prompts import PromptError, body_prompts
from kvloop.front.responses import Message
from kvloop.front.tokenizer import load_vocabulary
from kvloop.locate import EMBEDDED_NAME

log = logging.getLogger("kvloop.router")

EMBEDDED_ALIASES = ("", "sim", EMBEDDED_NAME)   # names whose tokenizer is the embedded model's


class PromptTokenizer:
    """Token ids of a completions or chat request body (None: cannot tokenize locally)."""

    def __init__(self) -> None:
        self._tokenizers: dict[str, Any] = {}
        self._failed: dict[str, str] = {}
        self._lock = threading.Lock()

    def token_ids(self, path: str, body: dict[str, Any], model: str | None,
                  history: list[Message] | None = None) -> list[int] | None:
        """The prompt of `body` (the first of a batch; a Responses body continuing
        `history`) as the worker serving `model` will tokenize it; None when there is no
        local tokenizer or the worker will refuse it."""
        try:
            return body_prompts(self._tokenizer(model), path, body, history)[0]
        except PromptError as e:  # the worker's to answer, not ours
            log.debug("prompt not tokenized locally (%s); routing by load", e)
            return None

    def embedding_ids(self, req: EmbeddingRequest, model: str | None) -> list[int] | None:
        """The first input of an embeddings request as the worker will tokenize it (a
        `truncate_prompt_tokens` of -1, which needs the worker's context length, cuts
        nothing here); None as `token_ids`."""
        try:
            return embedding_inputs(self._tokenizer(model), req, None)[0]
        except PromptError as e:
            log.debug("input not tokenized locally (%s); routing by load", e)
            return None

    def _tokenizer(self, model: str | None) -> Any:
        key = model or ""
        with self._lock:
            if key in self._tokenizers:
                return self._tokenizers[key]
            if key in self._failed:
                return _NO_TOKENIZER
            try:
                tok = load_vocabulary(None if key in EMBEDDED_ALIASES else key).tokenizer
            except Exception as e:
                self._failed[key] = str(e)
                log.warning("no local tokenizer for model %r (%s): text prompts are routed "
                            "by load only", model, e)
                return _NO_TOKENIZER
            self._tokenizers[key] = tok
            return tok


class _NoTokenizer:
    """In place of a tokenizer the router cannot load: token-id prompts still route by
    prefix; text and chat raise (and are routed by load)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise ValueError("the router has no tokenizer for this model")

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True) -> str:
        raise ValueError("the router has no tokenizer for this model")


_NO_TOKENIZER = _NoTokenizer()
