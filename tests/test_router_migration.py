"""Mid-stream migration (`--migration-limit`): a stream whose worker dies goes on elsewhere.

- `Migration` on its own: which streams migrate, what it records and strips, the
  continuation it asks for, how a continuation's chunks are translated (exact dicts);
- kill -9 of a simulated worker holding streams among 20 in flight, with
  `--migration-limit 1`: every stream completes as one answer (one id, every token asked
  for, one finish, usage over the whole answer); migrations counted and logged with both
  workers named; with the limit 0 the same kill ends those streams with the error event.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

from kvloop.front.prometheus_text import metric_value
from kvloop.router.fleet import Fleet, FleetConfig
from kvloop.router.migration import Leg, Migration, refusal
from kvloop.router.sessions import SESSION_HEADER, session_key
from tests.conftest import RouterThread, needs_embedded_model, wait_until
from tests.test_router_fleet import ADMIN, SIM_ARGS, random_ids, router_config

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _migration(path: str = COMPLETIONS, **body: Any) -> Migration:
    m = Migration.of(path, {"stream": True, **body}, {}, 1, None, [1, 2, 3])
    assert m is not None
    return m


def _data(m: Migration, payload: dict[str, Any]) -> dict[str, Any] | None:
    out = m.on_event(json.dumps(payload).encode())
    return None if out is None else json.loads(out)


# --- Migration on its own -------------------------------------------------------------------
@pytest.mark.parametrize(("path", "body", "why"), [
    (COMPLETIONS, {"prompt": "hi"}, None),
    (COMPLETIONS, {"prompt": [1, 2]}, None),
    (CHAT, {"messages": [], "response_format": {"type": "text"}, "logprobs": False}, None),
    (COMPLETIONS, {"prompt": ["a", "b"]}, "several prompts"),
    (COMPLETIONS, {"prompt": "hi", "n": 2}, "n or best_of over 1"),
    (COMPLETIONS, {"prompt": "hi", "echo": True}, "echo is set"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 0}, "logprobs is set"),
    (CHAT, {"messages": [], "tools": [{}]}, "tools is set"),
    (CHAT, {"messages": [], "response_format": {"type": "json_object"}},
     "response_format is set"),
    ("/v1/messages", {}, "/v1/messages streams do not migrate"),
])
def test_which_streams_migrate(path, body, why):
    assert refusal(path, body) == why


def test_a_completions_stream_is_recorded_stripped_and_continued():
    m = _migration(prompt="hi", max_tokens=10, temperature=0, min_tokens=4, echo=False)
    assert m.body["return_token_ids"] is True and not m.client_ids
    first = {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "sim",
             "choices": [{"index": 0, "text": " a", "logprobs": None, "finish_reason": None,
                          "stop_reason": None, "token_ids": [7], "prompt_token_ids": [1, 2]}]}
    assert _data(m, first) == {**first, "choices": [{
        "index": 0, "text": " a", "logprobs": None, "finish_reason": None,
        "stop_reason": None}]}
    ids_only = {**first, "choices": [{"index": 0, "text": "", "logprobs": None,
                                      "finish_reason": None, "token_ids": [8]}]}
    assert _data(m, ids_only) is None                 # nothing the client asked for
    assert m.prompt_ids == [1, 2] and m.output_ids == [7, 8]
    leg = m.next_leg("w1")
    assert isinstance(leg, Leg) and leg.path == COMPLETIONS and leg.tokens == [1, 2, 7, 8]
    assert json.loads(leg.raw) == {
        "prompt": [1, 2, 7, 8], "max_tokens": 8, "min_tokens": 2, "temperature": 0,
        "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    assert leg.max_tokens == 8 and m.failed == ["w1"] and m.moves == 1
    cont = {"id": "cmpl-2", "object": "text_completion", "created": 9, "model": "sim",
            "choices": [{"index": 0, "text": " b", "logprobs": None, "finish_reason": "length",
                         "stop_reason": None, "token_ids": [9],
                         "prompt_token_ids": [1, 2, 7, 8]}]}
    assert _data(m, cont) == {"id": "cmpl-1", "object": "text_completion", "created": 5,
                              "model": "sim", "choices": [{
                                  "index": 0, "text": " b", "logprobs": None,
                                  "finish_reason": "length", "stop_reason": None}]}
    usage = {"id": "cmpl-2", "object": "text_completion", "created": 9, "model": "sim",
             "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 8,
                                      "total_tokens": 12}}
    assert _data(m, usage)["usage"] == {"prompt_tokens": 2, "completion_tokens": 10,
                                        "total_tokens": 12}
    assert m.finished and m.output_ids == [7, 8, 9]
    assert m.next_leg("w2") == "--migration-limit 1 reached"


def test_a_chat_stream_continues_as_chat_chunks():
    m = _migration(CHAT, messages=[{"role": "user", "content": "x"}], return_token_ids=True)
    role = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5,
            "model": "sim", "prompt_token_ids": [3, 4],
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None, "stop_reason": None}]}
    assert _data(m, role) == role                     # the client asked for the ids
    _data(m, {**role, "choices": [{"index": 0, "delta": {"content": "a"}, "logprobs": None,
                                   "finish_reason": None, "token_ids": [5]}]})
    leg = m.next_leg("w1")
    assert isinstance(leg, Leg)
    body = json.loads(leg.raw)
    assert body["prompt"] == [3, 4, 5] and body["max_tokens"] is None   # all the room left
    assert "messages" not in body
    cont = {"id": "cmpl-9", "object": "text_completion", "created": 9, "model": "sim",
            "choices": [{"index": 0, "text": "b", "logprobs": None, "finish_reason": None,
                         "stop_reason": None, "token_ids": [6], "prompt_token_ids": [3, 4, 5]}]}
    assert _data(m, cont) == {"id": "chatcmpl-1", "object": "chat.completion.chunk",
                              "created": 5, "model": "sim", "choices": [{
                                  "index": 0, "delta": {"content": "b"}, "logprobs": None,
                                  "finish_reason": None, "stop_reason": None,
                                  "token_ids": [6]}]}


def test_a_stream_that_sent_nothing_is_sent_again_as_it_was():
    m = _migration(prompt="hi", max_tokens=3)
    leg = m.next_leg("w1")
    assert isinstance(leg, Leg) and leg.path == COMPLETIONS and leg.tokens is None
    assert json.loads(leg.raw) == m.body and leg.max_tokens == 3


def test_every_token_relayed_leaves_nothing_to_continue():
    m = _migration(prompt="hi", max_tokens=1)
    _data(m, {"id": "c", "created": 1, "model": "s", "choices": [
        {"index": 0, "text": "a", "token_ids": [5], "prompt_token_ids": [1]}]})
    assert m.next_leg("w1") == "every token asked for was relayed"


def test_a_leg_that_ends_the_stream_itself_is_interrupted_and_moves_on():
    m = _migration(prompt="hi", max_tokens=5)
    head = {"id": "c", "created": 1, "model": "s"}
    _data(m, {**head, "choices": [{"index": 0, "text": "a", "token_ids": [5],
                                   "prompt_token_ids": [1], "finish_reason": None}]})
    abort = {**head, "choices": [{"index": 0, "text": "", "finish_reason": "abort"}]}
    assert _data(m, abort) is None and m.interrupted == 'finish_reason "abort" (the worker ' \
        'is stopping)'
    assert _data(m, {**head, "choices": [], "usage": {"completion_tokens": 1}}) is None
    assert m.on_event(b"[DONE]") is None          # the rest of that leg is dropped
    leg = m.next_leg("w1")
    assert isinstance(leg, Leg) and json.loads(leg.raw)["max_tokens"] == 4
    assert m.interrupted is None and m.on_event(b"[DONE]") == b"[DONE]"
    # no move left: the next leg's abort or error reaches the client as it is
    assert _data(m, abort) is not None and m.interrupted is None
    error = {"error": {"message": "the engine core process died", "code": 500}}
    assert _data(m, error) == error


@pytest.mark.parametrize("command", ["router", "fleet"])
def test_the_flag_reaches_the_router_config(command):
    from kvloop.cli import build_parser
    from kvloop.router.cli_args import router_config as config_of

    args = build_parser().parse_args([command, "--migration-limit", "2"])
    assert config_of(args).migration_limit == 2
    assert config_of(build_parser().parse_args([command])).migration_limit == 0
    with pytest.raises(ValueError, match="migration_limit must be >= 0"):
        config_of(build_parser().parse_args([command, "--migration-limit", "-1"]))


# --- a fleet of simulated workers -----------------------------------------------------------
def _revive(fleet: Fleet) -> None:
    """Start again any worker of a module's fleet that an earlier case killed (the last
    case's victim is left dead: the fleet stops after it)."""
    for i, p in enumerate(fleet.workers):
        if not p.alive():
            fleet.workers[i] = fleet.worker(i)
            fleet.workers[i].start(300)


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    f = Fleet(FleetConfig(3, "sim", ("both",), SIM_ARGS + ("--sim-speedup", "4"),
                          start_timeout_s=120, stop_timeout_s=10, echo_output=False))
    try:
        f.start()
        yield f
    finally:
        f.stop()


