"""What to generate and when to stop: `SamplingParams` and its structured-output constraint
(`StructuredOutputsParams`), vLLM's names and rules (vLLM's module of the same name holds
them too, beside its engine rather than inside it).

One type from the user to the engine: the offline API (`from kvloop import SamplingParams`),
the API server, the wire (`kvloop.wire.EngineCoreRequest` carries it as is) and the engine's
`Request` (`kvloop.core.request`, which re-exports these names). It imports nothing of kvloop,
so the wire and the core both stand on it without standing on each other.
"""

from __future__ import annotations

import enum
import json
import re
from re import _constants as re_constants  # type: ignore[attr-defined]
from re import _parser as re_parser  # type: ignore[attr-defined]
from typing import Any

import msgspec

KV_TRANSFER_PARAMS_KEY = "kv_transfer_params"   # vLLM's key in SamplingParams.extra_args


def _check_extra_args(extra_args: dict[str, Any] | None) -> None:
    if extra_args is None:
        return
    if not isinstance(extra_args, dict) or not all(isinstance(k, str) for k in extra_args):
        raise ValueError("extra_args must be an object with string keys")
    params = extra_args.get(KV_TRANSFER_PARAMS_KEY)
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    try:
        msgspec.msgpack.encode(extra_args)
    except (TypeError, OverflowError) as e:
        raise ValueError(f"extra_args must be msgpack-serialisable: {e}") from e


class StructuredOutputKind(enum.Enum):
    """What a structured-output spec constrains the output to (vLLM's request types)."""

    JSON = "json"                 # a JSON schema
    JSON_OBJECT = "json_object"   # any JSON object
    REGEX = "regex"
    CHOICE = "choice"             # one of a list of strings
    GRAMMAR = "grammar"           # an EBNF (GBNF) grammar


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
NO_GRAMMAR_BACKEND = ("structured output is not supported by this engine: it has no grammar "
                      "backend (the simulator, --model sim, has none; serve a real model)")


class StructuredOutputsParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """vLLM's `StructuredOutputsParams`: exactly one constraint, and its options.

    A msgspec Struct inside `SamplingParams`, so it crosses to the engine as is and is checked
    again on decode (`__post_init__`: shape only; whether a schema, regex or grammar is valid
    is the grammar backend's verdict, `kvloop.core.structured_output`). `json` is a schema
    (a dict, or its JSON text); `choice` a non-empty list of strings; `grammar` EBNF.
    `disable_any_whitespace` allows no whitespace between JSON tokens (the default allows
    any, as vLLM's). `disable_additional_properties` is accepted for vLLM's sake and changes
    nothing: the backend already refuses properties a schema does not name unless it allows
    them. `whitespace_pattern` and `structural_tag` are refused.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINTS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one constraint of "
                             f"{', '.join(_CONSTRAINTS[:-1])}; got "
                             f"{', '.join(given) if given else 'none'}.")
        if self.structural_tag is not None:
            raise ValueError("structured outputs: structural_tag is not supported by kvloop.")
        if self.whitespace_pattern is not None:
            raise ValueError("structured outputs: whitespace_pattern is not supported by "
                             "kvloop's grammar backend (xgrammar).")
        if self.json_object is False:
            raise ValueError("structured outputs: json_object must be true when given.")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) for c in self.choice)):
            raise ValueError("structured outputs: choice must be a non-empty list of strings.")
        if isinstance(self.json, str):
            _check_json_text(self.json)
        for name in ("regex", "grammar"):
            if getattr(self, name) == "":
                raise ValueError(f"structured outputs: {name} must not be empty.")

    @property
    def kind(self) -> StructuredOutputKind:
        for kind in StructuredOutputKind:
            if getattr(self, kind.value) is not None:
                return kind
        raise AssertionError("checked in __post_init__")

    @property
    def spec(self) -> str:
        """The constraint as text: the schema's JSON (as given: the order of its properties is
        the order of the output's), the regex, the grammar, the choices as a JSON list; ""
        for json_object."""
        kind = self.kind
        if kind == StructuredOutputKind.JSON:
            return self.json if isinstance(self.json, str) else json.dumps(self.json)
        if kind == StructuredOutputKind.CHOICE:
            return json.dumps(self.choice)
        if kind == StructuredOutputKind.JSON_OBJECT:
            return ""
        return str(getattr(self, kind.value))

    @property
    def compile_cost(self) -> int:
        """What compiling it roughly costs, in the units of its spec's length: a regex's or
        grammar's size with its bounded repeats unrolled (`expansion_cost`: a 12-byte
        `[a-z]{1,128}` costs 2,048), else the spec's length. The compile queue orders by it
        and the API refuses a regex or grammar over `MAX_EXPANSION`."""
        kind = self.kind
        if kind in (StructuredOutputKind.REGEX, StructuredOutputKind.GRAMMAR):
            return max(len(self.spec), expansion_cost(self.spec, kind))
        return len(self.spec)

    @property
    def key(self) -> tuple[StructuredOutputKind, str, bool]:
        """What a compiled grammar depends on: (kind, spec, any whitespace); the cache key."""
        return self.kind, self.spec, not self.disable_any_whitespace


def _check_json_text(text: str) -> None:
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise ValueError(f"structured outputs: json is not valid JSON ({e}).") from None
    if not isinstance(schema, dict | bool):
        raise ValueError("structured outputs: json must be a JSON schema (an object).")


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """What to generate and when to stop; vLLM's names and defaults.

    One type for the offline API (`from kvloop import SamplingParams`, keyword arguments as
    vLLM's), the API server, the wire (`kvloop.wire.EngineCoreRequest` carries it as is) and
    the engine. A frozen msgspec Struct, as vLLM's own is a Struct: `__post_init__` runs on
    construction, on `msgspec.structs.replace` and on decode, so the engine process validates
    what it receives (a bad value is a `msgspec.ValidationError` naming the rule) and nobody
    converts field by field. Change with `msgspec.structs.replace`.

    `eos_token_id` is filled from the tokenizer by whoever builds the request; with
    `ignore_eos` it is not checked (it is still masked while `min_tokens` is not reached).
    `stop` (strings) is handled by the detokenizing frontend, not the engine.
    `extra_args` is vLLM's bag of request extensions, msgpack-serialisable (integers within
    int64/uint64); the engine reads `extra_args["kv_transfer_params"]` (a dict) as
    `Request.kv_transfer_params` (docs/disaggregation.md section 2).
    `structured_outputs` constrains what may be sampled (kvloop.core.structured_output).

    What may be sampled, as vLLM's logits processors (kvloop.model.sampler applies them):
    `allowed_token_ids` (None: any; else only these), `bad_words` (words never to complete:
    each word's token ids, tokenized with and without a leading space, are
    `bad_words_token_ids`, filled from the tokenizer by whoever builds the request, as the EOS
    id is; a word's last token is banned when the output ends with its other tokens) and
    `logit_bias` (token id -> a bias added to its logit, clamped to [-100, 100], OpenAI's
    rule). `prompt_logprobs`: the logprob of each prompt token given the tokens before it,
    and the top-n at its position (`RequestOutput.prompt_logprobs`); asking for them skips
    reading the prefix cache (`skips_prefix_cache`), as vLLM does.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    eos_token_id: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = None
    skip_reading_prefix_cache: bool | None = None
    extra_args: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        _check_extra_args(self.extra_args)
        self._check_token_filters()
        if isinstance(self.stop, str):
            msgspec.structs.force_setattr(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            msgspec.structs.force_setattr(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            msgspec.structs.force_setattr(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, "
                             f"got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens="
                             f"{self.max_tokens}, got {self.min_tokens}.")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable) or at least 1, "
                             f"got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, "
                             f"got {self.repetition_penalty}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], "
                             f"got {self.frequency_penalty}.")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.")

    def _check_token_filters(self) -> None:
        """Shapes of `logit_bias`, `allowed_token_ids` and the bad words (ids against the
        vocabulary are checked by whoever knows it: the API server, `LLM`)."""
        if self.logit_bias is not None:
            bias = {int(t): min(100.0, max(-100.0, float(b))) for t, b in self.logit_bias.items()}
            if any(t < 0 for t in bias):
                raise ValueError("logit_bias token ids must be non-negative.")
            msgspec.structs.force_setattr(self, "logit_bias", bias)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, tuple):
                msgspec.structs.force_setattr(self, "allowed_token_ids",
                                              tuple(self.allowed_token_ids))
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty.")
            if any(t < 0 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be non-negative token ids.")
        if not isinstance(self.bad_words, tuple):
            msgspec.structs.force_setattr(self, "bad_words", tuple(self.bad_words))
        words = tuple(tuple(w) for w in self.bad_words_token_ids)
        if any(not w or min(w) < 0 for w in words):
            raise ValueError("bad_words_token_ids must be non-empty lists of token ids.")
        msgspec.structs.force_setattr(self, "bad_words_token_ids", words)

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError (its first word the field) for a token id of `logit_bias`,
        `allowed_token_ids` or the bad words beyond a vocabulary of `vocab_size` ids."""
        bias = sorted(t for t in self.logit_bias or () if t >= vocab_size)
        if bias:
            raise ValueError(f"logit_bias contains out-of-vocab token ids {bias[:8]}. "
                             f"Vocabulary size: {vocab_size}")
        if any(t >= vocab_size for t in self.allowed_token_ids or ()):
            raise ValueError(f"allowed_token_ids contains out-of-vocab token ids (vocabulary "
                             f"size: {vocab_size})")
        bad = sorted({t for w in self.bad_words_token_ids for t in w if t >= vocab_size})
        if bad:
            raise ValueError(f"bad_words contain out-of-vocab token ids {bad[:8]} (the model "
                             f"vocabulary size is {vocab_size})")

    @property
    def filters_tokens(self) -> bool:
        """Whether `allowed_token_ids`, bad words or `logit_bias` change the logits."""
        return bool(self.allowed_token_ids is not None or self.bad_words_token_ids
                    or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def skips_prefix_cache(self) -> bool:
        """vLLM skips reading the prefix cache when prompt logprobs are asked for."""
        if self.skip_reading_prefix_cache is not None:
            return self.skip_reading_prefix_cache
        return self.prompt_logprobs is not None

    @property
    def effective_eos(self) -> int | None:
        return None if self.ignore_eos else self.eos_token_id


# A regex's or grammar's size once its bounded repeats are unrolled, as the grammar compiler
# unrolls them: a literal counts 1, a character class `CLASS_COST` (the compiler builds a
# token mask per class state: measured, `[a-z]{1,200}` takes 2.4 s on one core where
# `(a{1,20}){1,20}`, 400 literals, takes 1 ms); `x{m,n}` counts n times x, `*`/`+` twice.
CLASS_COST = 16
MAX_EXPANSION = 2048
_GRAMMAR_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def expansion_cost(spec: str, kind: StructuredOutputKind) -> int:
    """The unrolled size of a regex (parsed by Python's `re` parser; one that does not
    parse is left to the compiler) or, for a grammar, of its repeats (each `{m,n}` counted
    as n character classes: a conservative bound)."""
    if kind == StructuredOutputKind.GRAMMAR:
        return sum(int(hi or lo) * CLASS_COST for lo, hi in _GRAMMAR_REPEAT.findall(spec))
    try:
        parsed = re_parser.parse(spec)
    except (re.error, RecursionError, OverflowError):
        return 0
    return _cost(parsed)


def _cost(items: Any) -> int:
    total = 0
    for op, arg in items:
        total += _item_cost(op, arg)
        if total > MAX_EXPANSION:
            return total
    return total


def _item_cost(op: Any, arg: Any) -> int:
    c = re_constants
    if op in (c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", c.MAX_REPEAT)):
        lo, hi, sub = arg
        times = 2 if hi == c.MAXREPEAT else max(int(hi), 1)
        return times * _cost(sub)
    if op == c.SUBPATTERN:
        return _cost(arg[-1])
    if op == c.BRANCH:
        return sum(_cost(branch) for branch in arg[1])
    if op in (c.ASSERT, c.ASSERT_NOT, getattr(c, "ATOMIC_GROUP", None)):
        return _cost(arg[-1] if isinstance(arg, tuple) else arg)
    if op in (c.IN, c.ANY, c.NOT_LITERAL, c.CATEGORY):
        return CLASS_COST
    return 1
