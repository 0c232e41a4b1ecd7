"""Prefill/decode disaggregation through real `kvloop serve` processes on 127.0.0.1
(docs/disaggregation.md): vLLM's toy proxy flow, written here from its description
(docs/vllm-facts.md#openai-server), not kvloop's router.

    proxy -> P: the body + kv_transfer_params {do_remote_decode: true, ...}, max_tokens=1,
                min_tokens=1, stream=false, no stream_options
    P -> proxy: the response's top-level kv_transfer_params (P holds the blocks, leased)
    proxy -> D: the original body + P's kv_transfer_params; D pulls the blocks it lacks

The simulator (`--model sim`) serves the accounting and failure tests, where the tokens do
not matter; the embedded model serves the equality tests (module `test_pd_serve_model.py`).
Every worker is `kv_both`: each request's params decide its leg."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest

from kvloop.front.launcher import ServeProcess
from kvloop.router.registry import WorkerDescription
from kvloop.trust import INTERNAL_TOKEN_HEADER, PURPOSE_INTERNAL_HTTP, FleetSecret, secret_env
from kvloop.wire import WorkerInfo

from .conftest import alive, serving, sse_events, wait_until

pytestmark = pytest.mark.processes   # every test here runs kvloop serve processes

BS = 16
LEASE = 3.0             # P's kv_lease_duration: short, so an expiry is seen quickly
TRANSFER_TIMEOUT = 2.0  # how long D waits for P before the load fails
MAX_LEN = 4096
# D's simulated transfers take bytes / this: a 2,000-token prompt loads in about a second
SLOW_BANDWIDTH = 5e7
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                  "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                  "remote_port": None}
GENERATE = "/inference/v1/generate"
SECRET = FleetSecret.generate()     # the fleet's: every worker has it (its environment)
FLEET_ENV = secret_env(SECRET)
FLEET = {INTERNAL_TOKEN_HEADER: SECRET.token(PURPOSE_INTERNAL_HTTP)}   # the router's proof
SIM = ["--model", "sim", "--sim-speedup", "5", "--num-gpu-blocks-override", "400",
       "--max-model-len", str(MAX_LEN), "--debug-check-invariants"]


def kv_config(policy: str = "fail", **extra: Any) -> str:
    """A `--kv-transfer-config` for a kv_both worker."""
    return json.dumps({"kv_connector": "KvloopConnector", "kv_role": "kv_both",
                       "kv_load_failure_policy": policy,
                       "kv_connector_extra_config": {"kv_lease_duration": LEASE,
                                                     "transfer_timeout": TRANSFER_TIMEOUT,
                                                     **extra}})


def tokens(n: int, seed: int) -> list[int]:
    """A prompt of `n` token ids, different for each seed."""
    return [1000 + (seed * 7919 + i * 104729) % 30000 for i in range(n)]


# --- the toy proxy ------------------------------------------------------------------------------
def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The P leg of `body` (vLLM's toy proxy, with Dynamo's min_tokens=1: P's one token is
    never an early EOS stop)."""
    leg = {k: v for k, v in body.items() if k not in ("stream_options", "min_completion_tokens")}
    leg.update(kv_transfer_params=dict(PREFILL_PARAMS), stream=False, max_tokens=1,
               max_completion_tokens=1, min_tokens=1)
    return leg


def prefill(p: ServeProcess, body: dict[str, Any], path: str = "/v1/completions",
            request_id: str | None = None) -> dict[str, Any]:
    r = httpx.post(p.url + path, json=prefill_body(body), timeout=60,
                   headers={**FLEET, "X-Request-Id": request_id or uuid.uuid4().hex})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def decode_body(body: dict[str, Any], p_answer: dict[str, Any]) -> dict[str, Any]:
    """The D leg: the original body with P's `kv_transfer_params`, when it sent any."""
    params = p_answer.get("kv_transfer_params")
    return {**body, "kv_transfer_params": params} if params else dict(body)


