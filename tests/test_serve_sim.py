"""The OpenAI API of a real `kvloop serve --model sim` process, through the official `openai`
client (unchanged) and raw HTTP: completions and chat, streaming and not, n > 1, stop
strings, logprobs, seeds, prefix caching and its metrics, bad inputs, the other endpoints,
and a client that disconnects mid-stream.

The simulator speaks the embedded SmolLM2's vocabulary: token counts and ids are checked
against that tokenizer (`SMOL`), and every generated token is one space-prefixed word."""

from __future__ import annotations

import json
import re
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvloop.front.launcher import ServeProcess
from kvloop.front.tokenizer import Tokenizer, find_model_path

from .conftest import post, sdk, serving

pytestmark = pytest.mark.processes   # a real `kvloop serve` for the module

BLOCKS = 256
MAX_LEN = 1024
VOCAB = 49152                      # SmolLM2's
TARGET_TPOT_MS = 10                # the modelled 512-token step: 7.9 ms, 1024: 15.4 ms
SMOL = Tokenizer.from_model(None)  # the reference: what a real SmolLM2 server tokenizes
WORDS = re.compile(r"( [a-z]+)+")  # what the simulator generates


def words(text: str | None, n: int) -> bool:
    """`text` is `n` generated tokens: `n` space-prefixed lowercase words."""
    return text is not None and WORDS.fullmatch(text) is not None and len(text.split()) == n


