"""Per-request output processing in the API server: detokenize, stop strings, logprobs.

The engine knows nothing about text. For each engine request the API server keeps an
`OutputState` that turns `EngineCoreOutput`s into text deltas, vLLM's way
(docs/vllm-facts.md#stop-strings):

- tokens are detokenized one at a time, so the token that completes a stop string is known
  and every token after it is dropped;
- stop strings are searched only in the newly added text, once more than `min_tokens` tokens
  exist; the one completing earliest wins, ties by list order; the text is cut before it (or
  after it with `include_stop_str_in_output`); the request then finishes with reason "stop"
  and `stop_reason` = the string, and the caller aborts it in the engine;
- a stop *token* the engine stopped on (EOS, `stop_token_ids`) is not detokenized unless
  `include_stop_str_in_output`;
- while stop strings can still match, the last `max(len(stop)) - 1` characters are held back
  from streaming until the request finishes.

Outputs of one request that queue up while its handler is busy are processed as one
(`merge_outputs`, vLLM's `RequestOutputCollector`): a handler that falls behind the engine
detokenizes and streams once per wake, not once per engine step, with the same text, tokens
and finish.

The API server and the offline `LLM` both use this module: `model_stops` fills a request's
EOS and the model's extra end-of-turn ids, `fan_out` turns a request with `n` samples into `n`
engine requests, and `OutputState` follows each of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from kvloop.core.request import SamplingParams
from kvloop.wire import EngineCoreOutput, PromptLogprobsChunk, RequestSpecDecodingStats


def model_stops(params: SamplingParams, tokenizer: Any) -> SamplingParams:
    """`params` with the tokenizer's EOS id (unless one is set) and, unless `ignore_eos`, the
    model's other end-of-turn ids (generation_config.json) appended to `stop_token_ids`, as
    vLLM adds them; and its `bad_words` tokenized (`bad_words_token_ids`)."""
    changes: dict[str, Any] = {}
    if params.eos_token_id is None and tokenizer.eos_token_id is not None:
        changes["eos_token_id"] = tokenizer.eos_token_id
    extra = set(getattr(tokenizer, "stop_token_ids", ())) - set(params.stop_token_ids)
    if extra and not params.ignore_eos:
        changes["stop_token_ids"] = (*params.stop_token_ids, *sorted(extra))
    if params.bad_words and not params.bad_words_token_ids:
        changes["bad_words_token_ids"] = bad_words_token_ids(params.bad_words, tokenizer)
    return msgspec.structs.replace(params, **changes) if changes else params


def bad_words_token_ids(words: Sequence[str], tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of `bad_words`: each word (leading spaces stripped) as it would
    start a text, and also after a space when that is a different first token of as many
    tokens (the word in mid-text). A word that tokenizes to nothing bans nothing."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not bare:
            continue
        out.append(bare)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            out.append(spaced)
    return tuple(out)


def fan_out(params: SamplingParams) -> list[SamplingParams]:
    """The `n` engine requests of one request: n = 1 each; seeded ones get seed, seed + 1..."""
    return [msgspec.structs.replace(params, n=1, seed=None if params.seed is None
                                    else params.seed + i) for i in range(params.n)]


def merge_outputs(first: EngineCoreOutput, later: EngineCoreOutput) -> EngineCoreOutput | None:
    """`first` and `later` (the request's next output) as one output, as if one engine step had
    sampled the tokens of both; None when they cannot be one: `first` finished, either carries
    an error, prompt logprobs or a pooled vector, or only one of them has logprobs. The
    finishing fields (`finish_reason`, `stop_reason`, `kv_transfer_params`, ...) are `later`'s.
    `OutputState.process` of the result gives what processing the two in order gives."""
    if first.finished or not _plain(first) or not _plain(later):
        return None
    if (first.new_logprobs is None) != (later.new_logprobs is None):
        return None
    logprobs = (None if first.new_logprobs is None or later.new_logprobs is None
                else first.new_logprobs + later.new_logprobs)
    return msgspec.structs.replace(later, new_token_ids=first.new_token_ids + later.new_token_ids,
                                   new_logprobs=logprobs)


def _plain(out: EngineCoreOutput) -> bool:
    """Only tokens, logprobs and finishing fields: nothing a merge could misplace."""
    return out.error is None and out.new_prompt_logprobs is None and out.pooling_output is None


class Detokenizer(Protocol):
    text: str

    def push(self, new_ids: Sequence[int]) -> str: ...


def make_detokenizer(tokenizer: Any, prompt_ids: Sequence[int],
                     skip_special_tokens: bool) -> Detokenizer:
    """The incremental detokenizer of `tokenizer` (its own factory if it has one)."""
    factory = getattr(tokenizer, "new_detokenizer", None)
    if factory is not None:
        return factory(prompt_ids, skip_special_tokens)  # type: ignore[no-any-return]
    from kvloop.front.tokenizer import IncrementalDetokenizer

    return IncrementalDetokenizer(tokenizer, list(prompt_ids),  # type: ignore[no-any-return]
                                  skip_special_tokens=skip_special_tokens)


def find_stop_string(text: str, new_char_count: int, stop: Sequence[str],
                     include: bool) -> tuple[str, int | None] | None:
    """The stop string completed by the last `new_char_count` characters of `text`.

    Returns (stop string, truncate_to): the text is cut to `text[:truncate_to]`, or kept whole
    when `truncate_to` is None (the stop string, included, ends the text). None if no match.
    """
    if not new_char_count or not stop:
        return None
    best: tuple[int, int, str] | None = None   # (end, start, stop string)
    for s in stop:
        start = text.find(s, max(len(text) - new_char_count - len(s) + 1, 0))
        if start < 0:
            continue
        end = start + len(s)
        if best is None or end < best[0]:
            best = (end, start, s)
    if best is None:
        return None
    end, start, s = best
    if include:
        return s, (None if end >= len(text) else end)
    return s, start


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None


@dataclass
class Delta:
    """What one engine output added to a request, after stop-string handling."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    stopped_locally: bool = False    # a stop string ended it: abort it in the engine


@dataclass(frozen=True)
class OutputOptions:
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    prompt_logprobs: bool = False

    @classmethod
    def of(cls, params: SamplingParams) -> OutputOptions:
        return cls(params.stop, params.include_stop_str_in_output, params.min_tokens,
                   params.skip_special_tokens, params.prompt_logprobs is not None)


class OutputState:
    """Text, tokens and logprobs of one engine request so far. Owned by one HTTP handler."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], options: OutputOptions):
        self.options = options
        self.detok = make_detokenizer(tokenizer, prompt_ids, options.skip_special_tokens)
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        # one per prompt token (the first has none): filled chunk by chunk during prefill
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] * len(prompt_ids) if options.prompt_logprobs else None)
        self.num_cached_tokens = 0
        self.kv_transfer_params: dict[str, Any] | None = None   # from the finishing output
        self.pooling_output: list[float] | None = None   # a pooling request's vector
        # the request's drafts and acceptances, from the finishing output
        self.spec_decoding_stats: RequestSpecDecodingStats | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._sent = 0
        hold = max((len(s) for s in options.stop), default=0) - 1
        self._holdback = hold if hold > 0 and not options.include_stop_str_in_output else 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def process(self, out: EngineCoreOutput) -> Delta:
        """Apply one engine output; return the delta to send (text held back as needed)."""
        if self.finished:
            return Delta()
        if out.error is not None:
            self.finish_reason = "error"
            return Delta(finish_reason="error", error=out.error)
        self.num_cached_tokens = out.num_cached_tokens
        if out.new_prompt_logprobs is not None:
            self._add_prompt_logprobs(out.new_prompt_logprobs)
        if out.kv_transfer_params is not None:
            self.kv_transfer_params = out.kv_transfer_params
        if out.pooling_output is not None:
            self.pooling_output = out.pooling_output
        if out.spec_decoding_stats is not None:
            self.spec_decoding_stats = out.spec_decoding_stats
        delta = Delta()
        lps = out.new_logprobs or []
        n = len(out.new_token_ids)
        for j, tok in enumerate(out.new_token_ids):
            delta.token_ids.append(tok)
            self.token_ids.append(tok)
            if j < len(lps):
                lp = lps[j]
                entry = TokenLogprob(tok, lp.logprob, list(zip(lp.top_token_ids, lp.top_logprobs,
                                                               strict=False)), lp.rank)
                delta.logprobs.append(entry)
                self.logprobs.append(entry)
            if j == n - 1 and self._is_stop_token(out):
                break
            if self._append_text(self.detok.push([tok])):
                delta.stopped_locally = True
                break
        if delta.stopped_locally:
            self.finish_reason = "stop"
        elif out.finish_reason is not None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        if self.finished:
            self._flush_detokenizer(delta)
        delta.finish_reason, delta.stop_reason = self.finish_reason, self.stop_reason
        delta.text = self._take_text()
        return delta

    def _add_prompt_logprobs(self, chunk: PromptLogprobsChunk) -> None:
        """Entries by position: a chunk computed again (after a preemption) overwrites its
        positions with equal values."""
        into = self.prompt_logprobs
        if into is None:
            return
        for j, e in enumerate(chunk.entries):
            pos = chunk.first_position + j
            if 0 < pos < len(into):
                into[pos] = TokenLogprob(e.token_id, e.logprob, list(zip(
                    e.top_token_ids, e.top_logprobs, strict=False)), e.rank)

    def _is_stop_token(self, out: EngineCoreOutput) -> bool:
        """The engine stopped on this last token (EOS or a stop token id): keep it out of the
        text unless asked to include it."""
        return (out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
                and not self.options.include_stop_str_in_output)

    def _append_text(self, new_text: str) -> bool:
        """Add text; True if it completed a stop string (the text is then cut)."""
        self.text += new_text
        opts = self.options
        if not opts.stop or len(self.token_ids) <= opts.min_tokens:
            return False
        hit = find_stop_string(self.text, len(new_text), opts.stop,
                               opts.include_stop_str_in_output)
        if hit is None:
            return False
        self.stop_reason = hit[0]
        if hit[1] is not None:
            self.text = self.text[:hit[1]]
        return True

    def _flush_detokenizer(self, delta: Delta) -> None:
        flush = getattr(self.detok, "flush", None)
        if flush is not None and not delta.stopped_locally:
            self.text += flush()

    def _take_text(self) -> str:
        end = len(self.text) if self.finished else len(self.text) - self._holdback
        if end <= self._sent:
            return ""
        chunk = self.text[self._sent:end]
        self._sent = end
        return chunk
