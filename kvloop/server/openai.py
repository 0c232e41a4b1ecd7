"""Pydantic schemas of the OpenAI-compatible API (requests), vLLM's fields and defaults.

Unknown fields are ignored (as vLLM does). Responses are plain dicts built in `serving.py`:
they are written once per token when streaming, and a dict costs less than a model there.
See specs/vllm-engine.md section 8 for the parameters and their meaning.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingRequest(OpenAIModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_token_ids: bool | None = None
    cache_salt: str | None = None
    priority: int = 0
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    request_id: str | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


_TYPE_OVERRIDES = {499: "ClientDisconnectedError"}


def error_type(status_code: int) -> str:
    """The error `type` of a status, one name per status (vLLM's: 400 BadRequestError,
    404 NotFoundError, 500 InternalServerError, 503 ServiceUnavailableError): the status's
    phrase in CamelCase, with "Error" appended unless it already ends so."""
    if status_code in _TYPE_OVERRIDES:
        return _TYPE_OVERRIDES[status_code]
    try:
        phrase = HTTPStatus(status_code).phrase
    except ValueError:
        return "Error"
    name = "".join(w[:1].upper() + w[1:] for w in phrase.replace("-", " ").split())
    return name if name.endswith("Error") else name + "Error"


def error_body(message: str, code: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's error shape: {"error": {"message", "type", "param", "code"}}, typed by status."""
    return {"error": {"message": message, "type": error_type(code), "param": param,
                      "code": code}}


def http_error_body(status_code: int, detail: object) -> dict[str, Any]:
    """The error object of an HTTP-level failure (unknown path, wrong method, a body that is
    not UTF-8)."""
    return error_body(str(detail), status_code)
