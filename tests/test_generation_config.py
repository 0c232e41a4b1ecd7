"""`--generation-config` and `--override-generation-config` (kvloop/server/generation_config.py):
where the default sampling parameters come from, what a request that leaves a field out gets
(read back from the server's own request log), and the start-up lines."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from kvloop.server.generation_config import DefaultSampling, default_sampling

from .conftest import serving


def test_auto_for_the_embedded_model_is_its_recommended_settings() -> None:
    d = default_sampling("auto", None)
    assert d.values() == {"temperature": 0.2, "top_p": 0.9}
    assert "temperature=0.2, top_p=0.9 (the embedded model's recommended settings)" \
        in d.describe()


def test_vllm_is_neutral_and_the_override_lies_over_either() -> None:
    assert default_sampling("vllm", None).values() == {}
    assert "vLLM's neutral defaults" in default_sampling("vllm", None).describe()
    over = default_sampling("vllm", None, '{"temperature": 0.5, "bos_token_id": 3}')
    assert (over.values(), over.source) == ({"temperature": 0.5}, "--override-generation-config")
    both = default_sampling("auto", None, '{"top_p": 0.5, "max_new_tokens": 16}')
    assert both.values() == {"temperature": 0.2, "top_p": 0.5, "max_tokens": 16}


def test_a_folder_and_a_gguf_file(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1,
         "eos_token_id": [1, 2]}))
    want = {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1}
    assert default_sampling("auto", str(tmp_path)).values() == want       # a model folder
    assert default_sampling(str(tmp_path), "/elsewhere/m.gguf").values() == want  # a DIR
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert default_sampling("auto", str(gguf)).values() == {}   # a bare GGUF: none, as vLLM


@pytest.mark.parametrize(("setting", "override", "match"), [
    ("/nonexistent", None, "no generation_config.json there"),
    ("vllm", "{not json", "not JSON"),
    ("vllm", "[1]", "a JSON object"),
    ("vllm", '{"temperature": 5}', "temperature must be in"),
    ("vllm", '{"top_p": 0}', "top_p must be in"),
    ("vllm", '{"temperature": "hot"}', "finite number"),
    ("vllm", '{"top_k": 1.5}', "integer"),
    ("vllm", '{"max_new_tokens": 0}', "max_new_tokens must be >= 1"),
])
def test_what_can_never_work_is_refused(setting: str, override: str | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        default_sampling(setting, None, override)


def test_the_request_wins_then_the_default_then_neutral() -> None:
    d = DefaultSampling(temperature=0.2, max_tokens=8)
    assert d.pick("temperature", 0.0, 1.0) == 0.0        # a request's 0 is a value
    assert d.pick("temperature", None, 1.0) == 0.2
    assert d.pick("top_p", None, 1.0) == 1.0
    assert (d.cap(100), d.cap(3), DefaultSampling().cap(100)) == (8, 3, 100)


def _params_of(log: str, request_id: str) -> str:
    line = next(ln for ln in log.splitlines() if f"Received request {request_id}" in ln)
    return line.split("params: ", 1)[1]


@pytest.mark.processes
def test_a_server_applies_the_defaults_and_says_so(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    args = ["--model", "sim", "--sim-speedup", "50", "--max-model-len", "512",
            "--enable-log-requests", "--override-generation-config", '{"top_k": 7}',
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    with serving(tmp_path_factory, "generation_config", args) as srv:
        bare = httpx.post(srv.url + "/v1/completions", timeout=30,
                          json={"prompt": "hello", "max_tokens": 2}).json()["id"]
        own = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                         json={"messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": 2, "temperature": 0.9, "top_k": 3}).json()["id"]
        log = srv.log()
    assert re.search(r"default sampling parameters: temperature=0\.2, top_p=0\.9, top_k=7 "
                     r"\(the embedded model's recommended settings, "
                     r"--override-generation-config\)", log)
    assert "speculative decoding on: ngram, up to 3 draft tokens per step" in log
    assert "request logging on (--enable-log-requests)" in log
    params = _params_of(log, bare)
    assert "temperature=0.2" in params and "top_p=0.9" in params and "top_k=7" in params
    params = _params_of(log, own)
    assert "temperature=0.9" in params and "top_k=3" in params and "top_p=0.9" in params
