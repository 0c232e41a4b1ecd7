"""Block hashes: vLLM's vectors byte for byte, NONE_HASH seed rules, extra keys, llm-d keys."""

from __future__ import annotations

import json

import cbor2
import pytest

from kvloop.core import hashing
from kvloop.core.hashing import (
    block_extra_keys,
    block_hashes,
    fnv1a_64,
    llmd_block_keys,
    llmd_root_key,
    none_hash,
    resolve_seed,
)
from kvloop.events.types import event_int

from .conftest import CONFORMANCE

VECTORS = json.loads((CONFORMANCE / "hash_vectors.json").read_text())


def _cases():
    for run in VECTORS["runs"]:
        for algo in run["algos"]:
            if algo["deterministic"]:
                yield run["PYTHONHASHSEED"], algo


@pytest.mark.parametrize("env_seed,algo", list(_cases()),
                         ids=lambda x: x["algo"] if isinstance(x, dict) else str(x))
def test_vllm_vectors(env_seed, algo, monkeypatch):
    if env_seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", env_seed)
    # explicit seed and the environment rule give the same vectors
    assert resolve_seed(algo["algo"]) == algo["none_hash_seed"]
    assert none_hash(algo["algo"]).hex() == algo["none_hash_hex"]
    for name, vec in algo["vectors"].items():
        tokens = VECTORS["inputs"][name]["token_ids"]
        for seed in (None, algo["none_hash_seed"]):
            hs = block_hashes(tokens, 16, algo["algo"], seed)
            assert [h.hex() for h in hs] == vec["hashes_hex"]
            assert [event_int(h) for h in hs] == vec["event_ints"]
            assert len(hs) == vec["num_full_blocks"]


def test_default_seed_is_vllm_none_hash(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert none_hash("sha256_cbor").hex() == (
        "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0")
    hs = block_hashes(list(range(48)), 16, "sha256_cbor")
    assert [event_int(h) for h in hs] == [2233398808101521225, 17911472383915781900,
                                          554445467503876716]


def test_xxhash_default_seed_is_random(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    seeds = {resolve_seed("xxhash") for _ in range(5)}
    assert len(seeds) == 5
    assert resolve_seed("xxhash_cbor", "0") == "0"


def test_cache_salt_on_block_zero_only(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    extra = [block_extra_keys(i, cache_salt="salt1") for i in range(3)]
    assert extra == [(("cache_salt", "salt1"),), None, None]
    hs = block_hashes(list(range(48)), 16, "sha256_cbor", extra_keys=extra)
    assert [h.hex() for h in hs] == [
        "d5d12f19983da5bf554a6edbb10aa6ffac8228cc94da98f6e9466f9e69c97af0",
        "65d57687a106a6eddc80b3cbb12fcd31a7f613d92e332ce760577ae8388f0983",
        "bcc905c0dc0d3f7edc77aab4041a1b16f293f48d78394717ef08bd7bd214a7de",
    ]


def test_lora_extra_key_every_block():
    assert block_extra_keys(3, lora_name="a", lora_path="/p") == (("lora", "a", "/p"),)
    assert hashing.event_extra_keys((("lora", "a", "/p"), ("cache_salt", "s"))) == ("a", "s")


def test_partial_tail_not_hashed():
    assert len(block_hashes([1] * 40, 16)) == 2
    assert block_hashes([1] * 15, 16) == []


def test_unknown_algo_rejected():
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        block_hashes([1] * 16, 16, "md5")


def test_fnv1a_64_reference_values():
    assert fnv1a_64(b"") == 0xCBF29CE484222325
    assert fnv1a_64(b"a") == 0xAF63DC4C8601EC8C
    assert fnv1a_64(b"foobar") == 0x85944171F73967E8


def test_llmd_cbor_encodings_match_spec():
    assert cbor2.dumps([0xCBF29CE484222325, None, "test-model"], canonical=True).hex() == (
        "831bcbf29ce484222325f66a746573742d6d6f64656c")
    assert cbor2.dumps([1, list(range(1, 17)), None], canonical=True).hex() == (
        "8301900102030405060708090a0b0c0d0e0f10f6")


def test_llmd_keys_chain():
    tokens = list(range(40))
    keys = llmd_block_keys(tokens, 16, seed="", model_name="m")
    assert len(keys) == 2
    root = llmd_root_key("", "m")
    assert root == fnv1a_64(cbor2.dumps([0xCBF29CE484222325, None, "m"], canonical=True))
    k0 = fnv1a_64(cbor2.dumps([root, list(range(16)), None], canonical=True))
    assert keys[0] == k0
    assert keys[1] == fnv1a_64(cbor2.dumps([k0, list(range(16, 32)), None], canonical=True))
    # seed and model name change every key; the chain is deterministic
    assert llmd_block_keys(tokens, 16, seed="x", model_name="m")[0] != keys[0]
    assert llmd_block_keys(tokens, 16, model_name="other")[0] != keys[0]
    assert llmd_block_keys(tokens, 16, model_name="m") == keys
