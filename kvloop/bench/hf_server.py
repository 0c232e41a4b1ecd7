"""An anchor for `kvloop bench --compare`: Hugging Face transformers behind a small
OpenAI-compatible HTTP front.

    python -m kvloop.bench.hf_server [--model PATH] [--port 0] [--dtype bf16]

What a Python user writes: `model.generate()` on a left-padded batch. Requests that arrive
while a batch runs wait for the next one (static batching, no prefix cache); a batch takes up
to `--max-batch` waiting requests, gathered for `--batch-wait-ms` after the first. Per
request: token-id (or text) prompt, `max_tokens`, `ignore_eos` (EOS masked for that row),
greedy or temperature sampling (the batch samples if any request does, at the highest
temperature), streaming SSE with `return_token_ids` and usage (`cached_tokens` is always 0).

`--model` takes a GGUF file (dequantized by transformers at load) or a Hugging Face
directory; the default is the embedded SmolLM2 GGUF. Prints "hf anchor serving on URL".
Not part of kvloop's serving path: the only torch user outside kvloop/model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvloop.bench.cli_args import HelpFormatter
from kvloop.locate import find_model_path

ANNOUNCEMENT = "hf anchor serving on {url}"   # the line that says it accepts connections

# --- the model -------------------------------------------------------------------------------


def load_model(path: str, dtype: str) -> tuple[Any, Any]:
    """(model, tokenizer or None) from a GGUF file or a Hugging Face directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    if path.endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(path))
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch_dtype)
        tok_args: dict[str, Any] = {"gguf_file": name}
    else:
        folder = path
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
        tok_args = {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **tok_args)
    except (OSError, ValueError, KeyError):
        tokenizer = None
    return model.eval(), tokenizer


# --- batching --------------------------------------------------------------------------------

@dataclass
class Job:
    """One request; `emit(token_ids, finish_reason)` is called from the batch thread."""

    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    temperature: float
    emit: Any
    num_out: int = 0
    done: bool = False


@dataclass
class BatchStats:
    batches: int = 0
    requests: int = 0
    sizes: list[int] = field(default_factory=list)


