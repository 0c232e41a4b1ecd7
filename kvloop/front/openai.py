"""Schemas of the OpenAI-compatible API: pydantic models of the requests (vLLM's fields and
defaults) and TypedDicts of the responses.

Unknown request fields are ignored (as vLLM does). Responses are plain dicts built in
`serving.py` and `api.py`: they are written once per token when streaming, and a dict costs
less than a model there. The TypedDicts below type those dicts (mypy checks every key and
value) and are what the published OpenAPI schema (`/openapi.json`) says of each body;
`NotRequired` keys are sent only when asked for (`return_token_ids`, usage chunks). The body
of `GET /kvloop/worker`, which routers decode, is a msgspec Struct: `kvloop.wire.WorkerInfo`.
See docs/vllm-facts.md#openai-server for the parameters and their meaning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Annotated, Any, Literal, NotRequired

import pydantic
from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import TypedDict  # pydantic reads typing's TypedDict only on 3.12+

DEFAULT_MAX_TOKENS = 16   # completions' (and /generate's) max_tokens when the body has none


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _documented(**keywords: Any) -> Any:
    """JSON-schema keywords for the published schema only: the handlers enforce them (with
    vLLM's messages and `param`), pydantic does not."""
    return Field(json_schema_extra=keywords)


TokenId = Annotated[int, _documented(minimum=0)]
TokenIds = Annotated[list[TokenId], _documented(minItems=1)]
Text = Annotated[str, _documented(minLength=1)]
# A prompt: one text, texts, token ids, or lists of token ids; never empty.
Prompt = Text | Annotated[list[Text], _documented(minItems=1)] | TokenIds | Annotated[
    list[TokenIds], _documented(minItems=1)]


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


# --- structured output (docs/vllm-facts.md#structured-output) -----------------------------------
class JsonSchemaFormat(OpenAIModel):
    """`response_format.json_schema`: the schema under `schema` (`strict` is accepted: the
    grammar backend is always strict)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIModel):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar (EBNF),
    json_object; options as `kvloop.core.request.StructuredOutputsParams`."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False


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
    response_format: ResponseFormat | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[TokenId] | None = None
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
    # prefill/decode disaggregation (docs/disaggregation.md): handed to the engine as
    # SamplingParams.extra_args["kv_transfer_params"]
    kv_transfer_params: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's deprecated names of `structured_outputs`' fields (accepted, with a warning)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None


class CompletionRequest(SamplingRequest):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "Hello, my name is", "max_tokens": 8},
        {"prompt": [1, 2, 3], "max_tokens": 4, "stream": True,
         "stream_options": {"include_usage": True}}]})

    prompt: Prompt
    max_tokens: int | None = DEFAULT_MAX_TOKENS
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
    tool_calls: list[dict[str, Any]] | None = None   # an assistant's earlier calls
    tool_call_id: str | None = None                  # a tool's answer to one

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8},
        {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4, "stream": True,
         "stream_options": {"include_usage": True}}]})

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False


class GenerateSamplingParams(SamplingRequest):
    """`sampling_params` of the token-in route: vLLM's SamplingParams fields (those kvloop
    has; the unsupported ones are refused as on the OpenAI routes)."""

    max_tokens: int | None = DEFAULT_MAX_TOKENS
    logprobs: int | None = None


class GenerateRequest(OpenAIModel):
    """vLLM's token-in request (`POST /inference/v1/generate`): token ids in, token ids out,
    nothing tokenized on the way, so a prefill and a decode worker see the same ids."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4, "temperature": 0}}]})

    request_id: str | None = None
    token_ids: TokenIds
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None


class TokenizeRequest(OpenAIModel):
    """Text (`prompt`) or a chat (`messages`, which wins when both are given)."""

    model_config = ConfigDict(json_schema_extra={
        "anyOf": [{"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                  {"required": ["messages"], "properties": {"messages": {"type": "array"}}}],
        "examples": [{"prompt": "Hello"}, {"messages": [{"role": "user", "content": "Hi"}]}]})

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False


class DetokenizeRequest(OpenAIModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"tokens": [72, 105]}]})

    model: str | None = None
    tokens: list[TokenId]


# --- responses ---------------------------------------------------------------------------------
class ErrorInfo(TypedDict):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(TypedDict):
    """Every error answer, and the event that ends a stream that failed."""

    error: ErrorInfo


class PromptTokensDetails(TypedDict):
    cached_tokens: int


class Usage(TypedDict):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int
    prompt_tokens_details: PromptTokensDetails


