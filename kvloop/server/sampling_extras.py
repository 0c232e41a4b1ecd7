"""The OpenAI routes' token filters and prompt logprobs, with vLLM's meaning and bounds.

Request side (`extra_kwargs`): `logit_bias` (token id text -> bias, clamped to [-100, 100]),
`allowed_token_ids`, `bad_words`, `prompt_logprobs` (completions with `echo` and `logprobs`
ask for the prompt's logprobs at the `logprobs` count, vLLM's rule: that is how
lm-evaluation-harness scores a context). Every error is a ValueError whose message starts with
the field it names (the caller answers 400 with it as `param`). Vocabulary checks are
`SamplingParams.check_vocab`'s.

Response side (`prompt_logprobs_body`): vLLM's `prompt_logprobs`, a list with null for the
first prompt token and, for each other, {token id: {logprob, rank, decoded_token}}: the
prompt token and the top-n at its position; -inf becomes -9999.0 (JSON has no infinity).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvloop.front.openai import PromptLogprob, SamplingRequest
from kvloop.front.processor import TokenLogprob

MAX_LOGIT_BIAS = 1024          # entries of logit_bias (OpenAI documents no bound; vLLM none)
MAX_BAD_WORDS = 256
MAX_BAD_WORD_CHARS = 512
LOGPROB_FLOOR = -9999.0        # vLLM's stand-in for -inf in JSON


def extra_kwargs(req: SamplingRequest, echo_logprobs: int | None = None) -> dict[str, Any]:
    """SamplingParams keyword arguments of the request's token filters and prompt logprobs
    (`echo_logprobs`: a completion's `logprobs` when it echoes its prompt)."""
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None:
        prompt_logprobs = echo_logprobs
    elif prompt_logprobs < 0:
        raise ValueError(f"prompt_logprobs must be a non-negative value, got {prompt_logprobs}.")
    return {"prompt_logprobs": prompt_logprobs, "logit_bias": _logit_bias(req.logit_bias),
            "allowed_token_ids": _allowed(req.allowed_token_ids),
            "bad_words": _bad_words(req.bad_words)}


def check_prompt_logprobs(req: SamplingRequest, max_logprobs: int) -> None:
    """ValueError (about `prompt_logprobs`) for prompt logprobs a stream cannot carry or
    beyond `--max-logprobs`."""
    n = req.prompt_logprobs
    if n is None:
        return
    if req.stream and n > 0:
        raise ValueError("prompt_logprobs are not available when `stream=True`.")
    if n > max_logprobs:
        raise ValueError(f"Requested prompt logprobs of {n}, which is greater than max "
                         f"allowed: {max_logprobs}")


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(bias)} entries, more than {MAX_LOGIT_BIAS}.")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids, got {key[:32]!r}.") from None
        if token < 0:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {token}.")
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"logit_bias values must be finite numbers, got {value}.")
        out[token] = value
    return out


def _allowed(ids: list[int] | None) -> tuple[int, ...] | None:
    if ids is None:
        return None
    if not ids:
        raise ValueError("allowed_token_ids must not be empty.")
    if any(t < 0 for t in ids):
        raise ValueError("allowed_token_ids must be non-negative token ids.")
    return tuple(sorted(set(ids)))


def _bad_words(words: list[str] | None) -> tuple[str, ...]:
    if not words:
        return ()
    if len(words) > MAX_BAD_WORDS:
        raise ValueError(f"bad_words has {len(words)} words, more than {MAX_BAD_WORDS}.")
    if any(len(w) > MAX_BAD_WORD_CHARS for w in words):
        raise ValueError(f"bad_words has a word longer than {MAX_BAD_WORD_CHARS} characters.")
    return tuple(words)


def prompt_logprobs_body(entries: Sequence[TokenLogprob | None],
                         token_str: Callable[[int], str]
                         ) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs` JSON (see the module docstring)."""
    body: list[dict[str, PromptLogprob] | None] = []
    for e in entries:
        if e is None:
            body.append(None)
            continue
        position = {str(e.token_id): _logprob(e.logprob, e.rank, token_str(e.token_id))}
        for rank, (tid, lp) in enumerate(e.top, start=1):
            position.setdefault(str(tid), _logprob(lp, rank, token_str(tid)))
        body.append(position)
    return body


def _logprob(lp: float, rank: int | None, text: str) -> PromptLogprob:
    return {"logprob": max(lp, LOGPROB_FLOOR), "rank": rank, "decoded_token": text}