def pd(p: ServeProcess, d: ServeProcess, body: dict[str, Any],
       path: str = "/v1/completions") -> tuple[dict[str, Any], httpx.Response]:
    """The toy proxy's flow for a non-streaming `body`: (P's answer, D's response)."""
    rid = uuid.uuid4().hex
    p_answer = prefill(p, body, path, rid)
    r = httpx.post(d.url + path, json=decode_body(body, p_answer), timeout=60,
                   headers={**FLEET, "X-Request-Id": rid})
    return p_answer, r


def completion(prompt: list[int], max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"model": "sim", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, **extra}


def token_ids(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]  # type: ignore[no-any-return]


# --- looking at workers -------------------------------------------------------------------------
def stats(w: ServeProcess) -> dict[str, Any]:
    return w.engine_stats()


def idle(w: ServeProcess, timeout_s: float = LEASE + 5) -> dict[str, Any]:
    """The worker's stats once every request is gone and every block is free again; fails
    (naming what is left) when that takes longer than `timeout_s`."""
    s = w.wait_idle(timeout_s)
    assert s["num_requests"] == 0 and s["num_free_blocks"] == s["num_total_blocks"], s
    return s


def counter(w: ServeProcess, name: str, **labels: str) -> float:
    return w.metric(name, **labels)


def worker_info(w: ServeProcess) -> WorkerInfo:
    return msgspec.json.decode(httpx.get(w.url + "/kvloop/worker", timeout=10).content,
                               type=WorkerInfo)


# --- the workers ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def p(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """The prefill worker (the router's role, prefix caching on)."""
    with serving(tmp_path_factory, "pd_p", [
            *SIM, "--role", "prefill", "--block-size", str(BS),
            "--kv-transfer-config", kv_config()], env=FLEET_ENV) \
            as srv:
        yield srv


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """The decode worker, policy "fail", prefix caching asked for (a decode worker's default
    is off), slow simulated transfers."""
    with serving(tmp_path_factory, "pd_d", [
            *SIM, "--role", "decode", "--enable-prefix-caching", "--block-size", str(BS),
            "--kv-transfer-config", kv_config(sim_bandwidth=SLOW_BANDWIDTH)], env=FLEET_ENV) \
            as srv:
        yield srv


