"""`kv_transfer_params`: what P hands on and what D requires (docs/disaggregation.md
section 2; vLLM's keys, docs/vllm-facts.md#disaggregation; the required keys and the rule for
a missing one are `kvloop.wire`'s, which the router shares), and the bounds every field must
keep before any work is done for it (`bounds_refusal`: the API server answers 400 with it,
the connector refuses with it)."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

from kvloop.core.kv_connector import KVFingerprint
from kvloop.wire import malformed_remote_field, missing_remote_keys

MAX_REMOTE_BLOCK_IDS = 1 << 16     # hard cap on remote_block_ids, whatever the prompt
MAX_BLOCK_ID = (1 << 31) - 1
MAX_PARAM_STR_CHARS = 256          # remote_engine_id, remote_request_id, remote_host
MIN_LEASE_S = 1.0                  # a shorter lease_expires_in_s counts as this (no spinning)
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$")


@dataclass(frozen=True)
class RemotePrefill:
    """A valid `do_remote_prefill` request: where D pulls from."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: list[int]
    num_tokens: int | None
    block_size: int | None
    lease_s: float | None

    @property
    def peer(self) -> tuple[str, str, int]:
        return (self.engine_id, self.host, self.port)


def wants_remote_prefill(params: dict[str, Any] | None) -> bool:
    return bool(params) and bool(params.get("do_remote_prefill"))   # type: ignore[union-attr]


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    return bool(params) and bool(params.get("do_remote_decode"))    # type: ignore[union-attr]


def asks_for_kv(params: dict[str, Any] | None) -> bool:
    """Do these params ask a worker to hold (`do_remote_decode`) or load
    (`do_remote_prefill`) KV blocks? Only an authorized caller may (docs/security.md)."""
    return wants_remote_prefill(params) or wants_remote_decode(params)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_host(text: str) -> bool:
    """An IP address or a DNS hostname (no scheme, port, path or blanks)."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return _HOSTNAME.match(text) is not None


def max_prompt_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """The most blocks a prompt of this length can name (its blocks, at most the hard cap)."""
    return min(MAX_REMOTE_BLOCK_IDS, -(-max(num_prompt_tokens, 1) // max(block_size, 1)))


def bounds_refusal(params: dict[str, Any], num_prompt_tokens: int,
                   block_size: int) -> str | None:
    """Why `params` break a bound (sizes first: cheap, before any element is looked at),
    else None. Only fields present are checked; a missing one is `parse_remote_prefill`'s."""
    ids = params.get("remote_block_ids")
    theirs = params.get("block_size")       # P's blocks may be smaller (a mismatch, later)
    if isinstance(theirs, int) and not isinstance(theirs, bool) and 0 < theirs < block_size:
        block_size = theirs
    if isinstance(ids, list):
        cap = max_prompt_blocks(num_prompt_tokens, block_size)
        if len(ids) > cap:
            return (f"remote_block_ids names {len(ids)} blocks; a prompt of "
                    f"{num_prompt_tokens} tokens has at most {cap} of {block_size} tokens")
        if not all(_is_int(b) and 0 <= b <= MAX_BLOCK_ID for b in ids):
            return "remote_block_ids must be a list of block ids"
    for key in ("remote_engine_id", "remote_request_id", "remote_host"):
        value = params.get(key)
        if isinstance(value, str) and len(value) > MAX_PARAM_STR_CHARS:
            return f"{key} is longer than {MAX_PARAM_STR_CHARS} characters"
    host = params.get("remote_host")
    if isinstance(host, str) and host and not is_host(host):
        return f"remote_host must be a hostname or an IP address, got {host[:64]!r}"
    return None


def parse_remote_prefill(params: dict[str, Any], num_prompt_tokens: int,
                         block_size: int) -> RemotePrefill | str:
    """The pull a `do_remote_prefill` request asks for, or why its params are invalid."""
    missing = missing_remote_keys(params)
    if missing:
        return f"missing {', '.join(missing)}"
    malformed = malformed_remote_field(params)
    if malformed is not None:
        return malformed
    ids, port = params["remote_block_ids"], params["remote_port"]
    refusal = bounds_refusal(params, num_prompt_tokens, block_size)
    if refusal is not None:
        return refusal
    num_tokens = params.get("remote_num_tokens")
    if num_tokens is not None and num_tokens != num_prompt_tokens:
        return (f"remote_num_tokens is {num_tokens!r} but the prompt has {num_prompt_tokens} "
                f"tokens (P and D tokenized differently)")
    remote_block_size = params.get("block_size")
    return RemotePrefill(
        engine_id=params["remote_engine_id"], request_id=params["remote_request_id"],
        host=params["remote_host"], port=port, block_ids=list(ids),
        num_tokens=num_tokens,
        block_size=remote_block_size if _is_int(remote_block_size) else None,
        lease_s=_lease(params.get("lease_expires_in_s")))


def _lease(value: Any) -> float | None:
    """P's lease as D heeds it: at least `MIN_LEASE_S` (heartbeats come every sixth of it)."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        return None
    return max(float(value), MIN_LEASE_S)


def producer_params(*, engine_id: str, request_id: str, block_ids: list[int], host: str,
                    port: int, num_tokens: int, block_size: int,
                    fingerprint: KVFingerprint, lease_s: float,
                    cached_tokens: int) -> dict[str, Any]:
    """What P returns for D (vLLM's keys, then kvloop's extras, which vLLM ignores)."""
    return {
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_engine_id": engine_id, "remote_request_id": request_id,
        "remote_block_ids": list(block_ids), "remote_host": host, "remote_port": port,
        "tp_size": 1,
        "remote_num_tokens": num_tokens, "block_size": block_size,
        "kv_fingerprint": fingerprint.to_dict(), "lease_expires_in_s": lease_s,
        "remote_prefill_cached_tokens": cached_tokens,
    }
