"""`POST /v1/embeddings` on real `kvloop serve --model sim` workers, with the `openai` SDK:
open, behind `--api-key`, and through the router (prefix-aware: a repeated input is
predicted a hit). The simulator's vector of a prompt is `sim_embedding(its token ids)`."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvloop.front.embeddings import MAX_INPUTS
from kvloop.front.launcher import ServeProcess
from kvloop.front.prometheus_text import metric_value
from kvloop.front.tokenizer import Tokenizer
from kvloop.router.fleet import Fleet
from kvloop.sim.runner import SIM_EMBED_DIM, sim_embedding

from .conftest import RouterThread, bearer, sdk, serving
from .test_router_fleet import router_config, start_fleet

pytestmark = pytest.mark.processes

SMOL = Tokenizer.from_model(None)       # the simulated workers' vocabulary
KEY = "embed-key"
TEXTS = ["The quick brown fox", "jumps over the lazy dog"]


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    f = start_fleet(2)
    try:
        yield f
    finally:
        f.stop()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with serving(tmp_path_factory, "serve_embed_key",
                 ["--model", "sim", "--sim-speedup", "50", "--api-key", KEY]) as srv:
        yield srv


def assert_vectors(data: list[Any], prompts: list[list[int]], exact: bool) -> None:
    assert [d.index for d in data] == list(range(len(prompts)))
    for d, ids in zip(data, prompts, strict=True):
        want = sim_embedding(ids)
        assert d.object == "embedding" and len(d.embedding) == SIM_EMBED_DIM
        if exact:
            assert d.embedding == want
        else:     # base64 carries float32
            assert max(abs(a - b) for a, b in zip(d.embedding, want, strict=True)) < 1e-7


def test_the_openai_sdk_gets_float_and_base64_embeddings(fleet: Fleet) -> None:
    url = fleet.workers[0].url
    prompts = [SMOL.encode(t) for t in TEXTS]
    got = sdk(url).embeddings.create(model="sim", input=TEXTS)        # the SDK asks base64
    assert_vectors(got.data, prompts, exact=False)
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, prompts))
    assert got.model == "sim" and got.object == "list"
    floats = sdk(url).embeddings.create(model="sim", input=TEXTS[0], encoding_format="float")
    assert_vectors(floats.data, prompts[:1], exact=True)
    ids = [[5, 6, 7, 8], [9, 10]]
    by_ids = sdk(url).embeddings.create(model="sim", input=ids, encoding_format="float")
    assert_vectors(by_ids.data, ids, exact=True)
    one = sdk(url).embeddings.create(model="sim", input=[11, 12], encoding_format="float")
    assert_vectors(one.data, [[11, 12]], exact=True)


def post(url: str, body: dict[str, Any], key: str | None = None) -> httpx.Response:
    return httpx.post(url + "/v1/embeddings", json=body, timeout=30,
                      headers=bearer(key) if key else {})


def test_vllm_extensions_and_what_is_refused(fleet: Fleet) -> None:
    url = fleet.workers[0].url
    r = post(url, {"input": [[1, 2, 3, 4, 5]], "truncate_prompt_tokens": 2,
                   "use_activation": False})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["data"][0]["embedding"] == sim_embedding([4, 5], normalize=False)
    assert body["usage"] == {"prompt_tokens": 2, "total_tokens": 2, "completion_tokens": 0,
                             "prompt_tokens_details": None}
    assert body["id"].startswith("embd-")
    unit = post(url, {"input": [1, 2]}).json()["data"][0]["embedding"]
    assert math.isclose(math.fsum(v * v for v in unit), 1.0, rel_tol=1e-12)
    refused = [({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [[]]}, "input"),
               ({"input": "hi", "dimensions": 8}, "dimensions"),
               ({"input": [[1]] * (MAX_INPUTS + 1)}, "input"),
               ({"input": [10 ** 6]}, "input"),
               ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
               ({"input": "hi", "truncate_prompt_tokens": 10 ** 6}, "truncate_prompt_tokens"),
               ({"input": [1] * 100_000}, "input"),
               ({"input": "hi", "encoding_format": "bytes"}, "body.encoding_format"),
               ({"input": "hi", "model": "nope"}, "model")]
    for body, param in refused:
        r = post(url, body)
        assert r.status_code == (404 if param == "model" else 400), (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)
    assert "matryoshka" in post(url, {"input": "hi", "dimensions": 8}).json()["error"]["message"]
    stats = httpx.get(url + "/kvloop/stats").json()
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]


def test_api_key_is_required(keyed: ServeProcess) -> None:
    with pytest.raises(openai.AuthenticationError):
        sdk(keyed.url, "wrong").embeddings.create(model="sim", input="hi")
    assert post(keyed.url, {"input": "hi"}).status_code == 401
    got = sdk(keyed.url, KEY).embeddings.create(model="sim", input="hi", encoding_format="float")
    assert got.data[0].embedding == sim_embedding(SMOL.encode("hi"))


def test_through_the_router_a_repeated_input_is_predicted_a_hit(fleet: Fleet) -> None:
    ids = list(range(1000, 1064))                        # 64 tokens: 3 blocks may hit
    series = "kvloop_router_predicted_hit_tokens_total"
    with RouterThread(router_config(), fleet.specs()) as rt:
        client = sdk(rt.url)
        first = client.embeddings.create(model="sim", input=[ids], encoding_format="float")
        assert first.data[0].embedding == sim_embedding(ids)
        before = metric_value(httpx.get(rt.url + "/metrics").text, series)
        for _ in range(50):    # until the worker's KV events reach the router's index
            again = client.embeddings.create(model="sim", input=[ids], encoding_format="float")
            hit = metric_value(httpx.get(rt.url + "/metrics").text, series) - before
            if hit:
                break
        assert hit == 48                                 # (64 - 1) // 16 whole blocks
        assert again.data[0].embedding == sim_embedding(ids)
        assert sdk(rt.url).embeddings.create(model="sim", input="hi").data   # base64, text
        r = httpx.post(rt.url + "/v1/embeddings", json={"input": ""}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"
        r = httpx.post(rt.url + "/v1/embeddings", json={"input": 3.5}, timeout=30)
        assert r.status_code == 400, r.text
