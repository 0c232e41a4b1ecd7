"""A tiny OpenAI-compatible server for the bench tests: real EngineCore, SimRunner, raw asyncio.

It speaks just enough HTTP/1.1 (keep-alive, chunked SSE, sized JSON errors) for
`kvloop bench`: GET /v1/models and POST /v1/completions with a token-id prompt, streaming,
`ignore_eos`, `return_token_ids` and usage with `prompt_tokens_details.cached_tokens`. It runs
its own event loop in a thread so a test can drive it from another loop. It records every
prompt it received. (It also holds the one sanity test of itself.)
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field

import pytest

from kvloop.config import CacheConfig, EngineConfig, SchedulerConfig
from kvloop.core.engine import EngineCore
from kvloop.core.request import SamplingParams
from kvloop.sim.runner import SimRunner


@dataclass
class FakeOptions:
    num_gpu_blocks: int = 512
    max_num_batched_tokens: int = 256
    send_token_ids: bool = True      # honour return_token_ids
    step_delay_s: float = 0.0        # sleep per engine step (to make timing visible)
    model: str = "fake-sim"


@dataclass
class _Pending:
    queue: asyncio.Queue
    prompt_len: int
    cached: int = 0
    num_out: int = 0


@dataclass
class FakeServer:
    options: FakeOptions = field(default_factory=FakeOptions)
    prompts: list[list[int]] = field(default_factory=list)
    bodies: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        o = self.options
        cfg = EngineConfig(cache=CacheConfig(num_gpu_blocks=o.num_gpu_blocks),
                           scheduler=SchedulerConfig(max_num_batched_tokens=o.max_num_batched_tokens))
        self.engine = EngineCore(cfg, SimRunner())
        self._pending: dict[str, _Pending] = {}
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._count = 0
        self.url = ""

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> FakeServer:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "fake server did not start"
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop_event.set)
            self._thread.join(10)

    def __enter__(self) -> FakeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._stop_event = asyncio.Event()
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        stepper = asyncio.create_task(self._engine_loop())
        self._ready.set()
        await self._stop_event.wait()
        stepper.cancel()
        server.close()

    # --- engine ------------------------------------------------------------------------------
    async def _engine_loop(self) -> None:
        assert self._wake is not None
        while True:
            if not self.engine.has_work():
                self._wake.clear()
                await self._wake.wait()
            result = self.engine.step()
            for out in result.outputs:
                p = self._pending.get(out.request_id)
                if p is not None:
                    p.cached = out.num_cached_tokens
                    p.queue.put_nowait(out)
            await asyncio.sleep(self.options.step_delay_s)

    # --- HTTP --------------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await self._one_request(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _one_request(self, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter) -> bool:
        line = await reader.readline()
        if not line:
            return False
        method, path, _ = line.decode().split(" ", 2)
        headers = {}
        while (h := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = h.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        body = await reader.readexactly(int(headers.get("content-length", 0)))
        if method == "GET" and path == "/v1/models":
            await self._json(writer, 200, {"object": "list", "data": [
                {"id": self.options.model, "object": "model"}]})
        elif method == "POST" and path == "/v1/completions":
            await self._completions(writer, json.loads(body))
        else:
            await self._json(writer, 404, {"error": {"message": f"no route {path}"}})
        return True

    async def _json(self, writer: asyncio.StreamWriter, status: int, doc: dict) -> None:
        data = json.dumps(doc).encode()
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        await writer.drain()

    async def _chunk(self, writer: asyncio.StreamWriter, doc: dict | str) -> None:
        data = b"data: " + (doc if isinstance(doc, str) else json.dumps(doc)).encode() + b"\n\n"
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()

    async def _completions(self, writer: asyncio.StreamWriter, body: dict) -> None:
        prompt, max_tokens = body.get("prompt"), body.get("max_tokens", 16)
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            await self._json(writer, 400, {"error": {"message": "prompt must be token ids"}})
            return
        if not isinstance(max_tokens, int) or max_tokens < 1:
            await self._json(writer, 400, {"error": {"message": "max_tokens must be >= 1"}})
            return
        self.prompts.append(prompt)
        self.bodies.append(body)
        self._count += 1
        rid = f"cmpl-{self._count}"
        pending = _Pending(asyncio.Queue(), len(prompt))
        self._pending[rid] = pending
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        self.engine.add_request(self.engine.make_request(rid, prompt, params))
        assert self._wake is not None
        self._wake.set()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        await self._stream(writer, rid, pending, bool(body.get("return_token_ids")))

    async def _stream(self, writer: asyncio.StreamWriter, rid: str, p: _Pending,
                      token_ids: bool) -> None:
        while True:
            out = await p.queue.get()
            p.num_out += len(out.new_token_ids)
            choice: dict = {"index": 0, "text": "x" * len(out.new_token_ids),
                            "finish_reason": out.finish_reason}
            if token_ids and self.options.send_token_ids:
                choice["token_ids"] = out.new_token_ids
            await self._chunk(writer, {"id": rid, "choices": [choice]})
            if out.finish_reason is not None:
                break
        del self._pending[rid]
        usage = {"prompt_tokens": p.prompt_len, "completion_tokens": p.num_out,
                 "total_tokens": p.prompt_len + p.num_out,
                 "prompt_tokens_details": {"cached_tokens": p.cached}}
        await self._chunk(writer, {"id": rid, "choices": [], "usage": usage})
        await self._chunk(writer, "[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()


@pytest.mark.processes
def test_fake_server_streams_one_completion() -> None:
    import urllib.request

    with FakeServer() as srv:
        req = urllib.request.Request(
            srv.url + "/v1/completions", method="POST",
            data=json.dumps({"prompt": [5, 6, 7], "max_tokens": 3, "stream": True}).encode())
        text = urllib.request.urlopen(req, timeout=10).read().decode()
    events = [e[6:] for e in text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 3
    assert srv.prompts == [[5, 6, 7]]
