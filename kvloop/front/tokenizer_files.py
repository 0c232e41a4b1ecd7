"""A tokenizer as data (`kvloop.wire.TokenizerFiles`), and back: how a worker hands its
tokenizer to a router on another host, which cannot read the worker's model files.

The worker serves `tokenizer_files(its tokenizer)` on `GET /kvloop/tokenizer` (to callers
its --api-key admits, like /tokenize, which discloses the same vocabulary one prompt at a
time); the router rebuilds it with `tokenizer_from_files`, so its token ids, and so its
block hashes, are the worker's. Torch-free.
"""

from __future__ import annotations

from typing import Any

from kvloop.front.byte_tokenizer import ByteTokenizer
from kvloop.front.tokenizer import Tokenizer
from kvloop.wire import TokenizerFiles

KIND_BPE = "bpe"
KIND_BYTE = "byte"
MAX_TOKENIZER_FILES_BYTES = 64 * 1024 * 1024   # a router reads no larger answer


def tokenizer_files(tok: Any) -> TokenizerFiles:
    """`tok` (a `Tokenizer` or the simulator's `ByteTokenizer`) as `TokenizerFiles`."""
    if isinstance(tok, ByteTokenizer):
        return TokenizerFiles(model=tok.model_name, kind=KIND_BYTE)
    return TokenizerFiles(
        model=tok.model_name, kind=KIND_BPE, tokenizer_json=tok.backend.to_str(),
        chat_template=tok.chat_template, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, extra_eos_ids=sorted(tok.stop_token_ids))


def tokenizer_from_files(files: TokenizerFiles) -> Tokenizer | ByteTokenizer:
    """The tokenizer `files` describe; ValueError when they do not make one."""
    if files.kind == KIND_BYTE:
        return ByteTokenizer(files.model)
    if files.kind != KIND_BPE or not files.tokenizer_json:
        raise ValueError(f"tokenizer files of kind {files.kind!r} without a tokenizer")
    from tokenizers import Tokenizer as Backend

    try:
        backend = Backend.from_str(files.tokenizer_json)
    except Exception as e:   # the library's own exception type: not a usable tokenizer
        raise ValueError(f"the tokenizer JSON does not load: {e}") from e
    return Tokenizer(backend, model_name=files.model, chat_template=files.chat_template,
                     bos_token_id=files.bos_token_id, eos_token_id=files.eos_token_id,
                     extra_eos_ids=files.extra_eos_ids)
