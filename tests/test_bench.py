"""`kvloop bench`: workloads, percentiles, SSE accounting, and runs against a fake server."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest

from kvloop.bench import workloads as w
from kvloop.bench.client import RequestResult, apply_event, completion_payload, error_message
from kvloop.bench.driver import BenchConfig, run_bench_sync
from kvloop.bench.report import (
    compare_ratios,
    distribution,
    format_compare,
    format_table,
    percentile,
    summarize,
)
from kvloop.cli import main as cli_main
from tests.test_bench_fakeserver import FakeOptions, FakeServer

# --- workloads ------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda seed: w.random_workload(20, 64, 16, seed, dist="uniform", spread=0.5),
    lambda seed: w.shared_prefix_workload(3, 40, 8, 4, 12, seed),
    lambda seed: w.multi_turn_workload(4, 3, 32, 8, 4, seed),
    lambda seed: w.with_poisson_arrivals(w.random_workload(10, 8, 2, seed), 5.0, seed),
])
def test_workloads_are_deterministic_for_a_seed(make) -> None:
    assert make(1) == make(1)
    assert make(1).sessions != make(2).sessions


def test_random_workload_lengths_and_token_range() -> None:
    wl = w.random_workload(50, 100, 10, seed=3, dist="uniform", spread=0.2,
                           token_range=(500, 600))
    lens = [len(s.turns[0].new_token_ids) for s in wl.sessions]
    assert all(80 <= n <= 120 for n in lens) and len(set(lens)) > 5
    assert all(500 <= t < 600 for s in wl.sessions for t in s.turns[0].new_token_ids)
    fixed = w.random_workload(5, 7, 3, seed=3)
    assert [(len(s.turns[0].new_token_ids), s.turns[0].max_tokens) for s in fixed.sessions] \
        == [(7, 3)] * 5


def test_shared_prefix_workload_shares_exactly_the_prefix() -> None:
    wl = w.shared_prefix_workload(num_groups=3, prefix_len=40, suffix_len=8, output_len=4,
                                  num_requests=12, seed=0)
    by_group: dict[int, list[tuple[int, ...]]] = {}
    for s in wl.sessions:
        assert s.group is not None
        by_group.setdefault(s.group, []).append(s.turns[0].new_token_ids)
    assert sorted(len(v) for v in by_group.values()) == [4, 4, 4]
    prefixes = {g: v[0][:40] for g, v in by_group.items()}
    assert len(set(prefixes.values())) == 3
    for g, prompts in by_group.items():
        assert all(p[:40] == prefixes[g] and len(p) == 48 for p in prompts)
        assert len({p[40:] for p in prompts}) == 4


def test_trace_workload_arrivals_lengths_and_shared_blocks() -> None:
    lines = [json.dumps({"timestamp": 1000, "input_length": 20, "output_length": 3,
                         "hash_ids": [7, 8]}),
             "",
             json.dumps({"timestamp": 1500, "input_length": 12, "output_length": 2,
                         "hash_ids": [7, 9]}),
             json.dumps({"time_s": 3.0, "prompt_token_ids": [1, 2, 3], "output_len": 1})]
    wl = w.trace_workload(lines, seed=0, block_tokens=10, speedup=2.0)
    assert [s.arrival_s for s in wl.sessions] == [0.0, 0.25, 1.0]
    a, b, c = (s.turns[0] for s in wl.sessions)
    assert (len(a.new_token_ids), a.max_tokens, len(b.new_token_ids)) == (20, 3, 12)
    assert a.new_token_ids[:10] == b.new_token_ids[:10]          # block 7 shared
    assert a.new_token_ids[10:12] != b.new_token_ids[10:12]      # blocks 8 and 9 differ
    assert c.new_token_ids == (1, 2, 3)
    with pytest.raises(ValueError, match="line 1"):
        w.trace_workload(['{"time_s": 0, "output_len": 2}'])


def test_bad_workload_arguments_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="distribution"):
        w.random_workload(2, 8, 2, dist="zipf")
    with pytest.raises(ValueError, match="token range"):
        w.random_workload(2, 8, 2, token_range=(10, 10))
    with pytest.raises(ValueError, match="rate"):
        w.with_poisson_arrivals(w.random_workload(2, 8, 2), 0.0)


def test_poisson_arrivals_have_the_requested_rate() -> None:
    wl = w.with_poisson_arrivals(w.random_workload(2000, 4, 1), rate=50.0, seed=1)
    times = [s.arrival_s for s in wl.sessions]
    assert times[0] == 0.0 and times == sorted(times)
    assert 50.0 * 0.93 < (len(times) - 1) / times[-1] < 50.0 * 1.07


# --- percentiles and summaries ---------------------------------------------------------------


def test_percentiles_on_known_inputs() -> None:
    vals = list(range(1, 11))  # 1..10
    assert percentile(vals, 50) == pytest.approx(5.5)
    assert percentile(vals, 90) == pytest.approx(9.1)
    assert percentile(vals, 99) == pytest.approx(9.91)
    assert percentile(vals, 0) == 1 and percentile(vals, 100) == 10
    assert percentile([3.0], 99) == 3.0
    assert percentile([10, 0, 20], 25) == pytest.approx(5.0)  # unsorted input
    assert distribution([0.001, 0.002, 0.003], 1000.0) == pytest.approx(
        {"mean": 2.0, "p50": 2.0, "p90": 2.8, "p99": 2.98})
    with pytest.raises(ValueError):
        percentile([], 50)


def _result(start: float, chunks: list[float], n_out: int, **kw) -> RequestResult:
    r = RequestResult(0, 0, 10, n_out, start=start, end=chunks[-1], **kw)
    r.first_token_time = chunks[0]
    r.chunk_times = chunks
    r.completion_tokens = n_out
    return r


def test_request_metrics_from_known_timings() -> None:
    r = _result(1.0, [1.5, 1.6, 1.8, 2.1], 4)
    assert r.ttft == pytest.approx(0.5)
    assert r.tpot == pytest.approx(0.2)            # (2.1 - 1.5) / 3
    assert r.itls() == pytest.approx([0.1, 0.2, 0.3])
    assert r.e2e == pytest.approx(1.1)


def test_summary_throughput_and_cache_share() -> None:
    from kvloop.bench.driver import BenchRun

    a = _result(0.0, [0.1, 0.2], 2, prompt_tokens=100, cached_tokens=64)
    b = _result(0.0, [0.3, 0.5], 2, prompt_tokens=60, cached_tokens=0)
    bad = RequestResult(0, 1, 10, 2, error="HTTP 400: nope")
    run = BenchRun("x", "http://h:1", "m", "random", {}, "closed", 2, [a, b, bad],
                   duration_s=2.0, client_cpu_s=0.5)
    s = summarize(run)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 400: nope"])
    assert s["cache_share"] == pytest.approx(64 / 160)
    assert s["output_throughput"] == pytest.approx(2.0)        # 4 tokens / 2 s
    assert s["total_token_throughput"] == pytest.approx(82.0)  # (160 + 4) / 2
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["client_cpu_share"] == pytest.approx(0.25)
    table = format_table(s)
    assert "prompt tokens from cache (%)" in table and "40.0" in table
    both = format_compare(s, s)
    assert "A/B" in both and "1.00" in both
    assert compare_ratios(s, s)["output throughput (tok/s)"] == pytest.approx(1.0)


# --- SSE events -------------------------------------------------------------------------------


def test_apply_event_counts_tokens_ids_and_usage() -> None:
    r = RequestResult(0, 0, 5, 3, start=0.0)
    apply_event(r, b'{"choices":[{"text":"","token_ids":[]}]}', 0.5)      # nothing yet
    apply_event(r, b'{"choices":[{"text":"ab","token_ids":[11,12]}]}', 1.0)
    apply_event(r, b'{"choices":[{"text":"c","token_ids":[13],"finish_reason":"length"}]}', 1.5)
    apply_event(r, b'{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,'
                   b'"prompt_tokens_details":{"cached_tokens":4}},"extra":{"a":1}}', 1.6)
    assert r.first_token_time == 1.0 and r.chunk_times == [1.0, 1.5]
    assert r.output_token_ids == [11, 12, 13] and r.output_tokens == 3
    assert (r.prompt_tokens, r.cached_tokens) == (5, 4)
    plain = RequestResult(0, 0, 5, 3, start=0.0)
    apply_event(plain, b'{"choices":[{"text":"hi"}]}', 0.2)   # no ids, no usage
    assert plain.output_tokens == 1 and plain.output_token_ids is None


def test_payload_and_error_messages() -> None:
    body = json.loads(completion_payload("m", [1, 2], 8, extra={"top_k": 5}))
    assert body == {"prompt": [1, 2], "max_tokens": 8, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "model": "m",
                    "ignore_eos": True, "return_token_ids": True, "top_k": 5}
    assert error_message(400, b'{"error":{"message":"bad prompt"}}') == "HTTP 400: bad prompt"
    assert error_message(502, b"<html>gateway</html>") == "HTTP 502: <html>gateway</html>"


# --- against the fake server ---------------------------------------------------------------


def _cfg(url: str, **kw) -> BenchConfig:
    return BenchConfig(url, progress=False, **kw)


@pytest.mark.processes
def test_shared_prefix_cache_share_is_exact_at_concurrency_one() -> None:
    wl = w.shared_prefix_workload(num_groups=2, prefix_len=64, suffix_len=16, output_len=4,
                                  num_requests=6, seed=0)
    with FakeServer() as srv:
        run = run_bench_sync(wl, _cfg(srv.url, concurrency=1, warmup=2))
    s = summarize(run)
    assert (s["completed"], s["failed"]) == (6, 0)
    # each group's first request misses, the other four hit the 64-token prefix (4 blocks)
    assert s["cached_tokens"] == 4 * 64
    assert s["cache_share"] == pytest.approx(256 / 480)
    assert s["output_tokens"] == 24 and s["model"] == "fake-sim"
    assert len(srv.prompts) == 8  # 2 warm-up + 6 measured
    assert all(b["ignore_eos"] and b["model"] == "fake-sim" for b in srv.bodies)


@pytest.mark.processes
def test_multi_turn_resends_the_conversation_with_the_real_answers() -> None:
    wl = w.multi_turn_workload(num_conversations=2, num_turns=3, first_len=40, turn_len=8,
                               output_len=24, seed=5)
    with FakeServer() as srv:
        run = run_bench_sync(wl, _cfg(srv.url, concurrency=2))
    assert all(r.ok for r in run.results) and run.stand_in_answers == 0
    results = {(r.session_id, r.turn): r for r in run.results}
    for sid, s in enumerate(wl.sessions):
        r0, r1, r2 = (results[(sid, k)] for k in range(3))
        p0 = list(s.turns[0].new_token_ids)
        p1 = p0 + r0.output_token_ids + list(s.turns[1].new_token_ids)
        p2 = p1 + r1.output_token_ids + list(s.turns[2].new_token_ids)
        assert (r0.prompt_len, r1.prompt_len, r2.prompt_len) == (40, 72, 104)
        assert p0 in srv.prompts and p1 in srv.prompts and p2 in srv.prompts
        # 40 prompt + 23 computed answer tokens = 63 -> 3 full blocks cached for turn 2
        assert r1.cached_tokens == 48


@pytest.mark.processes
def test_multi_turn_without_token_ids_uses_stand_ins() -> None:
    wl = w.multi_turn_workload(num_conversations=1, num_turns=2, first_len=40, turn_len=8,
                               output_len=24, seed=5)
    with FakeServer(FakeOptions(send_token_ids=False)) as srv:
        run = run_bench_sync(wl, _cfg(srv.url))
    assert run.stand_in_answers == 1
    second = [r for r in run.results if r.turn == 1][0]
    assert second.prompt_len == 72 and second.cached_tokens == 32  # only the prompt's blocks
    assert "stand-in" in format_table(summarize(run))


@pytest.mark.processes
def test_errors_are_counted_not_raised() -> None:
    wl = w.random_workload(3, 8, 2, seed=0)
    with FakeServer() as srv:
        run = run_bench_sync(wl, _cfg(srv.url, extra_body=(("max_tokens", 0),)))
    s = summarize(run)
    assert (s["completed"], s["failed"]) == (0, 3)
    assert s["errors"] == ["HTTP 400: max_tokens must be >= 1"]


@pytest.mark.processes
def test_unreachable_server_and_timeouts_are_errors(free_port: Callable[[], int]) -> None:
    dead = f"http://127.0.0.1:{free_port()}"   # reserved, nothing listens
    run = run_bench_sync(w.random_workload(2, 8, 2), _cfg(dead, model="m"))
    assert [r.ok for r in run.results] == [False, False]
    assert "ConnectionRefusedError" in (run.results[0].error or "")
    with FakeServer(FakeOptions(step_delay_s=0.05)) as srv:
        run = run_bench_sync(w.random_workload(1, 8, 50), _cfg(srv.url, timeout_s=0.3))
    assert run.results[0].error == "timed out after 0.3 s"


@pytest.mark.processes
def test_open_loop_follows_arrival_times() -> None:
    wl = w.trace_workload([json.dumps({"time_s": t, "input_len": 8, "output_len": 2})
                           for t in (0.0, 0.2, 0.4)])
    with FakeServer() as srv:
        run = run_bench_sync(wl, _cfg(srv.url))
    starts = sorted(r.start for r in run.results)
    assert run.mode == "open"
    assert starts[1] - starts[0] == pytest.approx(0.2, abs=0.08)
    assert starts[2] - starts[0] == pytest.approx(0.4, abs=0.08)


@pytest.mark.processes
def test_closed_loop_keeps_concurrency_in_flight() -> None:
    wl = w.random_workload(8, 16, 20, seed=1)
    with FakeServer(FakeOptions(step_delay_s=0.005)) as srv:
        run = run_bench_sync(wl, _cfg(srv.url, concurrency=4))
    spans = [(r.start, r.end) for r in run.results]
    peak = max(sum(1 for a, b in spans if a <= t < b) for t, _ in spans)
    assert peak == 4 and all(r.ok and r.output_tokens == 20 for r in run.results)
    assert all(r.tpot is not None and r.tpot > 0 for r in run.results)


@pytest.mark.processes
def test_cli_compare_prints_ratios_and_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    with FakeServer() as a, FakeServer(FakeOptions(step_delay_s=0.002)) as b:
        t0 = time.perf_counter()
        rc = cli_main(["bench", "--url", a.url, "--compare", b.url, "--workload",
                       "shared-prefix", "--num-groups", "2", "--prefix-len", "32",
                       "--suffix-len", "16", "--output-len", "3", "--num-requests", "4",
                       "--json-out", str(out), "--no-progress", "--label", "kvloop",
                       "--compare-label", "anchor"])
        assert time.perf_counter() - t0 < 10
    assert rc == 0
    text = capsys.readouterr().out
    assert "A/B" in text and "A kvloop" in text and "B anchor" in text
    doc = json.loads(out.read_text())
    assert [r["label"] for r in doc["runs"]] == ["kvloop", "anchor"]
    assert doc["runs"][0]["cache_share"] == pytest.approx(2 * 32 / (4 * 48))
    assert doc["ratios"]["prompt tokens"] == pytest.approx(1.0)
    assert a.prompts == b.prompts  # the same workload, token for token


def test_cli_rejects_bad_arguments(capsys) -> None:
    assert cli_main(["bench", "--url", "ftp://x", "--no-progress"]) == 2
    assert "http" in capsys.readouterr().err
    assert cli_main(["bench", "--url", "http://127.0.0.1:1", "--workload", "trace"]) == 2
    assert "--workload-file" in capsys.readouterr().err


def test_figures_median_table_and_distinct_case_seeds() -> None:
    from kvloop.bench.figures import cases, median_table

    def summary(out_tps: float, cache: float | None) -> dict:
        return {"output_throughput": out_tps, "total_token_throughput": 3 * out_tps,
                "ttft_ms": {"p50": 10.0, "p99": 20.0}, "tpot_ms": {"p50": 5.0},
                "cache_share": cache, "failed": 0, "client_cpu_share": 0.01}
    runs = [{"case": "c", "server": "kv", "summary": summary(v, 0.5)} for v in (10, 30, 20)]
    runs += [{"case": "c", "server": "hf", "summary": summary(v, None)} for v in (5, 4, 100)]
    table = median_table(runs, ("kv", "hf"))
    assert table.splitlines()[2:] == [
        "| c | kv | 3 | 20 | 60 | 10 | 20 | 5 | 50 | 0 | 1 |",     # medians of 3 runs
        "| c | hf | 3 | 5 | 15 | 10 | 20 | 5 | - | 0 | 1 |",
        "| c | ratio kv/hf | | 4 | 4 | 1 | 1 | 1 | - | - | 1 |"]
    prompts = [c.workload.sessions[0].turns[0].new_token_ids
               for rep in (0, 1) for c in cases(0.25, rep)]
    assert len(set(prompts)) == len(prompts)  # no case or repetition reuses another's prompts


def _raw_server_run(response: bytes, n_requests: int = 2,
                    answers_per_connection: int | None = None) -> list[RequestResult]:
    """Stream `response` verbatim to each request, over one kept-alive connection (the server
    closes a connection after `answers_per_connection` answers, at the next request, without
    a word: llama-server does so after each streamed answer)."""
    import asyncio

    from kvloop.bench.client import Connection, Endpoint, stream_completion

    async def main() -> list[RequestResult]:
        connections = 0

        async def handle(reader, writer) -> None:
            nonlocal connections
            connections += 1
            answers = 0
            while await reader.readline():
                length = 0
                while (h := await reader.readline()) not in (b"\r\n", b""):
                    if h.lower().startswith(b"content-length:"):
                        length = int(h.split(b":")[1])
                await reader.readexactly(length)
                if answers == answers_per_connection:
                    break
                answers += 1
                writer.write(response)
                await writer.drain()
                if b"Connection: close" in response:
                    break
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        conn = Connection(Endpoint.parse(f"http://127.0.0.1:{port}"))
        results = []
        for i in range(n_requests):
            results.append(await stream_completion(conn, b"{}", RequestResult(0, i, 1, 3)))
        await conn.close()
        server.close()
        results[0].session_id = connections  # smuggle the connection count out
        return results

    return asyncio.run(main())


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@pytest.mark.processes
def test_client_reassembles_events_across_odd_chunking_and_keeps_alive() -> None:
    events = (b'data: {"choices":[{"text":"a","token_ids":[1]}]}\r\n\r\n'
              b'data: {"choices":[{"text":"b","token_ids":[2,3]}]}\n\n'
              b': keep-alive comment\n\n'
              b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":3}}\n\n'
              b"data: [DONE]\n\n")
    pieces = [events[:7], events[7:60], events[60:61], events[61:]]  # splits mid-event
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    results = _raw_server_run(head + b"".join(_chunk(p) for p in pieces) + b"0\r\n\r\n")
    assert results[0].session_id == 1  # both requests on one connection
    for r in results:
        assert r.ok and r.output_token_ids == [1, 2, 3] and r.output_tokens == 3
        assert len(r.chunk_times) == 2


@pytest.mark.processes
def test_client_reads_close_delimited_streams_and_sized_errors() -> None:
    body = b'data: {"choices":[{"text":"x"}]}\n\ndata: [DONE]\n\n'
    closing = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + body
    results = _raw_server_run(closing)
    assert all(r.ok and r.output_tokens == 1 for r in results)
    assert results[0].session_id == 2  # reconnected after the server closed
    err = b'{"error":{"message":"nope"}}'
    sized = b"HTTP/1.1 503 Busy\r\nContent-Length: %d\r\n\r\n%s" % (len(err), err)
    assert [r.error for r in _raw_server_run(sized)] == ["HTTP 503: nope"] * 2
    cut = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + body[:20]
    assert _raw_server_run(cut, 1)[0].error == "the stream ended without [DONE]"


@pytest.mark.processes
def test_client_resends_once_when_a_kept_alive_connection_was_closed_unannounced() -> None:
    body = b'data: {"choices":[{"text":"x"}]}\n\ndata: [DONE]\n\n'
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
               b"Keep-Alive: timeout=5, max=100\r\n\r\n" + _chunk(body) + b"0\r\n\r\n")
    results = _raw_server_run(chunked, 3, answers_per_connection=1)
    assert [(r.ok, r.output_tokens) for r in results] == [(True, 1)] * 3
    assert results[0].session_id == 3  # one connection per answer, no request lost
