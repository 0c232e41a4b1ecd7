"""Prefill/decode disaggregation with the embedded SmolLM2-135M: through vLLM's toy proxy
flow (tests/test_pd_serve.py), a decode worker's greedy output equals an aggregated
worker's, token for token, for prompts of 1, 15, 16, 17, 48 and 624 tokens, with the
prefill worker computing the prompt in chunks and in one pass.

Three real workers for the module: A (chunked prefill, 128-token steps: the long prompt takes
5, four whole and a partial last, over 39 full blocks; `--role prefill`), B (no chunked
prefill: the long prompt in one step; `--role decode`), both `kv_both`, and the aggregated
reference C, which answers each prompt once. Flow 1 prefills on A and decodes on B, flow 2
the other way round, on the same prompts, both prefix caches reset in between; a third run
sends the prompts through kvloop's router (P/D policy `always`) in front of A and B: the
same tokens again.

D recomputes only the last prompt token on top of P's KV; the aggregated worker computes it
in the same pass as the rest (docs/vllm-facts.md#openai-server, P/D numerics). The equality
asked for is of the token ids; the logprobs of the chosen tokens agree to LOGPROB_TOL: the
recomputed token's attention is the decode kernel's, the reference's the prefill's, fp32 sums
in other orders (seen: 1.2e-5 absolute on a logprob of -2.7 with the scalar decode kernel,
1.4e-5 on one of -1.2 with the vectorised one, ~1e-6 of logits of ~10-20)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvloop.front.launcher import ServeProcess

from .conftest import RouterThread, needs_embedded_model, serving, wait_until
from .test_pd_serve import BS, FLEET_ENV, SECRET, idle, kv_config, pd, tokens

pytestmark = [pytest.mark.processes, needs_embedded_model]

ADMIN = "pd-model-admin"
# --low-bit-max-tokens 0: the equality below is exact, so every step runs dense (D's
# one-token recompute would otherwise take the 4-bit path; docs/cpu-performance.md).
# --dtype float32: the equality below is exact (logprobs within 4e-5), and under `auto` on a
# CPU with bf16 dot products the dense layer matmuls return bf16 (oneDNN's kernel; torch has
# no fp32-output bf16 matmul on CPU), so where a chunked prefill's and an aggregated step's
# sums run in another order the rounded outputs differ by a bf16 step: measured 0.016 in a
# token's logprob (docs/cpu-performance.md, "Precision"). A test of the KV bytes needs the
# path whose only differences are summation order.
MODEL = ["--dtype", "float32", "--low-bit-max-tokens", "0", "--max-model-len", "2048",
         "--block-size", str(BS),
         "--max-num-seqs", "8",
         "--kv-cache-memory", "256MiB", "--admin-api-key", ADMIN]
# The long prompt: several chunks on A (a first, middle ones reading the KV of earlier
# chunks, a partial last one), whole blocks only (as the 2,000 tokens it replaces had);
# each chunk beyond a few adds cost, not a path.
LONG = 624
CHUNK = 128
LENGTHS = (1, 15, 16, 17, 48, LONG)
# D waits this long for P: the real model's P may be mid-way through the long prompt's chunked
# prefill when D asks (the sim tests' 2 s ran out beside a CPU burner: "no answer from
# prefill engine ... within 2 s")
KV = kv_config(transfer_timeout=60.0)
LOGPROB_TOL = {"rel": 1e-5, "abs": 4e-5}
MAX_TOKENS = 6


def _worker(tmp_path_factory: pytest.TempPathFactory, name: str,
            *args: str) -> Iterator[ServeProcess]:
    with serving(tmp_path_factory, name, [*MODEL, *args], timeout_s=300, env=FLEET_ENV) as srv:
        yield srv


@pytest.fixture(scope="module")
def chunked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    yield from _worker(tmp_path_factory, "pd_model_a", "--max-num-batched-tokens", str(CHUNK),
                       "--role", "prefill", "--kv-transfer-config", KV)


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    yield from _worker(tmp_path_factory, "pd_model_b", "--no-enable-chunked-prefill",
                       "--role", "decode", "--kv-transfer-config", KV)


def body(n: int) -> dict[str, Any]:
    """The request of the `n`-token prompt (each length its own tokens: no prompt is a
    prefix of another, so the reference computes each whole)."""
    return {"prompt": tokens(n, n), "max_tokens": MAX_TOKENS, "temperature": 0,
            "logprobs": 1, "ignore_eos": True, "return_token_ids": True}


def ids_and_logprobs(r: httpx.Response) -> tuple[list[int], list[float]]:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory
              ) -> dict[int, tuple[list[int], list[float]]]:
    """The aggregated worker's greedy tokens and logprobs for each prompt length (the worker
    stops once it has answered them)."""
    with serving(tmp_path_factory, "pd_model_c", MODEL, timeout_s=300) as srv:
        return {n: ids_and_logprobs(httpx.post(srv.url + "/v1/completions", json=body(n),
                                               timeout=300)) for n in LENGTHS}


def reset_prefix_cache(w: ServeProcess) -> None:
    r = httpx.post(w.url + "/reset_prefix_cache", headers={"Authorization": f"Bearer {ADMIN}"},
                   timeout=30)
    assert r.json() == {"success": True}, r.text


@pytest.mark.parametrize("flow", ["prefill-chunked", "prefill-whole"])
def test_decode_output_equals_aggregated(
        flow: str, reference: dict[int, tuple[list[int], list[float]]],
        chunked: ServeProcess, whole: ServeProcess) -> None:
    p, d = (chunked, whole) if flow == "prefill-chunked" else (whole, chunked)
    for w in (p, d):   # P computes each prompt itself, D has nothing of it: all is transferred
        idle(w)
        reset_prefix_cache(w)
    for n in LENGTHS:
        p_answer, r = pd(p, d, body(n))
        assert p_answer["kv_transfer_params"]["remote_num_tokens"] == n
        assert p_answer["kv_transfer_params"]["remote_prefill_cached_tokens"] == 0
        ids, lps = ids_and_logprobs(r)
        ref_ids, ref_lps = reference[n]
        assert ids == ref_ids, (n, ids, ref_ids)
        assert lps == pytest.approx(ref_lps, **LOGPROB_TOL), n
        # P's one (discarded) token is D's first: both sampled from the same prompt
        assert p_answer["choices"][0]["token_ids"] == ids[:1], n
        assert r.json()["usage"]["prompt_tokens"] == n
    idle(p)
    idle(d)


def test_router_pd_output_equals_aggregated(
        reference: dict[int, tuple[list[int], list[float]]],
        chunked: ServeProcess, whole: ServeProcess) -> None:
    """kvloop's router in front of A (prefill) and B (decode), every prefill remote: each
    prompt's blocks move A -> B and B's greedy tokens equal the aggregated worker's."""
    from kvloop.router.config import PDConfig, RouterConfig
    from kvloop.router.registry import WorkerSpec

    for w in (chunked, whole):
        idle(w)
        reset_prefix_cache(w)
    loads = whole.metric("kvloop:kv_transfers_total", side="recv")
    specs = [WorkerSpec(chunked.url, role="prefill"), WorkerSpec(whole.url, role="decode")]
    with RouterThread(RouterConfig(pd=PDConfig(policy="always"), fleet_secret=SECRET),
                      specs) as rt:
        wait_until(lambda: sum(w.up for w in rt.router.registry.all()) == 2, 30, "both up")
        for n in LENGTHS:
            ids, lps = ids_and_logprobs(httpx.post(rt.url + "/v1/completions", json=body(n),
                                                   timeout=300))
            ref_ids, ref_lps = reference[n]
            assert ids == ref_ids, (n, ids, ref_ids)
            assert lps == pytest.approx(ref_lps, **LOGPROB_TOL), n
    # every prompt longer than one token was loaded from A (a 1-token prompt has no block
    # to move: its one token is the one D recomputes)
    assert whole.metric("kvloop:kv_transfers_total", side="recv") - loads >= len(LENGTHS) - 1
    idle(chunked)
    idle(whole)
