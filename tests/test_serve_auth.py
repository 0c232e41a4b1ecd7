"""API keys, the admin key, the body limit and the read timeouts of a real `kvloop serve
--model sim`, through the `openai` client, httpx and raw sockets."""

from __future__ import annotations

import selectors
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvloop.cli import build_parser
from kvloop.front.auth import AuthConfig, Caller, auth_config, check_key
from kvloop.front.launcher import ServeProcess
from kvloop.front.tokenizer import Tokenizer, find_model_path

from .conftest import bearer, sdk, serving

KEYS = ("key-one", "key-two")
ADMIN = "admin-key"
LIMIT = 4096
EMBEDDED = find_model_path(None)      # what a simulated SmolLM2 worker reports as its path
TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    sock = tmp_path_factory.mktemp("serve_auth_ipc") / "events.sock"
    with serving(tmp_path_factory, "serve_auth", [
            "--model", "sim", "--sim-speedup", "50", "--api-key", KEYS[0], "--api-key", KEYS[1],
            "--admin-api-key", ADMIN, "--kv-events-endpoint", f"ipc://{sock}",
            "--max-request-body-bytes", str(LIMIT), "--http-header-timeout", str(TIMEOUT_S),
            "--http-body-timeout", str(TIMEOUT_S)]) as srv:
        yield srv


def assert_error(r: httpx.Response, code: int, type_: str) -> dict[str, Any]:
    assert r.status_code == code, r.text
    err = r.json()["error"]
    assert (err["code"], err["type"], err["param"]) == (code, type_, None), err
    return err  # type: ignore[no-any-return]


