"""The router's side of the Responses API: which worker holds a stored response.

A stored response lives in the memory of the one worker that answered it
(kvloop/server/responses_store.py), as in vLLM, whose store is per API-server process. So the
router remembers, for each response it relayed, the worker and the conversation a
continuation starts from (`conversation_after`, the worker's own rule):

- `POST /v1/responses` with a `previous_response_id` the router knows goes to that worker
  (no other could answer it: the others would 404), and its prompt is tokenized with that
  conversation, so the predicted prefix hit is the worker's to the token; one the router
  does not know (relayed by another router, or forgotten) is routed as a fresh prompt of its
  own input, and the worker answers it (404 if it does not hold it);
- `GET /v1/responses/{id}` asks the worker that holds it, else each usable worker in turn
  until one has it (404 when none does).

Bounded like the worker's store: `max_entries` ids and `max_bytes` of conversations, least
recently used out. A holder that is down gets the request anyway: the router's 503 says no
worker is usable for it.

Owner: one `ResponseAffinity` per router, used on its event loop.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvloop.front.responses import Message, ResponsesRequest, conversation_after

DEFAULT_MAX_ENTRIES = 4096
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Held:
    worker: str
    conversation: list[Message]
    size: int


class ResponseAffinity:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES,
                 max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._held: OrderedDict[str, Held] = OrderedDict()
        self.num_bytes = 0

    def holder(self, response_id: str | None) -> Held | None:
        held = self._held.get(response_id or "")
        if held is not None:
            self._held.move_to_end(response_id or "")
        return held

    def record(self, worker: str, body: dict[str, Any], answer: Any) -> None:
        """Remember the response `answer` (a response object) that `worker` gave to the
        request `body`, if it was stored there."""
        if not (isinstance(answer, dict) and isinstance(answer.get("id"), str)
                and answer.get("status") in ("completed", "incomplete")):
            return
        try:
            req = ResponsesRequest.model_validate(body)
        except ValueError:          # pydantic's ValidationError
            return
        if not req.store:
            return
        prev = self.holder(req.previous_response_id)
        history = prev.conversation if prev is not None else []
        conversation = conversation_after(history, req, list(answer.get("output") or []))
        self._put(answer["id"], Held(worker, conversation, len(json.dumps(conversation))))

    def _put(self, response_id: str, held: Held) -> None:
        if held.size > self.max_bytes or self.max_entries == 0:
            return
        self._drop(response_id)
        while self._held and (len(self._held) >= self.max_entries
                              or self.num_bytes + held.size > self.max_bytes):
            self._drop(next(iter(self._held)))
        self._held[response_id] = held
        self.num_bytes += held.size

    def _drop(self, response_id: str) -> None:
        held = self._held.pop(response_id, None)
        if held is not None:
            self.num_bytes -= held.size


def completed_response(event_data: bytes) -> Any:
    """The response object of a `response.completed` stream event's data, else None."""
    if b'"response.completed"' not in event_data:
        return None
    try:
        payload = json.loads(event_data)
    except ValueError:
        return None
    if isinstance(payload, dict) and payload.get("type") == "response.completed":
        return payload.get("response")
    return None
