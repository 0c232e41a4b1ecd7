"""Prefill/decode disaggregation decisions: pure functions of worker snapshots, no I/O.

For each request, in this order (docs/disaggregation.md section 6):

    1. the decode worker D, load first: fewest requests active there, then the lower KV usage,
       then the longer cached prefix (a decode worker caches only with prefix caching on),
       then the prompt's rendezvous order;
    2. the prefill worker P, by prefix match on the prefill role's index plus load (the
       router's routing policy over the prefill workers, `scorer.py`);
    3. remote or local, from the estimated time to the first token (seconds) both ways:

    local  = prefill(D's queued prefill tokens + the prompt tokens D lacks; on D, every step
                     shared with D's running decodes)
    remote = max(prefill(P's queued prefill tokens + the prompt tokens P lacks; on P)
                 + bytes of the blocks D reads / transfer bandwidth,
                 prefill(D's queued prefill tokens; on D))
             + one step on D (its last prompt token, recomputed, with D's running decodes)

`prefill(n)` walks the steps a chunked prefill of n tokens takes (at most the worker's
`max_num_batched_tokens` per step, less one token per running decode) through the
simulator's step-time model (`kvloop.sim.latency.LatencyModel`: base + per token + per
sequence + per context token): the same model a simulated worker runs, with the coefficients
fitted on the real embedded model (`kvloop/sim/latency_smollm2_cpu.json`). A running decode
adds its token, its sequence and its context (its prompt, as the router knows it) to every
step. So a short uncached prompt stays local (the transfer and D's extra step cost more than
the prefill saved), a long one goes remote once D is busy decoding (every chunk of a local
prefill would carry D's whole decode batch), and a prompt P already caches goes remote
cheaply. The time of an HTTP round trip is not modelled.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvloop.config import QUANTIZED_KV_CACHE_DTYPES, quantized_kv_row_bytes
from kvloop.sim.latency import LatencyModel

# Decision reasons (the `reason` label of kvloop_router_pd_decisions_total).
REMOTE_CHEAPER = "remote_cheaper"        # cost: the remote estimate is lower
LOCAL_CHEAPER = "local_cheaper"          # cost: the local estimate is lower (or equal)
ALWAYS = "always"                        # --pd-policy always
NEVER = "never"                          # --pd-policy never
NO_PREFILL_WORKER = "no_prefill_worker"  # no usable prefill worker
MULTIPLE_PROMPTS = "multiple_prompts"    # n > 1, best_of or a batch: one leg cannot hand on
CLIENT_PARAMS = "client_params"          # the client sent its own kv_transfer_params
DECODE_CANNOT_LOAD = "decode_cannot_load"  # the decode worker has no connector that loads
PD_REASONS = (REMOTE_CHEAPER, LOCAL_CHEAPER, ALWAYS, NEVER, NO_PREFILL_WORKER,
              MULTIPLE_PROMPTS, CLIENT_PARAMS, DECODE_CANNOT_LOAD)

# Why a remote prefill fell back to decode-only (kvloop_router_pd_fallbacks_total).
PREFILL_HTTP_ERROR = "prefill_http_error"        # P answered 5xx
PREFILL_CONNECTION = "prefill_connection"        # P could not be reached or failed mid-answer
NO_KV_TRANSFER_PARAMS = "no_kv_transfer_params"  # P answered 200 without usable params
PREFILL_TIMEOUT = "prefill_timeout"              # P did not answer within --prefill-timeout
FALLBACK_REASONS = (PREFILL_HTTP_ERROR, PREFILL_CONNECTION, NO_KV_TRANSFER_PARAMS,
                    PREFILL_TIMEOUT)


@dataclass(frozen=True)
class PDWorker:
    """One worker as the P/D decision sees it.

    `budget`: its max_num_batched_tokens; `queued_prefill_tokens`: prompt tokens of
    requests sent there that have not started producing; `decoding_contexts`: one context
    length per request decoding there; `cached_tokens`: the credited cached prefix of this
    prompt there (0 when its cache signal is distrusted); `active`: requests it runs or
    queues (the router's plus those the worker reports beyond them).
    """

    name: str
    budget: int
    queued_prefill_tokens: int = 0
    decoding_contexts: tuple[int, ...] = ()
    cached_tokens: int = 0
    active: int = 0
    kv_usage: float = 0.0


@dataclass(frozen=True)
class TransferModel:
    """What moving KV blocks costs: `bandwidth` bytes/s, `bytes_per_token` of K and V."""

    bandwidth: float
    bytes_per_token: float

    def seconds(self, blocks: int, block_size: int) -> float:
        return blocks * block_size * self.bytes_per_token / self.bandwidth


@dataclass(frozen=True)
class Estimate:
    """Estimated seconds to the first token, prefilled on D (`local_s`) or on P (`remote_s`)."""

    local_s: float
    remote_s: float
    transfer_s: float


@dataclass(frozen=True)
class PDDecision:
    """Remote prefill or not, why, and the estimate behind it (None: not estimated)."""

    remote: bool
    reason: str
    estimate: Estimate | None = None


def prefill_seconds(model: LatencyModel, new_tokens: int, cached_tokens: int, budget: int,
                    decoding_contexts: tuple[int, ...]) -> float:
    """Seconds of the steps a chunked prefill of `new_tokens` after `cached_tokens` takes,
    every step shared with the running decodes (each adds a token, a sequence and its
    context). The step model is linear, so the steps add up in closed form:

        steps s = ceil(new / chunk), chunk = budget - decodes (at least 1)
        s * base + per_token * (new + s * decodes) + per_seq * s * (1 + decodes)
                 + per_ctx * sum over steps of (cached + prefilled so far + decode context)
    """
    if new_tokens <= 0:
        return 0.0
    decodes = len(decoding_contexts)
    chunk = max(1, budget - decodes)
    steps = -(-new_tokens // chunk)
    prefilled = chunk * steps * (steps - 1) // 2 + new_tokens   # sum of min(k*chunk, new)
    context = steps * (cached_tokens + sum(decoding_contexts) + decodes) + prefilled
    m = model
    return (steps * m.base_s + m.per_token_s * (new_tokens + steps * decodes)
            + m.per_seq_s * steps * (1 + decodes) + m.per_ctx_token_s * context) / m.speedup


def last_token_step_seconds(model: LatencyModel, prompt_tokens: int,
                            decoding_contexts: tuple[int, ...]) -> float:
    """D's step that recomputes a pulled prompt's last token (with its running decodes)."""
    return prefill_seconds(model, 1, max(0, prompt_tokens - 1), 2 + len(decoding_contexts),
                           decoding_contexts)


def estimate(model: LatencyModel, transfer: TransferModel, d: PDWorker, p: PDWorker,
             prompt_tokens: int, block_size: int) -> Estimate:
    """Seconds to the first token both ways (the module docstring's formulas)."""
    d_lacks = prompt_tokens - d.cached_tokens
    local = prefill_seconds(model, d.queued_prefill_tokens + d_lacks, d.cached_tokens,
                            d.budget, d.decoding_contexts)
    p_lacks = prompt_tokens - p.cached_tokens
    on_p = prefill_seconds(model, p.queued_prefill_tokens + p_lacks, p.cached_tokens,
                           p.budget, p.decoding_contexts)
    # D reads the blocks holding prompt tokens past its own hit, but not a last block that
    # holds only the last prompt token (it recomputes that one)
    blocks = math.ceil(max(0, prompt_tokens - 1) / block_size) - d.cached_tokens // block_size
    moved = transfer.seconds(max(0, blocks), block_size)
    d_queue = prefill_seconds(model, d.queued_prefill_tokens, 0, d.budget,
                              d.decoding_contexts)
    remote = max(on_p + moved, d_queue) + last_token_step_seconds(
        model, prompt_tokens, d.decoding_contexts)
    return Estimate(local, remote, moved)


def decide(policy: str, est: Estimate | None) -> PDDecision:
    """Apply --pd-policy to an estimate (None: no prefill worker could take the request)."""
    if policy == "never":
        return PDDecision(False, NEVER, est)
    if est is None:
        return PDDecision(False, NO_PREFILL_WORKER)
    if policy == "always":
        return PDDecision(True, ALWAYS, est)
    if est.remote_s < est.local_s:
        return PDDecision(True, REMOTE_CHEAPER, est)
    return PDDecision(False, LOCAL_CHEAPER, est)


def decode_order(d: PDWorker, session_tokens: int = 0) -> tuple[int, float, int]:
    """Sort key of decode candidates (lower first): load, KV usage, then the larger of its
    cache and its session credit (`session_tokens`, prompt tokens)."""
    return d.active, round(d.kv_usage, 2), -max(d.cached_tokens, session_tokens)


_ELEMENT_BYTES = {"float32": 4, "fp32": 4, "float": 4, "float16": 2, "fp16": 2, "half": 2,
                  "bfloat16": 2, "bf16": 2, "float64": 8, "int8": 1, "uint8": 1,
                  "float8_e4m3fn": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


def fingerprint_bytes_per_token(fingerprint: object) -> float | None:
    """K and V bytes per token from a prefill answer's `kv_fingerprint` ({num_layers,
    num_kv_heads, head_dim, dtype}); None when it does not say."""
    if not isinstance(fingerprint, dict):
        return None
    dims = [fingerprint.get(k) for k in ("num_layers", "num_kv_heads", "head_dim")]
    dtype = str(fingerprint.get("dtype", "")).removeprefix("torch.")
    size = _ELEMENT_BYTES.get(dtype)
    if size is None or not all(isinstance(x, int) and x > 0 for x in dims):
        return None
    layers, heads, head_dim = (int(x) for x in dims)   # type: ignore[arg-type]
    if dtype in QUANTIZED_KV_CACHE_DTYPES:     # --kv-cache-dtype fp8 / int8: codes and scale
        return float(2 * layers * heads * quantized_kv_row_bytes(head_dim))
    return float(2 * layers * heads * head_dim * size)


def local_reason(body: Mapping[str, Any]) -> str | None:
    """Why this request cannot take a remote prefill (None: it can). One prefill leg hands
    on one prompt's blocks: several choices or prompts stay local, and a client's own
    `kv_transfer_params` are its business (passed to D as they are)."""
    if body.get("kv_transfer_params") is not None:
        return CLIENT_PARAMS
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], str | list)
    if batch or (body.get("n") or 1) > 1 or (body.get("best_of") or 1) > 1:
        return MULTIPLE_PROMPTS
    return None