# --- API keys -----------------------------------------------------------------------------------
@pytest.mark.processes
def test_the_openai_client_needs_one_of_the_keys(server: ServeProcess) -> None:
    import openai
    for key in KEYS:
        r = sdk(server.url, key).completions.create(model="sim", prompt="hi", max_tokens=3)
        assert r.usage is not None and r.usage.completion_tokens == 3
    chat = sdk(server.url, KEYS[1]).chat.completions.create(
        model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.choices[0].finish_reason == "length"
    with pytest.raises(openai.AuthenticationError) as e:
        sdk(server.url, "not-a-key").completions.create(model="sim", prompt="hi", max_tokens=1)
    assert e.value.status_code == 401
    assert e.value.body == {"message": "invalid API key", "type": "UnauthorizedError",
                            "param": None, "code": 401}
    assert e.value.response.headers["www-authenticate"].startswith("Bearer")


@pytest.mark.processes
def test_no_key_is_refused_in_the_openai_error_shape(server: ServeProcess) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    err = assert_error(r, 401, "UnauthorizedError")
    assert "Authorization: Bearer" in err["message"] and KEYS[0] not in err["message"]
    assert r.headers["www-authenticate"] == 'Bearer realm="kvloop"'
    wrong_scheme = {"Authorization": f"Basic {KEYS[0]}"}
    assert httpx.get(server.url + "/v1/models", headers=wrong_scheme).status_code == 401
    # the admin key is a key too
    assert httpx.get(server.url + "/v1/models", headers=bearer(ADMIN)).status_code == 200


@pytest.mark.processes
def test_public_routes_answer_without_a_key_and_the_rest_need_one(server: ServeProcess) -> None:
    for path in ("/health", "/ping", "/load", "/version"):
        assert httpx.get(server.url + path).status_code == 200, path
    metrics = httpx.get(server.url + "/metrics")
    assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text
    for method, path in (("GET", "/v1/models"), ("POST", "/tokenize"), ("GET", "/kvloop/stats"),
                         ("GET", "/kv_event_sources"), ("GET", "/no/such/route")):
        r = httpx.request(method, server.url + path, json={"prompt": "a"})
        assert_error(r, 401, "UnauthorizedError")
        ok = httpx.request(method, server.url + path, json={"prompt": "a"}, headers=bearer(KEYS[0]))
        assert ok.status_code == (404 if path == "/no/such/route" else 200), (path, ok.text)


def _leaks(info: Any, where: str = "") -> list[str]:
    """Keys named like a pid or a path, and string values that look like file paths."""
    out: list[str] = []
    if isinstance(info, dict):
        for k, v in info.items():
            if "pid" in k or "path" in k:
                out.append(f"{where}{k}")
            out += _leaks(v, f"{where}{k}.")
    elif isinstance(info, str) and ("/" in info and not info.startswith("tcp://")):
        out.append(f"{where} = {info!r}")
    return out


@pytest.mark.processes
def test_worker_info_shows_pids_and_paths_only_to_a_key(server: ServeProcess) -> None:
    anon = httpx.get(server.url + "/kvloop/worker").json()
    assert _leaks(anon) == [] and anon["kv_events"]["endpoint"] is None
    assert (anon["block_size"], anon["hash_algo"], anon["hash_seed"]) == \
        (16, "sha256", "vllm-none-hash")
    assert (anon["api_key_required"], anon["api_key_accepted"]) == (True, False)
    for key in (KEYS[0], ADMIN):
        info = httpx.get(server.url + "/kvloop/worker", headers=bearer(key)).json()
        assert info["api_pid"] == server.pid and info["engine_pid"] not in (None, server.pid)
        assert info["model_path"] == EMBEDDED and info["api_key_accepted"] is True
        assert info["kv_events"]["endpoint"].startswith("ipc:///")
        assert _leaks(info) != []
    wrong = httpx.get(server.url + "/kvloop/worker", headers=bearer("nope")).json()
    assert _leaks(wrong) == [] and wrong["api_key_accepted"] is False


@pytest.mark.processes
def test_reset_prefix_cache_needs_the_admin_key(server: ServeProcess) -> None:
    url = server.url + "/reset_prefix_cache"
    r = httpx.post(url)
    assert "--admin-api-key" in assert_error(r, 401, "UnauthorizedError")["message"]
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert_error(httpx.post(url, headers=bearer("nope")), 401, "UnauthorizedError")
    assert_error(httpx.post(url, headers=bearer(KEYS[0])), 403, "ForbiddenError")
    assert httpx.post(url, headers=bearer(ADMIN)).json() == {"success": True}


def test_flags_and_the_environment_variable_give_the_keys() -> None:
    parse = build_parser().parse_args
    args = parse(["serve", "--api-key", "a", "--api-key", "b", "--admin-api-key", "z"])
    assert auth_config(args, {"VLLM_API_KEY": "e"}) == AuthConfig(("a", "b"), "z")
    router = parse(["router", "--api-key", "r", "--worker-api-key", "w"])
    assert (auth_config(router, {}), router.worker_api_key) == (AuthConfig(("r",)), "w")
    assert auth_config(parse(["serve"]), {"VLLM_API_KEY": "e"}) == AuthConfig(("e",))
    assert auth_config(parse(["serve"]), {}) == AuthConfig()
    for bad in ("", " lead", "in side"):
        with pytest.raises(ValueError):
            check_key(bad)


def test_who_sees_private_facts() -> None:
    """A configured key; without --api-key also callers on this host (they can run `ps`)."""
    for open_ in (AuthConfig(), AuthConfig(admin_api_key="adm")):
        assert [open_.sees_private(None, h) for h in ("127.0.0.1", "::1", "::ffff:127.0.0.1")] \
            == [True, True, True]
        assert [open_.sees_private(None, h) for h in ("10.0.0.7", "192.168.1.2", None, "x")] \
            == [False] * 4
    assert AuthConfig(admin_api_key="adm").sees_private("Bearer adm", "10.0.0.7")
    keyed = AuthConfig(("k",), "adm")
    assert not keyed.sees_private(None, "127.0.0.1")
    assert keyed.sees_private("Bearer k", "10.0.0.7") and keyed.sees_private("bearer adm", None)
    assert [keyed.identify(h) for h in (None, "Bearer x", "Bearer k", "Bearer adm")] == \
        [Caller.NONE, Caller.INVALID, Caller.API, Caller.ADMIN]


@pytest.mark.processes
def test_the_environment_key_works_and_admin_routes_are_off_without_an_admin_key(
        tmp_path: Path) -> None:
    import openai
    with ServeProcess(["--model", "sim", "--sim-speedup", "50"], tmp_path / "serve.log",
                      env={"VLLM_API_KEY": "env-key"}).start() as srv:
        r = sdk(srv.url, "env-key").completions.create(model="sim", prompt="x", max_tokens=2)
        assert r.usage is not None and r.usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            sdk(srv.url, KEYS[0]).models.list()
        assert httpx.get(srv.url + "/health").status_code == 200
        r2 = httpx.post(srv.url + "/reset_prefix_cache", headers=bearer("env-key"))
        assert "disabled" in assert_error(r2, 403, "ForbiddenError")["message"]
        assert _leaks(httpx.get(srv.url + "/kvloop/worker").json()) == []
    assert "Traceback" not in srv.log()


# --- body limit ---------------------------------------------------------------------------------
def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def _read_until_closed(s: socket.socket, timeout_s: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection."""
    s.settimeout(timeout_s)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def _head(key: str, extra: str) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\n{extra}\r\n").encode()


@pytest.mark.processes
def test_a_body_over_the_limit_gets_413(server: ServeProcess) -> None:
    import openai
    client = sdk(server.url, KEYS[0])
    fits = "y" * (LIMIT - 200)          # the JSON body stays under the limit
    ok = client.completions.create(model="sim", prompt=fits, max_tokens=1)
    smol = Tokenizer.from_model(None)   # (here, not at import: 0.3 s of every collection)
    assert ok.usage is not None and ok.usage.prompt_tokens == len(smol.encode(fits))
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="sim", prompt="y" * LIMIT, max_tokens=1)
    assert e.value.status_code == 413
    assert e.value.body["type"] == "RequestEntityTooLargeError"  # type: ignore[index]


@pytest.mark.processes
def test_a_chunked_body_is_refused_before_the_client_finished_sending(
        server: ServeProcess) -> None:
    with _connect(server.url) as s:
        s.sendall(_head(KEYS[0], "Transfer-Encoding: chunked\r\n"))
        s.sendall(b"%x\r\n" % (LIMIT + 1) + b"z" * (LIMIT + 1) + b"\r\n")
        answer = _read_until_closed(s)   # the final chunk was never sent
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert b'"type":"RequestEntityTooLargeError"' in answer


@pytest.mark.processes
def test_a_huge_content_length_is_refused_before_any_body(server: ServeProcess) -> None:
    with _connect(server.url) as s:
        s.sendall(_head(KEYS[0], f"Content-Length: {10 ** 12}\r\n"))
        answer = _read_until_closed(s)
    assert answer.startswith(b"HTTP/1.1 413 ") and b"--max-request-body-bytes" in answer


# --- read timeouts ------------------------------------------------------------------------------
def _closed_within(socks: list[socket.socket], timeout_s: float) -> dict[socket.socket, bytes]:
    """What each socket received before the server closed it; only those closed in time."""
    sel = selectors.DefaultSelector()
    got: dict[socket.socket, bytes] = {}
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
        got[s] = b""
    closed: dict[socket.socket, bytes] = {}
    deadline = time.monotonic() + timeout_s
    while len(closed) < len(socks) and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.2):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if chunk:
                got[s] += chunk
            else:
                sel.unregister(s)
                closed[s] = got[s]
    sel.close()
    return closed


def half_sent_requests_are_closed(url: str, key: str, n: int, timeout_s: float) -> None:
    """`n` sockets stall mid-headers and 4 mid-body; a normal request still works
    meanwhile; the server closes all of them with 408 within the timeout (plus slack)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = _connect(url)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
            socks.append(s)
        for _ in range(4):
            s = _connect(url)
            s.sendall(_head(key, "Content-Length: 100\r\n") + b'{"prompt":')
            socks.append(s)
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/completions", json={"prompt": "ok", "max_tokens": 1},
                       headers=bearer(key), timeout=10)
        assert r.status_code == 200, r.text
        closed = _closed_within(socks, timeout_s + 8.0)
        elapsed = time.monotonic() - t0
        assert len(closed) == len(socks), f"{len(socks) - len(closed)} sockets still open"
        assert elapsed >= timeout_s * 0.5, elapsed
        headers = [closed[s] for s in socks[:n]]
        bodies = [closed[s] for s in socks[n:]]
        assert all(b.startswith(b"HTTP/1.1 408 ") and b"--http-header-timeout" in b
                   for b in headers), {b[:80] for b in headers}
        assert all(b.startswith(b"HTTP/1.1 408 ") and b"--http-body-timeout" in b
                   for b in bodies), {b[:80] for b in bodies}
    finally:
        for s in socks:
            s.close()


@pytest.mark.processes
def test_half_sent_requests_do_not_hold_sockets(server: ServeProcess) -> None:
    half_sent_requests_are_closed(server.url, KEYS[0], 200, TIMEOUT_S)
    assert httpx.get(server.url + "/health").status_code == 200


def _one_response(s: socket.socket) -> bytes:
    """One HTTP response with a Content-Length body, read off a kept-alive socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += s.recv(65536)
    return head


@pytest.mark.processes
def test_a_silent_connection_is_closed_and_keep_alive_still_works(server: ServeProcess) -> None:
    with _connect(server.url) as s:
        assert _read_until_closed(s).startswith(b"HTTP/1.1 408 ")   # sent nothing at all
    body = b'{"prompt": "k", "max_tokens": 1}'
    with _connect(server.url) as s:
        for _ in range(2):   # one connection, idle longer than the header timeout between
            s.sendall(_head(KEYS[0], f"Content-Length: {len(body)}\r\n") + body)
            assert _one_response(s).startswith(b"HTTP/1.1 200 ")
            time.sleep(TIMEOUT_S * 1.5)
