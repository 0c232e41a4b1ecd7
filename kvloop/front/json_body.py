"""A client's JSON body, read with its nesting bounded.

Python's JSON reader recurses once per nesting level: a few kilobytes of `[[[[...` raise
`RecursionError` (which no handler expects: a 500), and a body just under the interpreter's
limit parses but breaks whatever walks it next (a re-encode, a template). `load_json` refuses
both as a client error: at most `MAX_JSON_DEPTH` levels of arrays and objects, far more than
any OpenAI or Anthropic body (a tool's JSON schema included) needs.

Every front reads client JSON through here (the router's routes; the API server's own reader
is FastAPI's, which answers a too-deep body 400 as well).
"""

from __future__ import annotations

import json
from typing import Any

MAX_JSON_DEPTH = 128


class JsonBodyError(ValueError):
    """The body is not JSON, or nests deeper than `MAX_JSON_DEPTH`: a 400."""


def load_json(raw: bytes | str) -> Any:
    """`raw` parsed; JsonBodyError when it is not JSON or is nested too deeply."""
    try:
        value = json.loads(_text(raw))
    except RecursionError:
        raise JsonBodyError(f"invalid JSON body: nested deeper than {MAX_JSON_DEPTH} "
                            "levels") from None
    except ValueError as e:
        raise JsonBodyError(f"invalid JSON body: {e}") from None
    depth = json_depth(value, MAX_JSON_DEPTH)
    if depth > MAX_JSON_DEPTH:
        raise JsonBodyError(f"invalid JSON body: nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def _text(raw: bytes | str) -> bytes | str:
    """UTF-8 decoded here (json.loads decodes bytes through a much slower path); other
    encodings JSON allows are left to json.loads."""
    if isinstance(raw, str):
        return raw
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


def json_depth(value: Any, stop_above: int) -> int:
    """The nesting depth of arrays and objects in `value` (a scalar: 0), walked without
    recursion; stops counting once it passes `stop_above`."""
    if not isinstance(value, (dict, list)):
        return 0
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        deepest = max(deepest, depth)
        if deepest > stop_above:
            return deepest
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest
