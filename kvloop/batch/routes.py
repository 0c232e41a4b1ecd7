"""The Batch API's HTTP routes, as a list a front adds to its route table.

    POST   /v1/files                   multipart: file (JSONL), purpose=batch
    GET    /v1/files                   the caller's files, newest first (after, limit, order)
    GET    /v1/files/{id}              a file object
    GET    /v1/files/{id}/content      its bytes
    DELETE /v1/files/{id}
    POST   /v1/batches                 input_file_id, endpoint, completion_window, metadata
    GET    /v1/batches                 the caller's batches, newest first (after, limit)
    GET    /v1/batches/{id}
    POST   /v1/batches/{id}/cancel

Everything is found by id and owner (`shapes.owner_of`): another key's file or batch is a
404, as an unknown id is. Errors are the front's OpenAI error objects. Owner: `BatchService`
(store, runner); a front calls `start()` and `stop()` from its lifespan.
"""

from __future__ import annotations

import asyncio
import json
import time
from email.parser import BytesParser
from email.policy import HTTP
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvloop.batch.config import COMPLETION_WINDOWS, ENDPOINTS, BatchConfig
from kvloop.batch.runner import BatchRunner, Send, input_copy
from kvloop.batch.shapes import (
    BATCH_PREFIX,
    FILE_PREFIX,
    TERMINAL,
    batch_object,
    check_metadata,
    file_object,
    new_id,
    owner_of,
    page,
    public,
    valid_id,
)
from kvloop.batch.store import Blobs, make_meta
from kvloop.front.openai import error_body

MAX_FILENAME_CHARS = 255
MAX_LIST_LIMIT = 10_000
PURPOSES_ACCEPTED = ("batch",)


