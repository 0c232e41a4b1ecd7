"""Unit tests of the API server's pieces that need no process: stop strings, output
processing, error shapes, metrics buckets, wire structs, CLI parsing."""

from __future__ import annotations

import argparse
import re
import socket
import uuid

import msgspec
import pytest

from kvloop.config import REAL_RUNNER_FACTORY, SIM_RUNNER_FACTORY
from kvloop.core.request import SamplingParams
from kvloop.events.config import KVEventsConfig
from kvloop.front.byte_tokenizer import ByteTokenizer
from kvloop.front.processor import OutputOptions, OutputState, find_stop_string
from kvloop.front.sockets import bind_tcp, http_url
from kvloop.front.tokenizer import find_model_path
from kvloop.server import cli_args, serving
from kvloop.server.client import EngineStartError, _decode_handshake
from kvloop.server.config import ServeConfig
from kvloop.server.metrics import ServerMetrics, build_1_2_5_buckets
from kvloop.server.sim_model import SIM_TEXT, load_sim_model
from kvloop.wire import (
    KV_LOAD_FAILED,
    WIRE_VERSION,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    EngineStartConfig,
    EngineStartFailed,
    KVEventsInfo,
    KVTransferStats,
    PrefixCacheStats,
    SchedulerStats,
    TopLogprobs,
)

# --- stop strings: vLLM's vectors (docs/vllm-facts.md#stop-strings) -------------------------


@pytest.mark.parametrize("stops", [["a", "is"], ["is", "a"]])
def test_stop_string_earliest_completion_wins(stops: list[str]) -> None:
    text = " The user is a"
    assert find_stop_string(text, len(" is a"), stops, False) == ("is", 10)
    assert find_stop_string(text, len(" is a"), stops, True) == ("is", 12)


def test_stop_string_ties_and_overlaps() -> None:
    assert find_stop_string("abc", 3, ["abc", "b"], False) == ("b", 1)
    assert find_stop_string("ab", 2, ["ab", "b"], False) == ("ab", 0)
    assert find_stop_string("ab", 2, ["b", "ab"], False) == ("b", 1)


def test_stop_string_at_end_and_no_match() -> None:
    assert find_stop_string("hello world.", 1, ["."], False) == (".", 11)
    assert find_stop_string("hello world.", 1, ["."], True) == (".", None)
    assert find_stop_string("hello world.", 0, ["."], False) is None
    assert find_stop_string("hello world.", 1, [], False) is None
    # only the new characters (and a stop string overlapping them) are searched
    assert find_stop_string("a.b", 1, ["."], False) is None


# --- output processing ----------------------------------------------------------------------
TOK = ByteTokenizer()


def _out(text: str, finish: str | None = None, stop_reason: int | str | None = None,
         extra: list[int] | None = None) -> EngineCoreOutput:
    return EngineCoreOutput("r", list(text.encode()) + (extra or []), finish, stop_reason)


def _state(**kw: object) -> OutputState:
    return OutputState(TOK, [1, 2], OutputOptions(**kw))  # type: ignore[arg-type]


def test_output_state_stop_string_cuts_and_drops_later_tokens() -> None:
    st = _state(stop=("lo w",))
    d1 = st.process(_out("hel"))
    assert d1.text == "" and d1.finish_reason is None  # 3 chars held back
    d2 = st.process(_out("lo world"))
    assert d2.stopped_locally and d2.finish_reason == "stop" and d2.stop_reason == "lo w"
    assert d1.text + d2.text == "hel" and st.text == "hel"
    assert d2.token_ids == list(b"lo w")   # the token completing the stop string is the last
    assert st.process(_out("more")).text == ""          # finished: ignores later outputs


def test_output_state_include_stop_str_and_min_tokens() -> None:
    st = _state(stop=("b",), include_stop_str_in_output=True)
    assert st.process(_out("aabxx")).text == "aab"
    st = _state(stop=("b",), min_tokens=3)
    d = st.process(_out("abab"))
    assert d.text == "aba" and d.stop_reason == "b"   # the first "b" is within min_tokens


def test_output_state_holdback_is_released_at_finish() -> None:
    st = _state(stop=("xyz",))
    parts = [st.process(_out(c)).text for c in "abcd"]
    assert parts == ["", "", "a", "b"]
    d = st.process(_out("e", finish="length"))
    assert d.text == "cde" and d.finish_reason == "length"
    assert "".join(parts) + d.text == "abcde"


