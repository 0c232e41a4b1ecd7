"""Chained block hashes: vLLM's four algorithms byte for byte, and llm-d's keys.

vLLM (0.33): `hash_k = H((parent, tuple(tokens_k), extra_keys_k))` where `parent` is the
previous block's digest, or for block 0 `NONE_HASH = H(seed)`. The seed is PYTHONHASHSEED if
set, else "vllm-none-hash" for the sha256 family and random bytes for xxhash (so xxhash
hashes differ across processes unless a seed is given).

    sha256       SHA-256 over pickle protocol 5 (vLLM's default)
    sha256_cbor  SHA-256 over canonical CBOR
    xxhash       xxh3-128 over pickle protocol 5
    xxhash_cbor  xxh3-128 over canonical CBOR

KV events carry `kvloop.events.types.event_int(hash)`: the digest's last 8 bytes, big-endian.

llm-d (`llmd_block_keys`): FNV-1a 64 over canonical CBOR, rooted at
`FNV(CBOR([FNV(seed), None, model_name]))`, one key per full block.

Only full blocks are hashed; a partial tail gets no hash.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import cbor2

HashFn = Callable[[Any], bytes]

DEFAULT_CRYPTO_SEED = "vllm-none-hash"
_INT64_MASK = (1 << 64) - 1


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _xxhash(obj: Any) -> bytes:
    import xxhash

    return xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _xxhash_cbor(obj: Any) -> bytes:
    import xxhash

    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


HASH_FUNCTIONS: dict[str, HashFn] = {
    "sha256": _sha256,
    "sha256_cbor": _sha256_cbor,
    "xxhash": _xxhash,
    "xxhash_cbor": _xxhash_cbor,
}


def get_hash_fn(algo: str) -> HashFn:
    """The hash function named `algo` (one of vLLM's four names)."""
    try:
        return HASH_FUNCTIONS[algo]
    except KeyError:
        raise ValueError(f"unknown hash algorithm {algo!r}; "
                         f"choose one of {sorted(HASH_FUNCTIONS)}") from None


def resolve_seed(algo: str, seed: str | None = None) -> str:
    """vLLM's NONE_HASH seed rule: explicit seed, else PYTHONHASHSEED, else the default.

    The default is "vllm-none-hash" for the sha256 family and a random string for xxhash*
    (exactly as vLLM; pass a seed to make xxhash reproducible across processes).
    """
    get_hash_fn(algo)
    if seed is not None:
        return seed
    env = os.environ.get("PYTHONHASHSEED")
    if env is not None:
        return env
    if algo.startswith("sha256"):
        return DEFAULT_CRYPTO_SEED
    return os.urandom(32).hex()


def none_hash(algo: str = "sha256", seed: str | None = None) -> bytes:
    """NONE_HASH: the parent of block 0."""
    return get_hash_fn(algo)(resolve_seed(algo, seed))


def hash_block_tokens(hash_fn: HashFn, parent: bytes, token_ids: Sequence[int],
                      extra_keys: tuple[Any, ...] | None = None) -> bytes:
    """One link of the chain: `hash_fn((parent, tuple(token_ids), extra_keys))`."""
    return hash_fn((parent, tuple(token_ids), extra_keys))


def block_hashes(token_ids: Sequence[int], block_size: int, algo: str = "sha256",
                 seed: str | None = None,
                 extra_keys: Sequence[tuple[Any, ...] | None] | None = None) -> list[bytes]:
    """Hashes of every full block of `token_ids`, chained from NONE_HASH.

    `extra_keys[i]` (optional) is block i's extra-key tuple, e.g.
    `(("cache_salt", "s"),)` for block 0 (see `block_extra_keys`).
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    hasher = BlockHasher(block_size, algo, seed)
    return hasher.hash_range(token_ids, none_hash_parent=None, start_block=0,
                             extra_keys=extra_keys)


def block_extra_keys(block_index: int, lora_name: str | None = None,
                     lora_path: str | None = None,
                     cache_salt: str | None = None) -> tuple[Any, ...] | None:
    """vLLM's extra keys of one block: LoRA on every block, cache_salt on block 0 only."""
    keys: list[tuple[Any, ...]] = []
    if lora_name is not None:
        keys.append(("lora", lora_name, lora_path))
    if cache_salt is not None and block_index == 0:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def event_extra_keys(extra: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """The untagged form of extra keys that KV events carry (lora -> name, salt -> salt)."""
    if extra is None:
        return None
    out: list[Any] = []
    for key in extra:
        tag = key[0]
        if tag == "lora":
            out.append(key[1])
        elif tag == "mm":
            out.append((key[1], key[2]))
        else:
            out.append(key[1])
    return tuple(out)


class BlockHasher:
    """Incremental chained hashing for one configuration (algorithm, seed, block size).

    The NONE_HASH is resolved once at construction, as vLLM's engine core does.
    """

    def __init__(self, block_size: int, algo: str = "sha256", seed: str | None = None):
        self.block_size = block_size
        self.algo = algo
        self.hash_fn = get_hash_fn(algo)
        self.seed = resolve_seed(algo, seed)
        self.none_hash = self.hash_fn(self.seed)

    def hash_range(self, token_ids: Sequence[int], none_hash_parent: bytes | None,
                   start_block: int,
                   extra_keys: Sequence[tuple[Any, ...] | None] | None = None) -> list[bytes]:
        """Hashes of full blocks `start_block, ...` of `token_ids`.

        `none_hash_parent` is the hash of block `start_block - 1` (None for block 0).
        """
        bs = self.block_size
        parent = none_hash_parent if none_hash_parent is not None else self.none_hash
        out: list[bytes] = []
        fn = self.hash_fn
        for i in range(start_block, len(token_ids) // bs):
            extra = extra_keys[i] if extra_keys is not None and i < len(extra_keys) else None
            parent = fn((parent, tuple(token_ids[i * bs:(i + 1) * bs]), extra))
            out.append(parent)
        return out


# ---------------------------------------------------------------------------------------
# llm-d keys: FNV-1a 64 over canonical CBOR.

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3


def fnv1a_64(data: bytes) -> int:
    """FNV-1a, 64-bit."""
    h = _FNV_OFFSET
    for byte in data:
        h ^= byte
        h = (h * _FNV_PRIME) & _INT64_MASK
    return h


def llmd_root_key(seed: str = "", model_name: str = "") -> int:
    """llm-d's chain root: `FNV(CBOR([FNV(utf8(seed)), null, model_name]))`."""
    init = fnv1a_64(seed.encode("utf-8"))
    return fnv1a_64(cbor2.dumps([init, None, model_name], canonical=True))


def llmd_block_keys(token_ids: Sequence[int], block_size: int = 16, seed: str = "",
                    model_name: str = "",
                    extra: Sequence[list[dict[str, str]] | None] | None = None) -> list[int]:
    """llm-d's block keys for every full block: `H_i = FNV(CBOR([H_{i-1}, tokens_i, extra_i]))`.

    `extra[i]` (optional) is block i's list of `{"Hash": str}` maps; None when absent.
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    parent = llmd_root_key(seed, model_name)
    keys: list[int] = []
    for i in range(len(token_ids) // block_size):
        chunk = [int(t) for t in token_ids[i * block_size:(i + 1) * block_size]]
        ext = extra[i] if extra is not None and i < len(extra) else None
        parent = fnv1a_64(cbor2.dumps([parent, chunk, ext], canonical=True))
        keys.append(parent)
    return keys
