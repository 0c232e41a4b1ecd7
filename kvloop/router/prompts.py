"""Prompt -> token ids, exactly as the worker will see them, so the router's block hashes
equal the engine's.

The body is read and tokenized by the API server's own code, shared by every HTTP front
(`kvloop.front.prompts`), with the worker's tokenizer. Where it comes from, in order:

1. `--tokenizer PATH` (vLLM's flag name): that .gguf file or Hugging Face folder, for every
   model;
2. the router's own copy of the model the worker names, loaded by the same loader as the
   worker's (`kvloop.front.tokenizer.load_vocabulary`): the model path the worker reports
   (to a local or keyed caller), else its model name; the embedded model's name, `sim` (a
   simulator wears the embedded model's vocabulary unless told otherwise) or nothing stand
   for the embedded model;
3. the worker itself: `GET /kvloop/tokenizer` (`kvloop.front.tokenizer_files`), with the
   router's --worker-api-key, so a router on another host needs no copy of the files.

A model for which all of these fail is a *problem*: `/health` says `degraded` with the cause
and the fix, `kvloop_router_tokenizer_missing{model}` is 1, and each text or chat request
routed by load only counts in `kvloop_router_untokenized_requests`. A failed fetch is tried
again after `RETRY_S`. A body the server would refuse is routed by load: the worker answers
it, in its own words.

Owner: one `PromptTokenizer` per router; it caches one tokenizer (or one failure) per model.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvloop.front.embeddings import EmbeddingRequest, embedding_inputs
from kvloop.front.prompts import (
    BoundedTokenizer,
    PromptError,
    body_prompts,
    check_prompt_tokens,
)
from kvloop.front.responses import Message
from kvloop.front.tokenizer import load_vocabulary
from kvloop.locate import EMBEDDED_NAME

if TYPE_CHECKING:
    from kvloop.router.metrics import RouterMetrics
    from kvloop.router.registry import WorkerState

log = logging.getLogger("kvloop.router")

EMBEDDED_ALIASES = ("", "sim", EMBEDDED_NAME)   # names whose tokenizer is the embedded model's
RETRY_S = 30.0   # a model whose tokenizer could not be had is tried again after this long
FIX = ("fix: give the router the model's tokenizer (--tokenizer PATH: a .gguf file or a "
       "Hugging Face folder), or let it fetch it from a worker (GET /kvloop/tokenizer: the "
       "router's --worker-api-key must be one the worker accepts)")

UNKNOWN_CONTEXT_TOKENS = 131072   # the context assumed to bound the work when none is known
Fetch = Callable[[], Awaitable[Any]]   # the tokenizer from a worker; raises with the cause


class PromptTokenizer:
    """Token ids of a completions or chat request body (None: cannot tokenize locally)."""

    def __init__(self, tokenizer_path: str | None = None,
                 metrics: RouterMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.tokenizer_path = tokenizer_path
        self.metrics = metrics
        self.clock = clock
        self._tokenizers: dict[str, Any] = {}
        self._failed: dict[str, tuple[str, float]] = {}   # model -> (cause, when)
        self._lock = threading.Lock()
        self._loading: asyncio.Lock | None = None   # one load or fetch at a time

    def token_ids(self, path: str, body: dict[str, Any], model: str | None,
                  history: list[Message] | None = None, max_model_len: int | None = None
                  ) -> list[int] | None:
        """The prompt of `body` (the first of a batch; a Responses body continuing
        `history`) as the worker serving `model` will tokenize it; None when there is no
        tokenizer for it (counted), the worker will refuse the body, or its text is too long
        to tokenize cheaply (`BoundedTokenizer`). Raises PromptTooLong when it has at least
        `max_model_len` tokens (the largest context of the fleet; None: unknown, nothing is
        refused and the work is bounded by `UNKNOWN_CONTEXT_TOKENS`), unless the body cuts
        its prompt itself (`truncate_prompt_tokens`)."""
        refuse = max_model_len is not None and body.get("truncate_prompt_tokens") is None
        tok = BoundedTokenizer(self._tokenizer(model), max_model_len or UNKNOWN_CONTEXT_TOKENS,
                               refuse)
        try:
            ids = body_prompts(tok, path, body, history)[0]
        except PromptError as e:  # the worker's to answer, not ours
            if isinstance(e.__cause__, NoTokenizerError) and self.metrics is not None:
                self.metrics.untokenized.labels(model or "").inc()
            log.debug("prompt not tokenized locally (%s); routing by load", e)
            return None
        if refuse and max_model_len is not None:
            check_prompt_tokens(max_model_len, len(ids))   # a token-id prompt's length
        return ids

    def embedding_ids(self, req: EmbeddingRequest, model: str | None) -> list[int] | None:
        """The first input of an embeddings request as the worker will tokenize it (a
        `truncate_prompt_tokens` of -1, which needs the worker's context length, cuts
        nothing here); None as `token_ids` (a text too long to tokenize cheaply too)."""
        tok = BoundedTokenizer(self._tokenizer(model), UNKNOWN_CONTEXT_TOKENS, refuse=False)
        try:
            return embedding_inputs(tok, req, None)[0]
        except PromptError as e:
            log.debug("input not tokenized locally (%s); routing by load", e)
            return None

    def _tokenizer(self, model: str | None) -> Any:
        """The tokenizer for `model` as far as it is known: loaded locally on first use when
        `ensure` has not run for it (a failure remembered), else `_NO_TOKENIZER`."""
        key = model or ""
        if key not in self._tokenizers and key not in self._failed:   # no ensure() first
            self._settle(key, *self._load_local(key))
        return self._tokenizers.get(key, _NO_TOKENIZER)

    async def ensure(self, model: str | None, fetch: Fetch | None) -> None:
        """Have a tokenizer for `model`: the flag's, a local copy, or `fetch`'s (module
        docstring); a failure is remembered (a /health problem) and tried again later."""
        key = model or ""
        if key in self._tokenizers or not self._due(key):
            return
        if self._loading is None:
            self._loading = asyncio.Lock()
        async with self._loading:
            if key not in self._tokenizers and self._due(key):
                await self._load(key, fetch)

    async def _load(self, key: str, fetch: Fetch | None) -> None:
        tok, cause = self._load_local(key)
        if tok is None and fetch is not None and self.tokenizer_path is None:
            try:
                tok = await fetch()
            except Exception as e:   # any failure of the fetch is a cause to report
                cause += f"; fetching it from a worker failed: {e}"
        self._settle(key, tok, cause)

    def _settle(self, key: str, tok: Any, cause: str) -> None:
        if tok is None:
            self._fail(key, cause)
        else:
            self._install(key, tok)

    def _due(self, key: str) -> bool:
        failed = self._failed.get(key)
        return failed is None or self.clock() - failed[1] >= RETRY_S

    def _load_local(self, key: str) -> tuple[Any, str]:
        """(tokenizer, "") or (None, why it cannot be loaded here)."""
        source = self.tokenizer_path or (None if key in EMBEDDED_ALIASES else key)
        try:
            return load_vocabulary(source).tokenizer, ""
        except Exception as e:   # not found, unreadable, not a model: all say the same
            where = f"--tokenizer {self.tokenizer_path}" if self.tokenizer_path else \
                "no local copy of it"
            return None, f"{where}: {e}"

    def _install(self, key: str, tok: Any) -> None:
        with self._lock:
            self._tokenizers[key] = tok
            had = self._failed.pop(key, None)
        if self.metrics is not None:
            self.metrics.tokenizer_missing.labels(key).set(0)
        if had is not None:
            log.warning("tokenizer for model %r found: text and chat prompts are routed by "
                        "prefix again", key)

    def _fail(self, key: str, cause: str) -> None:
        with self._lock:
            first = key not in self._failed
            self._failed[key] = (cause, self.clock())
        if self.metrics is not None:
            self.metrics.tokenizer_missing.labels(key).set(1)
        if first:
            log.error("%s", _problem(key, cause))

    def problems(self) -> list[str]:
        """The /health reasons: one per model the router cannot tokenize for."""
        with self._lock:
            return [_problem(k, cause) for k, (cause, _) in self._failed.items()]


def _problem(model: str, cause: str) -> str:
    return (f"no tokenizer for model {model!r} ({cause}): text and chat requests are "
            f"routed by load only, without prefix-cache credit; {FIX}")


class NoTokenizerError(ValueError):
    """Text or chat met a model whose tokenizer the router does not have."""


class _NoTokenizer:
    """In place of a tokenizer the router does not have: token-id prompts still route by
    prefix; text and chat raise (and are routed by load, counted)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NoTokenizerError("the router has no tokenizer for this model")

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        raise NoTokenizerError("the router has no tokenizer for this model")


_NO_TOKENIZER = _NoTokenizer()


def fleet_context(workers: Sequence[WorkerState]) -> int | None:
    """The largest `max_model_len` of the usable workers: a prompt at least this long fits
    none of them. None when one of them does not say (no kvloop worker) or none is up."""
    lens = [w.description.max_model_len if w.description is not None else None
            for w in workers if w.up]
    if not lens or any(n is None for n in lens):
        return None
    return max(n for n in lens if n is not None)
