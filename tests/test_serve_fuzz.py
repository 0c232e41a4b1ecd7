"""Random requests against a real `kvloop serve --model sim`: whatever the body, the server
answers below 500 (an OpenAI error object for every 4xx), streams end with [DONE], and
afterwards no request, block or traceback is left behind.

The bodies mix every parameter the server reads, with valid values, edge values (0, huge
ints, non-finite and denormal floats, empty strings) and values of the wrong JSON type.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvloop.front.launcher import ServeProcess

from .conftest import serving

pytestmark = pytest.mark.processes   # a real `kvloop serve` for the module

BLOCKS = 64
MAX_LEN = 160   # SmolLM2's chat template adds a ~20-token system turn
VOCAB = 49152   # the simulator speaks SmolLM2's vocabulary
ERROR_KEYS = {"message", "type", "param", "code"}

junk = st.one_of(st.none(), st.booleans(), st.text(max_size=4),
                 st.lists(st.integers(-2, 2), max_size=2),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
ints = st.one_of(st.integers(-3, 24), st.sampled_from([2 ** 31, 2 ** 63, 10 ** 30, -2 ** 63]))
nums = st.one_of(st.floats(-3, 3), st.sampled_from(
    [0.0, 1e-320, 2.0000001, 1e308, float("inf"), float("-inf"), float("nan")]))
token_ids = st.lists(st.one_of(st.integers(-2, 300), st.sampled_from(
    [VOCAB - 1, VOCAB, 2 ** 40])), max_size=24)
texts = st.text(max_size=30)
prompts = st.one_of(texts, token_ids, st.lists(texts, max_size=3),
                    st.lists(token_ids, max_size=3), junk)
stops = st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=5), junk)
COMMON: dict[str, st.SearchStrategy[Any]] = {
    "model": st.one_of(st.sampled_from(["sim", "alias", "nope", ""]), junk),
    "max_tokens": st.one_of(ints, junk), "max_completion_tokens": ints,
    "temperature": st.one_of(nums, junk), "top_p": nums, "top_k": ints, "min_p": nums,
    "n": st.one_of(st.integers(-1, 4), st.sampled_from([10 ** 6]), junk),
    "stop": stops, "stop_token_ids": st.one_of(token_ids, junk),
    "seed": st.one_of(ints, junk), "stream": st.one_of(st.booleans(), junk),
    "stream_options": st.one_of(st.fixed_dictionaries(
        {}, optional={"include_usage": st.one_of(st.booleans(), junk)}), junk),
    "presence_penalty": nums, "frequency_penalty": nums, "repetition_penalty": nums,
    "ignore_eos": st.one_of(st.booleans(), junk), "min_tokens": ints,
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
    "return_token_ids": st.booleans(), "cache_salt": st.one_of(texts, junk),
    "priority": ints, "user": st.one_of(texts, junk), "logit_bias": junk,
    "best_of": st.one_of(st.integers(-1, 3), junk),
}
COMPLETION = {**COMMON, "prompt": prompts, "echo": st.one_of(st.booleans(), junk),
              "logprobs": st.one_of(ints, junk)}
messages = st.one_of(
    st.lists(st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), junk)},
        optional={"content": st.one_of(texts, st.lists(st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url"]), "text": texts}), max_size=2),
            junk),
            "name": texts}), max_size=3),
    junk)
CHAT = {**COMMON, "messages": messages, "logprobs": st.one_of(st.booleans(), junk),
        "top_logprobs": st.one_of(ints, junk), "add_generation_prompt": st.booleans()}


# Mostly valid bodies, so that the fuzzing also reaches the engine: every field from its
# valid range, then at most one field swapped for a wrong one.
VALID_COMMON: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["sim", "alias"]), "max_tokens": st.integers(1, 24),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 20),
    "min_p": st.floats(0, 1), "n": st.integers(1, 3),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "seed": st.integers(0, 2 ** 31), "stream": st.booleans(),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 4), "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(), "return_token_ids": st.booleans(),
    "cache_salt": st.text(min_size=1, max_size=6), "user": texts,
}
VALID_COMPLETION = {**VALID_COMMON, "echo": st.booleans(), "logprobs": st.integers(0, 5),
                    "prompt": st.one_of(st.text(min_size=1, max_size=40),
                                        st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                                 max_size=40),
                                        st.lists(st.text(min_size=1, max_size=8), min_size=1,
                                                 max_size=3))}
VALID_CHAT = {**VALID_COMMON, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
              "messages": st.lists(st.fixed_dictionaries(
                  {"role": st.sampled_from(["system", "user", "assistant"]),
                   "content": st.text(max_size=30)}), min_size=1, max_size=3)}


@st.composite
def nearly_valid(draw: st.DrawFn, valid: dict[str, st.SearchStrategy[Any]],
                 wild: dict[str, st.SearchStrategy[Any]], required: str) -> dict[str, Any]:
    body = draw(st.fixed_dictionaries({required: valid[required]}, optional={
        k: v for k, v in valid.items() if k != required}))
    if body.get("stream") and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    if draw(st.booleans()):
        key = draw(st.sampled_from(sorted(wild)))
        body[key] = draw(wild[key])
    return body


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with serving(tmp_path_factory, "serve_fuzz", [
            "--model", "sim", "--sim-speedup", "2000", "--num-gpu-blocks-override",
            str(BLOCKS), "--max-model-len", str(MAX_LEN), "--debug-check-invariants",
            "--served-model-name", "sim", "alias"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: ServeProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def _check(r: httpx.Response, body: Any, path: str = "/v1/completions") -> None:
    """Below 500; an OpenAI error object on 4xx; a complete answer or stream on 200."""
    assert r.status_code < 500, (body, r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == ERROR_KEYS and err["code"] == r.status_code and err["message"], err
        return
    assert r.status_code == 200, (body, r.status_code)
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", (body, r.text[-300:])
        for e in events[:-1]:
            chunk = json.loads(e)
            assert "error" not in chunk or chunk["error"]["code"] < 500, (body, chunk)
    elif path.startswith("/v1/"):
        out = r.json()
        assert out["choices"] and out["usage"]["completion_tokens"] >= 0, (body, out)
    elif path == "/tokenize":
        assert isinstance(r.json()["tokens"], list), (body, r.text)
    else:
        assert isinstance(r.json()["prompt"], str), (body, r.text)


def _send(http: httpx.Client, path: str, body: Any) -> int:
    """POST `body` (NaN/Infinity written as such: not JSON, the server must say 400), check
    the answer, return its status."""
    raw = json.dumps(body, allow_nan=True)
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    _check(r, body, path)
    return r.status_code


FUZZ = settings(max_examples=120, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(body=st.fixed_dictionaries({}, optional=COMPLETION))
def test_random_completions_never_5xx(http: httpx.Client, body: dict[str, Any]) -> None:
    assert _send(http, "/v1/completions", body) < 500


@FUZZ
@given(body=st.fixed_dictionaries({}, optional=CHAT))
def test_random_chats_never_5xx(http: httpx.Client, body: dict[str, Any]) -> None:
    assert _send(http, "/v1/chat/completions", body) < 500


@FUZZ
@given(body=nearly_valid(VALID_COMPLETION, COMPLETION, "prompt"))
def test_nearly_valid_completions(http: httpx.Client, body: dict[str, Any]) -> None:
    assert _send(http, "/v1/completions", body) < 500


@FUZZ
@given(body=nearly_valid(VALID_CHAT, CHAT, "messages"))
def test_nearly_valid_chats(http: httpx.Client, body: dict[str, Any]) -> None:
    assert _send(http, "/v1/chat/completions", body) < 500


@FUZZ
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize",
                             "/detokenize"]),
       body=st.one_of(junk, st.floats(), st.fixed_dictionaries({}, optional={
           "prompt": prompts, "tokens": st.one_of(token_ids, junk), "messages": messages,
           "model": junk, "add_special_tokens": junk})))
def test_odd_bodies_and_other_endpoints_never_5xx(http: httpx.Client, path: str,
                                                  body: Any) -> None:
    assert _send(http, path, body) < 500


@FUZZ
@given(raw=st.binary(max_size=40))
def test_raw_bytes_never_5xx(http: httpx.Client, raw: bytes) -> None:
    r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    _check(r, raw)


def test_routing_errors_use_the_error_object(http: httpx.Client) -> None:
    for r, code in ((http.get("/no/such/path"), 404), (http.get("/v1/completions"), 405),
                    (http.post("/v1/completions", content=b"\x80",
                               headers={"content-type": "application/json"}), 400)):
        assert r.status_code == code
        err = r.json()["error"]
        assert set(err) == ERROR_KEYS and err["code"] == code and err["message"], err
    assert http.get("/v1/completions").headers["allow"] == "POST"


def test_concurrent_streams_with_random_disconnects(server: ServeProcess) -> None:
    """60 requests at once (more than the 64-block pool can hold, so some wait and some are
    preempted), a third of the clients leave at a random point; the rest finish whole."""
    rng = random.Random(7)

    async def one(c: httpx.AsyncClient, i: int) -> tuple[str, int, int]:
        want = rng.randrange(1, 40)
        body = {"model": "sim", "prompt": [rng.randrange(VOCAB) for _ in range(rng.randrange(
            1, 60))], "max_tokens": want, "ignore_eos": True, "return_token_ids": True,
            "stream": rng.random() < 0.7}
        leave_after = rng.randrange(0, 6) if i % 3 == 0 else None
        if not body["stream"]:
            try:
                r = await c.post("/v1/completions", json=body,
                                 timeout=0.05 if leave_after is not None else 30)
            except httpx.TimeoutException:
                return "left", 0, want
            return "done", r.json()["usage"]["completion_tokens"], want
        async with c.stream("POST", "/v1/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    seen += len(json.loads(line[6:])["choices"][0]["token_ids"])
                    if leave_after is not None and seen > leave_after:
                        return "left", seen, want
            return "done", seen, want

    async def main() -> list[tuple[str, int, int]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            return await asyncio.gather(*(one(c, i) for i in range(60)))

    results = asyncio.run(main())
    done = [(got, want) for kind, got, want in results if kind == "done"]
    assert len(done) >= 35 and all(got == want for got, want in done), results
    stats = server.wait_idle()
    assert stats["num_requests"] == 0, stats
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats


def test_nothing_is_left_behind(server: ServeProcess, http: httpx.Client) -> None:
    """Runs after the fuzzers (file order): every request ended, every block is free."""
    stats = server.wait_idle()
    assert stats["num_requests"] == 0, stats
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert http.get("/health").status_code == 200
    ok = http.post("/v1/completions", json={"model": "sim", "prompt": "still fine",
                                            "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    assert "Traceback" not in server.log() and "ERROR" not in server.log()
