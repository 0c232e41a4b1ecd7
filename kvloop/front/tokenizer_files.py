"""A tokenizer as data (`kvloop.wire.TokenizerFiles`), and back: how a worker hands its
tokenizer to a router on another host, which cannot read the worker's model files.

The worker serves `tokenizer_files(its tokenizer)` on `GET /kvloop/tokenizer` (to callers
its --api-key admits, like /tokenize, which discloses the same vocabulary one prompt at a
time); the router rebuilds it with `tokenizer_from_files`, so its token ids, and so its
block hashes, are the worker's. Torch-free.

`write_hf_folder(tok, folder)` writes the same tokenizer as a Hugging Face tokenizer folder
(`tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json`,
`generation_config.json`): what `kvloop export-tokenizer DIR` makes from a GGUF, so
`transformers.AutoTokenizer.from_pretrained(DIR)` (lm-eval's `tokenizer=DIR`) loads it with no
hub, and `Tokenizer.from_hf_folder(DIR)` reads it back with the same ids.
"""

from __future__ import annotations

import json
from pathlib import Path
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


HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                      "generation_config.json")


def write_hf_folder(tok: Tokenizer | ByteTokenizer, folder: str | Path,
                    model_max_length: int | None = None,
                    more_special_ids: dict[str, int] | None = None) -> list[Path]:
    """`tok` as a Hugging Face tokenizer folder (created if missing; these files replaced):
    the `tokenizers` JSON as built from the GGUF, the special tokens by name (bos, eos and
    `more_special_ids`: {"pad_token": id, "unk_token": id}, `gguf_special_ids`), the chat
    template, and every end-of-sequence id in `generation_config.json`. Returns the paths
    written. Raises ValueError for a tokenizer without a vocabulary (the simulator's)."""
    if not isinstance(tok, Tokenizer):
        raise ValueError(f"{tok.model_name!r} has no tokenizer vocabulary to export (the "
                         f"simulator's byte tokenizer)")
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    special = _special_tokens(tok, more_special_ids or {})
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast", **special,
        "clean_up_tokenization_spaces": False, "model_input_names": ["input_ids",
                                                                    "attention_mask"]}
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    if tok.chat_template is not None:
        config["chat_template"] = tok.chat_template
    eos_ids = sorted({*([tok.eos_token_id] if tok.eos_token_id is not None else []),
                      *tok.stop_token_ids})
    texts = {"tokenizer.json": tok.backend.to_str(pretty=True),
             "tokenizer_config.json": _json(config),
             "special_tokens_map.json": _json(special),
             "generation_config.json": _json(
                 {"bos_token_id": tok.bos_token_id,
                  "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids})}
    paths = []
    for name in HF_TOKENIZER_FILES:
        path = root / name
        path.write_text(texts[name], encoding="utf-8")
        paths.append(path)
    return paths


def gguf_special_ids(meta: dict[str, Any]) -> dict[str, int]:
    """The padding and unknown token ids a GGUF's metadata names, by their
    `tokenizer_config.json` names (what transformers' own GGUF reader sets)."""
    keys = {"pad_token": "tokenizer.ggml.padding_token_id",
            "unk_token": "tokenizer.ggml.unknown_token_id"}
    return {name: int(meta[key]) for name, key in keys.items() if meta.get(key) is not None}


def _special_tokens(tok: Tokenizer, more: dict[str, int]) -> dict[str, str]:
    """The special tokens by their text (the names `tokenizer_config.json` uses)."""
    out = {}
    ids = {"bos_token": tok.bos_token_id, "eos_token": tok.eos_token_id, **more}
    for key, token_id in ids.items():
        text = None if token_id is None else tok.id_to_token(token_id)
        if text:
            out[key] = text
    return out


def _json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False) + "\n"
