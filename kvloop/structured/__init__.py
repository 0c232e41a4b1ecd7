"""Structured output's grammar backend: xgrammar over the model's own vocabulary.

`load_backend` is the factory the engine process names (`kvloop.config.GRAMMAR_BACKEND_FACTORY`,
"module:function", as it names its runner's): it reads the served model's vocabulary with the
HTTP fronts' loader (`kvloop.front.tokenizer.load_vocabulary`), so the grammar and the
tokenizer that decodes the output agree token for token. The engine core
(`kvloop.core.structured_output`) sees only the `GrammarBackend` protocol; importing this
package imports no grammar engine (xgrammar, which brings torch and transformers, is imported
when the first backend is built).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvloop.config import RunnerConfig
    from kvloop.front.tokenizer import Tokenizer
    from kvloop.structured.xgrammar_backend import XgrammarBackend


def load_backend(runner: RunnerConfig, vocab_size: int,
                 tokenizer: Tokenizer | None = None) -> XgrammarBackend:
    """The grammar backend of the model `runner` serves, for logits of `vocab_size` ids:
    over `tokenizer` when the caller has loaded one (the offline `LLM`), else over the
    model's own vocabulary."""
    if tokenizer is None:
        from kvloop.front.tokenizer import load_vocabulary

        vocab = load_vocabulary(runner.model)
        return backend_for(vocab.tokenizer, max(vocab_size, vocab.vocab_size))
    return backend_for(tokenizer, max(vocab_size, tokenizer.vocab_size))


def backend_for(tokenizer: Any, vocab_size: int) -> XgrammarBackend:
    """The grammar backend of a loaded `kvloop.front.tokenizer.Tokenizer`."""
    from kvloop.structured.xgrammar_backend import XgrammarBackend

    return XgrammarBackend(tokenizer, vocab_size)
