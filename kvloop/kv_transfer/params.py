"""`kv_transfer_params`: what P hands on and what D requires (docs/disaggregation.md
section 2; vLLM's keys, docs/vllm-facts.md#disaggregation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvloop.core.kv_connector import KVFingerprint

# The keys D must find, besides `do_remote_prefill`, to pull (vLLM's rule).
REQUIRED_REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port",
                        "remote_block_ids")


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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_remote_prefill(params: dict[str, Any], num_prompt_tokens: int) -> RemotePrefill | str:
    """The pull a `do_remote_prefill` request asks for, or why its params are invalid."""
    missing = [k for k in REQUIRED_REMOTE_KEYS if params.get(k) in (None, "", [])]
    if missing:
        return f"missing {', '.join(missing)}"
    ids, port = params["remote_block_ids"], params["remote_port"]
    if not isinstance(ids, list) or not all(_is_int(b) and b >= 0 for b in ids):
        return "remote_block_ids must be a list of block ids"
    if not _is_int(port) or not 0 < port < 65536:
        return f"remote_port must be a port number, got {port!r}"
    for key in ("remote_engine_id", "remote_request_id", "remote_host"):
        if not isinstance(params[key], str):
            return f"{key} must be a string"
    num_tokens = params.get("remote_num_tokens")
    if num_tokens is not None and num_tokens != num_prompt_tokens:
        return (f"remote_num_tokens is {num_tokens!r} but the prompt has {num_prompt_tokens} "
                f"tokens (P and D tokenized differently)")
    block_size = params.get("block_size")
    lease = params.get("lease_expires_in_s")
    return RemotePrefill(
        engine_id=params["remote_engine_id"], request_id=params["remote_request_id"],
        host=params["remote_host"], port=port, block_ids=list(ids),
        num_tokens=num_tokens, block_size=block_size if _is_int(block_size) else None,
        lease_s=float(lease) if isinstance(lease, int | float) and lease > 0 else None)


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
