"""Fused layer ops on CPU (a small C++ extension, csrc/) with pure-torch twins.

Each op below does what its `torch_*` twin does, in one call instead of 4-12 eager ops;
the twins run where the extension is absent (no compiler, another device, or
`KVLOOP_CPU_OPS=0`) and are the oracle the tests compare the C++ ops against (fp32: equal to
~1e-6 relative; bf16: within one rounding).

- `add_rms_norm(x, residual, w, eps)`: residual += x, then x = rms_norm(residual) * w, both
  in place (residual None: x normalised in place);
- `rope_and_cache(qkv, positions, cos, sin, kv_cache, slots, H, K)`: RoPE (half-split
  pairs) on the H query and K key heads of `qkv` [T, (H + 2K) * D] in place, then this step's
  K and V into the layer's cache [2, K, blocks, block_size, D] at `slots`;
- `decode_attention(q, kv_cache, block_table, seq_lens, scale)`: one query per request,
  q [R, H, D] -> [R, H * D], keys read in place through `block_table` [R, max_blocks];
- `prefill_attention(q, kv_cache, slots, scale, window)`: one prefill chunk, q [c, H, D]
  -> [c, H * D], over the n keys at `slots` [n] of the cache (the chunk's own K and V, written
  by `rope_and_cache` before, last), lower-right causal (query i sees keys j <= n - c + i;
  `window` > 0: also j > n - c + i - window), flash style in C++ (key blocks, online
  softmax, no [c, n] scores) where the kernel variant has a vector kernel for it (AVX2 and
  AVX-512; on generic the twin runs: the portable loops are slower than SDPA); twin: SDPA over the
  keys gathered and widened to q's dtype;
- the cache of these three (and of `DecodeStack`) is in q's dtype, or bf16 beside fp32 q
  (`--kv-cache-dtype bfloat16`): written rounded to nearest even, read widened exactly;
- `silu_and_mul(x)`: x [T, 2F] -> silu(x[:, :F]) * x[:, F:];
- `q4_matmul` / `q8_matmul(x, ...)`: x @ W.T on 4-bit / 8-bit group-32 weights
  (`kvloop.model.quant` holds them; 8-bit in blocks of `q8_block_columns` output columns,
  `quant.q8_column_blocks`, with the column count passed), and `q4_matmul_argmax` /
  `q8_matmul_argmax`: each row's (argmax, max) of the same product without writing the
  row whole (greedy decoding's LM head; twin: the matmul, then argmax);
  `q4_*(..., bf16_x=True)`: fp32 x may be rounded to bf16 at the rows the AVX512_BF16
  kernels take (3+: the lane kernel's `bf16_lane_rows(M)`, then the bf16 tiles';
  `Precision.low_bit_bf16_x`): exact products of those rows rounded, fp32 sums;
  `q4_matmul(..., blocks=(qs, scale, offset))`: the same W also in column blocks
  (`quant.q4_column_blocks`), which every one of those rows reads where the variant has
  the block kernel (`has_q4_block_kernel()`: AVX512_BF16), the columns in vector lanes;
- `DecodeStack(norms, quantized, ...)` (extension only, no twin: its oracle is the Python
  layer loop, see `kvloop.model.llama.FusedDecode`): built once from the weights, its
  `forward` runs every decoder layer of a step of decodes in one call, with the 4-bit
  weights, on kvloop's own thread pool (csrc/pool.h).

Kernels: csrc/ holds the portable kernels and drivers (generic.cpp), one file per instruction
set (x86_avx2.cpp; x86_avx512.cpp: AVX-512 F/BW/VL/DQ with VNNI; x86_avx512_bf16.cpp: the
same with AVX512_BF16's bf16 dot products), all built on every machine
(each in a region compiled for its own target, none with -march=native), and one dispatch
table (dispatch.cpp) that runs the best variant this CPU can execute, chosen once per
process from the CPU's own feature bits; `KVLOOP_CPU_ISA=<name>` (`KERNELS_ENV`) makes it
run another (an error where this CPU cannot run it), and `use_kernels` does the same in a
running process (tests run every variant this way). docs/cpu-performance.md, "Kernels and
dispatch", says how to add a kernel or a variant.

Building: `python -m kvloop.model.cpu_ops` (the Makefile's install step; it exits non-zero
when the build fails) compiles it with `torch.utils.cpp_extension` into `.venv`-independent
cache `~/.cache/kvloop/torch_extensions/<name>`, the name keyed by the sources, torch's
version, the compiler flags and the machine's architecture (`build_key`; not its CPU's
features: one build serves every CPU of the architecture). Loading never compiles unless
asked (`load(build=True)`): a process that finds no build, or cannot build (no compiler),
uses the twins and says so once in the log. Processes building at once build once, and a
build killed midway blocks none after it (`kvloop.model.extension_build`).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvloop.model import extension_build

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
CACHE_ROOT = Path(os.environ.get("KVLOOP_CACHE", Path.home() / ".cache" / "kvloop"))
ENV_SWITCH = "KVLOOP_CPU_OPS"          # "0": never use the extension
KERNELS_ENV = "KVLOOP_CPU_ISA"         # a kernel variant's name: run it, not the best one
# -fopenmp: at::parallel_for is a header template that runs serially unless _OPENMP is
# defined; the extension then links libgomp, which resolves to the one torch has loaded.
# No -march: the library runs on any CPU of its architecture; the instruction-set files
# choose their own targets (csrc/isa.h).
_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=fast"]

_module: Any = None
_tried = False


def source_files() -> list[Path]:
    """Every file of the extension's source (what the build key hashes), sorted."""
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".cpp", ".h"))


