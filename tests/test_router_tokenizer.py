"""A router that cannot tokenize says so (`degraded`, the cause and the fix, a metric), and
the two fixes work: `--tokenizer PATH`, and the worker's `GET /kvloop/tokenizer` fetched
with the router's worker key. One real simulated worker whose model file the router cannot
read (it was moved after the worker loaded it, as on another host)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import msgspec
import pytest

from kvloop.front.byte_tokenizer import ByteTokenizer
from kvloop.front.prometheus_text import metric_value
from kvloop.front.tokenizer import Tokenizer, find_model_path
from kvloop.front.tokenizer_files import tokenizer_files, tokenizer_from_files
from kvloop.router.config import RouterConfig
from kvloop.router.registry import WorkerSpec
from kvloop.wire import TOKENIZER_FILES_PATH, TokenizerFiles

from .conftest import RouterThread, bearer, sdk, serving, wait_until
from .test_router_fleet import router_config

KEY = "worker-key"
MODEL = "moved"   # a served name that is no file the router can open


def prompts(tag: str) -> tuple[str, list[dict[str, str]]]:
    """A text prompt and chat messages that no other test sends (the worker is shared)."""
    text = f"{tag}: the history of the printing press begins in the fifteenth century. " * 6
    return text, [{"role": "system", "content": f"{tag}: you answer in one word. " * 20},
                  {"role": "user", "content": "What colour is the sky on a clear day?"}]


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(URL, the model's real path): a keyed sim worker whose reported model path is gone."""
    real = find_model_path(None)
    link = tmp_path_factory.mktemp("model") / "Moved.gguf"
    os.symlink(real, link)
    args = ["--model", "sim", "--sim-model", str(link), "--sim-speedup", "40",
            "--api-key", KEY, "--enable-kv-cache-events", "--served-model-name", MODEL]
    with serving(tmp_path_factory, "tokenizer-worker", args) as srv:
        link.unlink()   # the router reads this path from the worker and finds nothing
        yield srv.url, real


def _router(url: str, **kw: object) -> RouterThread:
    base = router_config()
    cfg = RouterConfig(policy=base.policy, liveness=base.liveness, index=base.index,
                       auth=base.auth, **kw)  # type: ignore[arg-type]
    return RouterThread(cfg, [WorkerSpec(url)])


def _health(rt: RouterThread) -> dict:
    return httpx.get(rt.url + "/health", timeout=10).json()


def _ask(rt: RouterThread, tag: str) -> None:
    text, messages = prompts(tag)
    client = sdk(rt.url, KEY)
    client.completions.create(model=MODEL, prompt=text, max_tokens=2)
    client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                   max_tokens=2)


def _index_blocks(rt: RouterThread) -> int:
    w = next(iter(httpx.get(rt.url + "/workers", timeout=10).json().values()))
    return int(w["index_blocks"])


def _verified(rt: RouterThread) -> tuple[int, int]:
    w = next(iter(httpx.get(rt.url + "/workers", timeout=10).json().values()))
    return w["verification"]["predicted_tokens"], w["verification"]["actual_tokens"]


@pytest.mark.processes
def test_no_tokenizer_is_degraded_with_cause_fix_and_metric(worker):
    url, _ = worker
    with _router(url) as rt:   # no worker key: the worker refuses the fetch (401)
        _ask(rt, "degraded")
        body = _health(rt)
        assert body["status"] == "degraded", body
        reason = next(r for r in body["reasons"] if "no tokenizer for model" in r)
        assert f"model {MODEL!r}" in reason and "401" in reason, reason
        assert "--tokenizer PATH" in reason and "--worker-api-key" in reason, reason
        metrics = httpx.get(rt.url + "/metrics", timeout=10).text
        assert metric_value(metrics, "kvloop_router_tokenizer_missing") == 1
        assert metric_value(metrics, "kvloop_router_untokenized_requests_total") == 2
        # the worker hides its events from a router it does not admit: that is said too
        assert any("hides its KV-event endpoint" in r for r in body["reasons"]), body


@pytest.mark.processes
@pytest.mark.parametrize("fix", ["--tokenizer", "fetch"])
def test_either_fix_routes_text_and_chat_by_prefix(worker, fix):
    url, real = worker
    kw = {"tokenizer": real} if fix == "--tokenizer" else {}
    with _router(url, worker_api_key=KEY, **kw) as rt:
        _ask(rt, fix)
        wait_until(lambda: _index_blocks(rt) >= 8, 10, "both prompts' blocks indexed")
        _ask(rt, fix)   # the same prompts again: cached, and the router knew it
        body = _health(rt)
        assert not any("tokenizer" in r for r in body["reasons"]), body
        predicted, actual = _verified(rt)
        assert actual > 0 and predicted == actual, (predicted, actual)
        metrics = httpx.get(rt.url + "/metrics", timeout=10).text
        assert metric_value(metrics, "kvloop_router_untokenized_requests_total") == 0


@pytest.mark.processes
def test_the_tokenizer_route_needs_the_key_and_round_trips(worker):
    url, real = worker
    assert httpx.get(url + TOKENIZER_FILES_PATH, timeout=10).status_code == 401
    r = httpx.get(url + TOKENIZER_FILES_PATH, headers=bearer(KEY), timeout=30)
    assert r.status_code == 200
    tok = tokenizer_from_files(tokenizer_files(Tokenizer.from_model(real)))
    fetched = tokenizer_from_files(msgspec.json.decode(r.content, type=TokenizerFiles))
    messages = prompts("route")[1]
    text = tok.apply_chat_template(messages)
    assert fetched.apply_chat_template(messages) == text
    assert fetched.encode(text) == Tokenizer.from_model(real).encode(text)


def test_tokenizer_files_of_the_byte_vocabulary_round_trip():
    tok = tokenizer_from_files(tokenizer_files(ByteTokenizer("sim")))
    assert isinstance(tok, ByteTokenizer)


def test_broken_tokenizer_json_is_refused():
    with pytest.raises(ValueError):
        tokenizer_from_files(TokenizerFiles(model="x", kind="bpe", tokenizer_json="{not json"))
