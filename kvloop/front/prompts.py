"""OpenAI request -> prompt token ids: the one implementation of the API server and the router.

The router hashes a prompt's blocks to find the worker that holds them, so its token ids must
be the worker's to the token: both call these functions, with the tokenizer loaded from the
same model path (`kvloop.front.tokenizer.load_vocabulary`). The rules are vLLM's OpenAI
server's:

- completions: `prompt` is a text, a list of texts, a list of token ids or a list of those
  (never empty); text gets the tokenizer's special tokens (BOS) unless `add_special_tokens`
  is false; token ids are taken as they are;
- Anthropic Messages (`/v1/messages`): the equivalent chat request
  (`kvloop.front.anthropic.chat_request`), then as chat;
- chat: each message becomes {role, content} (text parts joined, no content is ""; an
  assistant's `tool_calls` and a tool's `tool_call_id` kept), the model's chat template
  renders them with the request's `tools`, with the generation prompt unless
  `add_generation_prompt` is false or `continue_final_message` is true; the text gets no
  special tokens unless `add_special_tokens` is true (the template wrote them).

A prompt's tokenization can be bounded (`BoundedTokenizer`, the router's): a text longer
than `CHARS_PER_TOKEN_BOUND` characters per token of the context is tokenized only up to
that many characters; if that prefix already fills the context the prompt is refused
(`PromptTooLong`, vLLM's context-length 400) without tokenizing the rest, else it is not
tokenized at all (`PromptError`: the router routes it by load and the worker decides).

A prompt that cannot be made into ids raises `PromptError` (a 400 naming `param`): the server
answers it, the router routes such a request by load and lets the worker answer. Checking ids
against the vocabulary is the server's (only it knows the engine's vocabulary size).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pydantic

from kvloop.core.request import ContextLengthError, check_context_length
from kvloop.front import anthropic, responses
from kvloop.front.anthropic import (
    COUNT_TOKENS_PATH,
    MESSAGES_PATHS,
    ConversionError,
    CountTokensRequest,
    MessagesRequest,
)
from kvloop.front.openai import ChatCompletionRequest, ChatMessage, CompletionRequest
from kvloop.front.responses import RESPONSES_PATH, Message, ResponsesRequest

CHARS_PER_TOKEN_BOUND = 16   # characters per token no usual text exceeds (English: about 4)


class PromptError(ValueError):
    """The request's prompt cannot be tokenized: a 400 whose `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class PromptTooLong(Exception):
    """The prompt has at least `tokens` tokens: more than the context holds (a 400 on
    `param`). Not a ValueError, so no tokenizer-error handler turns it into a PromptError."""

    def __init__(self, message: str, tokens: int, param: str = "prompt"):
        super().__init__(message)
        self.tokens = tokens
        self.param = param


class BoundedTokenizer:
    """`tokenizer`, with each `encode` bounded by a context of `max_model_len` tokens
    (module docstring). `refuse` False (the request truncates its prompt itself): a text
    too long to tokenize cheaply is never refused, only left untokenized."""

    def __init__(self, tokenizer: Any, max_model_len: int, refuse: bool = True):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.refuse = refuse

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        limit = self.max_model_len * CHARS_PER_TOKEN_BOUND
        ids = list(self.tokenizer.encode(text[:limit], add_special_tokens=add_special_tokens))
        if self.refuse:
            check_prompt_tokens(self.max_model_len, len(ids))
        if len(text) > limit:
            raise ValueError(f"a text of {len(text)} characters is more than the router "
                             f"tokenizes ({limit})")
        return ids

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(messages, **kwargs)


def check_prompt_tokens(max_model_len: int, prompt_len: int) -> None:
    """PromptTooLong unless a prompt of (at least) `prompt_len` tokens fits the context."""
    try:
        check_context_length(max_model_len, prompt_len)
    except ContextLengthError as e:
        raise PromptTooLong(str(e), prompt_len, e.param) from None


def encode(tokenizer: Any, text: str, add_special_tokens: bool, param: str) -> list[int]:
    """Tokenize user text; text the tokenizer cannot take (lone surrogates...) is a
    PromptError."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    except (UnicodeError, ValueError, TypeError) as e:
        raise PromptError(f"cannot tokenize the {param}: {e}", param) from e


def truncated(ids: list[int], truncate_prompt_tokens: int | None,
              max_model_len: int | None) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the last k tokens of the prompt (-1: k is
    `max_model_len`; None: the prompt as is). k of 0 or below -1, or beyond `max_model_len`,
    is a PromptError. `max_model_len` None (the router, which does not know it): -1 and a k
    beyond the context are left for the worker to apply or refuse."""
    k = truncate_prompt_tokens
    if k is None:
        return ids
    param = "truncate_prompt_tokens"
    if k == 0 or k < -1:
        raise PromptError(f"truncate_prompt_tokens must be an integer >= 1 or -1, got {k}.",
                          param)
    if max_model_len is None:
        return ids if k == -1 else ids[-k:]
    if k == -1:
        k = max_model_len
    if k > max_model_len:
        raise PromptError(f"truncate_prompt_tokens value ({k}) is greater than max_model_len "
                          f"({max_model_len}). Please, select a smaller truncation size.", param)
    return ids[-k:]