# Streams last seconds, so every one is still running when a test kills its worker, also on a
# loaded machine.
MAX_TOKENS = 400


def _body(i: int) -> tuple[str, dict[str, Any]]:
    """Stream `i`: completions or chat, token ids asked for or not, usage always."""
    common = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
              "stream_options": {"include_usage": True}, "return_token_ids": i % 4 < 2}
    if i % 2:
        return CHAT, {**common, "messages": [{"role": "user", "content": f"story {i}"}]}
    return COMPLETIONS, {**common, "prompt": f"Once upon a time {i}"}


class Stream:
    """One client stream on its own thread: its events' payloads, and whether it started."""

    def __init__(self, url: str, i: int, body: tuple[str, dict[str, Any]] | None = None,
                 headers: dict[str, str] | None = None):
        self.path, self.body = body or _body(i)
        self.headers = headers or {}
        self.payloads: list[Any] = []
        self.url = url
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with httpx.stream("POST", self.url + self.path, json=self.body, timeout=60,
                          headers=self.headers) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    self.payloads.append(data if data == "[DONE]" else json.loads(data))
                    if len(self.payloads) >= 3:
                        self.started.set()

    def check_one_answer(self) -> None:
        """One id, no error, every token asked for, one finish, usage over the whole."""
        p = self.payloads
        assert p[-1] == "[DONE]", p[-3:]
        chunks = p[:-1]
        assert not any("error" in c for c in chunks), [c for c in chunks if "error" in c]
        assert len({c["id"] for c in chunks}) == 1
        choices = [ch for c in chunks for ch in c["choices"]]
        assert [ch["finish_reason"] for ch in choices if ch["finish_reason"]] == ["length"]
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == MAX_TOKENS
        assert usage["total_tokens"] == usage["prompt_tokens"] + MAX_TOKENS
        if self.body.get("return_token_ids"):
            assert sum(len(ch.get("token_ids", [])) for ch in choices) == MAX_TOKENS
        else:
            assert not any("token_ids" in ch for ch in choices)


