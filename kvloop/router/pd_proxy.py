"""The router's P/D flow over HTTP (docs/disaggregation.md sections 2 and 6).

    1. Router.pick_pd: the decode worker D, remote or local prefill, the prefill worker P;
    2. remote: POST the prefill leg to P: the client's body with `kv_transfer_params`
       {do_remote_decode: true, ...}, max_tokens 1 (and max_completion_tokens 1 where the
       client set it or on chat), min_tokens 1, stream false, no stream_options; read P's
       answer whole and take its top-level `kv_transfer_params`;
    3. POST the decode leg to D: the client's body plus P's `kv_transfer_params`, verbatim
       (local: the client's body alone); D's answer, streamed or not, goes back with D's
       status and Content-Type (`SingleFlow._relay` / `_whole`).

Both legs carry one `X-Request-Id` (the client's, else a new uuid4). A client that
disconnects during the prefill leg closes P's connection (P aborts it) and D is never asked;
during the decode leg it closes D's (D aborts, and tells P it is done with the blocks). A
prefill leg that fails (5xx, no connection, no answer within --prefill-timeout, or a 200
without usable `kv_transfer_params`) falls back to decode-only: D prefills the prompt
itself; the fallback is counted (`kvloop_router_pd_fallbacks_total{worker,reason}`), logged
and shown in /health; a timed-out P gets no prefill leg for one liveness window. A 4xx from
P is the client's error: it goes back to the client as P sent it. A decode worker that refuses
the connection is marked down and the request is routed again (nothing reached it; a prefill
leg done for it is left to its lease).

Owner: `PDFlow` owns nothing but its reference to the `SingleFlow` (the HTTP client, the relay),
which it sees through `FlowApp`; the pieces both flows use are `relay.py`'s.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import httpx
from starlette.requests import Request
from starlette.responses import Response

from kvloop.router import tracing
from kvloop.router.flow import FlowKey, Permit
from kvloop.router.pd import (
    NO_KV_TRANSFER_PARAMS,
    PREFILL_CONNECTION,
    PREFILL_HTTP_ERROR,
)
from kvloop.router.relay import (
    RETRY,
    Disconnected,
    Retry,
    cached_tokens,
    error_response,
    json_or_none,
    response_headers,
    unless_disconnected,
)
from kvloop.router.request import RoutingRequest
from kvloop.router.router import NoWorkerError, PDRouted, Routed, Router
from kvloop.wire import PREFILL_PARAMS, malformed_remote_field, missing_remote_keys

CHAT_PATH = "/v1/chat/completions"
REQUEST_ID = "x-request-id"


def prefill_body(body: dict[str, Any], path: str) -> dict[str, Any]:
    """The prefill leg's body: the client's, made a one-token, non-streamed prefill whose
    blocks P holds for a decode worker. The client's min_tokens goes to D only."""
    out = {k: v for k, v in body.items()
           if k not in ("stream_options", "min_completion_tokens")}
    out.update(kv_transfer_params=dict(PREFILL_PARAMS), stream=False, max_tokens=1,
               min_tokens=1)
    if path == CHAT_PATH or "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


def answer_params(payload: Any) -> tuple[dict[str, Any] | None, str]:
    """P's `kv_transfer_params` if D can use them, else (None, what is wrong)."""
    params = payload.get("kv_transfer_params") if isinstance(payload, dict) else None
    if not isinstance(params, dict):
        return None, "its answer has no kv_transfer_params (a worker without a KV connector?)"
    missing = missing_remote_keys(params)   # D's rule: D would refuse them
    if not isinstance(params.get("remote_block_ids"), list) and "remote_block_ids" not in missing:
        missing.append("remote_block_ids")   # not a list of blocks: D could not pull them
    if missing:
        return None, f"its kv_transfer_params lack {', '.join(missing)}"
    malformed = malformed_remote_field(params)
    if malformed is not None:
        return None, f"its kv_transfer_params are malformed: {malformed}"
    return params, ""


class FlowApp(Protocol):
    """What the P/D flow asks of the single-worker flow (`kvloop.router.single.SingleFlow`):
    its router, its HTTP client to the workers, flow control's admission, a routing decision
    off or on the event loop, and the single-worker flow's last two steps, reused for the
    decode leg."""

    router: Router
    client: httpx.AsyncClient | None

    async def admission(self, request: Request, key: FlowKey | None) -> Permit | Response: ...

    async def decide(self, route: Callable[..., PDRouted], *args: Any) -> PDRouted: ...

    async def open_upstream(self, request: Request, routed: Routed, path: str, raw: bytes,
                            headers: dict[str, str]) -> httpx.Response | Response | Retry: ...

    async def answer(self, request: Request, upstream: httpx.Response, routed: Routed,
                     stream: bool, strip_usage: bool) -> Response: ...


