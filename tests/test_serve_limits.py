"""Requests that can never succeed are 400 (vLLM's words where vLLM has them), not 503 or a
silent clamp: max_tokens beyond the context, more sequences than --max-waiting-requests lets
wait. An unasked max_tokens still means "what fits" and is no error. Against a real
`kvloop serve --model sim --sim-model bytes` (one token per byte, so lengths are exact)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvloop.front.launcher import ServeProcess

from .conftest import post, sdk, serving

pytestmark = pytest.mark.processes   # a real `kvloop serve` for the module

MAX_LEN = 128
MAX_WAITING = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with serving(tmp_path_factory, "serve_limits", [
            "--model", "sim", "--sim-model", "bytes", "--sim-speedup", "200",
            "--num-gpu-blocks-override", "64",
            "--max-model-len", str(MAX_LEN), "--max-waiting-requests", str(MAX_WAITING),
            "--debug-check-invariants"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return sdk(server.url)


def _error(r: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["type"] == "BadRequestError"
    return err


def _too_large(max_tokens: int, prompt_len: int) -> str:
    return (f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
            f"maximum context length is {MAX_LEN} tokens and your request has {prompt_len} "
            f"input tokens ({max_tokens} > {MAX_LEN} - {prompt_len}).")


# --- max_tokens and the context --------------------------------------------------------------
@pytest.mark.parametrize("max_tokens", [MAX_LEN - 99, 10 ** 23])
@pytest.mark.parametrize("stream", [False, True])
def test_completion_max_tokens_beyond_the_context_is_400(server: ServeProcess, max_tokens: int,
                                                         stream: bool) -> None:
    r = post(server, "/v1/completions", {"prompt": "p" * 100, "max_tokens": max_tokens,
                                          "stream": stream})
    err = _error(r)
    assert err["message"] == _too_large(max_tokens, 100) and err["param"] == "max_tokens"


def test_max_tokens_that_just_fits_is_served(client: openai.OpenAI) -> None:
    r = client.completions.create(model="sim", prompt="p" * 100, max_tokens=MAX_LEN - 100)
    (c,) = r.choices
    assert len(c.text) == MAX_LEN - 100 and c.finish_reason == "length"
    assert r.usage is not None and r.usage.total_tokens == MAX_LEN


def test_every_prompt_of_a_list_is_checked(server: ServeProcess) -> None:
    r = post(server, "/v1/completions", {"prompt": ["short", "q" * 120], "max_tokens": 10})
    assert _error(r)["message"] == _too_large(10, 120)


def test_chat_max_completion_tokens_beyond_the_context_is_400(server: ServeProcess,
                                                              client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "hello"}]
    prompt_len = len(httpx.post(server.url + "/tokenize", json={"messages": msgs})
                     .json()["tokens"])
    for field in ("max_tokens", "max_completion_tokens"):
        r = post(server, "/v1/chat/completions", {"messages": msgs, field: MAX_LEN})
        err = _error(r)
        assert err["message"] == _too_large(MAX_LEN, prompt_len) and err["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="is too large: 500"):
        client.chat.completions.create(model="sim", messages=msgs,  # type: ignore[arg-type]
                                       max_completion_tokens=500)


def test_unasked_max_tokens_is_what_fits(client: openai.OpenAI) -> None:
    """Completions default to 16 tokens, cut to the room left; chat to all of the room."""
    assert len(client.completions.create(model="sim", prompt="a").choices[0].text) == 16
    (c,) = client.completions.create(model="sim", prompt="b" * (MAX_LEN - 4)).choices
    assert len(c.text) == 4 and c.finish_reason == "length"
    (c,) = client.completions.create(model="sim", prompt="c" * 60,
                                     extra_body={"max_tokens": None}).choices
    assert len(c.text) == MAX_LEN - 60
    r = client.chat.completions.create(model="sim", messages=[{"role": "user",
                                                               "content": "d"}])
    assert r.usage is not None and r.usage.total_tokens == MAX_LEN
    assert r.choices[0].finish_reason == "length"


def test_a_prompt_that_fills_the_context_is_400(server: ServeProcess) -> None:
    err = _error(post(server, "/v1/completions", {"prompt": "z" * MAX_LEN}))
    assert err["param"] == "prompt" and err["message"] == (
        f"This model's maximum context length is {MAX_LEN} tokens. However, your request has "
        f"{MAX_LEN} input tokens. Please reduce the length of the input messages.")


# --- more sequences than may ever wait -------------------------------------------------------
def test_n_beyond_max_waiting_requests_is_400(server: ServeProcess) -> None:
    n = MAX_WAITING + 1
    for path, body in (("/v1/completions", {"prompt": "x", "n": n, "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "x"}],
                                                 "n": n, "max_tokens": 2, "stream": True})):
        r = post(server, path, body)
        err = _error(r)
        assert "retry-after" not in r.headers and err["param"] == "n"
        assert err["message"] == (
            f"This request needs {n} sequences (n={n} for each of 1 prompt(s)), more than the "
            f"{MAX_WAITING} that --max-waiting-requests lets wait at once; it can never be "
            f"admitted. Reduce n or the number of prompts.")


def test_too_many_prompts_is_400(server: ServeProcess) -> None:
    r = post(server, "/v1/completions", {"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2})
    err = _error(r)
    assert err["param"] == "n" and "needs 6 sequences (n=2 for each of 3 prompt(s))" in \
        err["message"]
    r = post(server, "/v1/completions", {"prompt": list("abcde"), "max_tokens": 2})
    err = _error(r)
    assert err["param"] == "prompt" and "needs 5 sequences (n=1 for each of 5 prompt(s))" in \
        err["message"]


def test_exactly_max_waiting_requests_is_served(client: openai.OpenAI) -> None:
    r = client.completions.create(model="sim", prompt="x", n=MAX_WAITING, max_tokens=3)
    assert len(r.choices) == MAX_WAITING and all(len(c.text) == 3 for c in r.choices)


def test_nothing_is_left_behind(server: ServeProcess) -> None:
    stats = server.wait_idle()
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
    assert server.metric("vllm:admission_rejections_total") == 0   # 400s are not admission