def _kill_the_busiest(rt: RouterThread, fleet: Fleet, streams: list[Stream]) -> tuple[str, int]:
    for s in streams:
        assert s.started.wait(30), "a stream did not start"
    victim = max(rt.router.registry.all(), key=lambda w: w.in_flight())
    held = victim.in_flight()
    proc = next(p for p in fleet.workers if p.url == victim.spec.url)
    os.kill(proc.pid, signal.SIGKILL)
    return victim.name, held


@pytest.mark.processes
def test_kill_9_with_20_streams_in_flight_and_migration_limit_1_completes_every_stream(
        fleet, caplog):
    caplog.set_level(logging.WARNING, "kvloop.router")
    _revive(fleet)
    cfg = replace(router_config(), migration_limit=1)
    with RouterThread(cfg, fleet.specs()) as rt:
        streams = [Stream(rt.url, i) for i in range(20)]
        victim, held = _kill_the_busiest(rt, fleet, streams)
        assert held >= 2
        for s in streams:
            s.thread.join(60)
            assert not s.thread.is_alive()
            s.check_one_answer()
        text = httpx.get(rt.url + "/metrics").text
        assert metric_value(text, "kvloop_router_migrations_total", worker=victim,
                            outcome="migrated") == held
        moved = [r.getMessage() for r in caplog.records if "stream migrated" in r.getMessage()]
        assert len(moved) == held
        assert all(f"from worker {victim} to worker " in m for m in moved)
        assert all(w.in_flight() == 0 for w in rt.router.registry.all())


@pytest.mark.processes
def test_without_migration_the_same_kill_ends_those_streams_with_the_error_event(fleet):
    _revive(fleet)
    with RouterThread(router_config(), fleet.specs()) as rt:
        streams = [Stream(rt.url, i) for i in range(20)]
        victim, held = _kill_the_busiest(rt, fleet, streams)
        for s in streams:
            s.thread.join(60)
        failed = [s for s in streams if any("error" in c for c in s.payloads[:-1])]
        assert len(failed) == held >= 2
        assert all(f"worker {victim} failed mid-stream" in s.payloads[-2]["error"]["message"]
                   for s in failed)


# --- the embedded model: greedy text equals an uninterrupted run ----------------------------
# fp32, every step dense: the continuation's prefill and the uninterrupted run's decode
# steps then agree to the last bit that matters for a greedy pick (tests/test_pd_serve_model)
MODEL_ARGS = ("--dtype", "float32", "--low-bit-max-tokens", "0", "--max-model-len", "1024",
              "--max-num-seqs", "4", "--kv-cache-memory", "128MiB")
GREEDY = {"max_tokens": 40, "temperature": 0, "stream": True}
QUESTIONS = [(COMPLETIONS, {"prompt": "The three primary colors are"}),
             (CHAT, {"messages": [{"role": "user",
                                   "content": "Name three rivers in Europe."}]})]


