"""The Batch API (kvloop/batch): lines, order and journal in-process; then the official
`openai` SDK against a router with flow control on two simulated workers: the workflow,
paging, cancel, another key's 404s, malformed lines, 1,000 lines beside interactive load
(interactive requests leave the router's queue before any queued batch line), and a router
killed mid-batch and restarted (every line answered exactly once)."""

from __future__ import annotations

import io
import json
import os
import random
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from kvloop.batch import journal
from kvloop.batch.config import BatchConfig
from kvloop.batch.lines import parse_lines, run_order
from kvloop.batch.routes import parse_multipart
from kvloop.front.auth import AuthConfig
from kvloop.router.config import LivenessConfig, RouterConfig
from kvloop.router.fleet import Fleet, FleetConfig
from kvloop.router.flow import BATCH_PRIORITY
from kvloop.router.flow_config import FlowConfig

from .conftest import RouterThread, lines_until, sdk, serving, wait_until

if TYPE_CHECKING:   # the processes tests import openai: a second per xdist worker otherwise
    import openai

KEY_A, KEY_B = "key-tenant-a", "key-tenant-b"
SIM_ARGS = ("--sim-speedup", "200", "--max-num-seqs", "4", "--max-num-batched-tokens", "512")
COMPLETIONS = "/v1/completions"


def line(cid: str, prompt: str, max_tokens: int = 2, url: str = COMPLETIONS) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": url,
            "body": {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}}


def jsonl(rows: list[Any]) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n"
                    for r in rows)


# --- in-process ---------------------------------------------------------------------------
def test_bad_lines_become_errors_and_the_rest_are_sendable():
    data = jsonl([line("a", "x"), b"{not json", [1, 2], {"method": "POST"}, line("a", "dup"),
                  {**line("m", "x"), "method": "GET"}, line("u", "x", url="/v1/embeddings"),
                  {**line("s", "x"), "body": {"prompt": "x", "stream": True}}, line("b", "y")])
    lines = parse_lines(data + b"\n\n", COMPLETIONS)
    assert [(ln.custom_id, ln.error[0] if ln.error else None) for ln in lines] == [
        ("a", None), (None, "invalid_json_line"), (None, "invalid_json_line"),
        (None, "invalid_custom_id"), ("a", "duplicate_custom_id"), ("m", "invalid_method"),
        ("u", "invalid_url"), ("s", "invalid_body"), ("b", None)]
    assert [ln.index for ln in run_order(lines)] == [0, 8]


def test_lines_sharing_a_prefix_run_next_to_each_other():
    rng = random.Random(0)
    prefixes = ["system prompt one. " * 4, "another shared context! " * 4, "third. " * 8]
    rows = [line(f"c{i}", rng.choice(prefixes) + f"question {i}") for i in range(30)]
    order = run_order(parse_lines(jsonl(rows), COMPLETIONS))
    groups = [next(p for p in prefixes if (ln.body or {})["prompt"].startswith(p))
              for ln in order]
    runs = [g for i, g in enumerate(groups) if i == 0 or groups[i - 1] != g]
    assert sorted(runs) == sorted(set(groups))   # each prefix is one contiguous run


def test_journal_keeps_each_line_once_and_cuts_a_torn_tail(tmp_path):
    import asyncio

    path = tmp_path / "j.jsonl"

    async def write() -> None:
        jr = journal.Journal(path)
        await asyncio.gather(*(jr.append(i, {"n": i}) for i in range(20)))
        await jr.append(3, {"n": "again"})
    asyncio.run(write())
    with open(path, "ab") as f:
        f.write(b'{"i": 99, "out": {"n"')   # killed mid-write
    done = journal.load(path)
    assert sorted(done) == list(range(20)) and done[3] == {"n": 3}
    assert path.read_bytes().endswith(b"\n") and journal.load(path) == done


def test_multipart_upload_is_read_byte_for_byte():
    data = b'{"a": 1}\r\n{"b": "\\u00e9"}\n\x00\xff\r'
    req = httpx.Request("POST", "http://x", files={"file": ("in.jsonl", data)},
                        data={"purpose": "batch"})
    fields, upload = parse_multipart(req.headers["content-type"], req.read())   # type: ignore
    assert fields == {"purpose": "batch"} and upload == ("in.jsonl", data)
    assert isinstance(parse_multipart("application/json", b"{}"), str)