def test_output_state_stop_token_is_not_detokenized() -> None:
    st = _state()
    d = st.process(_out("hi", finish="stop", stop_reason=None, extra=[ord("!")]))
    assert d.text == "hi" and d.token_ids == list(b"hi!") and d.stop_reason is None
    st = _state(include_stop_str_in_output=True)
    assert st.process(_out("hi", finish="stop", stop_reason=33, extra=[33])).text == "hi!"


def test_output_state_error_and_logprobs() -> None:
    st = _state()
    lp = [TopLogprobs(ord("a"), -0.5, 1, [ord("a"), ord("b")], [-0.5, -1.0])]
    d = st.process(EngineCoreOutput("r", [ord("a")], new_logprobs=lp))
    assert d.logprobs[0].logprob == -0.5 and d.logprobs[0].top == [(97, -0.5), (98, -1.0)]
    d = _state().process(EngineCoreOutput("r", [], "error", error="no room"))
    assert d.finish_reason == "error" and d.error == "no room"


# --- sim tokenizer ----------------------------------------------------------------------------
def test_byte_tokenizer_roundtrip_and_specials() -> None:
    ids = TOK.encode("héllo")
    assert ids == list("héllo".encode()) and TOK.decode(ids) == "héllo"
    assert TOK.decode([TOK.eos_token_id, 104]) == "h"
    assert TOK.decode([TOK.eos_token_id, 104], skip_special_tokens=False) == "<|endoftext|>h"
    det = TOK.new_detokenizer([], True)
    e = "é".encode()
    assert det.push([e[0]]) == "" and det.push([e[1]]) == "é"   # split UTF-8 held back
    assert "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" == \
        TOK.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError):
        TOK.special_text(5)


# --- wire -------------------------------------------------------------------------------------
def test_sampling_params_are_validated_on_construction() -> None:
    sp = SamplingParams(stop="x", stop_token_ids=[3, 4], temperature=0)
    assert sp.stop == ("x",) and sp.stop_token_ids == (3, 4) and sp.greedy
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")    # vLLM's list, kept as a tuple
    with pytest.raises(ValueError, match=r"^temperature must be in \[0, 2\], got 3\.$"):
        SamplingParams(temperature=3)
    with pytest.raises(ValueError, match="min_tokens must be less than or equal to max_tokens=2"):
        msgspec.structs.replace(SamplingParams(max_tokens=2), min_tokens=3)
    with pytest.raises(AttributeError, match="immutable"):
        sp.n = 2  # type: ignore[misc]


def test_sampling_params_cross_the_wire_as_they_are() -> None:
    sp = SamplingParams(n=2, temperature=0.5, stop=("x", "y"), stop_token_ids=(3,), seed=7,
                        eos_token_id=2, cache_salt="s")
    req = EngineCoreRequest("r", [1, 2], sp, arrival_time=1.5)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=EngineCoreRequest)
    assert back == req and back.sampling_params.effective_eos == 2
    # only what differs from the defaults travels
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(SamplingParams(max_tokens=3))) == \
        {"max_tokens": 3}


@pytest.mark.parametrize(("params", "message"), [
    ({"temperature": 5.0}, r"^temperature must be in \[0, 2\], got 5\.0\. - at `\$\[2\]`$"),
    ({"max_tokens": 2, "min_tokens": 3}, "min_tokens must be less than or equal to max_tokens"),
    ({"n": 0}, "n must be at least 1, got 0"),
    ({"n": "2"}, r"Expected `int`, got `str` - at `\$\[2\]\.n`"),
    ({"stop": "x"}, r"Expected `array`, got `str` - at `\$\[2\]\.stop`"),
])
def test_sampling_params_are_validated_on_decode(params: dict[str, object], message: str
                                                 ) -> None:
    decode = msgspec.msgpack.Decoder(EngineCoreRequest).decode
    with pytest.raises(msgspec.ValidationError, match=message):
        decode(msgspec.msgpack.encode(["r", [1, 2], params]))
    assert decode(msgspec.msgpack.encode(["r", [1, 2], {"stop": ["x"]}])).sampling_params == \
        SamplingParams(stop=("x",))


