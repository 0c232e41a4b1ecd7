"""Where the low-bit weights stop paying: measured once at start-up, per machine.

Torch's 4-bit CPU matmul reads a quarter of fp32's bytes but does more work per weight, so it
wins for the skinny matmuls of decode steps and loses once a step carries enough tokens to
be compute-bound (on this project's 2-core Zen 3 dev box: fp32 30.7 ms against 9.4 ms for
all 120 layer matmuls of one token, even at ~32 tokens, 2x slower at 64). The crossover
depends on the CPU's vector units and memory, so it is measured: for growing token counts,
the dense and the low-bit matmuls of a few layers (enough weights to stream from memory, as a
real step does) and of the LM head are timed, and the policy keeps the low-bit path up to the
largest count where it is faster at that count and every smaller one (`crossover`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import torch

from kvloop.model.llama import Linear, LlamaModel
from kvloop.model.quant import LowBitPolicy

logger = logging.getLogger(__name__)

SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
LAYERS_TIMED = 4     # layers whose matmuls are timed (~40-60 MB of fp32: past the L3 cache)
REPEATS = 5


def crossover(timings: dict[int, tuple[float, float]]) -> int:
    """timings: tokens -> (dense seconds, low-bit seconds). The largest token count such that
    the low-bit path is faster there and at every smaller count measured; 0 if never."""
    best = 0
    for size in sorted(timings):
        dense, low = timings[size]
        if low >= dense:
            break
        best = size
    return best


def measure_policy(model: LlamaModel, sizes: tuple[int, ...] = SIZES) -> LowBitPolicy:
    """Time dense against low-bit matmuls on `model`'s own weights; the policy and a log
    line with what was measured. Stops growing once the low-bit path has lost twice."""
    layers = [m for layer in list(model.layers)[:LAYERS_TIMED] for m in _layer_linears(layer)]
    layers = [m for m in layers if m.low_bit is not None]
    head = [model.lm_head] if model.lm_head.low_bit is not None else []
    layer_times = _time_sizes(layers, sizes, model.dtype) if layers else {}
    head_times = _time_sizes(head, sizes, model.dtype) if head else {}
    policy = LowBitPolicy(crossover(layer_times), crossover(head_times))
    logger.info("low-bit weights: layers up to %d tokens per step, LM head up to %d rows "
                "(measured ms dense/low-bit: layers %s; head %s)", policy.max_tokens,
                policy.max_logits_rows, _fmt(layer_times), _fmt(head_times))
    return policy


def _layer_linears(layer: torch.nn.Module) -> list[Linear]:
    return [m for m in layer.modules() if isinstance(m, Linear)]


def _time_sizes(linears: list[Linear], sizes: tuple[int, ...], dtype: torch.dtype
                ) -> dict[int, tuple[float, float]]:
    out: dict[int, tuple[float, float]] = {}
    losses = 0
    with torch.inference_mode():
        for size in sizes:
            inputs = [torch.randn(size, m.low_bit.in_features, dtype=dtype)
                      for m in linears if m.low_bit is not None]
            dense, low = _best_of_interleaved(functools.partial(_run, linears, inputs, False),
                                              functools.partial(_run, linears, inputs, True))
            out[size] = (dense, low)
            losses += low >= dense
            if losses >= 2:
                break
    return out


def _run(linears: list[Linear], inputs: list[torch.Tensor], low_bit: bool) -> None:
    for m, x in zip(linears, inputs, strict=True):
        m(x, low_bit)


def _best_of_interleaved(a: Callable[[], object], b: Callable[[], object]
                         ) -> tuple[float, float]:
    """The fastest of `REPEATS` runs of each, a and b alternating (a busy neighbour then
    slows both alike, and the minimum drops the runs it hit)."""
    a(), b()                                  # warm-up: first touch, primitive creation
    best = [float("inf"), float("inf")]
    for _ in range(REPEATS):
        for i, fn in enumerate((a, b)):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]


def _fmt(timings: dict[int, tuple[float, float]]) -> str:
    if not timings:
        return "none"
    return ", ".join(f"{n}: {d * 1e3:.2f}/{q * 1e3:.2f}" for n, (d, q) in timings.items())