def test_routes_refuse_bad_input_and_keep_each_key_within_its_quota(tmp_path):
    """The routes alone (no runner started): 4xx in OpenAI's error shape, never a crash."""
    import asyncio

    from starlette.applications import Starlette

    from kvloop.batch.routes import BatchService

    cfg = BatchConfig(directory=str(tmp_path), tenant_quota_bytes=100, max_files_per_tenant=2,
                      max_lines=3)
    service = BatchService(cfg, send=None)   # type: ignore[arg-type]   # never sends
    app = Starlette(routes=service.routes())

    async def run() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", headers={"authorization":
                                                                   "Bearer k"}) as c:
            def up(data: bytes, purpose: str = "batch") -> Any:
                return c.post("/v1/files", files={"file": ("f.jsonl", data)},
                              data={"purpose": purpose})
            codes = [(await c.post("/v1/files", json={"purpose": "batch"})).status_code,
                     (await up(b"{}", "fine-tune")).status_code,
                     (await up(b"{}\n" * 4)).status_code,            # over max_lines
                     (await up(b"x" * 101)).status_code,             # over the quota
                     (await up(b"{}\n")).status_code, (await up(b"{}\n")).status_code,
                     (await up(b"{}\n")).status_code,                # a third file
                     (await c.get("/v1/files/..%2F..%2Fetc%2Fpasswd")).status_code,
                     (await c.get("/v1/files/file-" + "0" * 24 + "/content")).status_code,
                     (await c.get("/v1/batches?limit=0")).status_code,
                     (await c.post("/v1/batches", content=b"[1")).status_code]
            fid = (await c.get("/v1/files")).json()["data"][0]["id"]
            for body in ({"input_file_id": fid, "endpoint": "/v1/foo",
                          "completion_window": "24h"},
                         {"input_file_id": fid, "endpoint": COMPLETIONS,
                          "completion_window": "1h"},
                         {"input_file_id": fid, "endpoint": COMPLETIONS,
                          "completion_window": "24h", "metadata": {"k": 1}}):
                r = await c.post("/v1/batches", json=body)
                assert r.json()["error"]["code"] == r.status_code
                codes.append(r.status_code)
            return codes
    assert asyncio.run(run()) == [400, 400, 400, 429, 200, 200, 429, 404, 404, 400, 400,
                                  400, 400, 400]


# --- against a router on simulated workers -----------------------------------------------
@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    f = Fleet(FleetConfig(2, "sim", ("both",), SIM_ARGS, start_timeout_s=120,
                          stop_timeout_s=10, echo_output=False))
    f.start()
    try:
        yield f
    finally:
        f.stop()


@pytest.fixture(scope="module")
def router(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterThread]:
    batch = BatchConfig(directory=str(tmp_path_factory.mktemp("batch")), concurrency=32,
                        retry_after_s=0.05, max_files_per_tenant=50)
    cfg = RouterConfig(liveness=LivenessConfig(poll_interval_s=0.1),
                       auth=AuthConfig(api_keys=(KEY_A, KEY_B)), batch=batch,
                       flow=FlowConfig(enabled=True, max_waiting=0, max_queue=512,
                                       queue_timeout_s=30.0))
    with RouterThread(cfg, fleet.specs()) as rt:
        yield rt


def submit(client: openai.OpenAI, rows: list[Any]) -> Any:
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint=COMPLETIONS,
                                 completion_window="24h")


def finished(client: openai.OpenAI, bid: str, timeout: float = 90) -> Any:
    return wait_until(lambda: (lambda b: b if b.status in ("completed", "failed", "expired",
                                                           "cancelled") else None)(
        client.batches.retrieve(bid)), timeout, f"batch {bid} to end")