def test_engine_outputs_roundtrip() -> None:
    outs = EngineCoreOutputs(
        outputs=[EngineCoreOutput("a", [1, 2], "stop", 7, 16)],
        scheduler_stats=SchedulerStats(num_running_reqs=1,
                                       prefix_cache_stats=PrefixCacheStats(queries=32, hits=16)),
        timestamp=1.5, scheduled=["a"], iteration_tokens=9)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(outs), type=EngineCoreOutputs) == outs


# --- metrics ----------------------------------------------------------------------------------
def test_request_token_buckets() -> None:
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(4) == [1, 2]


def test_metrics_from_scheduler_stats() -> None:
    m = ServerMetrics("m", 1000)
    m.observe_scheduler_stats(SchedulerStats(
        num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.25, num_preemptions=1,
        prefix_cache_stats=PrefixCacheStats(queries=64, hits=32, preempted_queries=99,
                                            preempted_hits=99)))
    text = m.render().decode()
    lab = '{engine="0",model_name="m"}'
    for line in (f"vllm:num_requests_running{lab} 3.0", f"vllm:num_requests_waiting{lab} 2.0",
                 f"vllm:kv_cache_usage_perc{lab} 0.25", f"vllm:num_preemptions_total{lab} 1.0",
                 f"vllm:prefix_cache_queries_total{lab} 64.0",
                 f"vllm:prefix_cache_hits_total{lab} 32.0"):
        assert line in text, line


def test_kv_transfer_metrics_only_with_a_connector() -> None:
    assert "kvloop:kv_transfers" not in ServerMetrics("m", 1000).render().decode()
    m = ServerMetrics("m", 1000, kv_transfer=True)
    lab = 'engine="0",model_name="m"'
    text = m.render().decode()
    for line in (f'kvloop:kv_transfers_total{{{lab},side="send"}} 0.0',
                 f'kvloop:kv_transfer_failures_total{{{lab},reason="unreachable"}} 0.0',
                 f"kvloop:kv_held_requests{{{lab}}} 0.0"):
        assert line in text, line
    for _ in range(2):
        m.observe_scheduler_stats(SchedulerStats(kv_transfer=KVTransferStats(
            transfers_sent=1, bytes_sent=100, transfers_received=2, bytes_received=300,
            transfer_seconds=[0.02, 0.3], failures={"mismatch": 1}, expired_requests=1,
            held_requests=3, loading_requests=4, external_prefix_cache_queries=50,
            external_prefix_cache_hits=40)))
    text = m.render().decode()
    for line in (f'kvloop:kv_transfers_total{{{lab},side="send"}} 2.0',
                 f'kvloop:kv_transfers_total{{{lab},side="recv"}} 4.0',
                 f'kvloop:kv_transfer_bytes_total{{{lab},side="send"}} 200.0',
                 f'kvloop:kv_transfer_bytes_total{{{lab},side="recv"}} 600.0',
                 'kvloop:kv_transfer_time_seconds_bucket{engine="0",le="0.025",model_name="m"} 2.0',
                 f"kvloop:kv_transfer_time_seconds_count{{{lab}}} 4.0",
                 f'kvloop:kv_transfer_failures_total{{{lab},reason="mismatch"}} 2.0',
                 f"kvloop:kv_expired_requests_total{{{lab}}} 2.0",
                 f"kvloop:kv_held_requests{{{lab}}} 3.0",
                 f"kvloop:kv_loading_requests{{{lab}}} 4.0",
                 f"vllm:external_prefix_cache_queries_total{{{lab}}} 100.0",
                 f"vllm:external_prefix_cache_hits_total{{{lab}}} 80.0"):
        assert line in text, line
    m.observe_scheduler_stats(SchedulerStats(kv_transfer=KVTransferStats()))
    assert m.value("kvloop:kv_held_requests") == 0   # a gauge follows the last stats


def test_kv_load_failures_are_500_refusals_400() -> None:
    assert serving.engine_error(f"{KV_LOAD_FAILED}: no answer from 127.0.0.1:9").status == 500
    assert serving.engine_error("the prompt needs 9 KV blocks; the KV cache has 8").status == 400