@pytest.fixture(scope="module")
def d_recompute(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """A decode worker with policy "recompute"; also the aggregated reference (a request
    without kv_transfer_params is an ordinary one)."""
    with serving(tmp_path_factory, "pd_d_recompute", [
            *SIM, "--block-size", str(BS), "--kv-transfer-config", kv_config("recompute")],
            env=FLEET_ENV) as srv:
        yield srv


@pytest.fixture(scope="module")
def p_wide(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """A prefill worker whose blocks are twice as large as the decode workers'."""
    with serving(tmp_path_factory, "pd_p_wide", [
            *SIM, "--block-size", str(2 * BS), "--kv-transfer-config", kv_config()],
            env=FLEET_ENV) \
            as srv:
        yield srv


def aggregated(ref: ServeProcess, body: dict[str, Any], path: str = "/v1/completions"
               ) -> httpx.Response:
    r = httpx.post(ref.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r


# --- configuration and the worker's facts -------------------------------------------------------
def test_the_connector_is_in_the_workers_facts(p: ServeProcess, d: ServeProcess) -> None:
    pi, di = worker_info(p), worker_info(d)
    assert pi.kv_transfer is not None and di.kv_transfer is not None
    routers_view = msgspec.json.decode(   # what a router's registry decodes, strictly
        httpx.get(p.url + "/kvloop/worker", timeout=10).content, type=WorkerDescription)
    assert routers_view.kv_transfer == pi.kv_transfer
    assert pi.kv_transfer.engine_id != di.kv_transfer.engine_id
    for info in (pi.kv_transfer, di.kv_transfer):
        assert uuid.UUID(info.engine_id).version == 4        # filled by the API server
        assert info.kv_role == "kv_both" and info.side_channel_host == "127.0.0.1"
        assert info.side_channel_port > 0                     # port 0 resolved
    assert (pi.role, pi.enable_prefix_caching) == ("prefill", True)
    assert (di.role, di.enable_prefix_caching) == ("decode", True)   # asked for explicitly
    assert f"engine_id {pi.kv_transfer.engine_id}" in p.log()


def test_bad_kv_transfer_params_are_400(p: ServeProcess) -> None:
    prompt = tokens(20, 1)
    for extra, message in (
            ({"kv_transfer_params": "do_remote_decode"}, "Input should be a valid dictionary"),
            ({"kv_transfer_params": [1]}, "Input should be a valid dictionary"),
            ({"kv_transfer_params": {"x": 2 ** 70}}, "out of the int64/uint64 range"),
            ({"kv_transfer_params": PREFILL_PARAMS, "n": 2}, "one prompt and n=1"),
            ({"kv_transfer_params": PREFILL_PARAMS, "prompt": [prompt, prompt]},
             "one prompt and n=1")):
        r = httpx.post(p.url + "/v1/completions", headers=FLEET,
                       json={**completion(prompt), **extra},
                       timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        # (a schema error's param is its location, body.kv_transfer_params)
        assert message in err["message"] and err["param"].endswith("kv_transfer_params"), err
    assert stats(p)["num_requests"] == 0


# --- the flow -----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 15, 16, 17, 48, 2000])
def test_toy_proxy_flow_equals_aggregated(p: ServeProcess, d: ServeProcess,
                                          d_recompute: ServeProcess, n: int) -> None:
    prompt = tokens(n, n)
    body = completion(prompt)
    p_before, sent0 = stats(p), counter(p, "kvloop:kv_transfers_total", side="send")
    p_answer, r = pd(p, d, body)
    params = p_answer["kv_transfer_params"]
    pi = worker_info(p).kv_transfer
    assert pi is not None
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert (params["remote_engine_id"], params["remote_host"], params["remote_port"]) == \
        (pi.engine_id, "127.0.0.1", pi.side_channel_port)
    assert len(params["remote_block_ids"]) == -(-n // BS)        # every prompt block, held
    assert (params["remote_num_tokens"], params["block_size"], params["tp_size"]) == \
        (n, BS, 1)
    assert p_answer["choices"][0]["finish_reason"] == "length"
    assert token_ids(r) == token_ids(aggregated(d_recompute, body))
    assert r.json()["kv_transfer_params"] is None                  # D hands nothing on
    assert r.json()["usage"]["prompt_tokens"] == n
    # P served one Read, then freed its blocks at D's Done; D holds nothing either
    wait_until(lambda: stats(p)["num_free_blocks"] == p_before["num_free_blocks"], 5,
               "P's blocks back in the free pool after D's Done")
    # one Read (a 1-token prompt may need none: D recomputes its last token anyway)
    assert counter(p, "kvloop:kv_transfers_total", side="send") - sent0 in \
        ((1,) if n > 1 else (0, 1))
    idle(d)


def test_chat_through_the_toy_proxy(p: ServeProcess, d: ServeProcess,
                                    d_recompute: ServeProcess) -> None:
    body = {"model": "sim", "messages": [{"role": "user", "content": "tell me about KV " * 20}],
            "max_completion_tokens": 6, "temperature": 0, "return_token_ids": True}
    p_answer, r = pd(p, d, body, "/v1/chat/completions")
    assert p_answer["kv_transfer_params"]["do_remote_prefill"] is True
    assert p_answer["usage"]["completion_tokens"] == 1
    assert token_ids(r) == token_ids(aggregated(d_recompute, body, "/v1/chat/completions"))
    idle(d)


def test_p_keeps_its_cache_and_d_reads_only_the_blocks_it_lacks(
        p: ServeProcess, d: ServeProcess, d_recompute: ServeProcess) -> None:
    """A's 7 blocks go to D; B shares A's first 4 blocks: P and D both hit them, D reads only
    B's other blocks; cached tokens on D = its hits, never the transferred tokens."""
    a = tokens(100, 501)                       # 7 blocks (6 full)
    b = a[:4 * BS] + tokens(50, 502)           # 114 tokens, 8 blocks, the first 4 shared
    recv_bytes = lambda: counter(d, "kvloop:kv_transfer_bytes_total", side="recv")  # noqa: E731
    bytes0, queries0, hits0 = (recv_bytes(), counter(d, "vllm:external_prefix_cache_queries_total"),
                               counter(d, "vllm:external_prefix_cache_hits_total"))
    p_a, r_a = pd(p, d, completion(a))
    assert p_a["kv_transfer_params"]["remote_prefill_cached_tokens"] == 0
    assert r_a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    idle(d)
    per_block = (recv_bytes() - bytes0) / 7
    assert per_block > 0 and per_block == int(per_block)
    # D's connector prefix stats, in tokens: the prompt less D's hit, all of it external
    assert counter(d, "vllm:external_prefix_cache_queries_total") - queries0 == 100
    assert counter(d, "vllm:external_prefix_cache_hits_total") - hits0 == 100
    # P: blocks freed, prefix kept (an ordinary request of A hits its 6 full blocks)
    idle(p)
    again = httpx.post(p.url + "/v1/completions", headers=FLEET,
                       json=completion(a), timeout=30).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 * BS
    bytes1 = recv_bytes()
    p_b, r_b = pd(p, d, completion(b))
    assert p_b["kv_transfer_params"]["remote_prefill_cached_tokens"] == 4 * BS   # P's hit
    assert token_ids(r_b) == token_ids(aggregated(d_recompute, completion(b)))
    assert recv_bytes() - bytes1 == (8 - 4) * per_block                  # B's blocks 4..7
    # D's hit (its own cache of A's loaded blocks) and P's hit are the same 64 tokens
    assert r_b.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BS
    idle(d)
    idle(p)


@pytest.mark.parametrize("cached_on", ["P", "D"])
def test_cached_tokens_on_d_count_either_hit(p: ServeProcess, d: ServeProcess,
                                             cached_on: str) -> None:
    """The prompt's first 3 blocks are cached on one side only: D reports those 48 tokens;
    with them on D, D reads only the 4th block."""
    c = tokens(60, 601 if cached_on == "P" else 602)
    warm = p if cached_on == "P" else d
    httpx.post(warm.url + "/v1/completions", json=completion(c[:3 * BS + 1]), timeout=30)
    idle(warm)
    sent0, recv0 = (counter(p, "kvloop:kv_transfer_bytes_total", side="send"),
                    counter(d, "kvloop:kv_transfer_bytes_total", side="recv"))
    hits0 = counter(d, "vllm:external_prefix_cache_hits_total")
    p_c, r_c = pd(p, d, completion(c))
    assert p_c["kv_transfer_params"]["remote_prefill_cached_tokens"] == \
        (3 * BS if cached_on == "P" else 0)
    assert r_c.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BS
    idle(d)
    sent = counter(p, "kvloop:kv_transfer_bytes_total", side="send") - sent0
    assert counter(d, "kvloop:kv_transfer_bytes_total", side="recv") - recv0 == sent > 0
    # D loads what its own cache lacks: all 60 tokens, or the 12 after its 48
    assert counter(d, "vllm:external_prefix_cache_hits_total") - hits0 == \
        (60 if cached_on == "P" else 60 - 3 * BS)


def test_streaming_decode_leg(p: ServeProcess, d: ServeProcess,
                              d_recompute: ServeProcess) -> None:
    body = completion(tokens(70, 701), max_tokens=12)
    reference = aggregated(d_recompute, body).json()["choices"][0]["text"]
    p_answer = prefill(p, body)
    stream = {**decode_body(body, p_answer), "stream": True,
              "stream_options": {"include_usage": True}}
    with httpx.stream("POST", d.url + "/v1/completions", headers=FLEET,
                      json=stream, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(list(r.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == reference
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    idle(d)
    idle(p)


def test_token_in_route_through_the_toy_proxy(p: ServeProcess, d: ServeProcess,
                                             d_recompute: ServeProcess) -> None:
    """vLLM's POST /inference/v1/generate: token ids in and out, both legs."""
    prompt = tokens(50, 1401)
    reference = token_ids(aggregated(d_recompute, completion(prompt, 6)))
    sampling = {"max_tokens": 6, "temperature": 0, "logprobs": 1}

    def p_leg() -> dict[str, Any]:
        r = httpx.post(p.url + GENERATE, headers=FLEET, timeout=30, json={
            "token_ids": prompt, "kv_transfer_params": PREFILL_PARAMS,
            "sampling_params": {**sampling, "max_tokens": 1, "min_tokens": 1}})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == reference[:1]
        params: dict[str, Any] = r.json()["kv_transfer_params"]
        assert params["remote_num_tokens"] == 50
        return params

    r = httpx.post(d.url + GENERATE, headers=FLEET, timeout=30, json={
        "request_id": "pd-1", "token_ids": prompt, "sampling_params": sampling,
        "kv_transfer_params": p_leg()})
    assert r.status_code == 200, r.text
    answer = r.json()
    (choice,) = answer["choices"]
    assert answer["request_id"] == "pd-1" and answer["kv_transfer_params"] is None
    assert choice["token_ids"] == reference and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["content"]) == 6
    with httpx.stream("POST", d.url + GENERATE, headers=FLEET, timeout=30, json={
            "token_ids": prompt, "sampling_params": sampling, "stream": True,
            "kv_transfer_params": p_leg()}) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        events = sse_events(list(s.iter_lines()))
    assert events[-1] == "[DONE]"
    assert [t for e in events[:-1] for t in e["choices"][0]["token_ids"]] == reference
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    for bad, param in (({"token_ids": []}, "token_ids"),
                       ({"token_ids": [10 ** 6]}, "token_ids"),
                       ({"token_ids": [5], "sampling_params": {"max_tokens": 1,
                                                               "min_tokens": 2}}, "min_tokens"),
                       ({"token_ids": [5], "kv_transfer_params": 3}, "kv_transfer_params")):
        r = httpx.post(d.url + GENERATE, headers=FLEET, json=bad, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"].endswith(param), r.text
    idle(d)
    idle(p)


# --- failures: no block is left held on either side ---------------------------------------------
def test_lease_expires_when_d_never_pulls(p: ServeProcess) -> None:
    expired0 = counter(p, "kvloop:kv_expired_requests_total")
    before = stats(p)["num_free_blocks"]
    t0 = time.monotonic()
    answer = prefill(p, completion(tokens(40, 801)))
    assert answer["kv_transfer_params"]["lease_expires_in_s"] == LEASE
    assert stats(p)["num_free_blocks"] == before - 3          # held for a D that never comes
    assert counter(p, "kvloop:kv_held_requests") == 1
    wait_until(lambda: counter(p, "kvloop:kv_expired_requests_total") == expired0 + 1,
               LEASE + 5, "the lease to expire")
    assert time.monotonic() - t0 >= LEASE * 0.9
    assert counter(p, "kvloop:kv_held_requests") == 0
    idle(p, 2)


def test_client_disconnect_during_the_prefill_leg(p: ServeProcess) -> None:
    """A P leg abandoned mid-prefill is aborted: nothing held, nothing to expire."""
    expired0, aborted0 = (counter(p, "kvloop:kv_expired_requests_total"),
                          counter(p, "vllm:request_success_total", finished_reason="abort"))
    with pytest.raises(httpx.ReadTimeout):   # the prompt takes 8 steps of about 80 ms
        httpx.post(p.url + "/v1/completions", headers=FLEET,
                   json=prefill_body(completion(tokens(4000, 802))),
                   timeout=httpx.Timeout(30, read=0.2))
    wait_until(lambda: counter(p, "vllm:request_success_total", finished_reason="abort")
               == aborted0 + 1, 10, "P to abort the abandoned leg")
    idle(p, 5)
    assert counter(p, "kvloop:kv_held_requests") == 0
    assert counter(p, "kvloop:kv_expired_requests_total") == expired0


def test_client_disconnect_while_d_waits_for_the_kv(p: ServeProcess, d: ServeProcess) -> None:
    """The client leaves while D loads: D aborts, keeps its blocks until the transfer
    reports, then frees them; P frees at D's Done (no lease expiry)."""
    expired0 = counter(p, "kvloop:kv_expired_requests_total")
    body = completion(tokens(2000, 901), max_tokens=50)
    d_leg = decode_body(body, prefill(p, body))
    aborted0 = counter(d, "vllm:request_success_total", finished_reason="abort")
    with httpx.stream("POST", d.url + "/v1/completions", headers=FLEET,
                      json={**d_leg, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        wait_until(lambda: counter(d, "kvloop:kv_loading_requests") == 1, 10,
                   "D to wait for the KV")
    # the connection is closed: the client is gone while D still loads
    wait_until(lambda: counter(d, "vllm:request_success_total", finished_reason="abort")
               == aborted0 + 1, 10, "D to abort the request")
    idle(d)
    idle(p)
    assert counter(d, "kvloop:kv_loading_requests") == 0
    assert counter(p, "kvloop:kv_expired_requests_total") == expired0


def test_client_disconnect_while_d_streams(p: ServeProcess, d: ServeProcess) -> None:
    expired0 = counter(p, "kvloop:kv_expired_requests_total")
    body = completion(tokens(200, 902), max_tokens=2000, ignore_eos=True)
    d_leg = decode_body(body, prefill(p, body))
    with httpx.stream("POST", d.url + "/v1/completions", headers=FLEET,
                      json={**d_leg, "stream": True},
                      timeout=60) as r:
        got = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                got.append(line)
            if len(got) == 3:
                break
    idle(d)
    idle(p)
    assert counter(p, "kvloop:kv_expired_requests_total") == expired0


def _doomed_prefill_worker(tmp_path_factory: pytest.TempPathFactory) -> ServeProcess:
    log = tmp_path_factory.mktemp("pd_doomed") / "serve.log"
    return ServeProcess([*SIM, "--block-size", str(BS), "--kv-transfer-config", kv_config()],
                        log, FLEET_ENV).start(timeout_s=60)


def _kill(w: ServeProcess) -> None:
    """SIGKILL both processes of a worker (the side channel lives in the engine's)."""
    engine_pid = worker_info(w).engine_pid
    assert isinstance(engine_pid, int)
    os.kill(engine_pid, signal.SIGKILL)
    w.kill()
    wait_until(lambda: not alive(engine_pid), 10, "the killed engine to be gone")


def test_prefill_worker_killed_before_the_pull(
        tmp_path_factory: pytest.TempPathFactory, d: ServeProcess,
        d_recompute: ServeProcess) -> None:
    """P dies holding the blocks: "fail" answers 500 naming the transfer failure within the
    transfer timeout, "recompute" prefills on D and answers as an aggregated worker."""
    doomed = _doomed_prefill_worker(tmp_path_factory)
    body_fail, body_recompute = completion(tokens(80, 1001)), completion(tokens(80, 1002))
    try:
        leg_fail = decode_body(body_fail, prefill(doomed, body_fail))
        leg_recompute = decode_body(body_recompute, prefill(doomed, body_recompute))
    finally:
        _kill(doomed)
    unreachable0 = counter(d, "kvloop:kv_transfer_failures_total", reason="unreachable")
    t0 = time.monotonic()
    r = httpx.post(d.url + "/v1/completions", headers=FLEET, json=leg_fail, timeout=60)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "InternalServerError" and "KV transfer failed" in err["message"]
    assert time.monotonic() - t0 < TRANSFER_TIMEOUT + 5
    assert counter(d, "kvloop:kv_transfer_failures_total", reason="unreachable") == \
        unreachable0 + 1
    assert counter(d, "vllm:request_success_total", finished_reason="error") >= 1
    idle(d)
    r = httpx.post(d_recompute.url + "/v1/completions", headers=FLEET,
                   json=leg_recompute, timeout=60)
    assert token_ids(r) == token_ids(aggregated(d_recompute, body_recompute))
    idle(d_recompute)


def test_streaming_decode_leg_of_a_failed_load_ends_with_an_error_event(
        tmp_path_factory: pytest.TempPathFactory, d: ServeProcess) -> None:
    doomed = _doomed_prefill_worker(tmp_path_factory)
    body = completion(tokens(40, 1101))
    try:
        leg = decode_body(body, prefill(doomed, body))
    finally:
        _kill(doomed)
    with httpx.stream("POST", d.url + "/v1/completions", headers=FLEET,
                      json={**leg, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        events = sse_events(list(r.iter_lines()))
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == 500
    assert "KV transfer failed" in events[-2]["error"]["message"]
    idle(d)


def test_mismatched_block_size_is_refused_and_the_policy_applied(
        p_wide: ServeProcess, d: ServeProcess, d_recompute: ServeProcess) -> None:
    body = completion(tokens(100, 1201))
    leg = decode_body(body, prefill(p_wide, body))
    assert leg["kv_transfer_params"]["block_size"] == 2 * BS
    mismatch0 = counter(d, "kvloop:kv_transfer_failures_total", reason="mismatch")
    expired0 = counter(p_wide, "kvloop:kv_expired_requests_total")
    r = httpx.post(d.url + "/v1/completions", headers=FLEET, json=leg, timeout=60)
    assert r.status_code == 500, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("KV transfer failed") and \
        f"block_size: P has {2 * BS}, D has {BS}" in message, message     # both sides named
    assert counter(d, "kvloop:kv_transfer_failures_total", reason="mismatch") == mismatch0 + 1
    line = next(ln for ln in d.log().splitlines() if "block_size: P has" in ln)
    assert " WARNING " in line and line.endswith("failing it"), line
    idle(d)
    leg = decode_body(body, prefill(p_wide, body))
    r = httpx.post(d_recompute.url + "/v1/completions", headers=FLEET, json=leg, timeout=60)
    assert token_ids(r) == token_ids(aggregated(d_recompute, body))
    line = next(ln for ln in d_recompute.log().splitlines() if "block_size: P has" in ln)
    assert line.endswith("recomputing from token 0"), line
    idle(d_recompute)
    idle(p_wide)
    # D gave up with a Done each time: P freed at once, no lease ran out
    assert counter(p_wide, "kvloop:kv_expired_requests_total") == expired0


def test_invalid_remote_params_prefill_locally(d: ServeProcess,
                                               d_recompute: ServeProcess) -> None:
    """vLLM's rule: D logs "invalid kv_transfer_params" and prefills itself."""
    body = completion(tokens(30, 1301))
    r = httpx.post(d.url + "/v1/completions", headers=FLEET, timeout=30, json={
        **body, "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "x"}})
    assert token_ids(r) == token_ids(aggregated(d_recompute, body))
    assert "invalid kv_transfer_params" in d.log()
    idle(d)


def test_everything_is_free_at_the_end(p: ServeProcess, d: ServeProcess,
                                       d_recompute: ServeProcess) -> None:
    for w in (p, d, d_recompute):
        idle(w)
        assert counter(w, "kvloop:kv_held_requests") == 0
        assert counter(w, "kvloop:kv_loading_requests") == 0