def results(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


@pytest.mark.processes
def test_sdk_workflow_paging_and_cancel(router):
    import openai
    a = sdk(router.url, KEY_A)
    rows = [line(f"req-{i}", f"shared prefix {i % 3} " * 3 + str(i)) for i in range(12)]
    b = submit(a, rows)
    assert b.status == "validating" and b.endpoint == COMPLETIONS
    done = finished(a, b.id)
    assert done.status == "completed" and done.error_file_id is None
    assert done.request_counts.model_dump() == {"total": 12, "completed": 12, "failed": 0}
    assert all(getattr(done, f) is not None for f in ("in_progress_at", "finalizing_at",
                                                      "completed_at"))
    out = results(a, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(r["custom_id"] for r in rows)
    assert all(o["response"]["status_code"] == 200 and o["error"] is None and
               o["response"]["body"]["usage"]["completion_tokens"] == 2 for o in out)
    assert a.files.retrieve(done.output_file_id).purpose == "batch_output"
    more = [submit(a, rows[:1]).id for _ in range(2)]
    seen = [p.id for p in a.batches.list(limit=1)]          # the SDK follows `after`
    assert seen[:2] == more[::-1] and b.id in seen and len(seen) == len(set(seen))
    big = submit(a, [line(f"c{i}", "x", max_tokens=64) for i in range(300)])
    cancelling = a.batches.cancel(big.id)
    assert cancelling.status == "cancelling"
    ended = finished(a, big.id)
    assert ended.status == "cancelled" and ended.cancelled_at is not None
    assert ended.request_counts.completed < 300
    with pytest.raises(openai.ConflictError):
        a.batches.cancel(b.id)


@pytest.mark.processes
def test_another_key_sees_nothing(router):
    import openai
    a, b = sdk(router.url, KEY_A), sdk(router.url, KEY_B)
    batch = submit(a, [line("only", "mine")])
    fid = batch.input_file_id
    for call in (lambda: b.files.retrieve(fid), lambda: b.files.content(fid),
                 lambda: b.files.delete(fid), lambda: b.batches.retrieve(batch.id),
                 lambda: b.batches.cancel(batch.id),
                 lambda: b.batches.create(input_file_id=fid, endpoint=COMPLETIONS,
                                          completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in [x.id for x in b.batches.list()]
    assert fid not in [x.id for x in b.files.list()]
    r = httpx.get(f"{router.url}/v1/files/{fid}/content")
    assert r.status_code == 401
    assert finished(a, batch.id).status == "completed"
    assert a.files.content(fid).content == jsonl([line("only", "mine")])


@pytest.mark.processes
def test_malformed_lines_go_to_the_error_file_and_nothing_else_is_lost(router):
    a = sdk(router.url, KEY_A)
    rows = [line("ok-1", "a"), b"{broken", line("ok-2", "b"), line("ok-1", "dup"),
            {**line("bad-body", "c"), "body": {"prompt": "c", "max_tokens": -5}},
            line("ok-3", "d")]
    done = finished(a, submit(a, rows).id)
    assert done.status == "completed"
    assert done.request_counts.model_dump() == {"total": 6, "completed": 3, "failed": 3}
    assert [o["custom_id"] for o in results(a, done.output_file_id)] == [
        "ok-1", "ok-2", "ok-3"]
    errors = results(a, done.error_file_id)
    assert [(e["custom_id"], (e["error"] or {}).get("code")) for e in errors] == [
        (None, "invalid_json_line"), ("ok-1", "duplicate_custom_id"), ("bad-body", None)]
    assert errors[2]["response"]["status_code"] == 400


@pytest.mark.processes
def test_a_thousand_lines_beside_interactive_traffic(router):
    """Alone, the batch fills the fleet; then every time the router's queue released a
    request, a batch line went only when no interactive request waited; interactive
    requests did wait; the batch finished."""
    flow = router.server.app.flow
    pops: list[tuple[int, int]] = []   # (band released, interactive requests then waiting)
    pop = flow.queue.pop

    def watched_pop() -> Any:
        waiting = flow.queue.lengths().get(0, 0)
        w = pop()
        if w is not None:
            pops.append((w.key.priority, waiting))
        return w
    flow.queue.pop = watched_pop   # type: ignore[method-assign]
    try:
        a = sdk(router.url, KEY_A)
        # 16 tokens a line: a line holds its slot for ~16 engine steps, so the batch fills the
        # fleet however slowly this busy process's router sends lines (2-token lines ended as
        # fast as the router sent them on a loaded machine: no poll saw all 8 slots taken)
        batch = submit(a, [line(f"n{i}", f"doc {i % 10} " * 4 + str(i), max_tokens=16)
                           for i in range(1000)])
        # a request joins the router's queue only while the fleet has no room (FlowControl.
        # admit), so batch lines leaving the queue show that the batch alone filled the
        # fleet (a poll of the slots, tried before, missed the moment on a loaded machine)
        wait_until(lambda: any(p == BATCH_PRIORITY for p, _ in pops), 60,
                   "batch lines queued behind a full fleet")
        statuses = _interactive(router.url, clients=4, each=15)
        done = finished(a, batch.id, timeout=300)
    finally:
        flow.queue.pop = pop   # type: ignore[method-assign]
    assert statuses == [200] * 60
    assert done.status == "completed"
    assert done.request_counts.model_dump() == {"total": 1000, "completed": 1000, "failed": 0}
    interactive_released = [w for p, w in pops if p == 0]
    assert len(interactive_released) >= 10          # they did wait behind a saturated fleet
    assert [w for p, w in pops if p == BATCH_PRIORITY and w > 0] == []


def _interactive(url: str, clients: int, each: int) -> list[int]:
    statuses: list[int] = []

    def one(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=url, timeout=60, headers={"authorization":
                                                             f"Bearer {KEY_B}"}) as c:
            for _ in range(each):
                r = c.post(COMPLETIONS, json={"prompt": f"chat {rng.random()}",
                                              "max_tokens": 2, "ignore_eos": True})
                statuses.append(r.status_code)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return statuses


# --- a router killed mid-batch ------------------------------------------------------------
def _router_process(fleet: Fleet, directory: Path) -> tuple[subprocess.Popen[str], str]:
    args = [sys.executable, "-m", "kvloop", "router", "--port", "0", "--batch-dir",
            str(directory), "--batch-concurrency", "4", "--poll-interval", "0.1"]
    for spec in fleet.specs():
        args += ["--worker", spec.url]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    marker = "kvloop router on "
    said = next(x for x in lines_until(proc, marker, 60) if marker in x)
    return proc, said.split(marker, 1)[1].split()[0]


@pytest.mark.processes
def test_router_killed_mid_batch_loses_and_repeats_nothing(fleet, tmp_path):
    proc, url = _router_process(fleet, tmp_path)
    try:
        a = sdk(url, "k")
        rows = [line(f"r{i}", f"p {i}", max_tokens=8) for i in range(200)]
        bid = submit(a, rows).id
        wait_until(lambda: a.batches.retrieve(bid).request_counts.completed >= 30, 60,
                   "30 lines done")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    on_disk = journal.load(tmp_path / "journals" / f"{bid}.jsonl")
    assert 30 <= len(on_disk) < 200
    proc, url = _router_process(fleet, tmp_path)
    try:
        a = sdk(url, "k")
        done = finished(a, bid, timeout=120)
        out = results(a, done.output_file_id)
        errors = results(a, done.error_file_id)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
    assert done.status == "completed"
    assert done.request_counts.model_dump() == {"total": 200, "completed": 200, "failed": 0}, \
        errors[:3]
    assert sorted(o["custom_id"] for o in out) == sorted(r["custom_id"] for r in rows)
    kept = {o["custom_id"]: o["id"] for o in out}   # the lines answered before the kill
    assert all(kept[rec["custom_id"]] == rec["id"] for rec in on_disk.values())


# --- a single `kvloop serve` --------------------------------------------------------------
@pytest.mark.processes
def test_a_single_server_runs_a_batch(tmp_path_factory, tmp_path):
    """`kvloop serve --batch-dir`: the same routes, lines run on the server itself."""
    import openai
    with serving(tmp_path_factory, "batch_serve", [
            "--model", "sim", "--sim-speedup", "200", "--api-key", KEY_A, "--api-key", KEY_B,
            "--batch-dir", str(tmp_path)]) as srv:
        a, b = sdk(srv.url, KEY_A), sdk(srv.url, KEY_B)
        chat = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"messages": [{"role": "user", "content": f"hi {i}"}],
                          "max_tokens": 3}} for i in range(5)]
        f = a.files.create(file=("chat.jsonl", io.BytesIO(jsonl(chat))), purpose="batch")
        batch = a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                 completion_window="24h")
        done = finished(a, batch.id)
        out = results(a, done.output_file_id)
        with pytest.raises(openai.NotFoundError):
            b.batches.retrieve(batch.id)
        assert a.files.delete(f.id).deleted and a.files.list().data[0].purpose == "batch_output"
    assert done.request_counts.model_dump() == {"total": 5, "completed": 5, "failed": 0}
    assert sorted(o["custom_id"] for o in out) == [f"q{i}" for i in range(5)]
    assert all(o["response"]["body"]["object"] == "chat.completion" for o in out)


