"""The official `openai` client against `kvloop serve` with the embedded SmolLM2-135M model:
completions and chat, streaming and not, n > 1, seeds, stop strings, logprobs, cached
tokens. Few tokens per request: the real model runs on two CPU cores."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvloop.front.launcher import ServeProcess

from .conftest import needs_embedded_model, sdk, serving

pytestmark = [pytest.mark.processes, needs_embedded_model]

PROMPT = ("The city of Paris is the capital of France. It is known for the Eiffel Tower, "
          "the Louvre museum and its cafes. The river that runs through Paris is the")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with serving(tmp_path_factory, "serve_model", ["--max-model-len", "512",
                                                   "--debug-check-invariants"],
                 timeout_s=300) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return sdk(server.url, timeout=240)


@pytest.fixture(scope="module")
def greedy(client: openai.OpenAI) -> openai.types.Completion:
    return client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                     max_tokens=3, temperature=0, logprobs=2)


def test_completion_with_logprobs(greedy: openai.types.Completion) -> None:
    (c,) = greedy.choices
    assert c.text and c.finish_reason in ("length", "stop")
    lp = c.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert "".join(lp.tokens) == c.text
    assert all(x <= 0 and math.isfinite(x) for x in lp.token_logprobs)
    assert lp.top_logprobs is not None
    for tok, top, x in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs, strict=True):
        assert top[tok] == pytest.approx(x) and len(top) >= 2
        assert max(top.values()) == pytest.approx(x, abs=1e-4)   # greedy: the best token


def test_streaming_same_text_and_cached_prompt(server: ServeProcess, client: openai.OpenAI,
                                               greedy: openai.types.Completion) -> None:
    hits0 = server.metric("vllm:prefix_cache_hits_total")
    chunks = list(client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                            max_tokens=3, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == greedy.choices[0].text
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= 16 and cached % 16 == 0
    assert server.metric("vllm:prefix_cache_hits_total") - hits0 == cached


def test_stop_string(client: openai.OpenAI, greedy: openai.types.Completion) -> None:
    text = greedy.choices[0].text
    if len(text) < 2:
        pytest.skip(f"greedy text {text!r} too short to pick a stop string")
    stop = text[1:]
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=3,
                                  temperature=0, stop=[stop]).choices[0]
    assert (r.text, r.finish_reason) == (text[:text.find(stop)], "stop")


def test_chat_n_and_seed(client: openai.OpenAI) -> None:
    def run() -> list[str]:
        r = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Say hi."}],
            max_tokens=3, n=2, temperature=0.8, seed=7)
        assert [c.index for c in r.choices] == [0, 1]
        assert r.usage is not None and r.usage.completion_tokens <= 6
        return [c.message.content or "" for c in r.choices]

    first = run()
    assert all(first) and run() == first


def test_log_is_clean(server: ServeProcess, tmp_path: Path) -> None:
    assert "Traceback" not in server.log()