ADMIN_KEY = "serve-sim-admin"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with serving(tmp_path_factory, "serve_sim", [
            "--model", "sim", "--sim-speedup", "50", "--num-gpu-blocks-override", str(BLOCKS),
            "--max-model-len", str(MAX_LEN), "--debug-check-invariants", "--target-tpot-ms",
            str(TARGET_TPOT_MS),
            "--served-model-name", "sim", "alias", "--admin-api-key", ADMIN_KEY]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return sdk(server.url)


def metric(server: ServeProcess, name: str, **labels: str) -> float:
    return server.metric(name, **labels)


def engine_stats(server: ServeProcess) -> dict[str, Any]:
    return server.engine_stats()


def wait_idle(server: ServeProcess) -> dict[str, Any]:
    return server.wait_idle()


# --- completions ------------------------------------------------------------------------------
def test_completion_text_prompt(client: openai.OpenAI) -> None:
    r = client.completions.create(model="sim", prompt="Hello, world", max_tokens=12,
                                  extra_body={"return_token_ids": True})
    (c,) = r.choices
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == "sim"
    assert words(c.text, 12) and c.finish_reason == "length"
    extra = c.model_extra or {}
    assert extra["prompt_token_ids"] == SMOL.encode("Hello, world") == [19556, 28, 905]
    assert SMOL.decode(extra["token_ids"]) == c.text
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (3, 12, 15)


def test_any_token_id_of_the_vocabulary_is_accepted(client: openai.OpenAI) -> None:
    prompt = [0, 1, 2, 17, 1000, 40000, VOCAB - 1]    # specials, EOS and the last id too
    r = client.completions.create(model="sim", prompt=prompt, max_tokens=5,
                                  extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert c.finish_reason == "length" and words(c.text, 5)
    assert r.usage is not None and r.usage.prompt_tokens == len(prompt)
    with pytest.raises(openai.BadRequestError, match=f"Token id {VOCAB} is out of vocabulary"):
        client.completions.create(model="sim", prompt=[5, VOCAB], max_tokens=1)


def test_completion_prompt_forms(client: openai.OpenAI) -> None:
    greedy = {"model": "alias", "max_tokens": 5, "temperature": 0}
    by_text = client.completions.create(prompt="abc", **greedy).choices[0].text
    by_ids = client.completions.create(prompt=SMOL.encode("abc"), **greedy).choices[0].text
    assert by_ids == by_text
    r = client.completions.create(prompt=["abc", "xyz"], **greedy)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == by_text
    r2 = client.completions.create(prompt=[SMOL.encode("abc"), SMOL.encode("xyz")], **greedy)
    assert [c.text for c in r2.choices] == [c.text for c in r.choices]
    assert r2.usage is not None
    assert r2.usage.prompt_tokens == len(SMOL.encode("abc") + SMOL.encode("xyz")) == 2


def test_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    kw = {"model": "sim", "prompt": "stream me", "max_tokens": 20, "temperature": 0}
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True,
                                            stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 20


def test_echo_and_return_token_ids(client: openai.OpenAI) -> None:
    r = client.completions.create(model="sim", prompt="echo:", max_tokens=3, echo=True,
                                  extra_body={"return_token_ids": True})
    c = r.choices[0]
    extra = c.model_extra or {}
    assert extra["prompt_token_ids"] == SMOL.encode("echo:") and len(extra["token_ids"]) == 3
    assert c.text == "echo:" + SMOL.decode(extra["token_ids"]) and words(c.text[5:], 3)


def test_n_and_seed(client: openai.OpenAI) -> None:
    kw = {"model": "sim", "prompt": "seeded", "max_tokens": 10, "temperature": 1.0, "n": 3}
    a = client.completions.create(seed=1234, **kw)
    b = client.completions.create(seed=1234, **kw)
    c = client.completions.create(seed=99, **kw)
    texts = [x.text for x in a.choices]
    assert [x.index for x in a.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert [x.text for x in b.choices] == texts
    assert [x.text for x in c.choices] != texts
    assert a.usage is not None and a.usage.completion_tokens == 30
    unseeded = [client.completions.create(model="sim", prompt="seeded", max_tokens=10)
                .choices[0].text for _ in range(2)]
    assert unseeded[0] != unseeded[1]


def test_stop_strings(client: openai.OpenAI) -> None:
    kw = {"model": "sim", "prompt": "stops", "max_tokens": 40, "temperature": 0}
    full = client.completions.create(**kw).choices[0].text
    stop = full[10:12]
    cut = full.index(stop)
    r = client.completions.create(stop=[stop, "\u2603"], **kw).choices[0]
    assert (r.text, r.finish_reason) == (full[:cut], "stop")
    assert (r.model_extra or {})["stop_reason"] == stop
    inc = client.completions.create(stop=stop, extra_body={"include_stop_str_in_output": True},
                                    **kw).choices[0]
    assert inc.text == full[:cut + 2]
    streamed = client.completions.create(stop=[stop], stream=True, **kw)
    assert "".join(c.choices[0].text for c in streamed) == full[:cut]


def test_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model="sim", prompt="lp", max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.token_logprobs) == 4
    assert lp.top_logprobs is not None and all(len(t) >= 2 for t in lp.top_logprobs)
    assert all(words(t, 1) for t in lp.tokens)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    chat = client.chat.completions.create(
        model="sim", messages=[{"role": "user", "content": "x"}], max_tokens=3, logprobs=True,
        top_logprobs=3)
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)


# --- chat -------------------------------------------------------------------------------------
def test_chat_stream_and_not(client: openai.OpenAI) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="sim", messages=msgs,  # type: ignore[arg-type]
                                       max_completion_tokens=15, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and words(text, 15)
    rendered = SMOL.apply_chat_template(msgs)   # SmolLM2's template, system turn given
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(SMOL.encode(rendered, add_special_tokens=False))
    chunks = list(client.chat.completions.create(
        model="sim", messages=msgs, max_tokens=15, temperature=0,  # type: ignore[arg-type]
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 15


def test_chat_n_streaming(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="sim", messages=[{"role": "user", "content": "two"}], max_tokens=6, n=2,
        temperature=1.0, stream=True))
    texts: dict[int, str] = {0: "", 1: ""}
    finished = set()
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and all(words(t, 6) for t in texts.values())


# --- prefix caching ---------------------------------------------------------------------------
def test_cached_tokens_and_prefix_cache_metrics(server: ServeProcess,
                                                client: openai.OpenAI) -> None:
    wait_idle(server)
    prefix = "The shared prefix of two prompts, long enough for several blocks. " * 2
    hits0 = metric(server, "vllm:prefix_cache_hits_total", model_name="sim")
    queries0 = metric(server, "vllm:prefix_cache_queries_total")
    first = client.completions.create(model="sim", prompt=prefix + "first", max_tokens=2)
    assert first.usage is not None
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model="sim", prompt=prefix + "second", max_tokens=2)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    a, b = SMOL.encode(prefix + "first"), SMOL.encode(prefix + "second")
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert cached == (common // 16) * 16 and cached > 0
    assert metric(server, "vllm:prefix_cache_hits_total") - hits0 == cached
    assert metric(server, "vllm:prefix_cache_queries_total") - queries0 == \
        first.usage.prompt_tokens + second.usage.prompt_tokens
    assert metric(server, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") >= \
        cached


# --- bad input --------------------------------------------------------------------------------
BAD_COMPLETIONS = [
    ({"prompt": 123}, 400, "body.prompt"),
    ({"prompt": "x", "max_tokens": "many"}, 400, "body.max_tokens"),
    ({"prompt": "x", "temperature": [1]}, 400, "body.temperature"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": 2.5}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "x", "stop": ["ok", ""]}, 400, "stop"),
    ({"prompt": "x", "min_tokens": 9, "max_tokens": 2}, 400, "min_tokens"),
    ({"prompt": "x", "seed": 2 ** 70}, 400, "seed"),
    ({"prompt": "x", "priority": 1}, 400, "priority"),
    ({"prompt": "x", "logit_bias": {str(VOCAB): 2}}, 400, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"abc": 2}}, 400, "logit_bias"),
    ({"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ({"prompt": "x", "allowed_token_ids": [VOCAB]}, 400, "allowed_token_ids"),
    ({"prompt": "x", "bad_words": ["w"] * 300}, 400, "bad_words"),
    ({"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ({"prompt": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ({"prompt": "x", "truncate_prompt_tokens": MAX_LEN + 1}, 400, "truncate_prompt_tokens"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, 2, 999999]}, 400, "prompt"),
    ({"prompt": [0, VOCAB]}, 400, "prompt"),
    ({"prompt": [-1]}, 400, "prompt"),
    ({"prompt": [1000] * MAX_LEN}, 400, "prompt"),
    ({"prompt": "x", "repetition_penalty": float("inf")}, 400, "repetition_penalty"),
    ({"prompt": "x", "temperature": float("nan")}, 400, "temperature"),
    ({"prompt": "x", "stop_token_ids": [10 ** 9]}, 400, "stop_token_ids"),
    ({"prompt": "lone \ud800 surrogate"}, 400, "prompt"),
    ({"prompt": "x", "model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_COMPLETIONS)
def test_bad_completion_inputs(server: ServeProcess, body: dict[str, object], status: int,
                               param: str) -> None:
    r = post(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["param"] == param and err["message"]


def test_bad_inputs_do_not_disturb_the_server(server: ServeProcess,
                                              client: openai.OpenAI) -> None:
    done: list[openai.types.Completion] = []
    running = threading.Thread(target=lambda: done.append(client.completions.create(
        model="sim", prompt="meanwhile", max_tokens=300)))
    running.start()
    for body, status, _ in BAD_COMPLETIONS:
        assert post(server, "/v1/completions", body).status_code == status
    r = httpx.post(server.url + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    for body in ({"messages": []}, {"messages": [{"content": "no role"}]},
                 {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
                 {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                 {"messages": "hi"}):
        assert post(server, "/v1/chat/completions", body).status_code == 400, body
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user",
                                                                   "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="sim", prompt="x", temperature=3)
    running.join(30)
    assert words(done[0].choices[0].text, 300) and done[0].choices[0].finish_reason == "length"
    assert httpx.get(server.url + "/health").status_code == 200
    huge_k = client.completions.create(model="sim", prompt="x", max_tokens=3,
                                       extra_body={"top_k": 2 ** 70})
    assert words(huge_k.choices[0].text, 3)


def test_default_max_tokens_is_clamped_to_the_context(client: openai.OpenAI) -> None:
    """Unasked, max_tokens (16) is cut to the room left; asked, too many is a 400
    (test_serve_limits.py)."""
    prompt = [1000] * (MAX_LEN - 4)
    r = client.completions.create(model="sim", prompt=prompt)
    assert words(r.choices[0].text, 4) and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="is too large: 100"):
        client.completions.create(model="sim", prompt=prompt, max_tokens=100)


# --- other endpoints --------------------------------------------------------------------------
def test_models_health_version_load(server: ServeProcess, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["sim", "alias"]
    assert (models.data[0].model_extra or {})["max_model_len"] == MAX_LEN
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/ping").status_code == 200
    assert httpx.post(server.url + "/ping").status_code == 200
    wrong = httpx.put(server.url + "/ping")  # one route per method: Allow names both
    assert wrong.status_code == 405 and wrong.headers["allow"] == "GET, POST"
    assert "version" in httpx.get(server.url + "/version").json()
    assert httpx.get(server.url + "/load").json() == {"server_load": 0}


def test_model_by_id(server: ServeProcess, client: openai.OpenAI) -> None:
    listed = httpx.get(server.url + "/v1/models").json()["data"]
    for card in listed:
        r = httpx.get(server.url + "/v1/models/" + card["id"])
        assert r.status_code == 200 and r.json() == card
    alias = client.models.retrieve("alias")
    assert (alias.id, alias.object, alias.owned_by) == ("alias", "model", "kvloop")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    for unknown in ("nope", "org/nope"):  # a served name may hold a slash: it is one id
        r = httpx.get(f"{server.url}/v1/models/{unknown}")
        assert r.status_code == 404 and r.json() == {"error": {
            "message": f"The model `{unknown}` does not exist. Valid aliases: sim, alias",
            "type": "NotFoundError", "param": "model", "code": 404}}


def _events(server: ServeProcess, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON events of a streamed answer (`[DONE]` checked and left out)."""
    r = post(server, path, {**body, "stream": True, "stream_options": {"include_usage": True}})
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and data[-1] == "[DONE]", r.text
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize(("sent", "named"), [("alias", "alias"), ("sim", "sim"), (None, "sim")])
def test_answers_name_the_model_the_client_sent(server: ServeProcess, sent: str | None,
                                                named: str) -> None:
    """vLLM's rule: the `model` of every answer and chunk is the alias the request named,
    or the first served name when it named none."""
    base: dict[str, Any] = {"max_tokens": 3} if sent is None else {"max_tokens": 3,
                                                                    "model": sent}
    for path, body in (("/v1/completions", {**base, "prompt": "x"}),
                       ("/v1/chat/completions",
                        {**base, "messages": [{"role": "user", "content": "x"}]})):
        r = post(server, path, body)
        assert r.status_code == 200 and r.json()["model"] == named, r.text
        events = _events(server, path, body)
        # at least a content chunk and the usage chunk: a loaded API process merges the
        # outputs that queued for one stream into one chunk (2 of 3 tokens seen beside a
        # CPU burner), so how many chunks 3 tokens make is not the claim
        assert len(events) >= 2 and {e["model"] for e in events} == {named}, events


def test_small_responses_are_not_delayed(server: ServeProcess) -> None:
    """Without TCP_NODELAY each response body waited ~40 ms for a delayed ACK."""
    with httpx.Client() as http:
        times = []
        for _ in range(9):
            t0 = time.perf_counter()
            http.post(server.url + "/detokenize", json={"tokens": [65]})
            times.append(time.perf_counter() - t0)
    assert statistics.median(times) < 0.03, times


def test_tokenize_detokenize(server: ServeProcess) -> None:
    t = post(server, "/tokenize", {"prompt": "héllo", "return_token_strs": True}).json()
    assert t["tokens"] == SMOL.encode("héllo") and t["count"] == 3
    assert t["max_model_len"] == MAX_LEN and len(t["token_strs"]) == 3
    assert post(server, "/detokenize", {"tokens": t["tokens"]}).json() == {"prompt": "héllo"}
    msgs = [{"role": "user", "content": "a"}]
    chat = post(server, "/tokenize", {"messages": msgs}).json()
    # SmolLM2's template, its default system prompt included
    assert chat["tokens"] == SMOL.encode(SMOL.apply_chat_template(msgs))
    assert SMOL.decode(chat["tokens"], skip_special_tokens=False).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert post(server, "/detokenize", {"tokens": [VOCAB - 1]}).status_code == 200
    assert post(server, "/detokenize", {"tokens": [VOCAB]}).status_code == 400


def test_worker_description(server: ServeProcess) -> None:
    w = httpx.get(server.url + "/kvloop/worker").json()
    assert w["model"] == "sim" and w["role"] == "both" and w["block_size"] == 16
    assert w["model_path"] == find_model_path(None) and w["max_model_len"] == MAX_LEN
    assert (w["hash_algo"], w["hash_seed"]) == ("sha256", "vllm-none-hash")
    assert w["num_gpu_blocks"] == BLOCKS and w["kv_capacity_blocks"] == BLOCKS - 1
    assert w["kv_events"] is None and isinstance(w["epoch"], str) and len(w["epoch"]) == 32
    assert w["engine_pid"] != w["api_pid"] == server.pid
    assert set(w) == {   # the names other tools read: kept as they are
        "model", "served_model_names", "model_path", "role", "epoch", "block_size",
        "hash_algo", "hash_seed", "enable_prefix_caching", "num_gpu_blocks",
        "kv_capacity_blocks", "max_model_len", "max_num_batched_tokens", "max_num_seqs",
        "kv_events", "api_pid", "engine_pid", "version", "api_key_required",
        "api_key_accepted", "kv_transfer", "kv_shared_store", "lora_adapters"}
    assert w["kv_transfer"] is None                 # no KV connector configured
    assert w["kv_shared_store"] is None             # no shared KV store
    assert w["lora_adapters"] == []                 # no --enable-lora


def test_the_token_budget_is_auto_by_default(server: ServeProcess) -> None:
    """No --max-num-batched-tokens: the engine picks the largest budget whose modelled step
    stays within --target-tpot-ms (kvloop.core.budget), reports it and logs why."""
    w = httpx.get(server.url + "/kvloop/worker").json()
    assert (w["max_num_batched_tokens"], w["max_num_seqs"]) == (512, 128)
    log = server.log()
    assert ("max_num_batched_tokens auto: step time per token budget (modelled) 128 -> 2.4 ms, "
            "256 -> 4.2 ms, 512 -> 7.9 ms, 1024 -> 15.4 ms; chose 512, the largest within the "
            "target TPOT 10 ms (1024 is over)") in log
    assert (f"engine config: max_num_batched_tokens 512 (auto), max_num_seqs 128, "
            f"max_model_len {MAX_LEN}, chunked prefill on, num_gpu_blocks {BLOCKS} of 16 "
            f"tokens, prefix caching on") in log


def test_metric_names_types_and_labels(server: ServeProcess, client: openai.OpenAI) -> None:
    client.completions.create(model="sim", prompt="metrics", max_tokens=4)
    text = httpx.get(server.url + "/metrics").text
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    expected = {
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge", "vllm:num_preemptions": "counter",
        "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
        "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter", "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
        "vllm:iteration_tokens_total": "histogram", "vllm:cache_config_info": "gauge",
    }
    for name, kind in expected.items():
        exposed = name + "_total" if kind == "counter" else name   # prometheus_client's text
        assert types.get(exposed) == kind, name
    assert metric(server, "vllm:request_success_total", finished_reason="length") >= 1
    assert metric(server, "vllm:time_to_first_token_seconds_count", model_name="sim",
                  engine="0") >= 1
    assert metric(server, "vllm:inter_token_latency_seconds_count") >= 3
    assert 'le="0.001"' in text and 'le="2560.0"' in text      # TTFT buckets
    assert "_created" not in text                 # like vLLM's multiprocess collector
    assert metric(server, "vllm:num_requests_running") == 0


# Every series the example Grafana dashboard of vLLM's docs (examples/observability/
# prometheus_grafana, 2026-09) queries, each filtered by model_name.
GRAFANA_SERIES = (
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count",
    "vllm:request_time_per_output_token_seconds_bucket",
    "vllm:request_time_per_output_token_seconds_sum",
    "vllm:request_time_per_output_token_seconds_count", "vllm:num_requests_running",
    "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum", "vllm:request_max_num_generation_tokens_sum",
)


def test_vllm_grafana_dashboard_series_exist(server: ServeProcess,
                                             client: openai.OpenAI) -> None:
    client.completions.create(model="sim", prompt="dashboard", max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    for name in GRAFANA_SERIES:
        assert re.search(rf'^{re.escape(name)}\{{[^}}]*model_name="sim"', text, re.M), name
    assert re.search(r'^vllm:request_success_total\{[^}]*finished_reason="length"', text, re.M)


# --- disconnect -------------------------------------------------------------------------------
def test_disconnect_mid_stream_aborts_and_frees_blocks(server: ServeProcess) -> None:
    wait_idle(server)
    aborts0 = metric(server, "vllm:request_success_total", finished_reason="abort")
    body = {"model": "sim", "prompt": "a long one", "max_tokens": MAX_LEN - 20,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(8)]
        assert all(line.startswith("data: {") or line == "" for line in got)
        assert engine_stats(server)["num_running_reqs"] == 1
    stats = wait_idle(server)
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
    assert metric(server, "vllm:request_success_total", finished_reason="abort") == aborts0 + 1
    assert httpx.post(server.url + "/v1/completions",
                      json={"prompt": "after", "max_tokens": 2}).status_code == 200


def test_immediate_disconnects_leave_nothing_behind(server: ServeProcess) -> None:
    body = {"model": "sim", "prompt": "gone", "max_tokens": MAX_LEN - 100, "stream": True}
    for path, b in (("/v1/completions", body),
                    ("/v1/chat/completions", {**body, "messages": [{"role": "user",
                                                                    "content": "x"}]})):
        for _ in range(3):
            with httpx.stream("POST", server.url + path, json=b, timeout=30) as r:
                assert r.status_code == 200
    stats = wait_idle(server)
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
    assert httpx.get(server.url + "/load").json() == {"server_load": 0}


def test_non_streaming_disconnect_aborts(server: ServeProcess) -> None:
    wait_idle(server)
    aborts0 = metric(server, "vllm:request_success_total", finished_reason="abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions",
                   json={"prompt": "slow", "max_tokens": MAX_LEN - 10}, timeout=0.3)
    stats = wait_idle(server)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert metric(server, "vllm:request_success_total", finished_reason="abort") == aborts0 + 1


def test_reset_prefix_cache(server: ServeProcess) -> None:
    wait_idle(server)
    assert httpx.post(server.url + "/reset_prefix_cache",
                      headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json() == {"success": True}
    assert engine_stats(server)["num_cached_blocks"] == 0


def test_log_has_no_errors(server: ServeProcess, tmp_path: Path) -> None:
    assert "ERROR" not in server.log() and "Traceback" not in server.log()


def test_prompt_logprobs_echo_and_truncation(server: ServeProcess) -> None:
    prompt = SMOL.encode("one two three four five six")
    body = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "echo": True,
                                            "logprobs": 1, "prompt_logprobs": 2}).json()
    choice = body["choices"][0]
    lps = choice["prompt_logprobs"]
    assert len(lps) == len(prompt) and lps[0] is None
    for tok, pos in zip(prompt[1:], lps[1:], strict=True):
        assert str(tok) in pos and len(pos) <= 3
        assert set(pos[str(tok)]) == {"logprob", "rank", "decoded_token"}
    echoed = choice["logprobs"]
    assert len(echoed["tokens"]) == len(prompt) + 2
    assert echoed["token_logprobs"][0] is None and echoed["top_logprobs"][0] is None
    assert echoed["token_logprobs"][1:len(prompt)] == [
        pos[str(t)]["logprob"] for t, pos in zip(prompt[1:], lps[1:], strict=True)]
    chat = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 1
    cut = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1,
                                           "truncate_prompt_tokens": 3,
                                           "return_token_ids": True}).json()
    assert cut["usage"]["prompt_tokens"] == 3
    assert cut["choices"][0]["prompt_token_ids"] == prompt[-3:]
