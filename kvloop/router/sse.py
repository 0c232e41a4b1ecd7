"""Server-sent events as the router relays them: split into whole events, the usage chunk
the router asked for stripped again, a migrating stream's events rewritten.

Owner: one `SseRelay` per relayed stream (`kvloop.router.single.SingleFlow._relay`).
"""

from __future__ import annotations

import json
from typing import Any

from kvloop.router.migration import Migration
from kvloop.router.relay import StreamEnd, cached_tokens, json_or_none


class SseRelay:
    """Splits an SSE byte stream into events; drops the injected usage chunk if asked."""

    def __init__(self, strip_usage: bool, migration: Migration | None = None):
        self.strip_usage = strip_usage
        self.migration = migration   # sees (and may rewrite) each event's data first
        self.buf = b""
        self.started = False
        self.cached_tokens: int | None = None
        self.end = StreamEnd()   # did the stream end as a complete answer ends?

    def feed(self, chunk: bytes) -> bytes:
        """The whole events of `chunk` (and what was buffered) the client gets. Once the
        stream has started, a chunk of whole events that no migration reads and that holds
        no usage is relayed as it is, unparsed (the common case: one token's event)."""
        if (self.started and self.migration is None and not self.buf
                and chunk.endswith(b"\n\n") and b'"usage"' not in chunk):
            self.end.note_events(chunk)
            return chunk
        self.buf += chunk
        out: list[bytes] = []
        while (found := event_end(self.buf)) is not None:
            end, sep = found
            event, self.buf = self.buf[:end + sep], self.buf[end + sep:]
            self._note_end(event)
            event = self._migrated(event)
            if event and self._keep(event):
                out.append(event)
        return b"".join(out)

    def flush(self) -> bytes:
        self._note_end(self.buf)
        rest, self.buf = self._migrated(self.buf), b""
        return rest if rest and self._keep(rest) else b""

    def _note_end(self, event: bytes) -> None:
        data = event_data(event)
        if data is not None:
            self.end.note(data)

    def _migrated(self, event: bytes) -> bytes:
        """`event` as the migration rewrites it (b"": dropped)."""
        data = event_data(event) if self.migration is not None else None
        if self.migration is None or data is None:
            return event
        out = self.migration.on_event(data)
        return b"" if out is None else b"data: " + out + b"\n\n"

    def _keep(self, event: bytes) -> bool:
        data = event_data(event)
        if data is None or data == b"[DONE]":
            return True
        if b'"usage"' not in data:
            self.started = True
            return True
        payload = json_or_none(data)
        if not isinstance(payload, dict):
            self.started = True
            return True
        cached = cached_tokens(payload)
        if cached is not None:
            self.cached_tokens = cached
        usage_only = payload.get("choices") == [] and payload.get("usage") is not None
        if not usage_only:
            self.started = True
        return not (usage_only and self.strip_usage)


def event_end(buf: bytes) -> tuple[int, int] | None:
    """Position and length of the first event separator in `buf`, or None."""
    a = buf.find(b"\n\n")
    b = buf.find(b"\r\n\r\n")
    if b >= 0 and (a < 0 or b < a):
        return b, 4
    return (a, 2) if a >= 0 else None


def event_data(event: bytes) -> bytes | None:
    lines = [ln[5:].strip() for ln in event.splitlines() if ln.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def sse_event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"
