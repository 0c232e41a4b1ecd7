"""Runs batches: validating -> in_progress -> finalizing -> completed (or failed, expired,
cancelling -> cancelled), and resumes them after a restart.

    validating   the input (copied when the batch was created) is parsed; an empty file
                 or one over `max_lines` fails the batch (`errors`), bad lines do not
    in_progress  lines run in `run_order`, at most `concurrency` at once over all batches;
                 a line refused before it ran (429, 503) is sent again after
                 `retry_after_s`; every result is in the journal (fsynced) before it counts
    finalizing   the output file (2xx answers) and error file (the rest) are written, in
                 input order, under ids derived from the batch's (so a restart here makes
                 the same files, not new ones)

A cancel (a `cancel` marker the route writes) or the completion window passing stops the
lines not yet answered: cancelled lines are left out, expired ones get a `batch_expired`
error line. After a restart, `scan` claims every unfinished batch and runs it from its
journal: no result is lost or written twice; a line whose answer never reached the
journal is sent again.

Owner: `BatchRunner` owns the running batches' tasks and is the only writer of a batch's
metadata after the route created it (the cancel route writes its own marker).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kvloop.batch import journal
from kvloop.batch.config import BatchConfig
from kvloop.batch.lines import Line, parse_lines, run_order
from kvloop.batch.shapes import (
    FILE_PREFIX,
    TERMINAL,
    error_line,
    file_object,
    output_line,
    succeeded,
)
from kvloop.batch.store import Blobs, Meta

log = logging.getLogger("kvloop.batch")

SCAN_INTERVAL_S = 1.0    # how often unfinished batches are claimed and claims renewed
WATCH_INTERVAL_S = 0.5   # how often a running batch saves its counts and reads its marker


@dataclass(frozen=True)
class Answer:
    """What the front answered to one line; `retry`: refused before it ran."""

    status: int
    body: Any
    request_id: str

    @property
    def retry(self) -> bool:
        return self.status in (429, 503)


Send = Callable[[str, dict[str, Any], str], Awaitable[Answer]]   # (path, body, owner)


def derived_file_id(bid: str, which: str) -> str:
    return FILE_PREFIX + hashlib.blake2b(f"{bid}/{which}".encode(), digest_size=12).hexdigest()


class BatchRunner:
    def __init__(self, cfg: BatchConfig, blobs: Blobs, meta: Meta, send: Send,
                 clock: Callable[[], float] = time.time):
        self.cfg, self.blobs, self.meta, self.send, self.clock = cfg, blobs, meta, send, clock
        self.holder = secrets.token_hex(8)
        self.slots = asyncio.Semaphore(cfg.concurrency)
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._scanner: asyncio.Task[None] | None = None

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    # --- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self._scanner = asyncio.get_running_loop().create_task(self._scan_loop())

    async def stop(self) -> None:
        """Stop every batch where it is (lines in flight are not recorded: they run again
        after a restart)."""
        tasks = [t for t in (self._scanner, *self.tasks.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _scan_loop(self) -> None:
        while True:
            try:
                await self.scan()
            except Exception:   # Redis away: try again next time
                log.exception("batch scan failed")
            await asyncio.sleep(SCAN_INTERVAL_S)

    async def scan(self) -> None:
        """Renew this runner's claims; claim and start every unfinished batch nobody runs."""
        for bid in list(self.tasks):
            await self.call(self.meta.claim, bid, self.holder, self.cfg.claim_ttl_s)
        for bid in await self.call(self.meta.active):
            await self.kick(bid)

    async def kick(self, bid: str) -> None:
        """Run `bid` here if nobody does."""
        if bid in self.tasks or not await self.call(self.meta.claim, bid, self.holder,
                                                    self.cfg.claim_ttl_s):
            return
        task = asyncio.get_running_loop().create_task(self._run(bid))
        self.tasks[bid] = task
        task.add_done_callback(lambda t: self._done(bid, t))

    def _done(self, bid: str, task: asyncio.Task[None]) -> None:
        self.tasks.pop(bid, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("batch %s stopped", bid, exc_info=task.exception())
        if not task.cancelled():
            self.meta.release(bid, self.holder)

    # --- one batch ------------------------------------------------------------------------
    async def _run(self, bid: str) -> None:
        b = await self.call(self.meta.get, "batch", bid)
        if b is None or b["status"] in TERMINAL:
            return
        data = await self.call(self.blobs.get, input_copy(bid))
        lines = parse_lines(data or b"", b["endpoint"])
        if b["status"] == "validating":
            if not await self._validate(b, lines):
                return
        done = await self.call(journal.load, self.blobs.journal(bid))
        outcome = "completed"
        if await self.call(self.meta.get, "cancel", bid) is not None:
            outcome = "cancelled"
        elif b["status"] == "in_progress":
            outcome = await self._execute(b, lines, done)
        elif b["status"] == "cancelling":
            outcome = "cancelled"
        await self._finalize(b, lines, done, outcome)

    async def _validate(self, b: dict[str, Any], lines: list[Line]) -> bool:
        problem = None
        if not lines:
            problem = ("empty_file", "the input file has no request line")
        elif len(lines) > self.cfg.max_lines:
            problem = ("too_many_lines", f"the input file has {len(lines)} lines; at most "
                                         f"{self.cfg.max_lines} are allowed")
        now = int(self.clock())
        if problem is not None:
            b.update(status="failed", failed_at=now, errors={"object": "list", "data": [
                {"code": problem[0], "message": problem[1], "param": None, "line": None}]})
        else:
            b.update(status="in_progress", in_progress_at=now,
                     request_counts={"total": len(lines), "completed": 0, "failed": 0})
            models = {ln.body.get("model") for ln in lines if ln.body is not None}
            b["model"] = models.pop() if len(models) == 1 else None
        await self.call(self.meta.put, "batch", b)
        return problem is None

    async def _execute(self, b: dict[str, Any], lines: list[Line],
                       done: dict[int, dict[str, Any]]) -> str:
        """Run every line not in `done`; the outcome: completed, cancelled or expired."""
        jr = journal.Journal(self.blobs.journal(b["id"]))
        for ln in lines:
            if ln.error is not None and ln.index not in done:
                done[ln.index] = error_line(ln.custom_id, *ln.error)
                await jr.append(ln.index, done[ln.index])
        stop: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        ended = asyncio.Event()
        watcher = asyncio.create_task(self._watch(b, lines, done, stop, ended))
        running: set[asyncio.Task[None]] = set()
        try:
            for ln in run_order([ln for ln in lines if ln.index not in done]):
                if not await _first(self.slots.acquire(), stop):
                    break
                t = asyncio.create_task(self._line(b, ln, jr, done))
                running.add(t)
                t.add_done_callback(running.discard)
            finished = asyncio.gather(*running)
            await _first(finished, stop)
        finally:
            for t in running:
                t.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            ended.set()      # the watcher ends between two saves, never inside one
            await asyncio.gather(watcher, return_exceptions=True)
        return stop.result() if stop.done() else "completed"

    async def _line(self, b: dict[str, Any], ln: Line, jr: journal.Journal,
                    done: dict[int, dict[str, Any]]) -> None:
        try:
            while True:
                ans = await self.send(b["endpoint"], ln.body or {}, b["_owner"])
                if not ans.retry:
                    break
                await asyncio.sleep(self.cfg.retry_after_s)
        finally:
            self.slots.release()
        out = output_line(ln.custom_id, ans.status, ans.request_id, ans.body)
        await jr.append(ln.index, out)
        done[ln.index] = out

    async def _watch(self, b: dict[str, Any], lines: list[Line],
                     done: dict[int, dict[str, Any]], stop: asyncio.Future[str],
                     ended: asyncio.Event) -> None:
        """Save the counts; stop the batch when it is cancelled or its window passes; return
        once `ended` is set."""
        saved = None
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(ended.wait(), WATCH_INTERVAL_S)
            if ended.is_set():
                return
            if await self.call(self.meta.get, "cancel", b["id"]) is not None:
                stop.set_result("cancelled")
                return
            if self.clock() >= b["expires_at"]:
                stop.set_result("expired")
                return
            counts = _counts(lines, done)
            if counts != saved:
                b["request_counts"] = saved = counts
                await self.call(self.meta.put, "batch", b)

    async def _finalize(self, b: dict[str, Any], lines: list[Line],
                        done: dict[int, dict[str, Any]], outcome: str) -> None:
        now = int(self.clock())
        if outcome == "expired":
            for ln in lines:
                done.setdefault(ln.index, error_line(ln.custom_id, "batch_expired", "the "
                                                     "batch expired before this request ran"))
        if outcome == "cancelled":
            b.update(status="cancelling", cancelling_at=b.get("cancelling_at") or now)
        else:
            b.update(status="finalizing", finalizing_at=b.get("finalizing_at") or now)
        b["request_counts"] = _counts(lines, done)
        await self.call(self.meta.put, "batch", b)
        ordered = [done[ln.index] for ln in lines if ln.index in done]
        for which, keep in (("output", True), ("error", False)):
            chosen = [o for o in ordered if succeeded(o) == keep]
            if chosen:
                fid = await self._write_file(b, which, chosen)
                b[f"{which}_file_id"] = fid
        final = {"completed": "completed", "cancelled": "cancelled", "expired": "expired"}
        b["status"] = final[outcome]
        b[f"{final[outcome]}_at"] = int(self.clock())
        await self.call(self.meta.put, "batch", b)

    async def _write_file(self, b: dict[str, Any], which: str, rows: list[dict[str, Any]]
                          ) -> str:
        import json

        fid = derived_file_id(b["id"], which)
        data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
        await self.call(self.blobs.put, fid, data)
        obj = file_object(fid, len(data), int(self.clock()), f"{b['id']}_{which}.jsonl",
                          "batch_output")
        obj.update(_owner=b["_owner"], _created_us=time.time_ns() // 1000)
        await self.call(self.meta.put, "file", obj)
        return fid


def input_copy(bid: str) -> str:
    """The blob name of a batch's own copy of its input (deleting the file leaves it)."""
    return f"{bid}.input"


def _counts(lines: list[Line], done: dict[int, dict[str, Any]]) -> dict[str, int]:
    ok = sum(1 for o in done.values() if succeeded(o))
    return {"total": len(lines), "completed": ok, "failed": len(done) - ok}


async def _first(work: Awaitable[Any], stop: asyncio.Future[str]) -> bool:
    """Wait for `work` or `stop`; True if `work` finished first (else it is cancelled)."""
    task = asyncio.ensure_future(work)
    await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False