def _error(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


class BatchService:
    def __init__(self, cfg: BatchConfig, send: Send):
        self.cfg = cfg
        self.blobs = Blobs(cfg.directory)
        self.meta = make_meta(cfg.directory, cfg.redis_url, cfg.redis_password)
        self.runner = BatchRunner(cfg, self.blobs, self.meta, send)
        self._lock = asyncio.Lock()   # quota checks and the writes they allow, in turn

    async def start(self) -> None:
        self.runner.start()

    async def stop(self) -> None:
        await self.runner.stop()
        close = getattr(self.runner.send, "aclose", None)
        if close is not None:
            await close()

    def routes(self) -> list[Route]:
        return [
            Route("/v1/files", self.upload, methods=["POST"]),
            Route("/v1/files", self.list_files, methods=["GET"]),
            Route("/v1/files/{file_id}", self.get_file, methods=["GET"]),
            Route("/v1/files/{file_id}", self.delete_file, methods=["DELETE"]),
            Route("/v1/files/{file_id}/content", self.file_content, methods=["GET"]),
            Route("/v1/batches", self.create_batch, methods=["POST"]),
            Route("/v1/batches", self.list_batches, methods=["GET"]),
            Route("/v1/batches/{batch_id}", self.get_batch, methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", self.cancel_batch, methods=["POST"]),
        ]

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await self.runner.call(fn, *args)

    async def _owned(self, kind: str, oid: str, owner: str) -> dict[str, Any] | None:
        prefix = FILE_PREFIX if kind == "file" else BATCH_PREFIX
        if not valid_id(oid, prefix):
            return None
        obj = await self._call(self.meta.get, kind, oid)
        return obj if obj is not None and obj.get("_owner") == owner else None

    # --- files ----------------------------------------------------------------------------
    async def upload(self, request: Request) -> Response:
        raw = await request.body()
        if len(raw) > self.cfg.max_file_bytes + 64 * 1024:
            return _error(f"a file has at most {self.cfg.max_file_bytes} bytes", 413, "file")
        form = parse_multipart(request.headers.get("content-type", ""), raw)
        if isinstance(form, str):
            return _error(form, 400)
        fields, upload = form
        if fields.get("purpose") not in PURPOSES_ACCEPTED:
            return _error(f"purpose must be one of {list(PURPOSES_ACCEPTED)}", 400, "purpose")
        if upload is None:
            return _error("a 'file' part with a filename is required", 400, "file")
        filename, data = upload
        problem = self._file_problem(filename, data)
        if problem is not None:
            return _error(*problem)
        owner = owner_of(request.headers)
        async with self._lock:
            refusal = await self._quota(owner, len(data))
            if refusal is not None:
                return refusal
            obj = file_object(new_id(FILE_PREFIX), len(data), int(time.time()), filename,
                              "batch")
            await self._call(self.blobs.put, obj["id"], data)
            await self._call(self.meta.put, "file", {**obj, "_owner": owner,
                                                     "_created_us": time.time_ns() // 1000})
        return JSONResponse(obj)

    def _file_problem(self, filename: str, data: bytes) -> tuple[str, int, str] | None:
        if not filename or len(filename) > MAX_FILENAME_CHARS or "\x00" in filename:
            return f"a filename has 1-{MAX_FILENAME_CHARS} characters", 400, "file"
        if len(data) > self.cfg.max_file_bytes:
            return f"a file has at most {self.cfg.max_file_bytes} bytes", 413, "file"
        if sum(1 for ln in data.splitlines() if ln.strip()) > self.cfg.max_lines:
            return f"a batch file has at most {self.cfg.max_lines} lines", 400, "file"
        return None

    async def _quota(self, owner: str, size: int) -> JSONResponse | None:
        files = await self._call(self.meta.owned, "file", owner)
        used = sum(f["bytes"] for f in files)
        if len(files) >= self.cfg.max_files_per_tenant:
            return _error(f"this key keeps at most {self.cfg.max_files_per_tenant} files: "
                          "delete some first", 429)
        if used + size > self.cfg.tenant_quota_bytes:
            return _error(f"this key's files would take {used + size} bytes, over its quota "
                          f"of {self.cfg.tenant_quota_bytes}: delete some first", 429)
        return None

    async def list_files(self, request: Request) -> Response:
        q = request.query_params
        limit = _limit(q.get("limit"), MAX_LIST_LIMIT, MAX_LIST_LIMIT)
        if limit is None or q.get("order", "desc") not in ("asc", "desc"):
            return _error(f"limit must be 1-{MAX_LIST_LIMIT} and order asc or desc", 400)
        files = await self._call(self.meta.owned, "file", owner_of(request.headers))
        if q.get("purpose"):
            files = [f for f in files if f["purpose"] == q["purpose"]]
        if q.get("order") == "asc":
            files.reverse()
        return JSONResponse(page(files, limit, q.get("after")))

    async def get_file(self, request: Request) -> Response:
        fid = request.path_params["file_id"]
        obj = await self._owned("file", fid, owner_of(request.headers))
        return JSONResponse(public(obj)) if obj else _no_file(fid)

    async def file_content(self, request: Request) -> Response:
        fid = request.path_params["file_id"]
        obj = await self._owned("file", fid, owner_of(request.headers))
        data = None if obj is None else await self._call(self.blobs.get, fid)
        if data is None:
            return _no_file(fid)
        return Response(data, media_type="application/octet-stream")

    async def delete_file(self, request: Request) -> Response:
        fid = request.path_params["file_id"]
        async with self._lock:
            obj = await self._owned("file", fid, owner_of(request.headers))
            if obj is None:
                return _no_file(fid)
            await self._call(self.meta.delete, "file", fid)
            await self._call(self.blobs.delete, fid)
        return JSONResponse({"id": fid, "object": "file", "deleted": True})

    # --- batches --------------------------------------------------------------------------
    async def create_batch(self, request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _error("the body must be JSON", 400)
        if not isinstance(body, dict):
            return _error("the body must be a JSON object", 400)
        problem = _create_problem(body)
        if problem is not None:
            return _error(*problem)
        owner = owner_of(request.headers)
        async with self._lock:
            src = await self._owned("file", body["input_file_id"], owner)
            if src is None or src["purpose"] != "batch":
                return _error(f"No such File object: {body['input_file_id']}", 404,
                              "input_file_id")
            if len(await self._call(self.meta.owned, "batch", owner)) >= \
                    self.cfg.max_batches_per_tenant:
                return _error(f"this key keeps at most {self.cfg.max_batches_per_tenant} "
                              "batches", 429)
            b = await self._new_batch(body, owner)
        await self.runner.kick(b["id"])
        return JSONResponse(public(b))

    async def _new_batch(self, body: dict[str, Any], owner: str) -> dict[str, Any]:
        now = int(time.time())
        b = batch_object(new_id(BATCH_PREFIX), body["input_file_id"], body["endpoint"],
                         body["completion_window"], now,
                         now + COMPLETION_WINDOWS[body["completion_window"]],
                         body.get("metadata"))
        data = await self._call(self.blobs.get, body["input_file_id"])
        await self._call(self.blobs.put, input_copy(b["id"]), data or b"")
        b.update(_owner=owner, _created_us=time.time_ns() // 1000)
        await self._call(self.meta.put, "batch", b)
        return b

    async def _view(self, b: dict[str, Any]) -> dict[str, Any]:
        """The batch as a client sees it: `cancelling` once cancelled, until it ends."""
        view = public(b)
        if b["status"] not in TERMINAL:
            mark = await self._call(self.meta.get, "cancel", b["id"])
            if mark is not None:
                view.update(status="cancelling",
                            cancelling_at=b.get("cancelling_at") or mark["created_at"])
        return view

    async def get_batch(self, request: Request) -> Response:
        bid = request.path_params["batch_id"]
        b = await self._owned("batch", bid, owner_of(request.headers))
        return JSONResponse(await self._view(b)) if b else _no_batch(bid)

    async def list_batches(self, request: Request) -> Response:
        limit = _limit(request.query_params.get("limit"), 100, 20)
        if limit is None:
            return _error("limit must be 1-100", 400, "limit")
        batches = await self._call(self.meta.owned, "batch", owner_of(request.headers))
        views = [await self._view(b) for b in batches]
        return JSONResponse(page(views, limit, request.query_params.get("after")))

    async def cancel_batch(self, request: Request) -> Response:
        bid = request.path_params["batch_id"]
        owner = owner_of(request.headers)
        b = await self._owned("batch", bid, owner)
        if b is None:
            return _no_batch(bid)
        if b["status"] in TERMINAL:
            return _error(f"Cannot cancel a batch with status '{b['status']}'.", 409)
        if await self._call(self.meta.get, "cancel", bid) is None:
            await self._call(self.meta.put, "cancel", {"id": bid, "_owner": owner,
                                                       "created_at": int(time.time())})
        return JSONResponse(await self._view(b))


def _create_problem(body: dict[str, Any]) -> tuple[str, int, str] | None:
    fid = body.get("input_file_id")
    if not isinstance(fid, str):
        return "input_file_id is required", 400, "input_file_id"
    if body.get("endpoint") not in ENDPOINTS:
        return f"endpoint must be one of {list(ENDPOINTS)}", 400, "endpoint"
    if body.get("completion_window") not in COMPLETION_WINDOWS:
        return (f"completion_window must be one of {list(COMPLETION_WINDOWS)}", 400,
                "completion_window")
    problem = check_metadata(body.get("metadata"))
    return None if problem is None else (problem, 400, "metadata")


def _limit(value: str | None, most: int, default: int) -> int | None:
    """A list's `limit` (None: not an integer in 1..most)."""
    if value is None:
        return default
    try:
        n = int(value)
    except ValueError:
        return None
    return n if 1 <= n <= most else None


def _no_file(fid: str) -> JSONResponse:
    return _error(f"No such File object: {fid}", 404, "id")


def _no_batch(bid: str) -> JSONResponse:
    return _error(f"No batch found with id '{bid}'.", 404, "batch_id")


def parse_multipart(content_type: str, body: bytes
                    ) -> tuple[dict[str, str], tuple[str, bytes] | None] | str:
    """The text fields and the `file` part (filename, bytes) of a multipart/form-data body,
    or what is wrong with it."""
    if not content_type.lower().startswith("multipart/form-data") or \
            "boundary=" not in content_type:
        return "the body must be multipart/form-data with a 'file' and a 'purpose'"
    head = b"Content-Type: " + content_type.encode("latin-1", "replace") + b"\r\n\r\n"
    msg = BytesParser(policy=HTTP).parsebytes(head + body)
    if not msg.is_multipart():
        return "the multipart body could not be read"
    fields: dict[str, str] = {}
    upload = None
    for part in msg.iter_parts():   # type: ignore[attr-defined]
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        if not isinstance(payload, bytes):
            return "a multipart part could not be read"
        if name == "file" and part.get_filename() is not None:
            upload = (str(part.get_filename()), payload)
        elif isinstance(name, str):
            fields[name] = payload.decode("utf-8", "replace")
    return fields, upload
