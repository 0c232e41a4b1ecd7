"""LoRA through a real `kvloop serve --enable-lora` (tiny random Llama, fp32) and the openai
SDK: `model` selects an adapter, /v1/models lists it with its parent, the admin routes load
and unload adapters at run time only from --lora-allowed-dirs, outputs equal peft's."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest

from kvloop.front.launcher import ServeProcess
from tests.test_lora_model import _peft_greedy, make_adapter
from tests.test_model_tiny import TINY_VOCAB, tiny_hf_model, write_hf_folder

from .conftest import bearer, sdk, serving

ADMIN = "lora-admin"
pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, dict]]:
    root = tmp_path_factory.mktemp("serve_lora")
    base = tiny_hf_model("llama", seed=31)
    folder = write_hf_folder(base, root / "base")
    allowed = root / "adapters"
    models = {"base": base,
              "x": make_adapter(base, allowed / "x", seed=5),
              "y": make_adapter(base, allowed / "y", seed=6, rank=2, alpha=4)}
    outside = root / "outside"
    make_adapter(base, outside, seed=7)
    with serving(tmp_path_factory, "serve_lora", [
            "--model", str(folder), "--served-model-name", "base", "--dtype", "float32",
            "--device", "cpu", "--num-threads", "1", "--low-bit-max-tokens", "0",
            "--block-size", "4", "--num-gpu-blocks-override", "64",
            "--enable-lora", "--lora-modules", f"x={allowed / 'x'}", "--max-loras", "1",
            "--max-lora-rank", "8", "--lora-allowed-dirs", str(allowed),
            "--admin-api-key", ADMIN]) as srv:
        yield srv, {"models": models, "allowed": allowed, "outside": outside}


def _greedy(srv: ServeProcess, model: str, prompt: list[int]) -> list[int]:
    r = httpx.post(srv.url + "/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}, timeout=60)
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


def test_models_lists_the_adapter_with_its_parent(fleet) -> None:
    srv, _ = fleet
    cards = {m.id: m for m in sdk(srv.url).models.list().data}
    assert set(cards) == {"base", "x"}
    assert cards["x"].parent == "base" and cards["base"].parent is None   # type: ignore
    assert sdk(srv.url).models.retrieve("x").parent == "base"   # type: ignore[attr-defined]


def test_model_selects_the_adapter_and_outputs_equal_peft(fleet) -> None:
    srv, facts = fleet
    prompt = np.random.default_rng(2).integers(3, TINY_VOCAB, 7).tolist()
    for name in ("x", "base"):
        assert _greedy(srv, name, prompt) == _peft_greedy(facts["models"][name], prompt, 4)
    out = sdk(srv.url).completions.create(model="x", prompt=prompt, max_tokens=2)
    assert out.model == "x"
    with pytest.raises(openai.NotFoundError):
        sdk(srv.url).completions.create(model="y", prompt=prompt, max_tokens=2)


def test_runtime_load_and_unload_are_admin_only_and_confined(fleet) -> None:
    srv, facts = fleet
    load, unload = srv.url + "/v1/load_lora_adapter", srv.url + "/v1/unload_lora_adapter"
    y = {"lora_name": "y", "lora_path": str(facts["allowed"] / "y")}
    assert httpx.post(load, json=y).status_code == 401          # no admin key
    admin = bearer(ADMIN)
    for path in (str(facts["outside"]), "/etc", str(facts["allowed"] / ".." / "outside"),
                 str(facts["allowed"] / "x" / "adapter_config.json")):
        r = httpx.post(load, json={"lora_name": "z", "lora_path": path}, headers=admin)
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
    r = httpx.post(load, json={"lora_name": "bad name", "lora_path": y["lora_path"]},
                   headers=admin)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    r = httpx.post(load, json={"lora_name": "x", "lora_path": y["lora_path"]}, headers=admin)
    assert r.status_code == 400 and "already been loaded" in r.text
    r = httpx.post(load, json=y, headers=admin, timeout=60)
    assert r.status_code == 200 and r.text.startswith("Success"), r.text
    prompt = np.random.default_rng(3).integers(3, TINY_VOCAB, 6).tolist()
    assert _greedy(srv, "y", prompt) == _peft_greedy(facts["models"]["y"], prompt, 4)
    assert _greedy(srv, "x", prompt) == _peft_greedy(facts["models"]["x"], prompt, 4)
    assert {m.id for m in sdk(srv.url).models.list().data} == {"base", "x", "y"}
    assert httpx.post(unload, json={"lora_name": "y"}).status_code == 401
    r = httpx.post(unload, json={"lora_name": "y"}, headers=admin, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.post(unload, json={"lora_name": "y"}, headers=admin).status_code == 404
    with pytest.raises(openai.NotFoundError):
        sdk(srv.url).completions.create(model="y", prompt=prompt, max_tokens=2)


def test_metrics_have_vllms_lora_info_gauge(fleet) -> None:
    srv, _ = fleet
    sdk(srv.url).completions.create(model="x", prompt=[5, 6, 7], max_tokens=2)
    lines = [ln for ln in httpx.get(srv.url + "/metrics").text.splitlines()
             if ln.startswith("vllm:lora_requests_info{")]
    assert len(lines) == 1, lines
    assert 'max_lora="1"' in lines[0] and "running_lora_adapters=" in lines[0]
    assert "waiting_lora_adapters=" in lines[0]


def test_embeddings_run_with_the_adapter(fleet) -> None:
    srv, _ = fleet
    vectors = {}
    for model in ("base", "x"):
        r = httpx.post(srv.url + "/v1/embeddings", json={"model": model, "input": [5, 6, 7]},
                       timeout=60)
        assert r.status_code == 200, r.text
        vectors[model] = r.json()["data"][0]["embedding"]
    assert len(vectors["x"]) == len(vectors["base"]) == 64
    assert vectors["x"] != vectors["base"]


def test_a_removed_adapter_folder_costs_one_request_not_the_worker(fleet) -> None:
    """issue 37 (3): with --max-loras 1 (and host memory for one adapter), "gone" leaves
    host memory when "evictor" is loaded, then its folder is removed: one request for it
    gets a 404 in OpenAI's shape, the worker lives, /v1/models and the worker facts stop
    naming it (routers stop sending it here). Old code: the engine step raised, the worker
    exited."""
    import shutil

    srv, facts = fleet
    admin = bearer(ADMIN)
    load = srv.url + "/v1/load_lora_adapter"
    gone = facts["allowed"] / "gone"
    shutil.copytree(facts["allowed"] / "x", gone)
    for name, path in (("gone", gone), ("evictor", facts["allowed"] / "y")):
        r = httpx.post(load, json={"lora_name": name, "lora_path": str(path)}, headers=admin,
                       timeout=60)
        assert r.status_code == 200, r.text
    shutil.rmtree(gone)
    r = httpx.post(srv.url + "/v1/completions", json={
        "model": "gone", "prompt": [5, 6, 7], "max_tokens": 2}, timeout=60)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["param"] == "model" and "unavailable" in err["message"], err
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    assert "gone" not in {m.id for m in sdk(srv.url).models.list().data}
    assert "gone" not in httpx.get(srv.url + "/kvloop/worker").json()["lora_adapters"]
    with pytest.raises(openai.NotFoundError):
        sdk(srv.url).completions.create(model="gone", prompt=[5, 6, 7], max_tokens=2)
    assert _greedy(srv, "x", [5, 6, 7])            # the worker still serves its adapters
    r = httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "evictor"},
                   headers=admin, timeout=60)
    assert r.status_code == 200, r.text