class SpecDecodingSummary(TypedDict):
    """vLLM's per-request acceptance summary (`metrics.speculative_decoding` with
    `--per-request-spec-decode-metrics summary`): `acceptance_histogram[j]` counts the
    verification steps that accepted exactly j drafts (length k + 1); by draft length:
    the same for the steps that verified n drafts (key n as text, k + 1 counts)."""

    mean_acceptance_length: float
    draft_acceptance_rate: float
    acceptance_histogram: list[int]
    acceptance_histogram_by_draft_length: dict[str, list[int]]
    num_spec_steps: int
    num_accepted_draft_tokens: int
    num_draft_tokens: int
    num_spec_tokens: int


class ResponseMetrics(TypedDict):
    speculative_decoding: SpecDecodingSummary | None


class CompletionLogprobs(TypedDict):
    """Legacy completions logprobs, one entry per token (echoed prompt tokens have null
    logprobs)."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class PromptLogprob(TypedDict):
    """One token of vLLM's `prompt_logprobs` (keyed by token id, as text)."""

    logprob: float
    rank: int | None
    decoded_token: str


# vLLM's `prompt_logprobs`: null for the first prompt token, then {token id: PromptLogprob}
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(TypedDict):
    """A choice of a completion, and of a completion chunk (`text` is then the new text)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_token_ids: NotRequired[list[int]]
    token_ids: NotRequired[list[int]]
    prompt_logprobs: NotRequired[PromptLogprobs]   # asked for (or echo with logprobs)


class CompletionResponse(TypedDict):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: None
    kv_transfer_params: dict[str, Any] | None   # what a decode worker needs (P/D), else None
    metrics: NotRequired[ResponseMetrics]   # --per-request-spec-decode-metrics summary


class CompletionStreamResponse(TypedDict):
    """One `data:` event of a completion stream; the usage-only chunk has no choices."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: NotRequired[Usage]


class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(TypedDict):
    content: list[ChatTokenLogprob]


class FunctionCall(TypedDict):
    name: str
    arguments: str          # JSON text


class ToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class DeltaFunctionCall(TypedDict):
    name: NotRequired[str]
    arguments: NotRequired[str]


class DeltaToolCall(TypedDict):
    """A piece of a streamed tool call: the first piece of call `index` has its id, type and
    name; later ones add to its arguments."""

    index: int
    id: NotRequired[str]
    type: NotRequired[Literal["function"]]
    function: DeltaFunctionCall


class AssistantMessage(TypedDict):
    role: Literal["assistant"]
    content: str | None
    tool_calls: NotRequired[list[ToolCall]]


class ChatChoice(TypedDict):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    token_ids: NotRequired[list[int]]


class ChatCompletionResponse(TypedDict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: None
    kv_transfer_params: dict[str, Any] | None   # what a decode worker needs (P/D), else None
    prompt_token_ids: NotRequired[list[int]]
    prompt_logprobs: NotRequired[PromptLogprobs]   # when asked for
    metrics: NotRequired[ResponseMetrics]   # --per-request-spec-decode-metrics summary


class ChatDelta(TypedDict):
    role: NotRequired[Literal["assistant"]]
    content: NotRequired[str]
    tool_calls: NotRequired[list[DeltaToolCall]]


class ChatStreamChoice(TypedDict):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    token_ids: NotRequired[list[int]]


class ChatCompletionStreamResponse(TypedDict):
    """One `data:` event of a chat stream; the usage-only chunk has no choices."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: NotRequired[Usage]
    prompt_token_ids: NotRequired[list[int]]   # the first chunk, with `return_token_ids`


class GenerateChoice(TypedDict):
    """A choice of the token-in route, and of its stream's chunks (then the new tokens)."""

    index: int
    token_ids: list[int]
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class GenerateResponse(TypedDict):
    request_id: str
    choices: list[GenerateChoice]
    prompt_logprobs: PromptLogprobs | None
    kv_transfer_params: dict[str, Any] | None


class GenerateStreamResponse(TypedDict):
    """One `data:` event of a token-in stream."""

    request_id: str
    choices: list[GenerateChoice]


class ModelCard(TypedDict):
    """One served model name, as `/v1/models` lists it and `/v1/models/{id}` answers."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int
    permission: list[dict[str, Any]]


class ModelList(TypedDict):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(TypedDict):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(TypedDict):
    prompt: str


# --- responses of the operator endpoints ---------------------------------------------------------
class VersionResponse(TypedDict):
    version: str


class LoadResponse(TypedDict):
    server_load: int


class EngineStats(TypedDict):
    """`GET /kvloop/stats`: the engine's blocks and queues (`kvloop.engine.proc.engine_stats`)."""

    num_gpu_blocks: int
    num_total_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    kv_cache_usage: float
    num_running_reqs: int
    num_waiting_reqs: int
    num_requests: int
    num_preemptions_total: int
    step_index: int
    num_kv_transfers: int     # requests whose blocks wait on the KV connector (held, loading)


class ResetPrefixCacheResponse(TypedDict):
    success: bool


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


def error_body(message: str, code: int, param: str | None = None) -> ErrorResponse:
    """vLLM's error shape: {"error": {"message", "type", "param", "code"}}, typed by status."""
    return {"error": {"message": message, "type": error_type(code), "param": param,
                      "code": code}}


def http_error_body(status_code: int, detail: object) -> ErrorResponse:
    """The error object of an HTTP-level failure (unknown path, wrong method, a body that is
    not UTF-8)."""
    return error_body(str(detail), status_code)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after",
              "function-before", "list[int]", "list[str]", "list[list[int]]"}


def _clean_loc(loc: tuple[Any, ...]) -> str:
    """Dotted location of a validation error, without pydantic's union-member tags."""
    parts = [str(p) for p in loc if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p))]
    return ".".join(parts)


def validation_error_body(errors: list[Any]) -> ErrorResponse:
    """The 400 body of a request that fails its schema (pydantic's `errors()`, locations
    starting with `body`), as the API server answers it."""
    lines = [f"  {_clean_loc(tuple(e.get('loc', ())))}: {e.get('msg', '')}" for e in errors[:10]]
    noun = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {noun}:\n" + "\n".join(lines)
    param = _clean_loc(tuple(errors[0].get("loc", ()))) if errors else None
    return error_body(message, 400, param)


def request_schema(path: str) -> type[SamplingRequest]:
    """The request model of an OpenAI route: chat completions, else completions."""
    return ChatCompletionRequest if path.endswith("/chat/completions") else CompletionRequest


def validate_body(path: str, body: Any) -> SamplingRequest | ErrorResponse:
    """`body` (parsed JSON) read with the schema of `path`, or the 400 body the API server
    answers it with (the same model, the same message: FastAPI validates with
    `from_attributes`, which changes pydantic's wording of some errors)."""
    try:
        return request_schema(path).model_validate(body, from_attributes=True)
    except pydantic.ValidationError as e:
        return validation_error_body([{**err, "loc": ("body", *err.get("loc", ()))}
                                      for err in e.errors()])


# --- the output length a request asks for: one rule for every front -------------------------
@dataclass(frozen=True)
class MaxTokens:
    """What a request asks of its output's length, read by `MaxTokens.of` (the API server, from
    its request model) or `MaxTokens.of_body` (the router, from a validated body) with one
    rule: chat reads `max_completion_tokens`, else `max_tokens`, and has no default;
    completions (and /generate's sampling params) read `max_tokens`, whose default
    (`DEFAULT_MAX_TOKENS`) applies only when the body has none: an explicit null asks for
    nothing. `asked`: the client's number (None: nothing asked); `default`: what applies then
    (None: all the room the context leaves after the prompt)."""

    asked: int | None
    default: int | None

    @staticmethod
    def of(req: CompletionRequest | ChatCompletionRequest | GenerateSamplingParams
           ) -> MaxTokens:
        return _max_tokens(isinstance(req, ChatCompletionRequest),
                           req.model_dump(include=_MAX_TOKENS_FIELDS, exclude_unset=True))

    @staticmethod
    def of_body(path: str, body: Mapping[str, Any]) -> MaxTokens:
        """From a body validated with `validate_body(path, ...)` (its fields as sent)."""
        return _max_tokens(request_schema(path) is ChatCompletionRequest, body)

    def tokens(self, room: int | None) -> int:
        """The output tokens allowed when `room` tokens of context are left after the prompt
        (an `asked` number beyond it is the API server's 400 to answer, as vLLM's). `room`
        None: the context is not known (the router, before it picks a worker): a request that
        only the context bounds counts as asking for `DEFAULT_MAX_TOKENS`."""
        if self.asked is not None:
            return self.asked
        if room is None:
            return DEFAULT_MAX_TOKENS if self.default is None else self.default
        return room if self.default is None else min(self.default, room)


_MAX_TOKENS_FIELDS = {"max_tokens", "max_completion_tokens"}


def _max_tokens(chat: bool, sent: Mapping[str, Any]) -> MaxTokens:
    if chat:
        asked = sent.get("max_completion_tokens")
        return MaxTokens(sent.get("max_tokens") if asked is None else asked, None)
    if "max_tokens" in sent:
        return MaxTokens(sent["max_tokens"], None)
    return MaxTokens(None, DEFAULT_MAX_TOKENS)
