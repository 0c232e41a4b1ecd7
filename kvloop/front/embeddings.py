"""`POST /v1/embeddings`: OpenAI's request and response shapes with vLLM's extensions, the
input's token ids (shared by the API server and the router, so both hash the same blocks) and
the vector encodings.

The request's fields and what kvloop does with them (docs/serving.md "Embeddings"):
- `input`: a text, texts, token ids or lists of token ids (never empty; at most `MAX_INPUTS`
  items, OpenAI's limit); texts get the tokenizer's special tokens unless
  `add_special_tokens` is false;
- `encoding_format`: "float" (a list of numbers) or "base64" (the float32 values' bytes in
  this machine's byte order, little-endian on x86 and ARM, base64: what the `openai` SDK
  sends by default and decodes);
- `dimensions`: refused (400, vLLM's words) as vLLM refuses it for a model without matryoshka
  representation, which no model kvloop serves has;
- `truncate_prompt_tokens` (vLLM): keep the last k tokens of each input; -1 keeps the last
  `max_model_len - 1` (kvloop's one rule: every prompt leaves one slot of the context);
- `use_activation` (vLLM): False returns the hidden state as it is, not normalized;
- `user`: accepted and ignored; `priority`, `cache_salt`: as on completions.
"""

from __future__ import annotations

import base64
from array import array
from collections.abc import Sequence
from typing import Any, Literal

import pydantic
from pydantic import ConfigDict
from typing_extensions import TypedDict

from kvloop.front.openai import ErrorResponse, OpenAIModel, Prompt, validation_error_body
from kvloop.front.prompts import PromptError, prompt_token_ids

EMBEDDINGS_PATH = "/v1/embeddings"
MAX_INPUTS = 2048     # OpenAI's limit on the items of one request's `input`


class EmbeddingRequest(OpenAIModel):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"input": "Hello, my name is"},
        {"input": [[1, 2, 3], [4, 5]], "encoding_format": "base64"}]})

    model: str | None = None
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM extensions
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    use_activation: bool | None = None
    priority: int = 0
    cache_salt: str | None = None


class EmbeddingData(TypedDict):
    index: int
    object: Literal["embedding"]
    embedding: list[float] | str


class EmbeddingUsage(TypedDict):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int
    prompt_tokens_details: None


class EmbeddingResponse(TypedDict):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def validate_embedding_body(body: Any) -> EmbeddingRequest | ErrorResponse:
    """`body` (parsed JSON) read as an embeddings request, or the 400 body the API server
    answers it with."""
    try:
        return EmbeddingRequest.model_validate(body, from_attributes=True)
    except pydantic.ValidationError as e:
        return validation_error_body([{**err, "loc": ("body", *err.get("loc", ()))}
                                      for err in e.errors()])


def embedding_inputs(tokenizer: Any, req: EmbeddingRequest,
                     max_model_len: int | None) -> list[list[int]]:
    """The token ids of each input, truncated as `truncate_prompt_tokens` asks (-1 needs
    `max_model_len`; None: not known, as in a router, and nothing is cut). PromptError (a
    400 naming the field) for an empty input, too many, or a truncation that cannot be."""
    if isinstance(req.input, list) and len(req.input) > MAX_INPUTS:
        raise PromptError(f"input must have at most {MAX_INPUTS} items, got "
                          f"{len(req.input)}", "input")
    prompts = prompt_token_ids(tokenizer, req.input, req.add_special_tokens, "input")
    keep = truncation(req.truncate_prompt_tokens, max_model_len)
    return prompts if keep is None else [ids[-keep:] for ids in prompts]


def truncation(truncate_prompt_tokens: int | None, max_model_len: int | None) -> int | None:
    """How many last tokens of each input to keep (None: all)."""
    k = truncate_prompt_tokens
    if k is None or (k == -1 and max_model_len is None):
        return None
    if k == -1:
        return max(max_model_len - 1, 1) if max_model_len is not None else None
    if k < 1:
        raise PromptError(f"truncate_prompt_tokens must be -1 or at least 1, got {k}",
                          "truncate_prompt_tokens")
    if max_model_len is not None and k > max_model_len:
        raise PromptError(f"truncate_prompt_tokens value ({k}) is greater than max_model_len "
                          f"({max_model_len}). Please, select a smaller truncation size.",
                          "truncate_prompt_tokens")
    return k


def encode_vector(vector: Sequence[float], encoding_format: str) -> list[float] | str:
    """A vector as the response carries it: numbers, or base64 of its float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(array("f", vector).tobytes()).decode("ascii")
    return list(vector)