class StaticBatcher:
    """Owns the model; runs `generate()` on batches of waiting jobs in one thread."""

    def __init__(self, model: Any, max_batch: int = 32, batch_wait_s: float = 0.01):
        self.model = model
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s
        self.stats = BatchStats()
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        gen = model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else model.config.eos_token_id
        self.eos_ids: set[int] = set(eos if isinstance(eos, list) else
                                     ([] if eos is None else [eos]))
        pad = gen.pad_token_id if gen.pad_token_id is not None else model.config.pad_token_id
        self.pad_id = pad if pad is not None else (min(self.eos_ids) if self.eos_ids else 0)
        self._thread = threading.Thread(target=self._loop, name="hf-batcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def _take_batch(self) -> list[Job] | None:
        first = self._jobs.get()
        if first is None:
            return None
        batch = [first]
        deadline = time.monotonic() + self.batch_wait_s
        while len(batch) < self.max_batch:
            try:
                job = self._jobs.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if job is None:
                self._jobs.put(None)
                break
            batch.append(job)
        return batch

    def _loop(self) -> None:
        while (batch := self._take_batch()) is not None:
            try:
                self.run_batch(batch)
            except Exception as e:  # report to every waiting client, keep serving
                for job in batch:
                    if not job.done:
                        job.done = True
                        job.emit([], f"error: {type(e).__name__}: {e}")

    def run_batch(self, jobs: list[Job]) -> None:
        """generate() once for `jobs`, streaming each row's tokens to its job."""
        import torch

        self.stats.batches += 1
        self.stats.requests += len(jobs)
        self.stats.sizes.append(len(jobs))
        width = max(len(j.prompt) for j in jobs)
        ids = torch.full((len(jobs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(jobs), width), dtype=torch.long)
        for i, j in enumerate(jobs):
            ids[i, width - len(j.prompt):] = torch.tensor(j.prompt)
            mask[i, width - len(j.prompt):] = 1
        temperature = max(j.temperature for j in jobs)
        kwargs: dict[str, Any] = {"do_sample": temperature > 0}
        if temperature > 0:
            kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
        with torch.inference_mode():
            self.model.generate(
                ids, attention_mask=mask, max_new_tokens=max(j.max_tokens for j in jobs),
                pad_token_id=self.pad_id, streamer=_RowStreamer(jobs, self.eos_ids),
                logits_processor=_processors(jobs, self.eos_ids),
                stopping_criteria=_stoppers(jobs), **kwargs)
        for j in jobs:
            if not j.done:  # generate() ended early (all rows finished)
                j.done = True
                j.emit([], "length")


class _RowStreamer:
    """generate()'s streamer: the first put() is the prompt, then one token per row."""

    def __init__(self, jobs: list[Job], eos_ids: set[int]):
        self.jobs = jobs
        self.eos_ids = eos_ids
        self.seen_prompt = False

    def put(self, value: Any) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        for job, tok in zip(self.jobs, value.reshape(-1).tolist(), strict=True):
            if job.done:
                continue
            job.num_out += 1
            finish = None
            if not job.ignore_eos and tok in self.eos_ids:
                finish = "stop"
            elif job.num_out >= job.max_tokens:
                finish = "length"
            job.done = finish is not None
            job.emit([tok], finish)

    def end(self) -> None:
        pass


def _processors(jobs: list[Job], eos_ids: set[int]) -> Any:
    from transformers import LogitsProcessor, LogitsProcessorList

    rows = [i for i, j in enumerate(jobs) if j.ignore_eos]
    eos = sorted(eos_ids)

    class MaskEos(LogitsProcessor):
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            if rows and eos:
                scores[rows, eos[0]:eos[0] + 1] = float("-inf")
                for e in eos[1:]:
                    scores[rows, e] = float("-inf")
            return scores

    return LogitsProcessorList([MaskEos()])


def _stoppers(jobs: list[Job]) -> Any:
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class AllDone(StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            done = all(j.done for j in jobs)
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool)

    return StoppingCriteriaList([AllDone()])


# --- HTTP ------------------------------------------------------------------------------------

@dataclass
class _HttpRequest:
    method: str
    path: str
    body: bytes


async def _read_request(reader: asyncio.StreamReader) -> _HttpRequest | None:
    line = await reader.readline()
    if not line:
        return None
    method, path, _ = line.decode("latin-1").split(" ", 2)
    length = 0
    while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = h.decode("latin-1").partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    return _HttpRequest(method, path.split("?", 1)[0], await reader.readexactly(length))


async def _send_json(writer: asyncio.StreamWriter, status: int, doc: Any) -> None:
    data = json.dumps(doc).encode()
    writer.write(f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                 .encode() + data)
    await writer.drain()


async def _send_event(writer: asyncio.StreamWriter, doc: Any) -> None:
    data = b"data: " + (doc if isinstance(doc, bytes) else json.dumps(doc).encode()) + b"\n\n"
    writer.write(b"%x\r\n%s\r\n" % (len(data), data))
    await writer.drain()


def _error(message: str, status: int = 400) -> tuple[int, dict[str, Any]]:
    return status, {"error": {"message": message, "type": "BadRequestError", "code": status}}


class AnchorServer:
    """The HTTP front: /v1/models, /health, /v1/completions (streamed or not)."""

    def __init__(self, batcher: StaticBatcher, tokenizer: Any, model_name: str):
        self.batcher = batcher
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._count = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (req := await _read_request(reader)) is not None:
                await self._route(req, writer)
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()

    async def _route(self, req: _HttpRequest, writer: asyncio.StreamWriter) -> None:
        if req.method == "GET" and req.path == "/v1/models":
            await _send_json(writer, 200, {"object": "list", "data": [
                {"id": self.model_name, "object": "model", "owned_by": "hf-anchor"}]})
        elif req.method == "GET" and req.path == "/health":
            await _send_json(writer, 200, {"status": "ok"})
        elif req.method == "POST" and req.path == "/v1/completions":
            await self._completions(req, writer)
        else:
            await _send_json(writer, *_error(f"no route {req.method} {req.path}", 404))

    def _parse(self, body: bytes) -> tuple[Job | None, dict[str, Any], tuple[int, dict] | None]:
        try:
            doc = json.loads(body)
        except json.JSONDecodeError:
            return None, {}, _error("the body is not JSON")
        prompt = doc.get("prompt")
        if isinstance(prompt, str) and self.tokenizer is not None:
            prompt = self.tokenizer.encode(prompt)
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            return None, doc, _error("prompt must be a non-empty list of token ids (or text)")
        max_tokens = doc.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return None, doc, _error("max_tokens must be an integer >= 1")
        job = Job(prompt, max_tokens, bool(doc.get("ignore_eos")),
                  float(doc.get("temperature") or 0.0), None)
        return job, doc, None

    async def _completions(self, req: _HttpRequest, writer: asyncio.StreamWriter) -> None:
        job, doc, err = self._parse(req.body)
        if err is not None or job is None:
            await _send_json(writer, *(err or _error("bad request")))
            return
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[list[int], str | None]] = asyncio.Queue()
        job.emit = lambda ids, fin: loop.call_soon_threadsafe(events.put_nowait, (ids, fin))
        self._count += 1
        rid = f"cmpl-hf-{self._count}"
        self.batcher.submit(job)
        if doc.get("stream"):
            await self._stream(writer, rid, job, doc, events)
        else:
            await self._whole(writer, rid, job, doc, events)

    def _text(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return "".join(f"<{t}>" for t in ids)
        return str(self.tokenizer.decode(ids))

    def _usage(self, job: Job) -> dict[str, Any]:
        return {"prompt_tokens": len(job.prompt), "completion_tokens": job.num_out,
                "total_tokens": len(job.prompt) + job.num_out,
                "prompt_tokens_details": {"cached_tokens": 0}}

    async def _stream(self, writer: asyncio.StreamWriter, rid: str, job: Job,
                      doc: dict[str, Any], events: asyncio.Queue) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n")
        with_ids = bool(doc.get("return_token_ids"))
        while True:
            ids, finish = await events.get()
            choice: dict[str, Any] = {"index": 0, "text": self._text(ids),
                                      "finish_reason": finish}
            if with_ids:
                choice["token_ids"] = ids
                if job.num_out == len(ids):
                    choice["prompt_token_ids"] = job.prompt
            await _send_event(writer, {"id": rid, "object": "text_completion",
                                       "created": int(time.time()), "model": self.model_name,
                                       "choices": [choice]})
            if finish is not None:
                break
        if (doc.get("stream_options") or {}).get("include_usage"):
            await _send_event(writer, {"id": rid, "object": "text_completion",
                                       "model": self.model_name, "choices": [],
                                       "usage": self._usage(job)})
        await _send_event(writer, b"[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def _whole(self, writer: asyncio.StreamWriter, rid: str, job: Job,
                     doc: dict[str, Any], events: asyncio.Queue) -> None:
        out: list[int] = []
        while True:
            ids, finish = await events.get()
            out += ids
            if finish is not None:
                break
        choice: dict[str, Any] = {"index": 0, "text": self._text(out), "finish_reason": finish}
        if doc.get("return_token_ids"):
            choice.update(token_ids=out, prompt_token_ids=job.prompt)
        await _send_json(writer, 200, {"id": rid, "object": "text_completion",
                                       "created": int(time.time()), "model": self.model_name,
                                       "choices": [choice], "usage": self._usage(job)})


async def serve(server: AnchorServer, host: str, port: int, ready: Any = None,
                stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT, or until `stop` is set."""
    srv = await asyncio.start_server(server.handle, host, port)
    bound = srv.sockets[0].getsockname()
    url = f"http://{bound[0]}:{bound[1]}"
    if ready is not None:
        ready(url)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread
    async with srv:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvloop.bench.hf_server",
                                 description=__doc__.split("\n\n")[0],
                                                           formatter_class=HelpFormatter)
    ap.add_argument("--model", help="GGUF file or HF directory (default: embedded SmolLM2)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0: any free port")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--batch-wait-ms", type=float, default=10.0)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    args = ap.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    path = find_model_path(args.model)
    model, tokenizer = load_model(path, args.dtype)
    batcher = StaticBatcher(model, args.max_batch, args.batch_wait_ms / 1000.0)
    batcher.start()
    name = os.path.basename(path.rstrip("/"))
    front = AnchorServer(batcher, tokenizer, name)
    try:
        asyncio.run(serve(front, args.host, args.port,
                          lambda url: print(ANNOUNCEMENT.format(url=url), flush=True)))
    finally:
        batcher.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