# --- CLI --------------------------------------------------------------------------------------
def test_kv_transfer_config_flag() -> None:
    none = cli_args.engine_config(cli_args_of())
    assert none.kv_transfer is None
    on = cli_args.engine_config(cli_args_of(
        "--kv-transfer-config", '{"kv_connector": "KvloopConnector", "kv_role": "kv_both", '
        '"kv_connector_extra_config": {"kv_lease_duration": 2}}')).kv_transfer
    assert on is not None and on.kv_role == "kv_both" and on.extra.kv_lease_duration == 2.0
    assert uuid.UUID(on.engine_id).version == 4     # vLLM's default, fixed by the API server
    named = cli_args.kv_transfer_config(cli_args_of(
        "--kv-transfer-config", '{"kv_connector": "KvloopConnector", "kv_role": "kv_producer", '
        '"engine_id": "p0", "kv_load_failure_policy": "recompute"}'))
    assert named is not None and (named.engine_id, named.kv_load_failure_policy) == \
        ("p0", "recompute")
    for text, message in (("{", "--kv-transfer-config is not valid JSON"),
                          ("[]", "must be a JSON object"),
                          ('{"kv_role": "kv_both"}', "missing required key(s) 'kv_connector'"),
                          ('{"kv_connector": "KvloopConnector", "kv_role": "kv_both", '
                           '"kv_conector_extra_config": {}}', "unknown key(s)")):
        with pytest.raises(ValueError, match=re.escape(message)):
            cli_args.build_configs(cli_args_of("--kv-transfer-config", text))


def cli_args_of(*argv: str) -> argparse.Namespace:
    from kvloop.cli import build_parser

    return build_parser().parse_args(["serve", "--model", "sim", *argv])


def test_parse_size() -> None:
    assert cli_args.parse_size("512MiB") == 512 << 20
    assert cli_args.parse_size("2G") == 2 << 30
    assert cli_args.parse_size("1000") == 1000
    with pytest.raises(argparse.ArgumentTypeError):
        cli_args.parse_size("lots")


def test_the_handshake_is_the_engines_facts_or_its_error() -> None:
    ready = EngineReady(wire_version=WIRE_VERSION, pid=7, model_name="m", vocab_size=None,
                        max_model_len=64, num_gpu_blocks=9, block_size=16,
                        enable_prefix_caching=True, hash_algo="sha256", hash_seed="s",
                        max_num_batched_tokens=64, max_num_seqs=4, epoch="e",
                        kv_events=KVEventsInfo(endpoint="tcp://127.0.0.1:5557",
                                               replay_endpoint=None, topic="", recency=False))
    assert _decode_handshake(msgspec.msgpack.encode(ready)) == ready
    failed = EngineStartFailed(wire_version=WIRE_VERSION, pid=7, error="OSError: no model")
    with pytest.raises(EngineStartError, match="^engine core failed to start: OSError: no model$"):
        _decode_handshake(msgspec.msgpack.encode(failed))
    other = msgspec.msgpack.encode({"type": "EngineReady", "wire_version": 1, "pid": 7})
    with pytest.raises(EngineStartError, match="another kvloop version"):
        _decode_handshake(other)


def test_build_configs_sim() -> None:
    from kvloop.cli import build_parser

    args = build_parser().parse_args([
        "serve", "--model", "sim", "--max-num-batched-tokens", "64", "--max-num-seqs", "200",
        "--num-gpu-blocks-override", "32", "--served-model-name", "a", "b",
        "--enable-kv-cache-events", "--kv-events-topic", "t"])
    serve, start, tok = cli_args.build_configs(args)
    assert serve.served_model_names == ("a", "b") and tok.vocab_size == 49152  # SmolLM2's
    assert serve.model_path == find_model_path(None)
    assert start.engine.scheduler.max_num_seqs == 64     # clamped to the token budget
    runner = start.runner
    assert runner.factory == SIM_RUNNER_FACTORY and runner.sim is not None
    assert runner.num_gpu_blocks_override == 32 and runner.model is None
    # the engine gets the vocabulary's facts, not the model file
    assert (runner.sim.vocab_size, runner.max_model_len) == (49152, 8192)
    assert runner.sim.text_token_ids == load_sim_model(None).text_token_ids
    assert start.kv_events == KVEventsConfig(topic="t", omit_token_ids=True)   # no secret
    back = msgspec.json.decode(msgspec.json.encode(start), type=EngineStartConfig)
    assert back == start