@pytest.fixture(scope="module")
def model_fleet() -> Iterator[Fleet]:
    from kvloop.locate import embedded_model_path

    f = Fleet(FleetConfig(2, embedded_model_path(), ("both",), MODEL_ARGS, start_timeout_s=300,
                          stop_timeout_s=10, echo_output=False))
    try:
        f.start()
        yield f
    finally:
        f.stop()


def _text(payloads: list[Any]) -> str:
    return "".join(ch.get("text") or ch.get("delta", {}).get("content") or ""
                   for p in payloads if p != "[DONE]" for ch in p["choices"])


def _stream_killing(rt: RouterThread, fleet: Fleet, path: str, body: dict[str, Any],
                    after: int | None) -> list[Any]:
    """The stream's payloads; after `after` chunks its worker is killed (None: never)."""
    payloads: list[Any] = []
    with httpx.stream("POST", rt.url + path, json={**body, **GREEDY}, timeout=240) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            payloads.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
            if after is not None and len(payloads) == after:
                w = next(w for w in rt.router.registry.all() if w.in_flight())
                os.kill(next(p.pid for p in fleet.workers if p.url == w.spec.url),
                        signal.SIGKILL)
    return payloads


@pytest.mark.parametrize(("path", "body"), QUESTIONS)
@pytest.mark.processes
@needs_embedded_model
def test_greedy_text_of_a_migrated_stream_equals_an_uninterrupted_run(model_fleet, path,
                                                                      body):
    """The second run is killed after 12 chunks: the rest comes from the other worker."""
    _revive(model_fleet)
    cfg = replace(router_config(), migration_limit=1)
    with RouterThread(cfg, model_fleet.specs()) as rt:
        whole = _stream_killing(rt, model_fleet, path, body, None)
        moved = _stream_killing(rt, model_fleet, path, body, 12)
        assert not any("error" in p for p in moved[:-1])
        assert len(_text(whole)) > 40
        assert _text(moved) == _text(whole)
        text = httpx.get(rt.url + "/metrics").text
        assert metric_value(text, "kvloop_router_migrations_total", outcome="migrated") == 1


# --- a migrated stream keeps its LoRA adapter and its session -------------------------------
@pytest.fixture
def lora_fleet(tmp_path) -> Iterator[Fleet]:
    """3 simulated workers; adapter `c` loaded on workers 0 and 1, not on worker 2."""
    (tmp_path / "c").mkdir()
    args = SIM_ARGS + ("--sim-speedup", "4", "--enable-lora", "--max-loras", "2",
                       "--lora-allowed-dirs", str(tmp_path))
    f = Fleet(FleetConfig(3, "sim", ("both",), args, start_timeout_s=120, stop_timeout_s=10,
                          echo_output=False))
    try:
        f.start()
        for w in f.workers[:2]:
            r = httpx.post(f"{w.url}/v1/load_lora_adapter", headers=ADMIN, timeout=30,
                           json={"lora_name": "c", "lora_path": str(tmp_path / "c")})
            assert r.status_code == 200, r.text
        yield f
    finally:
        f.stop()


@pytest.mark.processes
def test_a_migrated_stream_keeps_its_adapter_and_its_session(lora_fleet):
    """The prompt's base-model blocks sit on worker 2, which lacks the adapter: a
    continuation routed without its adapter goes there (its hashes match) and gets a 404.
    With the adapter, it goes on on the other holder, and the session follows it."""
    f = lora_fleet
    prompt = random_ids(random.Random(7), 512)
    cfg = replace(router_config(), migration_limit=1)
    with RouterThread(cfg, f.specs()) as rt:
        bystander = f.specs()[2].name
        r = httpx.post(f.workers[2].url + "/v1/completions", timeout=60,
                       json={"prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200, r.text
        wait_until(lambda: rt.router.index.worker_blocks(bystander) >= 512 // 16, 30,
                   "the base-model blocks of the prompt on worker 2 in the index")
        body = {"model": "c", "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        s = Stream(rt.url, 0, body=(COMPLETIONS, body), headers={SESSION_HEADER: "s-7"})
        victim, held = _kill_the_busiest(rt, f, [s])
        assert held == 1 and victim != bystander
        s.thread.join(60)
        assert not s.thread.is_alive()
        s.check_one_answer()
        survivor = next(w.name for w in f.specs()[:2] if w.name != victim)
        text = httpx.get(rt.url + "/metrics").text
        assert metric_value(text, "kvloop_router_migrations_total", worker=victim,
                            outcome="migrated") == 1
        turn = rt.router.sessions.last_turn(session_key({SESSION_HEADER: "s-7"}, {}),
                                            rt.router.clock())
        assert turn is not None and turn.worker == survivor
