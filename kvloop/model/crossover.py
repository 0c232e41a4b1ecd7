"""Where the low-bit weights stop paying: measured once at start-up, per machine.

Torch's 4-bit CPU matmul reads a quarter of fp32's bytes but does more work per weight, so it
wins for the skinny matmuls of decode steps and loses once a step carries enough tokens to
be compute-bound (on this project's 2-core Zen 3 dev box: fp32 30.7 ms against 9.4 ms for
all 120 layer matmuls of one token, even at ~32 tokens, 2x slower at 64). The crossover
depends on the CPU's vector units and memory, so it is measured: for growing token counts,
the dense and the low-bit matmuls of a few layers (enough weights to stream from memory, as a
real step does) and of the LM head are timed, and the policy keeps the low-bit path up to the
largest count where it is faster, and faster or within a tie's margin at every smaller one
(`crossover`).

Steps of decodes alone can run every layer fused (`llama.FusedDecode`: the low-bit kernels
with no Python between them, on kvloop's own thread pool), which wins up to larger counts
than the matmuls alone say; so those steps are timed too, whole (norms, RoPE, attention over
a one-token context, both ways alike) on the same layers: the dense layer loop against the
fused stack, giving `LowBitPolicy.max_decode_tokens`.

The measurement takes ~3 s of CPU at every start, so `cached_policy` keeps its answer on disk
(`~/.cache/kvloop/crossover/`, or under `KVLOOP_CACHE`) under a key of everything the
timings depend on: the model's file, the precision, the CPU, the thread count, the kernel
build and variant, torch and the model code. A later start with the same key reads it;
deleting the folder measures again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar, cast

import torch

from kvloop.model import cpu_ops
from kvloop.model.attention import AttentionMetadata
from kvloop.model.llama import DecoderLayer, FusedDecode, Linear, LlamaModel
from kvloop.model.quant import LowBitPolicy
from kvloop.model.step import StepInputs

logger = logging.getLogger(__name__)

SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
LAYERS_TIMED = 4     # layers timed (SmolLM2-135M: 57 MB of fp32 dense weights, 28 of bf16)
REPEATS = 5
TIE_MARGIN = 0.1    # low-bit within 10 % of dense: a tie (`lost`)

T = TypeVar("T")


def lost(dense: float, low: float) -> bool:
    """Whether the low-bit side lost a timing: slower than dense by more than `TIE_MARGIN`
    (closer is a tie: within what one start-up's timings move between fresh processes)."""
    return low > dense * (1.0 + TIE_MARGIN)


def crossover(timings: dict[int, tuple[float, float]]) -> int:
    """timings: tokens -> (dense seconds, low-bit seconds). The largest token count where the
    low-bit path is faster, with every smaller count measured faster or a tie (`lost`); 0 if
    never. A tie neither ends the low-bit range nor extends it: on a 2-core Zen 4, fused
    decode steps of 8 rows tie with the dense loop (2.29-3.64 against 2.32-3.40 ms over
    fresh start-ups) while 16 rows win clearly (2.26-2.70 against 2.97-4.63), and stopping at
    the first slower count chose 4 rows in 2 of 4 start-ups and 32 in the other two."""
    best = 0
    for size in sorted(timings):
        dense, low = timings[size]
        if lost(dense, low):
            break
        if low < dense:
            best = size
    return best


def measure_policy(model: LlamaModel, sizes: tuple[int, ...] = SIZES) -> LowBitPolicy:
    """Time dense against low-bit matmuls on `model`'s own weights; the policy and a log
    line with what was measured. Stops growing once the low-bit path has lost twice. The
    timings run on a thread of their own (`on_a_step_thread`)."""
    return on_a_step_thread(functools.partial(_measure_policy, model, sizes))


def on_a_step_thread(fn: Callable[[], T]) -> T:
    """fn() on a fresh thread, as the runner runs every step on its forward thread
    (`kvloop.model.runner`), never on the main one. The two time differently: on a 2-core
    Zen 4, 4 layers' fused 8-row decode steps timed 2.27-2.36 ms on the main thread of 2 of
    4 fresh processes and 1.78-2.21 on a thread of the same processes (the other two
    1.75-1.86 both ways); in another process all 30 layers' 8-row steps over 256-token
    contexts, dense / fused, 21.5 / 22.8 ms on the main thread and 28.7 / 17.2 on a thread.
    The main thread's stack starts at a random offset within its page (ASLR), a thread's at
    the same one in every process: the fused kernels' per-process slow group
    (docs/cpu-performance.md) looks like the main thread's."""
    with ThreadPoolExecutor(1, thread_name_prefix="kvloop-crossover") as thread:
        return thread.submit(fn).result()


def _measure_policy(model: LlamaModel, sizes: tuple[int, ...]) -> LowBitPolicy:
    layers = [m for layer in list(model.layers)[:LAYERS_TIMED] for m in _layer_linears(layer)]
    layers = [m for m in layers if m.low_bit is not None]
    head = [model.lm_head] if model.lm_head.low_bit is not None else []
    layer_times = _time_sizes(layers, sizes, model.dtype) if layers else {}
    head_times = _time_sizes(head, sizes, model.dtype) if head else {}
    decode_times = _time_decode_steps(model, sizes) if model.fused_decode else {}
    policy = LowBitPolicy(crossover(layer_times), crossover(head_times),
                          crossover(decode_times) if decode_times else None)
    _log_policy(policy, f"measured ms dense/low-bit: layers {_fmt(layer_times)}; head "
                        f"{_fmt(head_times)}; decode steps dense/fused {_fmt(decode_times)}")
    return policy


def _log_policy(policy: LowBitPolicy, source: str) -> None:
    """The start-up line naming the thresholds, and where they come from."""
    logger.info("low-bit weights: layers up to %d tokens per step, LM head up to %d rows, "
                "decode steps fused up to %s (%s)", policy.max_tokens, policy.max_logits_rows,
                policy.max_decode_tokens, source)


def cached_policy(model: LlamaModel, identity: Mapping[str, object]) -> LowBitPolicy:
    """`measure_policy(model)`, measured once per key and then read from the cache folder:
    the key digests `identity` (what names the model and its precision) with this machine's
    facts (`machine_identity`). A cache that cannot be read or written is measured around."""
    key = hashlib.sha256(json.dumps({**identity, **machine_identity()}, sort_keys=True,
                                    default=str).encode()).hexdigest()[:24]
    path = cpu_ops.CACHE_ROOT / "crossover" / f"{key}.json"
    try:
        policy = LowBitPolicy(**json.loads(path.read_text()))
        _log_policy(policy, f"measured before on this machine: {path}")
        return policy
    except (OSError, ValueError, TypeError):
        pass
    policy = measure_policy(model)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps(policy.__dict__))
        scratch.replace(path)        # whole or absent, for a start beside this one
    except OSError as exc:
        logger.warning("low-bit crossover not cached (%s)", exc)
    return policy


