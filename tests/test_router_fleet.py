"""The router in front of real simulated workers (`kvloop serve --model sim`) on 127.0.0.1.

One fleet of 4 workers serves this module; each worker caches only 3 of the workload's 8
long prefixes (`--num-gpu-blocks-override`). Routers run in-process on ephemeral ports.
The workers speak the embedded SmolLM2's vocabulary; workloads are token ids drawn from
`TOKEN_RANGE`, as a benchmark for a real model sends them. The helpers here are shared with
test_router_faults.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import statistics
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvloop.front.auth import AuthConfig
from kvloop.front.prometheus_text import metric_value
from kvloop.router.config import IndexConfig, LivenessConfig, RouterConfig
from kvloop.router.fleet import Fleet, FleetConfig

from .conftest import RouterThread, bearer, sdk, wait_until

pytestmark = pytest.mark.processes   # a fleet of real workers; routers on threads

ADMIN_KEY = "fleet-admin"   # workers' and routers' --admin-api-key in these tests
ADMIN = bearer(ADMIN_KEY)
SIM_ARGS = ("--sim-speedup", "40", "--max-num-batched-tokens", "1024",
            "--admin-api-key", ADMIN_KEY)
BS = 16
TOKEN_RANGE = (1000, 40000)   # ids of SmolLM2's vocabulary (49,152)


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


# --- helpers --------------------------------------------------------------------------------
def start_fleet(n: int, *extra: str, roles: tuple[str, ...] = ("both",)) -> Fleet:
    fleet = Fleet(FleetConfig(n, "sim", roles, SIM_ARGS + extra, start_timeout_s=120,
                              stop_timeout_s=10, echo_output=False))
    fleet.start()
    return fleet


def router_config(policy: str = "kv-aware", **liveness: Any) -> RouterConfig:
    lv = {"window_s": 30.0, "poll_interval_s": 0.2, **liveness}
    return RouterConfig(policy=policy, liveness=LivenessConfig(**lv),
                        index=IndexConfig(provisional_ttl_s=2.0),
                        auth=AuthConfig(admin_api_key=ADMIN_KEY))


def shared_prefix_prompts(num_prefixes: int, prefix_len: int, suffix_len: int, repeats: int,
                          seed: int) -> list[tuple[int, list[int]]]:
    """(prefix id, prompt) in a random order; every prompt has a unique suffix."""
    rng = random.Random(seed)
    prefixes = [random_ids(rng, prefix_len) for _ in range(num_prefixes)]
    out = [(g, prefixes[g] + random_ids(rng, suffix_len))
           for g in range(num_prefixes) for _ in range(repeats)]
    rng.shuffle(out)
    return out


def best_hit_share(prompts: list[tuple[int, list[int]]], prefix_len: int) -> float:
    """Every prefix computed once, every later use a full hit (vLLM's cap applies)."""
    seen: set[int] = set()
    hit = 0
    for g, p in prompts:
        if g in seen:
            hit += min(prefix_len // BS, (len(p) - 1) // BS) * BS
        seen.add(g)
    return hit / sum(len(p) for _, p in prompts)


async def _drive(url: str, prompts: list[list[int]], concurrency: int,
                 max_tokens: int) -> list[dict[str, Any]]:
    queue = list(enumerate(prompts))
    results: list[dict[str, Any]] = [{} for _ in prompts]
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async def worker() -> None:
            while queue:
                i, p = queue.pop(0)
                r = await client.post("/v1/completions", json={
                    "prompt": p, "max_tokens": max_tokens, "ignore_eos": True})
                assert r.status_code == 200, r.text
                results[i] = r.json()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def run_workload(url: str, prompts: list[list[int]], concurrency: int = 4,
                 max_tokens: int = 2) -> float:
    """Send every prompt through `url`; the share of prompt tokens served from cache."""
    results = asyncio.run(_drive(url, prompts, concurrency, max_tokens))
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results)
    return cached / sum(r["usage"]["prompt_tokens"] for r in results)


def reset_caches(fleet: Fleet) -> None:
    """Empty every worker's cache. An engine publishes the AllBlocksCleared only inside a
    step, so one tiny request per worker flushes it before a new router subscribes."""
    for w in fleet.workers:
        r = httpx.post(f"{w.url}/reset_prefix_cache", headers=ADMIN, timeout=10)
        assert r.status_code == 200 and r.json()["success"], r.text
        httpx.post(f"{w.url}/v1/completions", json={"prompt": [1], "max_tokens": 1})


# --- the fleet ------------------------------------------------------------------------------
PREFIXES, PREFIX_LEN, SUFFIX_LEN, REPEATS = 8, 256, 16, 6


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    # 56 blocks = the null block + 55: room for 3 prefixes of 17 blocks, not 4
    f = start_fleet(4, "--num-gpu-blocks-override", "56")
    try:
        yield f
    finally:
        f.stop()


def test_prefix_aware_routing_nears_the_best_hit_share_round_robin_thrashes(fleet):
    workload = shared_prefix_prompts(PREFIXES, PREFIX_LEN, SUFFIX_LEN, REPEATS, seed=11)
    prompts = [p for _, p in workload]
    best = best_hit_share(workload, PREFIX_LEN)
    reset_caches(fleet)
    with RouterThread(router_config("kv-aware"), fleet.specs()) as rt:
        kv_share = run_workload(rt.url, prompts)
        text = httpx.get(rt.url + "/metrics").text
        health = httpx.get(rt.url + "/health").json()
    reset_caches(fleet)
    with RouterThread(router_config("round-robin"), fleet.specs()) as rt:
        rr_share = run_workload(rt.url, prompts)
    print(f"hit share: best {best:.3f}, kv-aware {kv_share:.3f}, round-robin {rr_share:.3f}")
    assert kv_share >= 0.9 * best
    assert rr_share <= kv_share - 0.3
    # the router predicted what the workers then reported, and saw nothing wrong
    predicted = metric_value(text, "kvloop_router_predicted_hit_tokens_total")
    actual = metric_value(text, "kvloop_router_actual_hit_tokens_total")
    assert actual > 0 and abs(predicted - actual) <= 0.1 * actual
    assert health["status"] == "ok", health["reasons"]
    assert metric_value(text, "kvloop_router_decisions_total", reason="prefix_hit") >= \
        (PREFIXES * (REPEATS - 1)) * 0.8


def test_streaming_passthrough_usage_and_errors(fleet):
    import openai
    with RouterThread(router_config(), fleet.specs()) as rt:
        client = sdk(rt.url, "x")
        prompt = [7] * 40
        chunks = list(client.completions.create(model="sim", prompt=prompt, max_tokens=5,
                                                stream=True, extra_body={"ignore_eos": True}))
        # (fewer chunks than tokens when outputs queue behind a busy handler: merge_outputs)
        assert 1 <= len(chunks) <= 5 and all(c.usage is None for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"
        chunks = list(client.completions.create(
            model="sim", prompt=prompt, max_tokens=3, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == 40
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32
        # chat with a text prompt: tokenized by the router with the workers' tokenizer
        # (SmolLM2's, template included), so a repeat is a hit predicted to the token
        msgs = [{"role": "user", "content": "tell me a long story about routers " * 4}]
        first = client.chat.completions.create(model="sim", messages=msgs, max_tokens=2)
        before = httpx.get(rt.url + "/metrics").text
        again = client.chat.completions.create(model="sim", messages=msgs, max_tokens=2)
        after = httpx.get(rt.url + "/metrics").text
        hit = again.usage.prompt_tokens_details.cached_tokens
        assert first.usage.prompt_tokens == again.usage.prompt_tokens
        assert hit == (again.usage.prompt_tokens - 1) // BS * BS > 0
        for name in ("predicted", "actual"):
            series = f"kvloop_router_{name}_hit_tokens_total"
            assert metric_value(after, series) - metric_value(before, series) == hit, name
        # worker errors come back as the worker sent them
        direct = httpx.post(fleet.workers[0].url + "/v1/completions",
                            json={"prompt": prompt, "max_tokens": -1})
        routed = httpx.post(rt.url + "/v1/completions",
                            json={"prompt": prompt, "max_tokens": -1})
        assert routed.status_code == direct.status_code == 400
        assert routed.json()["error"]["message"] == direct.json()["error"]["message"]
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="sim", prompt=prompt, max_tokens=-1)
        bad = httpx.post(rt.url + "/v1/completions", content=b"{not json")
        assert bad.status_code == 400 and "invalid JSON" in bad.json()["error"]["message"]
        # a prompt the server refuses is routed by load, and the worker answers it; a body
        # that fails the server's schema ({"prompt": 5}) the router answers itself, in the
        # worker's words
        for body in ({"prompt": [1, -2]}, {"prompt": 5}, {"prompt": []}):
            direct = httpx.post(fleet.workers[0].url + "/v1/completions", json=body)
            routed = httpx.post(rt.url + "/v1/completions", json=body)
            assert routed.status_code == direct.status_code == 400, body
            assert routed.json() == direct.json(), body
        text = httpx.get(rt.url + "/metrics").text
        assert metric_value(text, "kvloop_router_requests_total", outcome="client_error") == 2 + 2


# Bodies in every prompt form the API takes; the workers speak SmolLM2 (template included).
STORY = "a long story about routers and the caches they keep warm " * 3
CHAT = [{"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Which cache is warm? " + STORY},
        {"role": "assistant", "content": "Mine."},
        {"role": "user", "content": "And now?"}]
PARTS = [{"role": "user", "content": [{"type": "text", "text": "Tell me "},
                                      {"type": "text", "text": STORY}]}]
PROMPT_BODIES = [
    ("/v1/completions", {"prompt": STORY}),
    ("/v1/completions", {"prompt": STORY, "add_special_tokens": False}),
    ("/v1/completions", {"prompt": [STORY]}),
    ("/v1/completions", {"prompt": list(range(1000, 1040))}),
    ("/v1/chat/completions", {"messages": CHAT}),
    ("/v1/chat/completions", {"messages": PARTS}),
    ("/v1/chat/completions", {"messages": CHAT, "add_generation_prompt": False}),
    ("/v1/chat/completions", {"messages": CHAT[:3], "continue_final_message": True}),
    ("/v1/chat/completions", {"messages": CHAT[:2] + [{"role": "assistant", "content": None}],
                              "add_special_tokens": True}),
]
BATCH_BODIES = [  # several prompts: the router routes by the first
    ("/v1/completions", {"prompt": [STORY, "and another one"]}),
    ("/v1/completions", {"prompt": [list(range(2000, 2020)), list(range(3000, 3005))]}),
]


def _worker_prompt_ids(url: str, path: str, body: dict[str, Any]) -> list[list[int]]:
    """The prompts' token ids as the worker tokenized them (`return_token_ids`)."""
    r = httpx.post(url + path, json={**body, "max_tokens": 1, "return_token_ids": True},
                   timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()
    if path.endswith("/chat/completions"):
        return [out["prompt_token_ids"]]
    return [c["prompt_token_ids"] for c in sorted(out["choices"], key=lambda c: c["index"])]


def test_router_and_worker_tokenize_every_prompt_form_alike(fleet):
    """The router's ids (the worker's reported model path, the shared body -> ids code) are
    the ids the worker served, in every prompt form and chat option."""
    from kvloop.front.prompts import body_prompts
    from kvloop.front.tokenizer import load_vocabulary
    from kvloop.router.prompts import PromptTokenizer

    with RouterThread(router_config(), fleet.specs()[:1]) as rt:
        worker = rt.router.registry.all()[0]
        model_path = worker.description.model_path
    assert model_path is not None
    shared, router = load_vocabulary(model_path).tokenizer, PromptTokenizer()
    for path, body in PROMPT_BODIES + BATCH_BODIES:
        served = _worker_prompt_ids(worker.spec.url, path, body)
        assert body_prompts(shared, path, body) == served, body
        assert router.token_ids(path, body, model_path) == served[0], body
    # the chat options change the ids, so each of them was tested
    chat_ids = {repr(router.token_ids(p, b, model_path)) for p, b in PROMPT_BODIES[4:]}
    assert len(chat_ids) == len(PROMPT_BODIES[4:])


def test_router_predicts_the_cached_tokens_the_worker_reports(fleet):
    """End to end, each body twice: every hit the router predicted is the hit the worker
    reported, to the token."""
    reset_caches(fleet)
    series = ("kvloop_router_predicted_hit_tokens_total", "kvloop_router_actual_hit_tokens_total")
    with RouterThread(router_config(), fleet.specs()) as rt:
        for path, body in PROMPT_BODIES:
            for attempt in range(2):
                before = httpx.get(rt.url + "/metrics").text
                r = httpx.post(rt.url + path, json={**body, "max_tokens": 1}, timeout=30)
                assert r.status_code == 200, r.text
                after = httpx.get(rt.url + "/metrics").text
                cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                predicted, actual = (metric_value(after, n) - metric_value(before, n)
                                     for n in series)
                assert predicted == actual == cached, (body, attempt, predicted, actual)
            assert cached > 0, body   # the repeat hit


def test_models_and_a_model_by_id_come_from_a_worker(fleet):
    with RouterThread(router_config(), fleet.specs()) as rt:
        listed = httpx.get(rt.url + "/v1/models")
        assert listed.status_code == 200 and [m["id"] for m in listed.json()["data"]] == ["sim"]
        one = httpx.get(rt.url + "/v1/models/sim")
        assert one.status_code == 200 and one.json()["id"] == "sim"
        assert one.json().keys() == listed.json()["data"][0].keys()
        for unknown in ("nope", "org/nope"):
            r = httpx.get(f"{rt.url}/v1/models/{unknown}")
            assert r.status_code == 404 and r.json()["error"]["message"].startswith(
                f"The model `{unknown}` does not exist"), r.text


def test_a_hot_prefix_is_replicated_when_its_holder_saturates(fleet):
    rng = random.Random(3)
    prefix = random_ids(rng, PREFIX_LEN)
    prompts = [prefix + random_ids(rng, SUFFIX_LEN) for _ in range(96)]
    reset_caches(fleet)
    with RouterThread(router_config(), fleet.specs()) as rt:
        share = run_workload(rt.url, prompts, concurrency=24, max_tokens=8)
        text = httpx.get(rt.url + "/metrics").text
        first_block = rt.router.block_hashes(prefix)[0]
        holders = [n for n, hs in httpx.get(rt.url + "/router/index").json()["workers"].items()
                   if first_block in hs]
    moved = sum(metric_value(text, "kvloop_router_decisions_total", reason=r)
                for r in ("hot_prefix_replica", "load_override", "bounded_load"))
    print(f"hot prefix: {moved:.0f} decisions moved it, {len(holders)} holders, "
          f"hit share {share:.3f}")
    # its holder got busy, so the prefix was copied on purpose to a few more workers (never
    # once per request), and nearly every request still reused it
    assert 2 <= len(holders) and 1 <= moved <= 0.1 * len(prompts)
    assert share >= 0.8 * (len(prompts) - len(holders)) * PREFIX_LEN / (
        len(prompts) * (PREFIX_LEN + SUFFIX_LEN))


def _finished(fleet: Fleet, reason: str) -> float:
    return sum(metric_value(httpx.get(w.url + "/metrics").text, "vllm:request_success_total",
                            finished_reason=reason) for w in fleet.workers)


def test_client_disconnect_aborts_the_request_on_the_worker(fleet):
    aborted, completed = _finished(fleet, "abort"), _finished(fleet, "length")
    with RouterThread(router_config(), fleet.specs()) as rt:
        # 850 tokens take about a second here; the client leaves after the first one. The
        # line iterator is kept: a dropped one is closed at once, and closing it closes the
        # connection (the disconnect would race the check below)
        body = {"prompt": [3] * 20, "max_tokens": 850, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", rt.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            busy = [w for w in rt.router.registry.all() if w.in_flight()]
            assert len(busy) == 1, [(w.name, w.in_flight()) for w in rt.router.registry.all()]
        wait_until(lambda: _finished(fleet, "abort") + _finished(fleet, "length")
                   > aborted + completed, 10, "the request to end on the worker")
        assert _finished(fleet, "abort") == aborted + 1, "it ran to the end: not aborted"
        wait_until(lambda: busy[0].in_flight() == 0, 5, "the router to close the ticket")
        text = httpx.get(rt.url + "/metrics").text
        outcomes = {o: metric_value(text, "kvloop_router_requests_total", outcome=o)
                    for o in ("ok", "disconnected", "worker_error")}
        assert outcomes["disconnected"] == 1, outcomes


def test_workers_register_and_deregister_at_run_time(fleet):
    specs = fleet.specs()
    with RouterThread(router_config(), specs[:1]) as rt:
        r = httpx.post(rt.url + "/workers", json={"url": specs[1].url, "role": "both"},
                       headers=ADMIN)
        assert r.status_code == 201 and r.json()["up"] is True, r.text
        assert httpx.post(rt.url + "/workers", json={"url": specs[1].url},
                          headers=ADMIN).status_code == 409
        listed = httpx.get(rt.url + "/workers").json()
        assert set(listed) == {specs[0].name, specs[1].name}
        assert listed[specs[1].name]["routing"] == "cache-aware"
        r = httpx.request("DELETE", rt.url + "/workers", json={"url": specs[0].url},
                          headers=ADMIN)
        assert r.status_code == 200
        assert set(httpx.get(rt.url + "/workers").json()) == {specs[1].name}
        assert httpx.request("DELETE", rt.url + "/workers", json={"url": specs[0].url},
                             headers=ADMIN).status_code == 404
        assert httpx.post(rt.url + "/workers", json={"role": "both"},
                          headers=ADMIN).status_code == 400
        for r, code in ((httpx.get(rt.url + "/no/such/path"), 404),
                        (httpx.get(rt.url + "/v1/completions"), 405),
                        (httpx.post(rt.url + "/v1/completions", content=b"\x80"), 400)):
            assert r.status_code == code and r.json()["error"]["code"] == code, r.text
        out = httpx.post(rt.url + "/v1/completions", json={"prompt": [1] * 20, "max_tokens": 1})
        assert out.status_code == 200
        httpx.request("DELETE", rt.url + "/workers", json={"url": specs[1].url}, headers=ADMIN)
        empty = httpx.post(rt.url + "/v1/completions", json={"prompt": [1] * 20})
        assert empty.status_code == 503 and "no worker" in empty.json()["error"]["message"]
        assert httpx.get(rt.url + "/health").status_code == 503


def test_index_dump_is_json(fleet):
    with RouterThread(router_config(), fleet.specs()[:1]) as rt:
        dump = httpx.get(rt.url + "/router/index").json()
        assert set(dump) == {"num_blocks", "workers"}
        json.dumps(dump)


def test_kvloop_router_command_serves_and_stops_on_sigterm(fleet):
    import signal
    import subprocess
    import sys

    spec = fleet.specs()[0]
    cmd = [sys.executable, "-m", "kvloop", "router", "--port", "0",
           "--worker", f"{spec.url},both", "--liveness-window", "5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = None
        for line in proc.stdout:
            m = re.search(r"kvloop router on (http://\S+) \(policy kv-aware\)", line)
            if m:
                url = m.group(1)
                break
        assert url is not None, "the router did not announce itself"
        r = httpx.post(url + "/v1/completions", json={"prompt": [2] * 30, "max_tokens": 2})
        assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    bad = subprocess.run([sys.executable, "-m", "kvloop", "router", "--worker", "nope"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "worker URL must look like" in bad.stderr


def test_small_router_responses_are_not_delayed(fleet):
    """The router binds its socket as the API server does (TCP, so asyncio sets TCP_NODELAY);
    it used not to, and every small response waited ~40 ms for a delayed ACK."""
    with RouterThread(router_config(), fleet.specs()[:1]) as rt, httpx.Client() as http:
        times = []
        for _ in range(9):
            t0 = time.perf_counter()
            assert http.get(rt.url + "/no-such-path").status_code == 404
            times.append(time.perf_counter() - t0)
    assert statistics.median(times) < 0.03, times