def completion_prompts(tokenizer: Any, req: CompletionRequest,
                       max_model_len: int | None = None) -> list[list[int]]:
    """`prompt` (text, texts, token ids, lists of token ids) as token id lists, each cut to
    `truncate_prompt_tokens` (`truncated`)."""
    return [truncated(x, req.truncate_prompt_tokens, max_model_len)
            for x in prompt_token_ids(tokenizer, req.prompt, req.add_special_tokens, "prompt")]


def prompt_token_ids(tokenizer: Any, p: str | Sequence[Any], add_special_tokens: bool,
                     param: str) -> list[list[int]]:
    """A completions-style prompt field `param` (text, texts, token ids, lists of token ids;
    the embeddings route's `input` too) as token id lists; PromptError if any is empty."""
    prompts: list[list[int]] = []
    if isinstance(p, str):
        prompts = [encode(tokenizer, p, add_special_tokens, param)]
    elif all(isinstance(x, int) for x in p):
        prompts = [[x for x in p if isinstance(x, int)]] if p else []
    else:
        for x in p:
            if isinstance(x, str):
                prompts.append(encode(tokenizer, x, add_special_tokens, param))
            elif isinstance(x, list):
                prompts.append(list(x))
    if not prompts or any(len(x) == 0 for x in prompts):
        raise PromptError(f"{param} must not be empty", param)
    return prompts


def chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template sees them: role and text content, and an assistant's
    `tool_calls` or a tool's `tool_call_id` when given."""
    out: list[dict[str, Any]] = []
    for m in messages:
        message: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls is not None:
            message["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def render_chat(tokenizer: Any, messages: Sequence[ChatMessage],
                add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None) -> str:
    """The chat template's text (with `tools` for a template that shows them); a template
    error is the request's fault (bad roles, order...): PromptError."""
    extra = {"tools": tools} if tools else {}
    try:
        return str(tokenizer.apply_chat_template(chat_messages(messages),
                                                 add_generation_prompt=add_generation_prompt,
                                                 **extra))
    except Exception as e:
        raise PromptError(f"cannot apply the chat template: {e}", "messages") from e


def chat_prompt(tokenizer: Any, req: ChatCompletionRequest,
                max_model_len: int | None = None) -> list[int]:
    """The token ids of a chat request's prompt (its `tools` are shown to the template, as
    vLLM shows them), cut to `truncate_prompt_tokens` (`truncated`)."""
    add_gen = req.add_generation_prompt and not req.continue_final_message
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    text = render_chat(tokenizer, req.messages, add_gen, tools)
    ids = encode(tokenizer, text, req.add_special_tokens, "messages")
    if not ids:
        raise PromptError("the chat prompt is empty", "messages")
    return truncated(ids, req.truncate_prompt_tokens, max_model_len)


def messages_prompt(tokenizer: Any, req: CountTokensRequest) -> list[int]:
    """The token ids of an Anthropic Messages request's prompt: its chat equivalent's."""
    try:
        chat = anthropic.chat_request(req)
    except ConversionError as e:
        raise PromptError(str(e), e.param) from e
    return chat_prompt(tokenizer, chat)


def body_prompts(tokenizer: Any, path: str, body: dict[str, Any],
                 history: list[Message] | None = None) -> list[list[int]]:
    """The prompts of a raw JSON body sent to `path` (Messages, chat, the Responses route,
    which continues `history`, else completions), read with the server's request schema;
    one list for a chat, Messages or Responses request."""
    try:
        if path in MESSAGES_PATHS:
            schema = CountTokensRequest if path == COUNT_TOKENS_PATH else MessagesRequest
            return [messages_prompt(tokenizer, schema.model_validate(body))]
        if path == RESPONSES_PATH:
            req = ResponsesRequest.model_validate(body)
            return [chat_prompt(tokenizer, responses.chat_request(req, history or []))]
        if path.endswith("/chat/completions"):
            return [chat_prompt(tokenizer, ChatCompletionRequest.model_validate(body))]
        return completion_prompts(tokenizer, CompletionRequest.model_validate(body))
    except pydantic.ValidationError as e:
        first = e.errors()[0]["loc"] if e.errors() else ()
        raise PromptError(f"the body fails validation: {e}",
                          str(first[0]) if first else "body") from e
