"""A lean asyncio HTTP/1.1 client for OpenAI-compatible streaming completions.

The load generator shares the CPU with the server it measures, so this client avoids
general-purpose HTTP stacks: one keep-alive connection per in-flight request (pooled), the
response body read as chunked / sized / until-close, server-sent events split on newlines,
and each event decoded by msgspec into a struct holding only the fields we use.

What one request records (`RequestResult`): when it started, when each content-bearing event
arrived, how many tokens it carried, the usage block (prompt, completion and cached prompt
tokens), the output token ids when the server returns them (`return_token_ids`), or the error.
Non-goals: HTTP/2, proxies, redirects, authentication beyond a bearer token.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import msgspec

MAX_ERROR_CHARS = 300


class HttpError(Exception):
    """A transport or protocol failure (not an HTTP error status)."""


class ClosedBeforeAnswer(HttpError):
    """The server closed the connection before a byte of the answer came."""


# --- the fields we read from the server's events ---------------------------------------------

class _PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _PromptDetails | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    token_ids: list[int] | None = None
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = msgspec.field(default_factory=list)
    usage: _Usage | None = None


class _ErrorBody(msgspec.Struct):
    error: dict[str, Any] | str | None = None
    message: str | None = None


_CHUNK_DECODER = msgspec.json.Decoder(_Chunk)


# --- URL and connection ----------------------------------------------------------------------

@dataclass(frozen=True)
class Endpoint:
    """Where the server is: scheme, host, port and the path prefix before `/v1/...`."""

    host: str
    port: int
    tls: bool
    prefix: str = ""

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected an http(s)://host:port URL, got {url!r}")
        tls = parts.scheme == "https"
        prefix = parts.path.rstrip("/")
        if prefix.endswith("/v1"):
            prefix = prefix[:-3]
        return cls(parts.hostname, parts.port or (443 if tls else 80), tls, prefix)

    @property
    def base(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}{self.prefix}"


class Connection:
    """One keep-alive HTTP/1.1 connection. Not shared between concurrent requests."""

    def __init__(self, endpoint: Endpoint, api_key: str | None = None):
        self.endpoint = endpoint
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reusable = False
        auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        self._fixed_headers = (f"Host: {endpoint.host}:{endpoint.port}\r\n"
                               f"User-Agent: kvloop-bench\r\n{auth}").encode()

    async def _open(self) -> None:
        ctx = ssl.create_default_context() if self.endpoint.tls else None
        self._reader, self._writer = await asyncio.open_connection(
            self.endpoint.host, self.endpoint.port, ssl=ctx, limit=1 << 22)
        self._reusable = True

    async def request(self, method: str, path: str, body: bytes | None = None,
                      accept: str = "application/json") -> Response:
        """Send one request; return the status, headers and an unread body.

        A kept-alive connection the server has closed meanwhile without saying so
        (llama-server closes one after every streamed answer) is reopened, and the request
        sent once more when the server closed it before answering."""
        reused = self._kept_alive()
        if not reused:
            await self.close()
            await self._open()
        try:
            return await self._send(method, path, body, accept)
        except (ClosedBeforeAnswer, ConnectionResetError, BrokenPipeError):
            if not reused:
                raise
        await self.close()
        await self._open()
        return await self._send(method, path, body, accept)

    def _kept_alive(self) -> bool:
        """Open, its last answer read to the end, and no end of stream seen from the server."""
        return (self._writer is not None and self._reader is not None and self._reusable
                and not self._writer.is_closing() and not self._reader.at_eof())

    async def _send(self, method: str, path: str, body: bytes | None,
                    accept: str) -> Response:
        assert self._reader is not None and self._writer is not None
        head = (f"{method} {self.endpoint.prefix}{path} HTTP/1.1\r\n"
                f"Accept: {accept}\r\n").encode() + self._fixed_headers
        if body is not None:
            head += (f"Content-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n").encode()
        self._writer.write(head + b"\r\n" + (body or b""))
        await self._writer.drain()
        self._reusable = False  # until the body has been read to its end
        return await Response.read_head(self, self._reader)

    def _body_done(self, keep_alive: bool) -> None:
        self._reusable = keep_alive

    async def close(self) -> None:
        writer, self._writer, self._reader = self._writer, None, None
        if writer is not None:
            writer.close()
            try:
                await writer.wait_closed()
            except (OSError, ssl.SSLError):
                pass


class Response:
    """Status, headers and a body to be read once (chunked, sized or until close)."""

    def __init__(self, conn: Connection, reader: asyncio.StreamReader, status: int,
                 headers: dict[str, str]):
        self.status = status
        self.headers = headers
        self._conn = conn
        self._reader = reader

    @classmethod
    async def read_head(cls, conn: Connection, reader: asyncio.StreamReader) -> Response:
        status_line = await reader.readline()
        if not status_line:
            raise ClosedBeforeAnswer("the server closed the connection before answering")
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise HttpError(f"not an HTTP/1.x response: {status_line[:80]!r}")
        headers: dict[str, str] = {}
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return cls(conn, reader, int(parts[1]), headers)

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive; marks the connection reusable when complete."""
        keep_alive = self.headers.get("connection", "").lower() != "close"
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            async for piece in self._chunked():
                yield piece
        elif "content-length" in self.headers:
            remaining = int(self.headers["content-length"])
            while remaining > 0:
                piece = await self._reader.read(min(remaining, 1 << 16))
                if not piece:
                    raise HttpError("the connection closed inside a response body")
                remaining -= len(piece)
                yield piece
        else:
            keep_alive = False
            while piece := await self._reader.read(1 << 16):
                yield piece
        self._conn._body_done(keep_alive)

    async def _chunked(self) -> AsyncIterator[bytes]:
        reader = self._reader
        while True:
            size_line = await reader.readline()
            if not size_line:
                raise HttpError("the connection closed inside a chunked body")
            size = int(size_line.split(b";", 1)[0], 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return
            data = await reader.readexactly(size + 2)
            yield data[:-2]

    async def read(self) -> bytes:
        return b"".join([p async for p in self.iter_bytes()])

    async def iter_lines(self) -> AsyncIterator[bytes]:
        """Complete body lines without their line ends (SSE framing: an unterminated last
        line is incomplete and dropped)."""
        pending = b""
        async for piece in self.iter_bytes():
            pending += piece
            if b"\n" not in pending:
                continue
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r")


class ConnectionPool:
    """Idle keep-alive connections to one endpoint, handed to one request at a time."""

    def __init__(self, endpoint: Endpoint, api_key: str | None = None):
        self.endpoint = endpoint
        self.api_key = api_key
        self._idle: list[Connection] = []

    def acquire(self) -> Connection:
        return self._idle.pop() if self._idle else Connection(self.endpoint, self.api_key)

    def release(self, conn: Connection) -> None:
        self._idle.append(conn)

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.close()


# --- one completion --------------------------------------------------------------------------

@dataclass
class RequestResult:
    """What one streamed completion did, in `time.perf_counter()` seconds."""

    session_id: int
    turn: int
    prompt_len: int
    max_tokens: int
    start: float = 0.0
    end: float = 0.0
    first_token_time: float | None = None
    chunk_times: list[float] = field(default_factory=list)   # content-bearing events
    num_chunk_tokens: int = 0                                 # tokens counted from events
    output_token_ids: list[int] | None = None
    prompt_tokens: int | None = None                          # from usage
    completion_tokens: int | None = None                      # from usage
    cached_tokens: int | None = None                          # usage...cached_tokens
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def output_tokens(self) -> int:
        """Output tokens: the usage count when the server sent one, else counted from events."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        return self.num_chunk_tokens

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        n = self.output_tokens
        if self.ttft is None or n < 2:
            return None
        return (self.end - self.first_token_time) / (n - 1)  # type: ignore[operator]

    def itls(self) -> list[float]:
        """Gaps between successive content-bearing events."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


def completion_payload(model: str | None, prompt: list[int] | str, max_tokens: int,
                       ignore_eos: bool = True, temperature: float = 0.0,
                       return_token_ids: bool = True,
                       extra: dict[str, Any] | None = None) -> bytes:
    """The JSON body of a streamed /v1/completions request with a token-id (or text)
    prompt."""
    body: dict[str, Any] = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
        "stream": True, "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    if ignore_eos:
        body["ignore_eos"] = True
    if return_token_ids:
        body["return_token_ids"] = True
    if extra:
        body.update(extra)
    return msgspec.json.encode(body)


def apply_event(result: RequestResult, data: bytes, now: float) -> None:
    """Account one SSE `data:` payload (not `[DONE]`) into `result`."""
    chunk = _CHUNK_DECODER.decode(data)
    if chunk.usage is not None:
        u = chunk.usage
        result.prompt_tokens = u.prompt_tokens
        result.completion_tokens = u.completion_tokens
        if u.prompt_tokens_details is not None:
            result.cached_tokens = u.prompt_tokens_details.cached_tokens
    for choice in chunk.choices:
        n = len(choice.token_ids) if choice.token_ids is not None else (1 if choice.text else 0)
        if choice.token_ids:
            if result.output_token_ids is None:
                result.output_token_ids = []
            result.output_token_ids.extend(choice.token_ids)
        if n:
            if result.first_token_time is None:
                result.first_token_time = now
            result.chunk_times.append(now)
            result.num_chunk_tokens += n


def error_message(status: int, body: bytes) -> str:
    """A short readable message from an error response."""
    text = body.decode("utf-8", "replace")
    try:
        parsed = msgspec.json.decode(body, type=_ErrorBody)
        err = parsed.error
        if isinstance(err, dict) and err.get("message"):
            text = str(err["message"])
        elif isinstance(err, str):
            text = err
        elif parsed.message:
            text = parsed.message
    except msgspec.DecodeError:
        pass
    return f"HTTP {status}: {text[:MAX_ERROR_CHARS]}"


async def stream_completion(conn: Connection, body: bytes, result: RequestResult,
                            path: str = "/v1/completions") -> RequestResult:
    """POST one streamed completion on `conn`, filling `result` as events arrive."""
    clock = time.perf_counter
    result.start = clock()
    try:
        resp = await conn.request("POST", path, body, accept="text/event-stream")
        if resp.status != 200:
            result.error = error_message(resp.status, await resp.read())
        else:
            await _read_events(resp, result)
    except (OSError, HttpError, asyncio.IncompleteReadError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]
        await conn.close()
    result.end = clock()
    return result


async def _read_events(resp: Response, result: RequestResult) -> None:
    clock = time.perf_counter
    done = False
    async for line in resp.iter_lines():
        if not line.startswith(b"data:"):
            continue  # blank separators, comments, `event:` lines
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            continue
        if data.startswith(b'{"error"') or data.startswith(b'{"object":"error"'):
            result.error = error_message(200, data)
            continue
        apply_event(result, data, clock())
    if not done and result.error is None:
        result.error = "the stream ended without [DONE]"


async def get_json(conn: Connection, path: str) -> Any:
    """GET a JSON document (e.g. /v1/models); raises HttpError on a non-200 status."""
    resp = await conn.request("GET", path)
    body = await resp.read()
    if resp.status != 200:
        raise HttpError(error_message(resp.status, body))
    return msgspec.json.decode(body)


async def first_model_id(pool: ConnectionPool) -> str | None:
    """The first id listed by /v1/models, or None when the server has no such route."""
    conn = pool.acquire()
    try:
        doc = await get_json(conn, "/v1/models")
    except (HttpError, OSError, msgspec.DecodeError):
        await conn.close()
        return None
    pool.release(conn)
    data = doc.get("data") if isinstance(doc, dict) else None
    if data and isinstance(data[0], dict):
        return data[0].get("id")
    return None