def test_build_configs_sim_vocabularies() -> None:
    from kvloop.cli import build_parser

    def configs(*flags: str) -> tuple[ServeConfig, EngineStartConfig, object]:
        return cli_args.build_configs(build_parser().parse_args(["serve", *flags]))

    serve, start, tok = configs("--model", "sim", "--sim-model", "bytes",
                                "--max-model-len", "100")
    assert isinstance(tok, ByteTokenizer) and serve.model_path == "bytes"
    sim = start.runner.sim
    assert sim is not None and (sim.vocab_size, start.runner.max_model_len) == (259, 100)
    assert list(sim.text_token_ids) == sorted(set(SIM_TEXT.encode()))
    with pytest.raises(ValueError, match="exceeds the context length"):
        configs("--model", "sim", "--max-model-len", "8193")
    with pytest.raises(ValueError, match="--sim-model needs --model sim"):
        configs("--model", "x.gguf", "--sim-model", "bytes")
    with pytest.raises(FileNotFoundError, match="neither a .gguf file"):
        configs("--model", "sim", "--sim-model", "/no/such/model")


def test_num_threads_reaches_the_real_runner() -> None:
    from kvloop.cli import build_parser

    args = build_parser().parse_args(["serve", "--num-threads", "1"])
    runner = cli_args.runner_config(args, "/models/x.gguf")
    assert runner.factory == REAL_RUNNER_FACTORY and runner.num_threads == 1
    assert build_parser().parse_args(["serve"]).num_threads is None
    bad = build_parser().parse_args(["serve", "--model", "sim", "--num-threads", "0"])
    with pytest.raises(ValueError, match="--num-threads"):
        cli_args.build_configs(bad)


def test_bind_ephemeral_port() -> None:
    sock = bind_tcp("127.0.0.1", 0)
    try:
        host, port = sock.getsockname()
        assert port > 0 and http_url(sock) == f"http://127.0.0.1:{port}"
        assert sock.family == socket.AF_INET
        assert sock.proto == socket.IPPROTO_TCP   # else asyncio skips TCP_NODELAY
    finally:
        sock.close()


@pytest.mark.processes
def test_front_server_serves_its_socket_announces_once_and_hands_signals_off() -> None:
    """FrontServer (both fronts' uvicorn): `on_ready(url)` once it accepts connections, the
    fronts' protocol (a silent connection gets 408), and with `on_signal` a signal reaches
    the handler instead of stopping uvicorn."""
    import asyncio
    import signal

    import httpx
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from kvloop.front.http_limits import HttpLimits
    from kvloop.front.uvicorn_server import FrontServer

    async def hello(request: object) -> PlainTextResponse:
        return PlainTextResponse("hi")

    app = Starlette(routes=[Route("/", hello)])
    ready: list[str] = []
    signals: list[int] = []

    async def run() -> None:
        sock = bind_tcp("127.0.0.1", 0)
        server = FrontServer(app, sock, HttpLimits(header_timeout_s=0.3), log_level="error",
                             graceful_shutdown_s=1, on_ready=ready.append,
                             on_signal=lambda sig, frame: signals.append(sig))
        task = asyncio.create_task(server.serve())
        while not ready:
            await asyncio.sleep(0.01)
        assert ready == [http_url(sock)] == [server.url]
        async with httpx.AsyncClient() as client:
            assert (await client.get(server.url + "/")).text == "hi"
        host, port = sock.getsockname()[:2]
        reader, writer = await asyncio.open_connection(host, port)
        assert (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/1.1 408")
        writer.close()
        server.handle_exit(signal.SIGTERM, None)   # what uvicorn's signal handler calls
        assert signals == [signal.SIGTERM] and not server.should_exit
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()

    asyncio.run(run())
    assert len(ready) == 1
    sock = bind_tcp("127.0.0.1", 0)
    plain = FrontServer(app, sock, HttpLimits(), log_level="error", graceful_shutdown_s=1,
                        on_ready=ready.append)
    plain.handle_exit(signal.SIGTERM, None)    # no handler given: uvicorn's own, it stops
    assert plain.should_exit
    sock.close()


def test_one_error_type_per_status() -> None:
    from kvloop.front.openai import error_body, error_type

    assert [error_type(c) for c in (400, 401, 404, 405, 413, 500, 502, 503)] == [
        "BadRequestError", "UnauthorizedError", "NotFoundError", "MethodNotAllowedError",
        "RequestEntityTooLargeError", "InternalServerError", "BadGatewayError",
        "ServiceUnavailableError"]
    assert error_body("m", 400, "prompt") == {
        "error": {"message": "m", "type": "BadRequestError", "param": "prompt", "code": 400}}
