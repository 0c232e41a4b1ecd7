"""The request side of structured output: the one constraint a request asks for.

Three ways to ask, as vLLM (docs/vllm-facts.md#structured-output), on /v1/completions and
/v1/chat/completions alike:

- OpenAI's `response_format`: `text` (no constraint), `json_object`, `json_schema` (its
  `schema`; `strict` accepted); `structural_tag` is refused;
- vLLM's `structured_outputs`: one of `json`, `regex`, `choice`, `grammar` (EBNF),
  `json_object`, with options (`disable_any_whitespace`, ...);
- the deprecated `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (and
  `guided_decoding_backend`, `guided_whitespace_pattern`): accepted with a logged warning
  naming the replacement.

A chat's `tools` with `tool_choice` "required" or a named function add their own constraint
(`kvloop.server.tools`). More than one of these in a request is a 400; so is a malformed
one (naming the field), and one larger than the server's limit (`check_size`: compiles grow
steeply with the spec, and the engine compiles only what fits). Whether a schema, regex or
grammar compiles is the engine's grammar backend's verdict: the handler waits for the
engine's first answer before it answers (streaming or not), so a spec that does not compile
(or does not within the engine's time limit) is a 400 too, with the backend's reason.
"""

from __future__ import annotations

import logging
from typing import Any

from kvloop.core.request import StructuredOutputKind, StructuredOutputsParams
from kvloop.front.openai import SamplingRequest
from kvloop.sampling_params import MAX_EXPANSION
from kvloop.server.config import MAX_SPEC_FLAG

logger = logging.getLogger("kvloop.server")

# deprecated name -> the `structured_outputs` field it fills
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar", "guided_whitespace_pattern": "whitespace_pattern"}
GUIDED_BACKENDS = ("xgrammar", "auto")   # what `guided_decoding_backend` may name
_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")


class ConstraintError(ValueError):
    """A structured-output request that cannot be served: a 400 naming `param`."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def requested_constraint(req: SamplingRequest, extra: tuple[str, dict[str, Any]] | None = None
                         ) -> tuple[StructuredOutputsParams, str] | None:
    """(the constraint, the field it came from) of `req`, None when it asks for none.
    `extra` is (field, constraint fields) of a constraint from elsewhere (tools).
    ConstraintError when the request asks for two, or for one that is malformed."""
    sources = [s for s in (_from_response_format(req), _from_structured_outputs(req),
                           _from_guided(req), extra) if s is not None]
    if not sources:
        if req.structured_outputs is not None:
            raise ConstraintError("structured_outputs needs one constraint: json, regex, "
                                  "choice, grammar or json_object.", "structured_outputs")
        return None
    if len(sources) > 1:
        names = " and ".join(name for name, _ in sources)
        raise ConstraintError(f"You can only use one kind of structured outputs constraint, "
                              f"but {names} both ask for one.", sources[1][0])
    param, fields = sources[0]
    options = _options(req)
    try:
        return StructuredOutputsParams(**fields, **options), param
    except ValueError as e:
        raise ConstraintError(str(e), param) from None


def check_size(params: StructuredOutputsParams, param: str, max_bytes: int) -> None:
    """ConstraintError naming the limit and its flag when the constraint's text (the
    schema's JSON, the regex, the grammar, the choices) is longer than `max_bytes`, or a
    regex or grammar would expand past `MAX_EXPANSION` (its `compile_cost`)."""
    size = len(params.spec.encode())
    if size > max_bytes:
        raise ConstraintError(f"The structured-output constraint of {param} is {size} bytes; "
                              f"this server compiles at most {max_bytes} bytes "
                              f"({MAX_SPEC_FLAG}).", param)
    kind = params.kind
    if kind in (StructuredOutputKind.REGEX, StructuredOutputKind.GRAMMAR):
        cost = params.compile_cost
        if cost > MAX_EXPANSION:
            raise ConstraintError(
                f"The {kind.value} of {param} repeats too much to compile in reasonable time "
                f"(about {cost} expanded states, at most {MAX_EXPANSION}: a bounded repeat "
                f"such as {{1,1000}} of a character class is compiled as that many copies); "
                f"use a smaller bound or an unbounded * or +.", param)


def _from_response_format(req: SamplingRequest) -> tuple[str, dict[str, Any]] | None:
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return "response_format", {"json_object": True}
    if rf.type == "structural_tag":
        raise ConstraintError("response_format of type structural_tag is not supported by "
                              "kvloop.", "response_format")
    if rf.json_schema is None:
        raise ConstraintError("When response_format type is 'json_schema', the "
                              "'json_schema' field must be provided.", "response_format")
    if rf.json_schema.json_schema is None:
        raise ConstraintError("response_format.json_schema needs a 'schema'.",
                              "response_format.json_schema.schema")
    return "response_format", {"json": rf.json_schema.json_schema}


def _from_structured_outputs(req: SamplingRequest) -> tuple[str, dict[str, Any]] | None:
    so = req.structured_outputs
    if so is None:
        return None
    fields = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
              "json_object": so.json_object, "structural_tag": so.structural_tag}
    given = {k: v for k, v in fields.items() if v is not None}
    if not given:
        return None        # options only: they shape another field's constraint
    return "structured_outputs", given


def _options(req: SamplingRequest) -> dict[str, Any]:
    so = req.structured_outputs
    options: dict[str, Any] = {}
    if so is not None:
        options = {k: getattr(so, k) for k in _OPTIONS if getattr(so, k)}
    if req.guided_whitespace_pattern is not None:
        options["whitespace_pattern"] = req.guided_whitespace_pattern
    return options


def _from_guided(req: SamplingRequest) -> tuple[str, dict[str, Any]] | None:
    given = [name for name in (*GUIDED_FIELDS, "guided_decoding_backend")
             if getattr(req, name) is not None]
    for name in given:
        logger.warning("%s is deprecated (vLLM removes it in v0.12.0 or v1.0.0); pass %s "
                       "instead", name, _replacement(name))
    backend = req.guided_decoding_backend
    if backend is not None and backend not in GUIDED_BACKENDS:
        raise ConstraintError(f"guided_decoding_backend {backend!r} is not available: "
                              f"kvloop's grammar backend is xgrammar.",
                              "guided_decoding_backend")
    fields = {GUIDED_FIELDS[name]: getattr(req, name) for name in given
              if name in GUIDED_FIELDS and name != "guided_whitespace_pattern"}
    if not fields:
        return None
    return next(iter(n for n in given if n in GUIDED_FIELDS)), fields


def _replacement(name: str) -> str:
    if name == "guided_decoding_backend":
        return "nothing (the server's grammar backend serves every request)"
    return f"`{GUIDED_FIELDS[name]}` in `structured_outputs`"
