"""The load driver: runs a workload's sessions against one server, closed or open loop.

    closed loop   `concurrency` clients; each takes the next session, runs its turns one
                  after the other, then takes another (sessions without arrival times)
    open loop     each session starts at its `arrival_s` (Poisson from `--rate`, or a trace);
                  `concurrency`, when given, caps the sessions in flight

Turn k of a session sends the conversation so far: every earlier prompt, the answer's token
ids as the server returned them (`return_token_ids`), then the turn's new user tokens. A
server that does not return token ids gets deterministic stand-in tokens of the right count
(its prefix cache then cannot match the answers; the report says so).

The driver owns its connection pool and the list of results; nothing here is global.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvloop.bench.client import (
    ConnectionPool,
    Endpoint,
    RequestResult,
    completion_payload,
    first_model_id,
    stream_completion,
)
from kvloop.bench.workloads import (
    DEFAULT_TOKEN_RANGE,
    Session,
    Workload,
    random_tokens,
    warmup_workload,
)


@dataclass(frozen=True)
class BenchConfig:
    """How to drive one server. `model` None: the first id of the server's /v1/models."""

    url: str
    model: str | None = None
    concurrency: int | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    return_token_ids: bool = True
    warmup: int = 0
    timeout_s: float = 600.0
    api_key: str | None = None
    extra_body: tuple[tuple[str, Any], ...] = ()
    progress: bool = True
    seed: int = 0
    label: str | None = None
    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE
    text_prompts: bool = False   # send each prompt as text: its ids decoded with the embedded
                                 # model's tokenizer (routers that refuse token-id prompts)

    def __post_init__(self) -> None:
        Endpoint.parse(self.url)  # raises ValueError on a bad URL
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout_s}")


@dataclass
class BenchRun:
    """Everything one run measured: per-request results, wall time and the client's CPU."""

    label: str
    url: str
    model: str | None
    workload: str
    workload_params: dict[str, Any]
    mode: str
    concurrency: int | None
    results: list[RequestResult] = field(default_factory=list)
    duration_s: float = 0.0
    started_at: float = 0.0     # wall clock (time.time()) of the measured phase
    client_cpu_s: float = 0.0
    stand_in_answers: int = 0


class _Driver:
    """Runs sessions on one pool; collects results in completion order."""

    def __init__(self, cfg: BenchConfig, pool: ConnectionPool, model: str | None,
                 on_done: Callable[[RequestResult], None] | None = None):
        self.cfg = cfg
        self.pool = pool
        self.model = model
        self.on_done = on_done
        self.results: list[RequestResult] = []
        self.stand_in_answers = 0
        self._extra = dict(cfg.extra_body)
        self._decode: Callable[[list[int]], str] | None = None
        if cfg.text_prompts:
            from kvloop.front.tokenizer import load_vocabulary

            self._decode = load_vocabulary(None).tokenizer.decode

    async def request(self, session_id: int, turn: int, prompt: list[int],
                      max_tokens: int) -> RequestResult:
        """One streamed completion with the per-request timeout; never raises."""
        cfg = self.cfg
        sent = prompt if self._decode is None else self._decode(prompt)
        body = completion_payload(self.model, sent, max_tokens, cfg.ignore_eos,
                                  cfg.temperature, cfg.return_token_ids, self._extra)
        result = RequestResult(session_id, turn, len(prompt), max_tokens)
        conn = self.pool.acquire()
        try:
            async with asyncio.timeout(cfg.timeout_s):
                await stream_completion(conn, body, result)
        except TimeoutError:
            result.error = f"timed out after {cfg.timeout_s:g} s"
            result.end = time.perf_counter()
            await conn.close()
        self.pool.release(conn)
        self.results.append(result)
        if self.on_done is not None:
            self.on_done(result)
        return result

    def answer_tokens(self, result: RequestResult) -> list[int]:
        """The answer to append to the conversation: the server's ids, or stand-ins."""
        ids = result.output_token_ids
        if ids is not None and len(ids) == result.output_tokens:
            return ids
        self.stand_in_answers += 1
        rng = random.Random(f"answer:{self.cfg.seed}:{result.session_id}:{result.turn}")
        return list(random_tokens(rng, result.output_tokens, self.cfg.token_range))

    async def session(self, s: Session) -> None:
        history: list[int] = []
        for k, turn in enumerate(s.turns):
            prompt = history + list(turn.new_token_ids)
            result = await self.request(s.session_id, k, prompt, turn.max_tokens)
            if not result.ok:
                return  # the conversation cannot go on without its answer
            if k + 1 < len(s.turns):
                history = prompt + self.answer_tokens(result)

    async def closed_loop(self, sessions: tuple[Session, ...], concurrency: int) -> None:
        it = iter(sessions)

        async def client() -> None:
            for s in it:
                await self.session(s)

        await asyncio.gather(*(client() for _ in range(min(concurrency, len(sessions)))))

    async def open_loop(self, sessions: tuple[Session, ...], cap: int | None) -> None:
        sem = asyncio.Semaphore(cap) if cap else None
        t0 = time.perf_counter()
        tasks = []

        async def start(s: Session) -> None:
            if sem is None:
                await self.session(s)
                return
            async with sem:
                await self.session(s)

        for s in sorted(sessions, key=lambda s: s.arrival_s or 0.0):
            delay = t0 + (s.arrival_s or 0.0) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(start(s)))
        await asyncio.gather(*tasks)


def is_open_loop(workload: Workload) -> bool:
    return any(s.arrival_s is not None for s in workload.sessions)


def _progress(total: int, label: str, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit="req", leave=False, mininterval=0.5)


async def run_bench(workload: Workload, cfg: BenchConfig) -> BenchRun:
    """Warm up, then run `workload` against `cfg.url`; returns the measured run."""
    pool = ConnectionPool(Endpoint.parse(cfg.url), cfg.api_key)
    model = cfg.model or await first_model_id(pool)
    open_loop = is_open_loop(workload)
    label = cfg.label or cfg.url
    run = BenchRun(label, cfg.url, model, workload.name, dict(workload.params),
                   "open" if open_loop else "closed",
                   cfg.concurrency if open_loop else (cfg.concurrency or 1))
    try:
        if cfg.warmup:
            warm = warmup_workload(workload, cfg.warmup, cfg.seed, cfg.token_range)
            await _Driver(cfg, pool, model).closed_loop(warm.sessions, cfg.concurrency or 1)
        bar = _progress(workload.num_requests, label, cfg.progress)
        driver = _Driver(cfg, pool, model, (lambda _r: bar.update(1)) if bar else None)
        run.started_at = time.time()
        cpu0, t0 = time.process_time(), time.perf_counter()
        if open_loop:
            await driver.open_loop(workload.sessions, cfg.concurrency)
        else:
            await driver.closed_loop(workload.sessions, cfg.concurrency or 1)
        run.duration_s = time.perf_counter() - t0
        run.client_cpu_s = time.process_time() - cpu0
        if bar is not None:
            bar.close()
    finally:
        await pool.close()
    run.results = driver.results
    run.stand_in_answers = driver.stand_in_answers
    return run


def run_bench_sync(workload: Workload, cfg: BenchConfig) -> BenchRun:
    return asyncio.run(run_bench(workload, cfg))
