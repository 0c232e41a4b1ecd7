"""The API server's stored responses (`store: true`, the default as OpenAI's): what
`GET /v1/responses/{id}` answers and `previous_response_id` continues.

Bounded in memory, least recently used first out: at most `max_entries` responses and
`max_bytes` of them (a response's size: its JSON and its conversation's, encoded). A
response alone over `max_bytes` is not stored (the request still succeeds; its id is then
unknown, as an evicted one's). Reading an entry (GET, or a request continuing it) makes it
the most recently used. vLLM keeps its store unbounded and off unless
`VLLM_ENABLE_RESPONSES_API_STORE=1`; kvloop stores by default, within these bounds
(`--responses-store-max-entries 0` turns storing off).

Each entry belongs to the API key that created it (`AuthConfig.owner`): another key, or no
key, finds nothing under its id (a 404, as an unknown id: the id's existence is not told).

Owner: one `ResponseStore` per API server, used only on its event loop (no lock needed).
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

MAX_ENTRIES_FLAG = "--responses-store-max-entries"
MAX_BYTES_FLAG = "--responses-store-max-bytes"
DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class ResponseStoreConfig:
    """The store's bounds; `max_entries` 0 stores nothing."""

    max_entries: int = DEFAULT_MAX_ENTRIES
    max_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        if self.max_entries < 0:
            raise ValueError(f"{MAX_ENTRIES_FLAG} must be >= 0, got {self.max_entries}")
        if self.max_bytes < 1:
            raise ValueError(f"{MAX_BYTES_FLAG} must be >= 1, got {self.max_bytes}")


def add_store_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Responses API store")
    g.add_argument(MAX_ENTRIES_FLAG, type=int, default=DEFAULT_MAX_ENTRIES, metavar="N",
                   help="stored responses kept for GET /v1/responses/{id} and "
                        "previous_response_id, least recently used evicted first (0: store "
                        "nothing)")
    g.add_argument(MAX_BYTES_FLAG, type=int, default=DEFAULT_MAX_BYTES, metavar="BYTES",
                   help="the most bytes of JSON the stored responses and their "
                        "conversations may take")


def store_config(args: argparse.Namespace) -> ResponseStoreConfig:
    return ResponseStoreConfig(args.responses_store_max_entries,
                               args.responses_store_max_bytes)


@dataclass(frozen=True)
class StoredResponse:
    """A finished response (the object GET answers) and its conversation: the chat messages
    a continuation starts with (inputs and output, not its instructions)."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    size: int
    owner: str | None = None          # `AuthConfig.owner` of the key that created it


class ResponseStore:
    def __init__(self, config: ResponseStoreConfig):
        self.config = config
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str, owner: str | None = None) -> StoredResponse | None:
        """`owner`'s stored response, now the most recently used; None if unknown, evicted
        or another owner's."""
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        self._entries.move_to_end(response_id)
        return entry

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]],
            owner: str | None = None) -> bool:
        """Store `response` under its id for `owner`, evicting the least recently used to
        fit; False when it alone is over the byte bound or storing is off."""
        size = len(msgspec.json.encode(response)) + len(msgspec.json.encode(conversation))
        if self.config.max_entries == 0 or size > self.config.max_bytes:
            return False
        self._drop(response["id"])
        while self._entries and (len(self._entries) >= self.config.max_entries
                                 or self.num_bytes + size > self.config.max_bytes):
            self._drop(next(iter(self._entries)))
        self._entries[response["id"]] = StoredResponse(response, conversation, size, owner)
        self.num_bytes += size
        return True

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_bytes -= entry.size

    def check_invariants(self) -> None:
        assert len(self._entries) <= self.config.max_entries
        assert self.num_bytes == sum(e.size for e in self._entries.values()) \
            <= self.config.max_bytes
