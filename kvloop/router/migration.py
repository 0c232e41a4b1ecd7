"""Mid-stream migration: a stream whose worker fails goes on on another worker.

`kvloop router --migration-limit N` (Dynamo's flag and meaning): when the worker serving a
stream fails after its headers (its connection breaks), the router sends the request to
another worker with the prompt plus every token it already relayed, and relays that answer
as the rest of the same stream:

    client <- worker A: chunk, chunk, ...  A dies
           <- worker B: POST /v1/completions {"prompt": prompt_ids + sent_ids,
                         "max_tokens": asked - sent, ...the request's sampling fields}
              translated: A's id, created and model; chat chunks for a chat stream; one
              usage chunk counting the whole answer (prompt: the client's prompt)

The client sees one uninterrupted answer, and greedy output equals an uninterrupted run (the
continuation's prompt is exactly the tokens the first worker had). At most N moves per
stream; then, or when no other worker takes it, the stream ends with the error event it
ends with without migration. A stream that failed before its first chunk is sent again as
it is; one that failed after its finishing chunk just ends. A worker that ends a stream
itself before its answer is complete moves it too: `finish_reason: "abort"` (its shutdown
timeout expired while it drained) or an error event (its engine died).

To know the token ids, the router asks a migratable stream for them (`return_token_ids`,
vLLM's field: the prompt's ids on the first chunk, each chunk's new ids) and strips them
again unless the client asked for them.

Which streams migrate (`refusal` says why one does not): completions and chat completions
with one choice (`n`, `best_of` 1), one prompt, no `echo`, `suffix`, `logprobs`,
`prompt_logprobs` or `truncate_prompt_tokens`, no structured output and no tools (the
continuation would restart a grammar or a tool-call parser mid-answer). Known limits: a stop
string split across the move is not seen; a seeded sampler restarts its seed on the new
worker.

Owner: one `Migration` per relayed stream, owned by that stream's relay
(kvloop/router/single.py); it is the only one that changes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvloop.front.openai import MaxTokens

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
MIGRATABLE_PATHS = (COMPLETIONS_PATH, CHAT_PATH)
# the fields a continuation keeps: what samples the rest of the answer the same way
SAMPLING_FIELDS = frozenset({
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "user", "ignore_eos", "stop",
    "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
    "spaces_between_special_tokens", "cache_salt", "priority", "allowed_token_ids",
    "bad_words"})
# fields whose meaning a continuation cannot keep (unless null or false)
_UNMIGRATABLE = ("echo", "suffix", "logprobs", "top_logprobs", "prompt_logprobs",
                 "truncate_prompt_tokens", "response_format", "structured_outputs",
                 "guided_json", "guided_regex", "guided_choice", "guided_grammar", "tools",
                 "kv_transfer_params")


def refusal(path: str, body: dict[str, Any]) -> str | None:
    """Why the stream of `body` (validated for `path`) cannot migrate; None: it can."""
    if path not in MIGRATABLE_PATHS:
        return f"{path} streams do not migrate"
    if body.get("n", 1) != 1 or body.get("best_of") not in (None, 1):
        return "n or best_of over 1"
    prompt = body.get("prompt")
    if path == COMPLETIONS_PATH and isinstance(prompt, list) and prompt \
            and not isinstance(prompt[0], int):
        return "several prompts"
    for name in _UNMIGRATABLE:
        value = body.get(name)
        if value is None or value is False or (name == "response_format"
                                               and value.get("type") == "text"):
            continue
        return f"{name} is set"
    return None


@dataclass
class Leg:
    """The next request of a migrating stream: where, what, and the tokens to route on
    (None: the client's prompt, as first routed)."""

    path: str
    raw: bytes
    tokens: list[int] | None
    max_tokens: int


@dataclass
class Migration:
    """What one stream has relayed so far, and how to go on elsewhere (module docstring).
    `body`: the request as first forwarded (with `return_token_ids`); `client_ids`: the
    client asked for token ids itself; `request`, `headers`: the client's request and the
    headers forwarded with it."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    limit: int
    client_ids: bool
    request: Any                         # the client's (starlette's `Request`)
    tokens: list[int]                    # the prompt as the router first routed it
    moves: int = 0
    failed: list[str] = field(default_factory=list)   # the workers it left, in order
    head: dict[str, Any] | None = None   # id, created, model of the first chunk
    prompt_ids: list[int] | None = None
    output_ids: list[int] = field(default_factory=list)
    carried: int = 0                     # tokens relayed before the latest move
    finished: bool = False               # a choice's finish_reason was relayed
    interrupted: str | None = None       # why the leg ended its stream itself (moves on)

    @staticmethod
    def of(path: str, body: dict[str, Any], headers: dict[str, str], limit: int,
           request: Any, tokens: list[int]) -> Migration | None:
        """The migration of a stream about to be forwarded (None: `limit` 0, or it cannot
        migrate); `body` gains `return_token_ids`."""
        if limit <= 0 or refusal(path, body) is not None:
            return None
        client_ids = bool(body.get("return_token_ids"))
        body["return_token_ids"] = True
        return Migration(path, body, headers, limit, client_ids, request, tokens)

    @property
    def chat(self) -> bool:
        return self.path == CHAT_PATH

    @property
    def continuing(self) -> bool:
        """Chunks come from a continuation (completions on token ids) since a move."""
        return self.moves > 0 and self.prompt_ids is not None

    def on_event(self, data: bytes) -> bytes | None:
        """One SSE event's data, as the client gets it (None: drop the event): recorded,
        translated after a move, token ids stripped unless the client asked. A leg that
        ends the stream itself while a move is left (`finish_reason: "abort"`: its worker
        stopped; an error event: its engine died) is `interrupted`: the rest of it is
        dropped, and the relay moves the stream on."""
        if self.interrupted is not None:
            return None
        payload = _json_object(data)
        if payload is None:
            return data
        if self.moves < self.limit:
            self.interrupted = _interruption(payload)
            if self.interrupted is not None:
                return None
        if self.continuing:
            payload = self._translate(payload)
        else:
            self._record(payload)
        if payload is None or (not self.client_ids and _empty(payload)):
            return None   # nothing for the client (only the token ids it did not ask for)
        return json.dumps(payload).encode()

    def _record(self, payload: dict[str, Any]) -> None:
        if self.head is None and "id" in payload:
            self.head = {k: payload[k] for k in ("id", "created", "model") if k in payload}
        ids = payload.get("prompt_token_ids")   # a chat stream's first chunk
        if isinstance(ids, list):
            self.prompt_ids = ids
        if not self.client_ids:
            payload.pop("prompt_token_ids", None)
        for choice in payload.get("choices") or ():
            ids = choice.get("prompt_token_ids")   # a completions stream's first chunk
            if isinstance(ids, list):
                self.prompt_ids = ids
            self._take(choice)

    def _take(self, choice: dict[str, Any]) -> None:
        """Note a choice's new token ids and finish; strip what the client did not ask."""
        self.output_ids.extend(choice.get("token_ids") or ())
        if choice.get("finish_reason") is not None:
            self.finished = True
        if not self.client_ids:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)

    def _translate(self, payload: dict[str, Any]) -> dict[str, Any] | None:
        """A continuation's chunk as the first worker's stream would have gone on (an
        event that is no chunk, an error, as it is)."""
        if "choices" not in payload:
            return payload
        choices = []
        for choice in payload.get("choices") or ():
            choice.pop("prompt_token_ids", None)
            ids = list(choice.get("token_ids") or ())
            self._take(choice)
            if self.chat:
                choice = _chat_choice(choice, ids if self.client_ids else None)
            choices.append(choice)
        usage = payload.get("usage")
        if not choices and usage is None:
            return None
        out = {**payload, **(self.head or {}), "choices": choices}
        if self.chat:
            out["object"] = "chat.completion.chunk"
        if isinstance(usage, dict):
            out["usage"] = self._usage(usage)
        return out

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The continuation's usage as the whole answer's: the client's prompt, every
        token generated."""
        prompt = len(self.prompt_ids or ())
        completion = self.carried + int(usage.get("completion_tokens") or 0)
        return {**usage, "prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    # --- moving -------------------------------------------------------------------------
    def next_leg(self, failed: str) -> Leg | str:
        """The request that continues this stream after `failed` failed, or why none can
        (the move is counted)."""
        self.failed.append(failed)
        self.interrupted = None
        if self.moves >= self.limit:
            return f"--migration-limit {self.limit} reached"
        if self.head is not None and self.prompt_ids is None:
            return "the worker did not stream its prompt's token ids"
        self.moves += 1
        asked = MaxTokens.of_body(self.path, self.body)
        if self.prompt_ids is None:   # nothing relayed yet: the request again, as it was
            return Leg(self.path, json.dumps(self.body).encode(), None, asked.tokens(None))
        return self._continuation(asked)

    def _continuation(self, asked: MaxTokens) -> Leg | str:
        assert self.prompt_ids is not None
        self.carried = len(self.output_ids)
        ids = self.prompt_ids + self.output_ids
        body = {k: v for k, v in self.body.items() if k in SAMPLING_FIELDS}
        body.update(prompt=ids, stream=True, return_token_ids=True,
                    stream_options={"include_usage": True})
        if asked.asked is None and asked.default is None:
            body["max_tokens"] = None      # all the room the context leaves, as asked
            left = asked.tokens(None)
        else:
            left = asked.tokens(None) - self.carried
            if left <= 0:
                return "every token asked for was relayed"
            body["max_tokens"] = left
        min_tokens = int(self.body.get("min_tokens") or 0)   # validated: an int or its text
        if min_tokens:
            body["min_tokens"] = max(0, min_tokens - self.carried)
        return Leg(COMPLETIONS_PATH, json.dumps(body).encode(), ids, left)


def _chat_choice(choice: dict[str, Any], ids: list[int] | None) -> dict[str, Any]:
    """A completions choice as a chat stream's (its text as the delta's content)."""
    text = choice.get("text") or ""
    out = {"index": choice.get("index", 0), "delta": {"content": text} if text else {},
           "logprobs": None, "finish_reason": choice.get("finish_reason"),
           "stop_reason": choice.get("stop_reason")}
    if ids is not None:
        out["token_ids"] = ids
    return out


def _interruption(payload: dict[str, Any]) -> str | None:
    """Why this chunk ends the stream before its answer is complete (None: it does not)."""
    error = payload.get("error")
    if error is not None:
        return f"its error event: {error.get('message') if isinstance(error, dict) else error}"
    if any(c.get("finish_reason") == "abort" for c in payload.get("choices") or ()):
        return 'finish_reason "abort" (the worker is stopping)'
    return None


def _empty(payload: dict[str, Any]) -> bool:
    """A chunk with no text, no delta, no finish and no usage."""
    if payload.get("usage") is not None or not payload.get("choices"):
        return False
    return all(not c.get("text") and not c.get("delta") and c.get("finish_reason") is None
               for c in payload["choices"])


def _json_object(data: bytes) -> dict[str, Any] | None:
    try:
        payload = json.loads(data)
    except ValueError:
        return None
    return payload if isinstance(payload, dict) else None
