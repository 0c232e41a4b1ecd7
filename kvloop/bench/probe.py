"""Issue 37's hostile-load findings as short, bounded probes against processes started here
(loopback only, ephemeral ports), each printing what it measured as one JSON line.

    python -m kvloop.bench.probe list
    python -m kvloop.bench.probe NAME [NAME ...] [--out DIR]
    python -m kvloop.bench.probe all

Each probe starts what it needs (`kvloop serve --model sim`, the embedded model, a router),
runs for seconds to a minute, stops everything and prints `{"probe": NAME, ...}`. The
figures are this machine's at this moment: on a shared machine say how busy it was.
What each reproduces, and the test that keeps it fixed: docs/security.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import stat
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import httpx

from kvloop.front.launcher import (
    ROUTER_URL_LINE,
    ServeProcess,
    UrlProcess,
    kvloop_command,
    stop_all,
)

SIM = ["--model", "sim", "--sim-speedup", "50", "--served-model-name", "sim"]
MIB = 1 << 20


# --- helpers --------------------------------------------------------------------------------------
def rss_mib(pid: int) -> float:
    """Resident memory of process `pid` in MiB (from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@contextlib.contextmanager
def worker(out: Path, name: str, *args: str, env: dict[str, str] | None = None
           ) -> Iterator[ServeProcess]:
    """A `kvloop serve ARGS` for one probe, stopped after it."""
    srv = ServeProcess(list(args), out / f"{name}.log", env).start(timeout_s=180)
    try:
        yield srv
    finally:
        stop_all([srv], 20)


@contextlib.contextmanager
def router(out: Path, name: str, *args: str) -> Iterator[UrlProcess]:
    """A `kvloop router ARGS` (port 0) for one probe, stopped after it."""
    proc = UrlProcess(kvloop_command("router", "--port", "0", *args), out / f"{name}.log",
                      ROUTER_URL_LINE)
    proc.start(timeout_s=60)
    try:
        yield proc
    finally:
        stop_all([proc], 20)


def engine_pid(srv: ServeProcess) -> int:
    return int(httpx.get(srv.url + "/kvloop/worker", timeout=10).json()["engine_pid"])


def model_of(url: str, headers: dict[str, str] | None = None) -> str:
    r = httpx.get(url + "/v1/models", headers=headers, timeout=10)
    return str(r.json()["data"][0]["id"])


# --- the probes -----------------------------------------------------------------------------------
def probe_large_prompts(out: Path) -> dict[str, Any]:
    """Finding 1: 16 concurrent /v1/completions with an 8 MiB text prompt through the router
    (one sim worker, 2,048-token context): the router's /health stays fast, its worker is
    never marked down, a small client is served, its RSS stays bounded."""
    with worker(out, "large_worker", *SIM, "--max-model-len", "2048") as w, \
            router(out, "large_router", "--worker", w.url) as r:
        big = {"model": "sim", "prompt": "word " * (8 * MIB // 5), "max_tokens": 4}
        pid = r.proc.pid if r.proc else 0

        async def run() -> dict[str, Any]:
            async with httpx.AsyncClient(timeout=120) as c:
                health: list[float] = []
                peak = [rss_mib(pid)]

                async def watch(stop: asyncio.Event) -> None:
                    while not stop.is_set():
                        t = time.monotonic()
                        await c.get(r.url + "/health")
                        health.append(time.monotonic() - t)
                        peak.append(rss_mib(pid))
                        await asyncio.sleep(0.1)

                stop = asyncio.Event()
                watcher = asyncio.create_task(watch(stop))
                bigs = [c.post(r.url + "/v1/completions", json=big) for _ in range(16)]
                small = c.post(r.url + "/v1/completions",
                               json={"model": "sim", "prompt": "hi", "max_tokens": 4})
                answers = await asyncio.gather(*bigs, small, return_exceptions=True)
                stop.set()
                await watcher
                workers = (await c.get(r.url + "/workers")).json()
            codes = [a.status_code if isinstance(a, httpx.Response) else type(a).__name__
                     for a in answers]
            return {"big_statuses": sorted(map(str, codes[:-1])), "small_status": codes[-1],
                    "health_max_s": round(max(health), 3), "health_checks": len(health),
                    "router_peak_rss_mib": round(max(peak), 1), "workers": _healthy(workers)}
        return asyncio.run(run())


def _healthy(workers: Any) -> Any:
    """The router's /workers as {name: up}."""
    if isinstance(workers, dict):
        return {name: info.get("up") for name, info in workers.items()
                if isinstance(info, dict)}
    return workers


def probe_long_prefill(out: Path, *budget: str) -> dict[str, Any]:
    """Finding 6: one long `prompt_logprobs` request (and one long embeddings request) beside
    a streaming decode on the embedded model: the stream's gaps between tokens while the
    long one runs. With the attention-weighted budget (docs/serving.md) its chunks shorten
    late in the prompt, so the gaps stay near the step budget's time; `budget` (e.g.
    `--max-num-batched-tokens 128`) for the rule before, every token counted 1."""
    with worker(out, "long_worker", "--max-model-len", "4096", *budget) as w:
        model = model_of(w.url)
        text = " ".join(f"word{i % 97}" for i in range(1100))   # about 3,000 tokens
        result: dict[str, Any] = {"budget_log": _grep(w.log(), "attention cost")}
        for kind in ("prompt_logprobs", "embeddings"):
            result[kind] = asyncio.run(_gaps_beside(w.url, model, kind, f"{kind} {text}"))
        return result


def _grep(log: str, needle: str) -> str | None:
    return next((line.strip() for line in log.splitlines() if needle in line), None)


async def _gaps_beside(url: str, model: str, kind: str, text: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=600) as c:
        stamps: list[float] = []
        stop = asyncio.Event()

        async def stream() -> None:
            body = {"model": model, "prompt": "Count: 1 2 3", "max_tokens": 3000,
                    "stream": True, "ignore_eos": True}
            async with c.stream("POST", url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        stamps.append(time.monotonic())
                    if stop.is_set():
                        return

        task = asyncio.create_task(stream())
        while len(stamps) < 3:
            await asyncio.sleep(0.05)
        t0 = time.monotonic()
        if kind == "embeddings":
            r = await c.post(url + "/v1/embeddings", json={"model": model, "input": text})
        else:
            r = await c.post(url + "/v1/completions", json={
                "model": model, "prompt": text, "max_tokens": 1, "prompt_logprobs": 1})
        t1 = time.monotonic()
        stop.set()
        await task
    gaps = sorted(b - a for a, b in zip(stamps, stamps[1:], strict=False)
                  if a >= t0 and b <= t1)
    return {"status": r.status_code, "long_request_s": round(t1 - t0, 2),
            "stream_tokens_meanwhile": len(gaps),
            "gap_p50_s": round(gaps[len(gaps) // 2], 3) if gaps else None,
            "gap_max_s": round(gaps[-1], 3) if gaps else None}


def probe_world_writable_tier(out: Path) -> dict[str, Any]:
    """Finding 7: a pre-existing 0777 disk-tier directory: the worker refuses to start
    (naming it) instead of using it."""
    d = Path(tempfile.mkdtemp(prefix="kvloop-probe-tier-"))
    d.chmod(0o777)
    srv = ServeProcess([*SIM, "--kv-disk-path", str(d), "--kv-disk-size", "0.01"],
                       out / "tier_worker.log")
    try:
        srv.start(timeout_s=60)
        started = True
    except RuntimeError:
        started = False
    finally:
        stop_all([srv], 20)
    mode = stat.S_IMODE(d.stat().st_mode)
    return {"started": started, "refusal": _grep(srv.log(), str(d)), "dir_mode": oct(mode)}


def probe_responses_owner(out: Path) -> dict[str, Any]:
    """Finding 9: a response stored with key A, read and continued with key B."""
    keys = ["key-a-probe", "key-b-probe"]
    args = [*SIM, "--api-key", keys[0], "--api-key", keys[1]]
    with worker(out, "responses_worker", *args) as w:
        a, b = ({"Authorization": f"Bearer {k}"} for k in keys)
        made = httpx.post(w.url + "/v1/responses", headers=a, timeout=30, json={
            "model": "sim", "input": "hello", "max_output_tokens": 4, "store": True}).json()
        rid = made.get("id")
        read = httpx.get(f"{w.url}/v1/responses/{rid}", headers=b, timeout=30)
        cont = httpx.post(w.url + "/v1/responses", headers=b, timeout=30, json={
            "model": "sim", "input": "more", "max_output_tokens": 4,
            "previous_response_id": rid})
        own = httpx.get(f"{w.url}/v1/responses/{rid}", headers=a, timeout=30)
        return {"other_key_get": read.status_code, "other_key_continue": cont.status_code,
                "own_key_get": own.status_code}


def probe_deep_json(out: Path) -> dict[str, Any]:
    """Finding 11: a 5,000-deep nested JSON body, to the router's OpenAI and Anthropic
    routes and to a worker."""
    deep = "[" * 5000 + "]" * 5000
    body = '{"model": "sim", "max_tokens": 1, "prompt": "x", "messages": ' + deep + "}"
    with worker(out, "deep_worker", *SIM) as w, \
            router(out, "deep_router", "--worker", w.url) as r:
        result = {}
        for where, url in (("router", r.url), ("worker", w.url)):
            for path in ("/v1/completions", "/v1/messages"):
                resp = httpx.post(url + path, content=body, timeout=30,
                                  headers={"content-type": "application/json"})
                err = resp.json()
                result[f"{where}{path}"] = [resp.status_code, err.get("type") or
                                            err.get("error", {}).get("type")]
        return result


def probe_malformed_kv_params(out: Path) -> dict[str, Any]:
    """Low: malformed `kv_transfer_params` fields from a fleet member (the fleet token) to a
    decode worker: statuses seen (400s, never a 500)."""
    from kvloop.trust import INTERNAL_TOKEN_HEADER, PURPOSE_INTERNAL_HTTP, FleetSecret, secret_env

    secret = FleetSecret.generate()
    token = {INTERNAL_TOKEN_HEADER: secret.token(PURPOSE_INTERNAL_HTTP)}
    cfg = json.dumps({"kv_connector": "KvloopConnector", "kv_role": "kv_consumer"})
    good = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r",
            "remote_host": "127.0.0.1", "remote_port": 5000, "remote_block_ids": [0, 1]}
    bad = [("remote_port", "5000"), ("remote_port", 70000), ("remote_port", [1]),
           ("block_size", 0), ("block_size", "16"), ("lease_expires_in_s", "x"),
           ("kv_fingerprint", "x"), ("remote_host", 7), ("remote_block_ids", "0,1"),
           ("do_remote_prefill", "yes")]
    with worker(out, "kvparams_worker", *SIM, "--role", "decode", "--block-size", "16",
                "--kv-transfer-config", cfg, env=secret_env(secret)) as w:
        seen: dict[str, int] = {}
        for key, value in bad:
            r = httpx.post(w.url + "/v1/completions", headers=token, timeout=30, json={
                "model": "sim", "prompt": list(range(20)), "max_tokens": 1,
                "kv_transfer_params": {**good, key: value}})
            seen[f"{key}={value!r}"] = r.status_code
        return {"statuses": seen, "health": httpx.get(w.url + "/health").status_code}


PATHOLOGICAL_REGEX = "[a-z]{1,1000}[0-9]{1,1000}[A-Z]{1,1000}"   # ~9 s of xgrammar, once


def probe_compile_share(out: Path) -> dict[str, Any]:
    """Finding 5: six clients of one API key send the pathological regex (400 before any
    compile) and six slow schemas under the size limit (seconds of compile each); a victim
    with another key sends a tiny json_schema while they compile: its status and time."""
    keys = ["attacker-key-probe", "victim-key-probe"]
    with worker(out, "compile_worker", "--max-model-len", "512", "--api-key", keys[0],
                "--api-key", keys[1]) as w:
        attacker, victim = ({"Authorization": f"Bearer {k}"} for k in keys)
        model = model_of(w.url, attacker)

        def chat(headers: dict[str, str], constraint: dict[str, Any]) -> Any:
            return {"model": model, "max_tokens": 8, "temperature": 0.0,
                    "messages": [{"role": "user", "content": "Answer in JSON."}], **constraint}

        def schema(tag: str, n: int, pattern: str) -> dict[str, Any]:
            props = {f"{tag}{i}": {"type": "string", "pattern": pattern} for i in range(n)}
            return {"response_format": {"type": "json_schema", "json_schema": {
                "name": tag, "schema": {"type": "object", "properties": props,
                                        "required": list(props)}}}}

        async def run() -> dict[str, Any]:
            async with httpx.AsyncClient(timeout=180) as c:
                url = w.url + "/v1/chat/completions"
                warm = await c.post(url, headers=victim, json=chat(victim, schema("w", 1, "a")))
                regexes = [c.post(url, headers=attacker, json=chat(attacker, {
                    "structured_outputs": {"regex": PATHOLOGICAL_REGEX}})) for _ in range(6)]
                slow = [c.post(url, headers=attacker, json=chat(attacker, schema(
                    f"s{i}x", 300, "[a-z]{1,20}"))) for i in range(6)]
                started = asyncio.gather(*regexes, *slow)
                await asyncio.sleep(1.0)
                t0 = time.monotonic()
                tiny = await c.post(url, headers=victim, json=chat(victim, schema("t", 1, "b")))
                took = time.monotonic() - t0
                done = await started
            return {"warm_up": warm.status_code,
                    "regex_statuses": [r.status_code for r in done[:6]],
                    "slow_schema_statuses": [r.status_code for r in done[6:]],
                    "victim_status": tiny.status_code, "victim_s": round(took, 2)}
        return asyncio.run(run())


def probe_count_tokens(out: Path) -> dict[str, Any]:
    """Low: `/v1/messages/count_tokens` with and without `tools`, and the input tokens
    `/v1/messages` reports for the same request (the embedded model's template)."""
    with worker(out, "count_worker", *SIM) as w:
        base = {"model": "sim", "messages": [{"role": "user", "content": "Weather?"}]}
        tools = [{"name": "get_weather", "description": "The weather of a city",
                  "input_schema": {"type": "object",
                                   "properties": {"city": {"type": "string"}}}}]
        count = [httpx.post(w.url + "/v1/messages/count_tokens", timeout=30,
                            json={**base, **extra}).json()["input_tokens"]
                 for extra in ({}, {"tools": tools})]
        served = httpx.post(w.url + "/v1/messages", timeout=30, json={
            **base, "tools": tools, "tool_choice": {"type": "none"}, "max_tokens": 1}).json()
        return {"count_without_tools": count[0], "count_with_tools": count[1],
                "messages_input_tokens": served["usage"]["input_tokens"]}


def probe_soak(out: Path, seconds: float = 40.0, real: bool = False) -> dict[str, Any]:
    """Low: a bounded loop of mixed requests (completions, streams cut short, chat, logprobs,
    prompt logprobs, embeddings, n=2, tokenize) against one worker; RSS of the API server and
    the engine process after a warm-up round and at the end, and the engine's counts."""
    args = ["--max-model-len", "2048"] if real else SIM
    with worker(out, "soak_real" if real else "soak_sim", *args) as w:
        model = model_of(w.url)
        api, eng = (w.proc.pid if w.proc else 0), engine_pid(w)
        statuses: Counter[str] = Counter()
        asyncio.run(mixed_requests(w.url, model, 20, statuses))
        before = {"api": rss_mib(api), "engine": rss_mib(eng)}
        n, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < seconds:
            n += asyncio.run(mixed_requests(w.url, model, 20, statuses))
        after = {"api": rss_mib(api), "engine": rss_mib(eng)}
        stats = w.wait_idle(30)
        return {"requests": n, "seconds": round(time.monotonic() - t0, 1),
                "statuses": dict(statuses),
                "rss_mib_after_warmup": {k: round(v, 1) for k, v in before.items()},
                "rss_mib_at_end": {k: round(v, 1) for k, v in after.items()},
                "engine_requests_left": stats.get("num_requests"),
                "free_blocks": [stats.get("num_free_blocks"), stats.get("num_total_blocks")]}


async def mixed_requests(url: str, model: str, rounds: int, statuses: Counter[str]) -> int:
    """`rounds` of six kinds of request, four at a time; returns how many were sent and
    counts their statuses (a cut stream counts as "cut")."""
    sent = 0
    async with httpx.AsyncClient(timeout=120) as c:
        for i in range(rounds):
            kinds = _one_round(c, url, model, f"soak {i} " + "text " * (i % 7 * 20))
            for start in range(0, len(kinds), 4):
                done = await asyncio.gather(*kinds[start:start + 4], return_exceptions=True)
                statuses.update(str(d.status_code) if isinstance(d, httpx.Response)
                                else "cut" if d is None else type(d).__name__ for d in done)
            sent += len(kinds)
    return sent


def _one_round(c: httpx.AsyncClient, url: str, model: str,
               prompt: str) -> list[Coroutine[Any, Any, Any]]:
    return [
        c.post(url + "/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": 8, "logprobs": 2}),
        c.post(url + "/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 1}),
        c.post(url + "/v1/chat/completions", json={
            "model": model, "max_tokens": 8, "n": 2,
            "messages": [{"role": "user", "content": prompt}]}),
        c.post(url + "/v1/embeddings", json={"model": model, "input": prompt}),
        c.post(url + "/tokenize", json={"model": model, "prompt": prompt}),
        _cut_stream(c, url, model, prompt),
    ]


async def _cut_stream(c: httpx.AsyncClient, url: str, model: str, prompt: str) -> None:
    """A stream the client leaves after its second event (the server aborts it)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 200, "stream": True}
    async with c.stream("POST", url + "/v1/completions", json=body) as r:
        seen = 0
        async for line in r.aiter_lines():
            seen += line.startswith("data: ")
            if seen >= 2:
                return


PROBES: dict[str, Callable[[Path], dict[str, Any]]] = {
    "large-prompts": probe_large_prompts,
    "long-prefill": probe_long_prefill,
    "long-prefill-tokens": lambda out: probe_long_prefill(out, "--max-num-batched-tokens",
                                                          "128"),
    "world-writable-tier": probe_world_writable_tier,
    "responses-owner": probe_responses_owner,
    "deep-json": probe_deep_json,
    "malformed-kv-params": probe_malformed_kv_params,
    "compile-share": probe_compile_share,
    "count-tokens": probe_count_tokens,
    "soak-sim": probe_soak,
    "soak-real": lambda out: probe_soak(out, seconds=30.0, real=True),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvloop.bench.probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="+", help="probe names, 'all' or 'list'")
    ap.add_argument("--out", default=None, help="where the processes' logs go (a temporary "
                    "directory by default)")
    args = ap.parse_args(argv)
    if args.names == ["list"]:
        for name, fn in PROBES.items():
            print(f"{name}: {(fn.__doc__ or '').split(chr(10))[0]}")
        return 0
    names = list(PROBES) if args.names == ["all"] else args.names
    unknown = [n for n in names if n not in PROBES]
    if unknown:
        ap.error(f"unknown probe(s) {unknown}; 'list' names them")
    out = Path(args.out or tempfile.mkdtemp(prefix="kvloop-probe-"))
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        t0 = time.monotonic()
        result = PROBES[name](out)
        print(json.dumps({"probe": name, "took_s": round(time.monotonic() - t0, 1), **result}),
              flush=True)
    print(f"logs: {out} (load average {os.getloadavg()[0]:.1f})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