# --- router replicas sharing Redis metadata ----------------------------------------------
@pytest.mark.processes
def test_replicas_share_batches_through_redis(fleet, tmp_path):
    """Two routers, one directory, metadata in a real redis-server: a batch created on one
    is seen (by its owner only) and run once."""
    import openai

    from kvloop.router.services import redis_url

    from .bus_helpers import redis_server

    with redis_server(tmp_path) as srv:
        batch = BatchConfig(directory=str(tmp_path / "dir"), redis_url=redis_url(srv),
                            retry_after_s=0.05)
        cfg = RouterConfig(liveness=LivenessConfig(poll_interval_s=0.1), batch=batch,
                           auth=AuthConfig(api_keys=(KEY_A, KEY_B)))
        with RouterThread(cfg, fleet.specs()) as one, RouterThread(cfg, fleet.specs()) as two:
            a1, a2, b2 = sdk(one.url, KEY_A), sdk(two.url, KEY_A), sdk(two.url, KEY_B)
            rows = [line(f"x{i}", f"shared {i}") for i in range(40)]
            created = submit(a1, rows)
            assert a2.batches.retrieve(created.id).input_file_id == created.input_file_id
            with pytest.raises(openai.NotFoundError):
                b2.batches.retrieve(created.id)
            done = finished(a2, created.id)
            out = results(a2, done.output_file_id)
            running = [len(r.server.app.batch.runner.tasks) for r in (one, two)]
    assert done.status == "completed" and running == [0, 0]
    assert sorted(o["custom_id"] for o in out) == sorted(r["custom_id"] for r in rows)