def machine_identity() -> dict[str, object]:
    """What the timings depend on besides the model: the CPU (its model and flags), torch's
    threads and version, the kernel build and variant, and the model code's source."""
    model_code = hashlib.sha256(b"".join(p.read_bytes() for p in
                                         sorted(Path(__file__).parent.glob("*.py"))))
    built = cpu_ops.load() is not None
    return {"cpu": _cpu_description(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "kernels": cpu_ops.kernels(),
            "build": cpu_ops.extension_name() if built else None,
            "model_code": model_code.hexdigest(), "machine": platform.machine()}


def _cpu_description() -> str:
    """/proc/cpuinfo's first processor's family, model, model name and flags
    (`platform.processor()` where there is no /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    first = text.split("\n\n", 1)[0]
    return "\n".join(line for line in first.splitlines()
                     if line.startswith(("model name", "flags", "cpu family", "model\t")))


def _layer_linears(layer: torch.nn.Module) -> list[Linear]:
    return [m for m in layer.modules() if isinstance(m, Linear)]


def _time_sizes(linears: list[Linear], sizes: tuple[int, ...], dtype: torch.dtype
                ) -> dict[int, tuple[float, float]]:
    def pair(size: int) -> tuple[Callable[[], object], Callable[[], object]]:
        inputs = [torch.randn(size, m.low_bit.in_features, dtype=dtype)
                  for m in linears if m.low_bit is not None]
        return (functools.partial(_run, linears, inputs, False),
                functools.partial(_run, linears, inputs, True))
    return _time_until_lost(sizes, pair)


def _time_decode_steps(model: LlamaModel, sizes: tuple[int, ...]
                       ) -> dict[int, tuple[float, float]]:
    """Steps of `size` decodes on the first layers: the dense layer loop against the fused
    stack (each request one cached token in a block of its own)."""
    layers = cast(list[DecoderLayer], list(model.layers)[:LAYERS_TIMED])
    fused = FusedDecode.build(model.config, layers)
    if fused is None:
        return {}

    def pair(size: int) -> tuple[Callable[[], object], Callable[[], object]]:
        x, positions, caches, meta = _decode_inputs(model, len(layers), size)
        return (functools.partial(_dense_decode, layers, x, positions, model, caches, meta),
                functools.partial(fused.forward, x, positions, model.rotary, caches, meta))
    return _time_until_lost(sizes, pair)


def _time_until_lost(sizes: tuple[int, ...],
                     pair: Callable[[int], tuple[Callable[[], object], Callable[[], object]]]
                     ) -> dict[int, tuple[float, float]]:
    """size -> (dense, low-bit) best times of the two callables `pair(size)` makes: the sizes
    grown until the low-bit side has lost twice (`lost`), then timed again `REPEATS - 1` times over,
    one repeat of every size per pass (`_best_of_passes`)."""
    pairs: dict[int, tuple[Callable[[], object], Callable[[], object]]] = {}
    out: dict[int, tuple[float, float]] = {}
    losses = 0
    with torch.inference_mode():
        for size in sizes:
            pairs[size] = pair(size)
            a, b = pairs[size]
            a(), b()                          # warm-up: first touch, primitive creation
            out[size] = _time_pair(a, b, 0)
            losses += lost(*out[size])
            if losses >= 2:
                break
        return _best_of_passes(pairs, out)


def _best_of_passes(pairs: dict[int, tuple[Callable[[], object], Callable[[], object]]],
                    first: dict[int, tuple[float, float]]) -> dict[int, tuple[float, float]]:
    """`first` (one timing of each size) improved to the best of `REPEATS`: each further pass
    times every size once, so the repeats of one size lie seconds apart and a burst of load
    from another process (on a shared machine it lasts tens to hundreds of ms) slows one
    repeat of several sizes, not every repeat of one size (docs/cpu-performance.md, "One
    decode step at 8 and 32 rows": on a loaded 2-core Zen 4, with a size's repeats back to
    back, 8 start-ups chose fused decode steps up to 2-32 rows)."""
    best = dict(first)
    for turn in range(1, REPEATS):
        for size, (a, b) in pairs.items():
            dense, low = _time_pair(a, b, turn)
            best[size] = (min(best[size][0], dense), min(best[size][1], low))
    return best


def _time_pair(a: Callable[[], object], b: Callable[[], object], turn: int
               ) -> tuple[float, float]:
    """(seconds of a, seconds of b), run back to back, a first on even turns, b on odd ones
    (whichever runs second may find the first's threads still awake)."""
    times = [0.0, 0.0]
    order = (0, 1) if turn % 2 == 0 else (1, 0)
    for i in order:
        fn = (a, b)[i]
        start = time.perf_counter()
        fn()
        times[i] = time.perf_counter() - start
    return times[0], times[1]


def _decode_inputs(model: LlamaModel, num_layers: int, size: int
                   ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], AttentionMetadata]:
    """Hidden states, positions, KV caches (blocks of one token) and metadata for `size`
    decodes with one cached token each."""
    c = model.config
    x = torch.randn(size, c.hidden_size, dtype=model.dtype)
    caches = [torch.zeros(2, c.num_key_value_heads, size + 1, 1, c.head_dim,
                          dtype=model.precision.kv_cache) for _ in range(num_layers)]
    blocks = torch.arange(1, size + 1, dtype=torch.int64)
    meta = AttentionMetadata(slot_mapping=blocks, num_decodes=size,
                             decode_block_table=blocks.view(size, 1).contiguous(),
                             decode_seq_lens=torch.ones(size, dtype=torch.int64))
    return x, torch.zeros(size, dtype=torch.int64), caches, meta


def _dense_decode(layers: list[DecoderLayer], x: torch.Tensor, positions: torch.Tensor,
                  model: LlamaModel, caches: list[torch.Tensor], meta: AttentionMetadata
                  ) -> None:
    step = StepInputs(input_ids=positions, positions=positions, meta=meta,
                      logits_indices=positions[:0])            # the dense weights
    h, residual = x, None
    for layer, cache in zip(layers, caches, strict=True):
        h, residual = layer.forward(h, residual, model.rotary, cache, step)


def _run(linears: list[Linear], inputs: list[torch.Tensor], low_bit: bool) -> None:
    for m, x in zip(linears, inputs, strict=True):
        m(x, low_bit)


def _fmt(timings: dict[int, tuple[float, float]]) -> str:
    if not timings:
        return "none"
    return ", ".join(f"{n}: {d * 1e3:.2f}/{q * 1e3:.2f}" for n, (d, q) in timings.items())
