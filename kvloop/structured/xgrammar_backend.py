"""xgrammar as kvloop's `GrammarBackend` (kvloop.core.structured_output).

- The vocabulary: xgrammar's `TokenizerInfo` is built from the served tokenizer's own tokens
  (a GGUF's `tokenizer.ggml.tokens`, or a tokenizer.json's vocabulary, as
  `kvloop.front.tokenizer` loads them), indexed by id up to the model's vocabulary size.
  Special tokens become empty strings, which xgrammar never allows inside a grammar; its stop
  tokens are the tokenizer's EOS and end-of-turn ids, allowed where the grammar may end. The
  vocabulary's encoding follows the tokenizer's decoder: byte-level BPE (GPT-2 style), byte
  fallback (SentencePiece style), or raw.
- The constraints, as vLLM's xgrammar backend compiles them: `json` with
  `compile_json_schema` (any whitespace unless `disable_any_whitespace`), `json_object` as the
  schema `{"type": "object"}`, `regex` with `compile_regex`, `choice` as the EBNF grammar
  `root ::= "a" | "b" ...`, `grammar` (EBNF) with `compile_grammar`. A grammar that does
  not compile is a ValueError naming the constraint and xgrammar's reason.
- One compile uses one thread (the engine's pool runs several); xgrammar's own cache is off:
  the engine caches compiled grammars by (kind, spec).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import xgrammar as xgr

from kvloop.core.request import StructuredOutputKind, StructuredOutputsParams

_LABELS = {StructuredOutputKind.JSON: "JSON schema", StructuredOutputKind.JSON_OBJECT: "JSON",
           StructuredOutputKind.REGEX: "regex", StructuredOutputKind.CHOICE: "choice",
           StructuredOutputKind.GRAMMAR: "grammar"}
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")   # "[12:00:00] /x/y.cc:83: "


class XgrammarBackend:
    """Compiles constraints for one vocabulary; hands out matchers and bitmasks."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, max_threads: int = 1):
        self.vocab_size = vocab_size
        self.tokenizer_info = tokenizer_info(tokenizer, vocab_size)
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads,
                                             cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind = params.kind
        try:
            return self._compile(kind, params)
        except Exception as e:  # xgrammar reports a bad spec as RuntimeError (or others)
            raise ValueError(f"Invalid {_LABELS[kind]} for structured output: "
                             f"{_LOG_PREFIX.sub('', str(e)).strip()}") from None

    def _compile(self, kind: StructuredOutputKind,
                 params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        any_whitespace = not params.disable_any_whitespace
        if kind == StructuredOutputKind.JSON:
            return self._compiler.compile_json_schema(params.spec, any_whitespace=any_whitespace)
        if kind == StructuredOutputKind.JSON_OBJECT:
            return self._compiler.compile_json_schema('{"type": "object"}',
                                                      any_whitespace=any_whitespace)
        if kind == StructuredOutputKind.REGEX:
            return self._compiler.compile_regex(str(params.regex))
        if kind == StructuredOutputKind.CHOICE:
            return self._compiler.compile_grammar(choice_grammar(params.choice or []))
        return self._compiler.compile_grammar(str(params.grammar))

    def matcher(self, compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(compiled)

    def allocate_bitmask(self, num_rows: int) -> np.ndarray:
        return np.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=np.int32)


def choice_grammar(choices: list[str]) -> str:
    """The EBNF grammar of "exactly one of `choices`" (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def tokenizer_info(tokenizer: Any, vocab_size: int) -> xgr.TokenizerInfo:
    """xgrammar's view of a `kvloop.front.tokenizer.Tokenizer`'s vocabulary."""
    backend = tokenizer.backend
    encoded = [""] * vocab_size
    special = set(tokenizer.all_special_ids)
    for token, token_id in backend.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size and token_id not in special:
            encoded[token_id] = token
    vocab_type, add_prefix_space = vocab_encoding(json.loads(backend.to_str()))
    stops = [tokenizer.eos_token_id, *sorted(tokenizer.stop_token_ids)]
    return xgr.TokenizerInfo(encoded, vocab_type, vocab_size=vocab_size,
                             stop_token_ids=[t for t in stops if t is not None],
                             add_prefix_space=add_prefix_space)


def vocab_encoding(spec: dict[str, Any]) -> tuple[xgr.VocabType, bool]:
    """(how tokens encode bytes, whether a space is prepended to the text) from a
    tokenizer.json: a ByteLevel decoder is byte-level BPE, a ByteFallback one SentencePiece
    style (with a prefix space when the normalizer prepends "▁"), anything else raw."""
    decoder = spec.get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []}
    if "ByteLevel" in kinds:
        return xgr.VocabType.BYTE_LEVEL, False
    if "ByteFallback" in kinds:
        normalizer = spec.get("normalizer") or {}
        parts = [normalizer, *(normalizer.get("normalizers") or [])]
        prepends = any(p.get("type") == "Prepend" for p in parts)
        return xgr.VocabType.BYTE_FALLBACK, prepends
    return xgr.VocabType.RAW, False
