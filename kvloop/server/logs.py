"""What the API server logs about its work, as vLLM does (INFO, logger `kvloop.server`).

- One line per prompt received (vLLM's RequestLogger), once admitted:
  `Received request cmpl-...-0: prompt: '...', params: SamplingParams(...), prompt_token_ids:
  [...].` The prompt is the decoded token ids (for chat: the templated conversation);
  `--max-log-len N` cuts it to N characters and the ids to N ids. The lines are off
  unless `--enable-log-requests`, as in current vLLM (`--disable-log-requests`, its old
  opt-out, is accepted with a deprecation warning). Nothing is logged when a request ends.
- Every `VLLM_LOG_STATS_INTERVAL` seconds (vLLM's variable, default 10; read by
  `kvloop.server.config.log_stats_interval`) while the engine is
  busy, a stats line (vLLM's LoggingStatLogger, same words and order):
  `Engine 000: Avg prompt throughput: X tokens/s, Avg generation throughput: Y tokens/s,
  Running: N reqs, Waiting: M reqs[, Preemptions: P], GPU KV cache usage: Z%, Prefix cache
  hit rate: W%`. "GPU" stays on CPU and in the simulator, so log parsers written for vLLM
  keep working. Busy = tokens flowed in the interval or requests are running or waiting; one
  more line follows the last busy one (showing the drop to zero), then the lines go to DEBUG
  until work comes back. `--disable-log-stats` turns the lines off (not /metrics).
  With speculative decoding, an interval that verified drafts adds vLLM's second line:
  `SpecDecoding metrics: Mean acceptance length: L, Accepted throughput: A tokens/s, Drafted
  throughput: D tokens/s, Accepted: N tokens, Drafted: M tokens, Per-position acceptance
  rate: r0, r1, ..., Avg Draft acceptance rate: R%`.

The stats line reads the Prometheus series the server keeps anyway (`ServerMetrics`):
throughputs are counter deltas over the interval (prompt tokens count when a request's first
token comes, as vLLM counts them); running, waiting and KV usage are the latest engine gauges;
the prefix-cache hit rate is hits / queries over the last interval that had lookups (vLLM's
covers the last 1000 requests).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvloop.server.config import ServeConfig

if TYPE_CHECKING:
    from kvloop.server.metrics import ServerMetrics

logger = logging.getLogger("kvloop.server")

# --- requests ----------------------------------------------------------------------------------
def log_request(config: ServeConfig, tokenizer: Any, request_id: str,
                prompt_ids: Sequence[int], params: object) -> None:
    """The "Received request" line of one prompt (nothing with `log_requests` off)."""
    if not config.log_requests or not logger.isEnabledFor(logging.INFO):
        return  # the prompt is decoded only for a line that is written
    limit = config.max_log_len
    ids = list(prompt_ids if limit is None else prompt_ids[:limit])
    text = tokenizer.decode(ids, skip_special_tokens=False)
    if limit is not None:
        text = text[:limit]
    logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s.",
                request_id, text, params, ids)


# --- periodic stats ----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Counters:
    """The counters the stats line differentiates, read at `time` (monotonic seconds)."""

    time: float
    prompt_tokens: float
    generation_tokens: float
    preemptions: float
    prefix_queries: float
    prefix_hits: float
    spec: tuple[float, ...] = ()    # drafts, draft tokens, accepted, accepted per position


class StatLogger:
    """vLLM's LoggingStatLogger over one server's metrics (see the module docstring).

    Owner: the server's event loop; `run()` logs every `interval_s` until cancelled.
    """

    def __init__(self, metrics: ServerMetrics, interval_s: float, engine_index: int = 0):
        self.metrics = metrics
        self.interval_s = interval_s
        self.prefix = f"Engine {engine_index:03d}: "
        self._last = self._read(time.monotonic())
        self._was_busy = False
        self._hit_rate = 0.0
        self.spec_text: str | None = None

    def _read(self, now: float) -> _Counters:
        v = self.metrics.value
        return _Counters(now, v("vllm:prompt_tokens_total"), v("vllm:generation_tokens_total"),
                         v("vllm:num_preemptions_total"), v("vllm:prefix_cache_queries_total"),
                         v("vllm:prefix_cache_hits_total"), self.metrics.spec_counts())


    def line(self, now: float) -> tuple[bool, str]:
        """(whether to log at INFO, the stats line) for the interval since the last call;
        the speculative-decoding line of the same interval is kept in `spec_text`."""
        cur, last = self._read(now), self._last
        self._last = cur
        elapsed = cur.time - last.time
        self.spec_text = spec_line(cur.spec, last.spec, elapsed)
        prompt = (cur.prompt_tokens - last.prompt_tokens) / elapsed if elapsed > 0 else 0.0
        gen = (cur.generation_tokens - last.generation_tokens) / elapsed if elapsed > 0 else 0.0
        queries = cur.prefix_queries - last.prefix_queries
        if queries > 0:
            self._hit_rate = (cur.prefix_hits - last.prefix_hits) / queries
        running = int(self.metrics.value("vllm:num_requests_running"))
        waiting = int(self.metrics.value("vllm:num_requests_waiting"))
        parts = [f"Avg prompt throughput: {prompt:.1f} tokens/s",
                 f"Avg generation throughput: {gen:.1f} tokens/s",
                 f"Running: {running} reqs", f"Waiting: {waiting} reqs"]
        preempted = int(cur.preemptions - last.preemptions)
        if preempted:
            parts.append(f"Preemptions: {preempted}")
        usage = self.metrics.value("vllm:kv_cache_usage_perc")
        parts += [f"GPU KV cache usage: {usage * 100:.1f}%",
                  f"Prefix cache hit rate: {self._hit_rate * 100:.1f}%"]
        busy = bool(prompt or gen or running or waiting)
        show, self._was_busy = busy or self._was_busy, busy
        return show, self.prefix + ", ".join(parts)

    def log(self, now: float) -> None:
        show, text = self.line(now)
        log = logger.info if show else logger.debug
        log("%s", text)
        if self.spec_text is not None:
            log("%s", self.prefix + self.spec_text)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.log(time.monotonic())


def spec_line(cur: tuple[float, ...], last: tuple[float, ...], elapsed: float) -> str | None:
    """vLLM's "SpecDecoding metrics" line over an interval (counter readings `cur` and
    `last`: drafts, draft tokens, accepted tokens, accepted per position), or None when no
    draft was verified in it."""
    if not cur:
        return None
    delta = [c - p for c, p in zip(cur, last or (0.0,) * len(cur), strict=True)]
    drafts, drafted, accepted, per_pos = delta[0], delta[1], delta[2], delta[3:]
    if drafts <= 0:
        return None
    rate = elapsed if elapsed > 0 else float("inf")
    rates = ", ".join(f"{n / drafts:.3f}" for n in per_pos)
    return (f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
            f"Accepted throughput: {accepted / rate:.2f} tokens/s, "
            f"Drafted throughput: {drafted / rate:.2f} tokens/s, "
            f"Accepted: {int(accepted)} tokens, Drafted: {int(drafted)} tokens, "
            f"Per-position acceptance rate: {rates}, "
            f"Avg Draft acceptance rate: {100 * accepted / drafted if drafted else 0:.1f}%")
