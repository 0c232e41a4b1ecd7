"""A client's request body read as the worker will read it, before anything is routed: the
API server's own schema (a malformed field gets the worker's 400), a client's
`kv_transfer_params` refused (they are the router's to set, unless the caller presents the
fleet token), and whether a stream's usage chunk must be asked for and stripped again.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse, Response

from kvloop.front.anthropic import MESSAGES_PATHS, MessagesRequest, validate_messages
from kvloop.front.embeddings import EmbeddingRequest, validate_embedding_body
from kvloop.front.json_body import JsonBodyError, load_json
from kvloop.front.openai import SamplingRequest, error_body, validate_body, validation_error_body
from kvloop.front.responses import ResponsesRequest
from kvloop.router.relay import error_response


def read_body(raw: bytes, path: str, fleet_member: bool = False
              ) -> tuple[dict[str, Any], bool, bool] | Response:
    """The client's body as the worker will read it, with whether it streams and whether the
    usage chunk the router asks for must be stripped again; or the 400 a worker would answer
    (the API server's own schema, `kvloop.front.openai`). `kv_transfer_params` are the
    router's to set: a client's are refused, unless the caller is a `fleet_member` (it
    presented the fleet's token: a router in front of this one)."""
    try:
        body = load_json(raw)
    except JsonBodyError as e:
        return error_response(str(e), 400)
    if path in MESSAGES_PATHS:
        return _read_messages_body(path, body, fleet_member)
    checked = validate_body(path, body)
    if not isinstance(checked, SamplingRequest):
        return JSONResponse(checked, status_code=400)
    if checked.kv_transfer_params is not None and not fleet_member:
        return _client_kv_params_refused()
    assert isinstance(body, dict)
    read = checked.model_dump(include=_READ_FIELDS, exclude_unset=True)
    body = {**body, **read}   # the fields the router reads, as the worker reads them
    opts = checked.stream_options
    stream = bool(checked.stream)
    return body, stream, stream and not (opts is not None and opts.include_usage)


def read_embedding_body(raw: bytes) -> tuple[dict[str, Any], EmbeddingRequest] | Response:
    """An embeddings body and its fields as the worker reads them, or the 400 it answers."""
    try:
        body = load_json(raw)
    except JsonBodyError as e:
        return error_response(str(e), 400)
    checked = validate_embedding_body(body)
    if not isinstance(checked, EmbeddingRequest):
        return JSONResponse(checked, status_code=400)
    return body, checked
def read_responses_body(raw: bytes) -> tuple[dict[str, Any], ResponsesRequest] | Response:
    """A Responses body as the worker reads it, or the 400 a worker would answer."""
    try:
        body = load_json(raw)
        return body, ResponsesRequest.model_validate(body)
    except JsonBodyError as e:
        return error_response(str(e), 400)
    except ValueError as e:   # not JSON, or not the schema (pydantic's is a ValueError)
        errors = getattr(e, "errors", None)     # pydantic's ValidationError
        if errors is not None:
            return JSONResponse(validation_error_body(
                [{**err, "loc": ("body", *err.get("loc", ()))} for err in errors()]),
                status_code=400)
        return error_response(f"invalid JSON body: {e}", 400)


def _client_kv_params_refused() -> Response:
    return JSONResponse(error_body(
        "kv_transfer_params are set by the router (prefill/decode disaggregation), never by "
        "a client", 400, "kv_transfer_params"), status_code=400)


def _read_messages_body(path: str, body: Any, fleet_member: bool
                        ) -> tuple[dict[str, Any], bool, bool] | Response:
    """`read_body` of an Anthropic Messages body: passed on as the client sent it (its usage
    reaches the router on every answer, streamed or not, so nothing is asked or stripped)."""
    checked = validate_messages(path, body)
    if not isinstance(checked, MessagesRequest):   # its 400 (reshaped by the middleware)
        return JSONResponse(checked, status_code=400)
    if checked.kv_transfer_params is not None and not fleet_member:
        return _client_kv_params_refused()
    assert isinstance(body, dict)
    return body, bool(checked.stream), False


_READ_FIELDS = {"stream", "stream_options", "n", "best_of", "max_tokens",
                "max_completion_tokens", "cache_salt"}
