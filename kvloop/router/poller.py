"""The router's worker poller: each worker's load from its /metrics, its identity (epoch)
and adapters from `GET /kvloop/worker`, re-probes of down workers, and the liveness alarms
after every round (`Router.check_liveness`).

Refused connections mark a worker down at once; slow or bad answers only after
`MAX_POLL_FAILURES` in a row (a busy worker is not a dead one). A worker whose epoch changed
restarted: it is registered again (its cache is gone).

Owner: `WorkerPoller` owns its poll task and per-worker failure counts; the HTTP client is
its front's (`RouterApp`), handed over at `start`.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
import msgspec

from kvloop.front.auth import WORKER_INFO_PATH
from kvloop.front.drain import DRAINING_METRIC
from kvloop.front.prometheus_text import metric_value, samples
from kvloop.router.registry import LoadSnapshot, WorkerDescription, WorkerSpec, WorkerState
from kvloop.router.router import Router

log = logging.getLogger("kvloop.router")

MAX_POLL_FAILURES = 3


class WorkerPoller:
    """Polls every registered worker every `poll_interval_s`; identity every
    `describe_every` rounds (and every round for a down worker)."""

    def __init__(self, router: Router, describe_every: int = 4):
        self.router = router
        self.describe_every = describe_every
        self.client: httpx.AsyncClient | None = None
        self._task: asyncio.Task[None] | None = None
        self._polls = 0
        self._poll_failures: dict[str, int] = {}

    def attach(self, client: httpx.AsyncClient) -> None:
        """The HTTP client it asks workers with (its front's)."""
        self.client = client

    def start(self) -> None:
        """Poll from now on, every `poll_interval_s`, until `stop`."""
        self._task = asyncio.create_task(self._poll_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def describe(self, spec: WorkerSpec) -> WorkerDescription | None:
        """The worker's `GET /kvloop/worker` answer; None when it has no such route (no
        kvloop worker: no hashing facts, no advertised events). Raises httpx.HTTPError when
        it cannot be asked, BadWorkerAnswer when its answer does not decode."""
        assert self.client is not None
        lv = self.router.config.liveness
        r = await self.client.get(spec.url + WORKER_INFO_PATH,
                                  timeout=lv.connect_timeout_s)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        try:
            return _DESCRIPTION.decode(r.content)
        except msgspec.DecodeError as e:   # malformed JSON, or a missing or mistyped field
            raise BadWorkerAnswer(f"{spec.url}{WORKER_INFO_PATH} answered what this router "
                                  f"cannot read: {e}") from e

    async def _poll_loop(self) -> None:
        interval = self.router.config.liveness.poll_interval_s
        while True:
            try:
                await self.poll_once()
            except Exception:  # the poller must survive any single bad answer
                log.exception("router poll failed")
            await asyncio.sleep(interval)

    async def poll_once(self) -> None:
        """Load of live workers, identity (epoch) checks, re-probes, alarms."""
        self._polls += 1
        describe = self._polls % self.describe_every == 0
        await asyncio.gather(*(self._poll_worker(w, describe)
                               for w in self.router.registry.all()))
        self.router.check_liveness()

    async def _poll_worker(self, w: WorkerState, describe: bool) -> None:
        if not w.up or describe:
            try:
                desc = await self.describe(w.spec)
            except (httpx.HTTPError, BadWorkerAnswer) as e:
                reason = describe_failure(w.spec, e)
                self.router.worker_down(w.name, reason)
                self.router.registry.note_unreachable(w.name, reason)   # if never up
                return
            epoch = desc.epoch if desc else None
            known = w.description.epoch if w.description else None
            if not w.up or epoch != known:
                if w.up:
                    log.warning("worker %s restarted (epoch %s -> %s): re-indexing", w.name,
                                known, epoch)
                else:
                    log.warning("worker %s is back (epoch %s)", w.name, epoch)
                self.router.register(w.spec, desc)
            elif desc is not None:
                self.router.registry.refresh_adapters(w.name, desc)
        await self._poll_load(w)

    async def _poll_load(self, w: WorkerState) -> None:
        """Read the worker's load. Refused connections mark it down at once; slow or bad
        answers only after `MAX_POLL_FAILURES` in a row (a busy worker is not a dead one)."""
        assert self.client is not None
        try:
            r = await self.client.get(w.spec.url + "/metrics",
                                      timeout=self.router.config.liveness.connect_timeout_s)
            r.raise_for_status()
        except httpx.HTTPError as e:
            failures = self._poll_failures.get(w.name, 0) + 1
            self._poll_failures[w.name] = failures
            if isinstance(e, httpx.ConnectError) or failures >= MAX_POLL_FAILURES:
                self.router.worker_down(w.name, f"/metrics failed: {e!r}")
            return
        self._poll_failures.pop(w.name, None)
        self.router.registry.set_load(w.name, parse_load(r.text, self.router.clock()))


class BadWorkerAnswer(ValueError):
    """A worker's `GET /kvloop/worker` answer that does not decode as a `WorkerDescription`."""


_DESCRIPTION = msgspec.json.Decoder(WorkerDescription)


def describe_failure(spec: WorkerSpec, e: Exception) -> str:
    """Why asking `spec` for its description failed (the reason a registration names)."""
    if isinstance(e, BadWorkerAnswer):
        return str(e)
    return f"GET {spec.url}{WORKER_INFO_PATH} failed: {e!r}"


def key_problems(spec: WorkerSpec, desc: WorkerDescription | None,
                  has_key: bool) -> list[str]:
    """Why requests forwarded to the worker would get 401 (empty: they would not, or a worker
    that is no kvloop one does not say)."""
    if desc is None or not desc.api_key_required or desc.api_key_accepted:
        return []
    if has_key:
        return [f"{spec.name} requires an API key and refused the router's "
                "(--worker-api-key): requests forwarded to it would get 401"]
    return [f"{spec.name} requires an API key and the router has none for it "
            "(--worker-api-key): only clients sending the worker's key get through"]


_LOAD_NAMES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
               "vllm:kv_cache_usage_perc": "kv_usage", DRAINING_METRIC: "draining"}


def parse_load(text: str, now: float) -> LoadSnapshot:
    """Running, waiting, KV usage and drain from a vLLM-style /metrics page (summed over
    engines), and the active LoRA adapters and max_lora of its newest
    `vllm:lora_requests_info`."""
    sums = {key: metric_value(text, name) for name, key in _LOAD_NAMES.items()}
    adapters, max_loras = _lora_info(text)
    return LoadSnapshot(int(sums["running"]), int(sums["waiting"]), sums["kv_usage"], now,
                        adapters, max_loras, sums["draining"] > 0)


def _lora_info(text: str) -> tuple[frozenset[str], int | None]:
    """(running and waiting adapters, max_lora) of the newest sample (its value is a time)."""
    newest = max(samples(text, "vllm:lora_requests_info"), key=lambda s: s[1], default=None)
    if newest is None:
        return frozenset(), None
    labels = newest[0]
    names = {n for key in ("running_lora_adapters", "waiting_lora_adapters")
             for n in labels.get(key, "").split(",") if n}
    try:
        max_loras: int | None = int(labels.get("max_lora", ""))
    except ValueError:
        max_loras = None
    return frozenset(names), max_loras