def build_key(sources: dict[str, bytes], torch_version: str, flags: list[str],
              machine: str) -> str:
    """The build's name for these source files (name -> bytes), torch version, compiler flags
    and machine architecture (`platform.machine()`)."""
    key = hashlib.sha256()
    for name in sorted(sources):
        key.update(name.encode() + b"\0" + sources[name] + b"\0")
    for part in (torch_version, " ".join(flags), machine):
        key.update(part.encode() + b"\0")
    return f"kvloop_cpu_ops_{key.hexdigest()[:16]}"


def extension_name() -> str:
    """Name of this source's build for this torch on this architecture."""
    return build_key({p.name: p.read_bytes() for p in source_files()}, torch.__version__,
                     _FLAGS, platform.machine())


def load(build: bool = False) -> Any:
    """The compiled module, or None (`KVLOOP_CPU_OPS=0`, no build and `build` False, or the
    build failed: a warning says so). Raises ValueError where `KVLOOP_CPU_ISA` names kernels
    this CPU or build cannot run."""
    global _module, _tried
    if _module is not None or (_tried and not build):
        return _module
    _tried = True
    if os.environ.get(ENV_SWITCH) == "0":
        return None
    try:
        _module = _load_or_build(build)
    except Exception as exc:   # no compiler, no headers, a broken build: the twins serve
        logger.warning("kvloop's CPU ops failed to build or load (%s); using the pure-torch "
                       "ops", exc)
        _module = None
    if _module is not None:
        _use_forced_kernels(_module)
    return _module


def build() -> Any:
    """The compiled module, built now where absent (whatever `KVLOOP_CPU_OPS` says); raises
    where it cannot be built or loaded."""
    global _module, _tried
    if _module is None:
        _module = _load_or_build(True)
        _tried = True
        _use_forced_kernels(_module)
    return _module


def _use_forced_kernels(module: Any) -> None:
    """The variant `KVLOOP_CPU_ISA` names, if any (ValueError where it cannot run here)."""
    forced = os.environ.get(KERNELS_ENV)
    if forced:
        module.use_cpu_kernels(forced)
    logger.info("kvloop's CPU ops: %s kernels", module.cpu_kernels())


def _load_or_build(build: bool) -> Any:
    name = extension_name()
    directory = CACHE_ROOT / "torch_extensions" / name
    library = extension_build.library_path(name, directory)
    if library.is_file():
        return extension_build.import_library(name, library)   # no compiler, no lock
    if build:
        sources = [str(p) for p in source_files() if p.suffix == ".cpp"]
        return extension_build.build_once(name, directory, sources, _FLAGS, [str(CSRC)])
    logger.warning("kvloop's CPU ops are not built (run `python -m kvloop.model.cpu_ops`); "
                   "using the slower pure-torch ops")
    return None


def kernels() -> str | None:
    """The kernel variant the ops run ("avx512_bf16", "avx512", "avx2", "generic"); None
    without the extension."""
    ops = load()
    return None if ops is None else str(ops.cpu_kernels())


@dataclass(frozen=True)
class KernelVariant:
    """One variant of the kernels (csrc/dispatch.cpp): the CPU features it needs (as
    /proc/cpuinfo names them), whether this build has it (its architecture's) and whether
    this CPU runs it."""

    name: str
    needs: str
    built: bool
    runs_here: bool


def kernel_variants() -> list[KernelVariant]:
    """Every variant, best first (empty without the extension)."""
    ops = load()
    return [] if ops is None else [KernelVariant(*v) for v in ops.cpu_kernel_variants()]


def use_kernels(name: str) -> None:
    """Run the named kernel variant from now on, process-wide (what `KVLOOP_CPU_ISA` does at
    load); ValueError where it is unknown or cannot run here."""
    ops = _module if _module is not None else load()
    if ops is None:
        raise ValueError("kvloop's CPU ops are not loaded")
    ops.use_cpu_kernels(name)


def available(device: torch.device) -> bool:
    return device.type == "cpu" and load() is not None


# --- the ops: the extension where built, else the twins ------------------------------------
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> None:
    ops = load() if x.device.type == "cpu" else None
    if ops is not None:
        ops.add_rms_norm(x, residual, weight, eps)
    else:
        torch_add_rms_norm(x, residual, weight, eps)


def rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                   heads: int, kv_heads: int) -> None:
    ops = load() if qkv.device.type == "cpu" else None
    if ops is not None:
        ops.rope_and_cache(qkv, positions, cos, sin, kv_cache, slots, heads, kv_heads)
    else:
        torch_rope_and_cache(qkv, positions, cos, sin, kv_cache, slots, heads, kv_heads)


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    ops = load() if q.device.type == "cpu" else None
    if ops is not None:
        return ops.decode_attention(q, kv_cache, block_table, seq_lens, scale)
    return torch_decode_attention(q, kv_cache, block_table, seq_lens, scale)


def prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                      scale: float, window: int = 0) -> torch.Tensor:
    ops = load() if q.device.type == "cpu" else None
    if ops is not None and ops.has_prefill_kernel():
        return ops.prefill_attention(q, kv_cache, slots, scale, window)
    return torch_prefill_attention(q, kv_cache, slots, scale, window)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    ops = load() if x.device.type == "cpu" else None
    if ops is not None:
        return ops.silu_and_mul(x)
    return torch_silu_and_mul(x)


def set_pool_threads(threads: int) -> None:
    """Size kvloop's own thread pool (csrc/pool.h: the low-bit matmuls and the fused decode
    stack run on it), caller included; a no-op without the extension."""
    ops = load()
    if ops is not None:
        ops.set_pool_threads(threads)


def huge_page_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU `tensors` (equal values, shapes, dtypes; contiguous), all in one buffer
    in 2 MiB pages (`huge_page_buffer`, csrc/cpu_ops.cpp: why), each at a 64-byte line; the
    buffer lives as long as any copy. Without the extension, or for none, `tensors` as
    they are."""
    views = _huge_page_views([(t.shape, t.dtype) for t in tensors])
    if views is None:
        return tensors
    return [v.copy_(t) for v, t in zip(views, tensors, strict=True)]


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype, count: int,
                    device: torch.device) -> list[torch.Tensor]:
    """`count` zeroed (so touched) tensors of `shape` and `dtype`: on CPU with the extension,
    all in one buffer in 2 MiB pages as `huge_page_copies` (the KV cache: a decode step reads
    it scattered through a layer's blocks), else `torch.zeros` each."""
    views = (_huge_page_views([(shape, dtype)] * count) if device.type == "cpu" and count
             else None)
    if views is None:
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)]
    return [v.zero_() for v in views]


def _huge_page_views(specs: list[tuple[Any, torch.dtype]]) -> list[torch.Tensor] | None:
    """Uninitialised contiguous tensors of these (shape, dtype)s in one `huge_page_buffer`,
    each at a 64-byte line; None without the extension or for none."""
    ops = load()
    if ops is None or not specs:
        return None
    sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size()
             for shape, dtype in specs]
    starts = [0]
    for nbytes in sizes:
        starts.append(starts[-1] + -(-nbytes // _LINE) * _LINE)
    buffer = ops.huge_page_buffer(max(starts[-1], 1))
    return [buffer[start:start + nbytes].view(dtype).view(shape)
            for (shape, dtype), start, nbytes in zip(specs, starts, sizes, strict=False)]


_LINE = 64


# --- the pure-torch twins -------------------------------------------------------------------
def torch_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> None:
    if residual is not None:
        residual.add_(x)
        source = residual
    else:
        source = x
    x.copy_(F.rms_norm(source, (x.shape[-1],), weight, eps))


def torch_rope(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, heads: int, kv_heads: int, dim: int) -> torch.Tensor:
    """RoPE on q and k of `qkv` in place; -> its rows `[T, heads + 2 * kv_heads, dim]`."""
    rows = qkv.view(qkv.shape[0], heads + 2 * kv_heads, dim)
    qk = rows[:, :heads + kv_heads]
    c = cos[positions].unsqueeze(1)                                # [T, 1, D/2] fp32
    s = sin[positions].unsqueeze(1)
    x1, x2 = qk.float().chunk(2, dim=-1)
    qk.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
    return rows


def torch_rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                         heads: int, kv_heads: int) -> None:
    dim = kv_cache.shape[-1]
    rows = torch_rope(qkv, positions, cos, sin, heads, kv_heads, dim)
    k = rows[:, heads:heads + kv_heads].to(kv_cache.dtype)     # a bf16 cache: rounded
    v = rows[:, heads + kv_heads:].to(kv_cache.dtype)
    kv_cache[0].view(kv_heads, -1, dim).index_copy_(1, slots, k.transpose(0, 1))
    kv_cache[1].view(kv_heads, -1, dim).index_copy_(1, slots, v.transpose(0, 1))


def torch_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    reqs, heads, dim = q.shape
    _, kv_heads, _, block_size, _ = kv_cache.shape
    group = heads // kv_heads
    ids = block_table.reshape(-1)
    keys = kv_cache[0].index_select(1, ids).view(kv_heads, reqs, -1, dim)    # [K, R, L, D]
    values = kv_cache[1].index_select(1, ids).view(kv_heads, reqs, -1, dim)
    length = keys.shape[2]
    query = q.view(reqs, kv_heads, group, dim).transpose(0, 1).float()        # [K, R, G, D]
    scores = torch.matmul(query, keys.float().transpose(-1, -2)) * scale       # [K, R, G, L]
    beyond = torch.arange(length) >= seq_lens.view(1, reqs, 1, 1)
    probs = torch.softmax(scores.masked_fill(beyond, float("-inf")), dim=-1)
    out = torch.matmul(probs, values.float())                                  # [K, R, G, D]
    return out.transpose(0, 1).reshape(reqs, heads * dim).to(q.dtype)


def torch_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                            scale: float, window: int = 0) -> torch.Tensor:
    chunk, heads, dim = q.shape
    kv_heads = kv_cache.shape[1]
    keys = kv_cache[0].view(kv_heads, -1, dim)[:, slots].to(q.dtype).unsqueeze(0)
    values = kv_cache[1].view(kv_heads, -1, dim)[:, slots].to(q.dtype).unsqueeze(0)
    mask = prefill_mask(chunk, len(slots), window, q.device)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, values,
                                         attn_mask=mask, is_causal=mask is None, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1).reshape(chunk, heads * dim)


def prefill_mask(q_len: int, kv_len: int, window: int,
                 device: torch.device) -> torch.Tensor | None:
    """[q_len, kv_len] bool, True = attend: query i sees keys j <= kv_len - q_len + i (and
    j > kv_len - q_len + i - window where window > 0); None where that is SDPA's top-left
    `is_causal` (no context, no window)."""
    if q_len == kv_len and window <= 0:
        return None
    rows = torch.arange(q_len, device=device).unsqueeze(1) + (kv_len - q_len)
    keys = torch.arange(kv_len, device=device).unsqueeze(0)
    mask = keys <= rows
    return mask & (keys > rows - window) if window > 0 else mask


def torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def main() -> int:
    """Build the extension for this machine (a no-op when built); exit 1, saying why, when it
    cannot be built (kvloop then runs its pure-torch ops, but `make test` must fail)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        module = build()
    except Exception as exc:  # noqa: BLE001 - reported, and the exit status says it
        print(f"kvloop CPU ops: FAILED to build or load: {exc}", file=sys.stderr)
        return 1
    runs = [v[0] for v in module.cpu_kernel_variants() if v[3]]
    print(f"kvloop CPU ops: built {extension_name()}; kernels {module.cpu_kernels()} "
          f"(this CPU runs: {', '.join(runs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