class PDFlow:
    """The P/D flow beside one `SingleFlow` (through its `FlowApp` interface)."""

    def __init__(self, app: FlowApp):
        self.app = app
        self.router = app.router

    async def send(self, request: Request, rr: RoutingRequest, raw: bytes,
                   body: dict[str, Any], headers: dict[str, str], stream: bool,
                   strip_usage: bool) -> Response:
        """`body` (`raw` encoded) through `Router.pick_pd(rr)`'s legs; a decode worker that
        refuses the connection is excluded and the request picked again."""
        headers = {**headers, REQUEST_ID: headers.get(REQUEST_ID) or uuid.uuid4().hex}
        path = rr.path
        permit = await self.app.admission(request, rr.flow_key)
        if isinstance(permit, Response):
            return permit
        while True:
            try:
                routed = await self.app.decide(self.router.pick_pd, rr)
            except NoWorkerError as e:
                return error_response(str(e), 503)
            finally:
                permit.close()   # routed: its decode ticket counts it from now on
            try:
                answer = await self._legs(request, path, raw, body, headers, routed, stream,
                                          strip_usage)
            except BaseException:   # cancelled or a bug: no leg's ticket stays open
                if routed.prefill is not None:
                    self.router.finish(routed.prefill.ticket, None, "disconnected")
                self.router.finish(routed.decode.ticket, None, "disconnected")
                raise
            if answer is RETRY:
                rr = rr.continued(exclude=[routed.decode.worker.name])
                continue
            assert isinstance(answer, Response)
            return answer

    async def _legs(self, request: Request, path: str, raw: bytes, body: dict[str, Any],
                    headers: dict[str, str], routed: PDRouted, stream: bool,
                    strip_usage: bool) -> Response | Retry:
        """The prefill leg (if remote), then the decode leg and D's answer to the client."""
        decode_raw = raw
        if routed.prefill is not None:
            got = await unless_disconnected(request, self._prefill(path, body, headers,
                                                                   routed))
            if isinstance(got, Disconnected):
                self.router.prefill_abandoned(routed)
                return Response(status_code=499)
            if isinstance(got, Response):
                return got
            if got is not None:
                decode_raw = json.dumps({**body, "kv_transfer_params": got}).encode()
        upstream = await self.app.open_upstream(request, routed.decode, path, decode_raw,
                                                headers)
        if not isinstance(upstream, httpx.Response):
            return upstream
        return await self.app.answer(request, upstream, routed.decode, stream, strip_usage)

    async def _prefill(self, path: str, body: dict[str, Any], headers: dict[str, str],
                       routed: PDRouted) -> dict[str, Any] | Response | None:
        """The prefill leg: P's kv_transfer_params, P's own 4xx answer, or None (fallen
        back to decode-only)."""
        client = self.app.client
        assert client is not None and routed.prefill is not None
        p = routed.prefill.worker
        t0 = time.perf_counter()
        cfg = self.router.config
        timeout = httpx.Timeout(cfg.pd.prefill_timeout_s,
                                connect=cfg.liveness.connect_timeout_s)
        headers = tracing.leg_headers(headers, routed.prefill, "prefill")
        try:
            r = await client.post(p.spec.url + path, headers=headers, timeout=timeout,
                                  content=json.dumps(prefill_body(body, path)).encode())
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            self.router.prefill_failed(routed, PREFILL_CONNECTION, repr(e))
            self.router.worker_down(p.name, f"connection failed: {e!r}")
            return None
        except httpx.TimeoutException as e:   # a frozen or swamped prefill worker
            self.router.prefill_timed_out(routed, f"no answer within --prefill-timeout "
                                                  f"{cfg.pd.prefill_timeout_s:g}s ({e!r})")
            return None
        except httpx.TransportError as e:
            self.router.prefill_failed(routed, PREFILL_CONNECTION, repr(e))
            return None
        finally:
            self.router.metrics.pd_prefill_seconds.observe(time.perf_counter() - t0)
            tracing.leg_done(routed.prefill)
        if r.status_code >= 500:
            self.router.prefill_failed(routed, PREFILL_HTTP_ERROR,
                                       f"HTTP {r.status_code}: {r.text[:200]}")
            return None
        if r.status_code >= 400:
            self.router.prefill_refused(routed)
            return Response(r.content, status_code=r.status_code, headers=response_headers(r))
        payload = json_or_none(r.content)
        params, problem = answer_params(payload)
        if params is None:
            self.router.prefill_failed(routed, NO_KV_TRANSFER_PARAMS, problem)
            return None
        self.router.prefill_done(routed, cached_tokens(payload), params)
        return params
