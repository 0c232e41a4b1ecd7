"""A batch's input lines: parsed and checked one by one, and the order they run in.

A line that is not a request this batch can send (not JSON, no `custom_id`, a repeated
`custom_id`, another method or URL than the batch's endpoint, a body that is not an object,
or asks to stream) is never sent: it becomes one line of the error file, and every other
line still runs. Blank lines are skipped (they are no request).

Order: lines run sorted by their prompt's leading text (model, system prompt, messages,
prompt or input, as JSON), so lines sharing a prefix run one after another and find it in
the workers' prefix caches; ties keep file order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MAX_CUSTOM_ID_CHARS = 512
_PROMPT_FIELDS = ("messages", "prompt", "input")


@dataclass(frozen=True)
class Line:
    """Line `index` (among the non-blank lines) of the input file."""

    index: int
    custom_id: str | None
    body: dict[str, Any] | None = None
    error: tuple[str, str] | None = None   # (code, message): never sent


def parse_lines(data: bytes, endpoint: str) -> list[Line]:
    out: list[Line] = []
    seen: set[str] = set()
    for raw in data.splitlines():
        if raw.strip():
            line = _parse(len(out), raw, endpoint, seen)
            out.append(line)
            if line.custom_id is not None:
                seen.add(line.custom_id)
    return out


def _parse(index: int, raw: bytes, endpoint: str, seen: set[str]) -> Line:
    try:
        obj = json.loads(raw)
    except ValueError as e:
        return Line(index, None, error=("invalid_json_line", f"line {index + 1} is not JSON: "
                                                             f"{e}"))
    if not isinstance(obj, dict):
        return Line(index, None, error=("invalid_json_line",
                                        f"line {index + 1} is not a JSON object"))
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID_CHARS:
        return Line(index, None, error=("invalid_custom_id", f"line {index + 1}: custom_id "
                                        f"must be a string of 1-{MAX_CUSTOM_ID_CHARS} "
                                        "characters"))
    problem = _problem(obj, endpoint, cid in seen)
    if problem is not None:
        return Line(index, cid, error=problem)
    return Line(index, cid, body=obj["body"])


def _problem(obj: dict[str, Any], endpoint: str, duplicate: bool) -> tuple[str, str] | None:
    if duplicate:
        return "duplicate_custom_id", "custom_id must be unique within a batch"
    if obj.get("method") != "POST":
        return "invalid_method", "method must be POST"
    if obj.get("url") != endpoint:
        return "invalid_url", f"url must be the batch's endpoint {endpoint}"
    body = obj.get("body")
    if not isinstance(body, dict):
        return "invalid_body", "body must be a JSON object"
    if body.get("stream"):
        return "invalid_body", "a batch request cannot stream"
    return None


def prefix_key(body: dict[str, Any]) -> str:
    """Text whose sort order puts requests sharing a prompt prefix next to each other."""
    prompt = next((body[f] for f in _PROMPT_FIELDS if f in body), None)
    head = json.dumps([body.get("model"), body.get("system")], ensure_ascii=False,
                      sort_keys=True, default=str)
    return head + json.dumps(prompt, ensure_ascii=False, sort_keys=True, default=str)


def run_order(lines: list[Line]) -> list[Line]:
    """The sendable lines of `lines`, in the order they run."""
    sendable = [ln for ln in lines if ln.body is not None]
    return sorted(sendable, key=lambda ln: (prefix_key(ln.body or {}), ln.index))
