"""OpenAI's Responses API (`POST /v1/responses`): the request schema and its one conversion
to a chat completion request, shared by the API server and the router (so both tokenize a
Responses body exactly as the chat route would: `kvloop.front.prompts.chat_prompt`).

What a body becomes (vLLM's `construct_input_messages`, with the differences noted):

- `instructions` -> a first `system` message (only this request's: the instructions of a
  previous response are not carried into the next, as OpenAI documents);
- the conversation of `previous_response_id` (what the server stored: its inputs and its
  output, never its instructions) -> the messages that follow;
- `input` as a string -> one `user` message; as items: a `message` item (role user, system,
  developer -> system, or assistant; content a string or `input_text`/`output_text` parts)
  -> that message; consecutive `function_call` items -> one assistant message with their
  `tool_calls` (vLLM makes one message per call); a `function_call_output` -> a `tool`
  message answering its `call_id`. Any other item or content part (images, files,
  reasoning) is refused by the schema: a 400;
- `tools` (flat function tools: `{"type": "function", "name", "parameters", ...}`) and
  `tool_choice` (`none`, `auto`, `required`, `{"type": "function", "name"}`) -> the chat
  request's, so kvloop/server/tools.py plans and reads the calls;
- `max_output_tokens` -> `max_completion_tokens`; `temperature`, `top_p`, `top_k`, `seed`,
  `cache_salt`, `priority`, `user` -> the same fields; `text.format` json_schema or
  json_object -> `response_format`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import ConfigDict, Field
from typing_extensions import TypedDict  # pydantic reads typing's TypedDict only on 3.12+

from kvloop.front.openai import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    OpenAIModel,
    ResponseFormat,
)

RESPONSES_PATH = "/v1/responses"
RESPONSE_ID_PREFIX = "resp_"
Message = dict[str, Any]          # a chat message as `ChatMessage` reads it


class InputText(OpenAIModel):
    """A text content part: `input_text` (a user's) or `output_text` (an earlier answer's)."""

    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionCallItem(OpenAIModel):
    """A call the model made earlier (as a previous response's output carried it)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(OpenAIModel):
    """The caller's result of a function call, answering `call_id`."""

    type: Literal["function_call_output"]
    call_id: str
    output: str


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    """`text.format`: `text`, `json_object`, or `json_schema` with its name and schema."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None


class ResponsesRequest(OpenAIModel):
    """`POST /v1/responses` (OpenAI's fields kvloop serves, and vLLM's extensions)."""

    model_config = ConfigDict(extra="ignore", json_schema_extra={"examples": [
        {"input": "Hello!", "max_output_tokens": 8},
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
         "instructions": "Be brief.", "max_output_tokens": 4, "stream": True}]})

    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool | None = False
    background: bool | None = False
    include: list[str] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    # vLLM's extensions
    top_k: int | None = None
    seed: int | None = None
    cache_salt: str | None = None
    priority: int = 0


# --- answers ----------------------------------------------------------------------------------
class InputTokensDetails(TypedDict):
    cached_tokens: int


class OutputTokensDetails(TypedDict):
    reasoning_tokens: int


class ResponseUsage(TypedDict):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseObject(TypedDict):
    """A response, as `POST /v1/responses` and `GET /v1/responses/{id}` answer it (and
    `response.created`, `.in_progress` and `.completed` events carry it). Output items are
    `message`s (`content`: `output_text` parts) and `function_call`s."""

    id: str
    object: Literal["response"]
    created_at: int
    status: str
    error: dict[str, Any] | None
    incomplete_details: dict[str, str] | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[dict[str, Any]]
    parallel_tool_calls: bool
    previous_response_id: str | None
    temperature: float
    top_p: float
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    truncation: str
    store: bool
    background: bool
    metadata: dict[str, str]
    user: str | None
    usage: ResponseUsage | None


class ResponseStreamEvent(TypedDict):
    """One event of a Responses stream (its SSE `event:` is its `type`); which other keys
    it has depends on the type (kvloop/server/responses.py lists them)."""

    type: str
    sequence_number: int
    response: NotRequired[ResponseObject]
    output_index: NotRequired[int]
    item_id: NotRequired[str]
    item: NotRequired[dict[str, Any]]
    content_index: NotRequired[int]
    part: NotRequired[dict[str, Any]]
    delta: NotRequired[str]
    text: NotRequired[str]
    arguments: NotRequired[str]
    name: NotRequired[str]
    logprobs: NotRequired[list[Any]]
    code: NotRequired[str]
    message: NotRequired[str]
    param: NotRequired[str | None]


# --- the conversion ------------------------------------------------------------------------------
def input_messages(items: str | list[InputItem]) -> list[Message]:
    """The chat messages of `input` (this request's own, without instructions)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[Message] = []
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": item.text()})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "content": item.output, "tool_call_id": item.call_id})
        else:
            _add_call(out, item)
    return out


def _add_call(out: list[Message], item: FunctionCallItem) -> None:
    call = {"id": item.call_id, "type": "function",
            "function": {"name": item.name, "arguments": item.arguments}}
    last = out[-1] if out else None
    if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
        last["tool_calls"].append(call)
    else:
        out.append({"role": "assistant", "content": "", "tool_calls": [call]})


def conversation_after(history: list[Message], req: ResponsesRequest,
                       output: list[dict[str, Any]]) -> list[Message]:
    """What a continuation of a response starts from: the conversation it continued
    (`history`), its input, and its `output` items as one assistant message (its text and
    its function calls); never its instructions."""
    text = "".join(part.get("text", "") for item in output if item.get("type") == "message"
                   for part in item.get("content", []))
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item.get("type") == "function_call"]
    message: Message = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [*history, *input_messages(req.input), message]


def chat_request(req: ResponsesRequest, history: list[Message]) -> ChatCompletionRequest:
    """The chat completion request a Responses request is served as: instructions, then
    `history` (a previous response's conversation, [] for none), then the input."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else [])
    messages += history + input_messages(req.input)
    return ChatCompletionRequest(
        model=req.model, messages=[ChatMessage.model_validate(m) for m in messages],
        max_completion_tokens=req.max_output_tokens, temperature=req.temperature,
        top_p=req.top_p, top_k=req.top_k, seed=req.seed, user=req.user,
        cache_salt=req.cache_salt, priority=req.priority,
        tools=[_chat_tool(t) for t in req.tools] or None,
        tool_choice=_chat_tool_choice(req), response_format=_response_format(req.text))


def _chat_tool(tool: FunctionTool) -> ChatTool:
    return ChatTool(function=FunctionDefinition(name=tool.name, description=tool.description,
                                                parameters=tool.parameters,
                                                strict=tool.strict))


def _chat_tool_choice(req: ResponsesRequest
                      ) -> Literal["none", "auto", "required"] | NamedToolChoice | None:
    choice = req.tool_choice
    if isinstance(choice, FunctionToolChoice):
        return NamedToolChoice(function=NamedFunction(name=choice.name))
    if not req.tools and choice == "auto":
        return None             # the default, with nothing to call
    return choice


def _response_format(text: TextConfig | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name=fmt.name or "response", description=fmt.description, schema=fmt.json_schema,
        strict=fmt.strict))
