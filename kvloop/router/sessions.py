"""Session affinity: which worker served a session's last turn, and how long its prompt was.

A session is named by the `x-session-id` header, else the body's `user` field (OpenAI's end-
user id). The router keeps a digest of the name, never the name, in a bounded LRU table
(at most `MAX_SESSIONS` entries and `MAX_SESSION_BYTES` bytes, at `SESSION_ENTRY_BYTES`
each: a client sending a new session id per request costs the router that much at most;
each entry is forgotten `SESSION_TTL_S` after its last turn). The scorer
credits the session's worker as if it held the session's last prompt (`Candidate.
session_tokens`, weighted by `CostConfig.session_weight`): a soft preference that load still
outweighs, so a multi-turn session stays where its cache is unless its worker is busier
than the credit is worth.

Owner: `Router` owns one `SessionTable`; only `route()` reads and writes it.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SESSION_HEADER = "x-session-id"
MAX_SESSIONS = 100_000
MAX_SESSION_BYTES = 8 * 1024 * 1024
SESSION_ENTRY_BYTES = 256   # one entry: its key, its turn and the table's link (measured: ~200)
SESSION_TTL_S = 600.0


@dataclass(frozen=True, slots=True)
class SessionTurn:
    """Where a session's last turn went, its prompt length and when."""

    worker: str
    prompt_tokens: int
    at: float


def session_key(headers: Mapping[str, str], body: Mapping[str, Any]) -> int | None:
    """The digest of the request's session name (`x-session-id`, else `user`), or None."""
    name = headers.get(SESSION_HEADER)
    if not name:
        user = body.get("user")
        name = user if isinstance(user, str) else None
    if not name:
        return None
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big")


class SessionTable:
    """Bounded LRU of session -> last turn; thread-safe (decisions may run on a thread)."""

    def __init__(self, max_sessions: int = MAX_SESSIONS, ttl_s: float = SESSION_TTL_S,
                 max_bytes: int = MAX_SESSION_BYTES):
        self.max_sessions = min(max_sessions, max_bytes // SESSION_ENTRY_BYTES)
        self.ttl_s = ttl_s
        self._turns: OrderedDict[int, SessionTurn] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._turns)

    def last_turn(self, key: int | None, now: float) -> SessionTurn | None:
        """The session's last turn, unless it is older than the TTL (then forgotten)."""
        if key is None:
            return None
        with self._lock:
            turn = self._turns.get(key)
            if turn is not None and now - turn.at > self.ttl_s:
                del self._turns[key]
                return None
            return turn

    def record(self, key: int | None, worker: str, prompt_tokens: int, now: float) -> None:
        """The session's turn went to `worker`; the least recently used session goes when
        the table is full."""
        if key is None:
            return
        with self._lock:
            self._turns[key] = SessionTurn(worker, prompt_tokens, now)
            self._turns.move_to_end(key)
            while len(self._turns) > self.max_sessions:
                self._turns.popitem(last=False)

    def forget_worker(self, worker: str) -> None:
        """A worker left (or lost its cache): its sessions start afresh."""
        with self._lock:
            for k in [k for k, t in self._turns.items() if t.worker == worker]:
                del self._turns[k]
