"""Fused layer ops on CPU (a small C++ extension, csrc/cpu_ops.cpp) with pure-torch twins.

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
- `silu_and_mul(x)`: x [T, 2F] -> silu(x[:, :F]) * x[:, F:];
- `DecodeStack(norms, quantized, ...)` (extension only, no twin: its oracle is the Python
  layer loop, see `kvloop.model.llama.FusedDecode`): built once from the weights, its
  `forward` runs every decoder layer of a step of decodes in one call, with the 4-bit
  weights, on kvloop's own thread pool (csrc/pool.h).

Building: `python -m kvloop.model.cpu_ops` (the Makefile's install step) compiles it with
`torch.utils.cpp_extension` (-O3 -march=native) into `.venv`-independent cache
`~/.cache/kvloop/torch_extensions/<name>`, the name keyed by the source, torch's version and
the CPU's flags (a build never loads on a CPU it was not built for). Loading never compiles
unless asked (`load(build=True)`): a process that finds no build uses the twins and says so
once in the log.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
# Built into the same extension; each registers its own ops (the quantized KV cache's:
# attn_kvq.cpp, in torch.ops under the build's name, see kvloop.model.kv_quant).
EXTRA_SOURCES = [Path(__file__).parent / "csrc" / "attn_kvq.cpp"]
HEADERS = [Path(__file__).parent / "csrc" / "pool.h"]
CACHE_ROOT = Path(os.environ.get("KVLOOP_CACHE", Path.home() / ".cache" / "kvloop"))
ENV_SWITCH = "KVLOOP_CPU_OPS"          # "0": never use the extension
# -fopenmp: at::parallel_for is a header template that runs serially unless _OPENMP is
# defined; the extension then links libgomp, which resolves to the one torch has loaded.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"]

_module: Any = None
_tried = False


def extension_name() -> str:
    """Name of this source's build for this torch and this CPU."""
    key = hashlib.sha256()
    for path in [SOURCE, *EXTRA_SOURCES, *HEADERS]:
        key.update(path.read_bytes())
    key.update(torch.__version__.encode())
    key.update(" ".join(_FLAGS).encode())
    key.update(_cpu_flags().encode())
    return f"kvloop_cpu_ops_{key.hexdigest()[:16]}"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return ""


def load(build: bool = False) -> Any:
    """The compiled module, or None (no build and `build` False, or the build failed)."""
    global _module, _tried
    if _module is not None or (_tried and not build):
        return _module
    _tried = True
    if os.environ.get(ENV_SWITCH) == "0":
        return None
    name = extension_name()
    directory = CACHE_ROOT / "torch_extensions" / name
    library = directory / f"{name}.so"
    try:
        if library.is_file():
            _module = _import(name, library)     # no compiler run, no subprocess
        elif build:
            _module = _compile(name, directory)
        else:
            logger.warning("kvloop's CPU ops are not built for this CPU (run `python -m "
                           "kvloop.model.cpu_ops`); using the slower pure-torch ops")
    except Exception as exc:   # no compiler, no headers, a broken build: the twins serve
        logger.warning("kvloop's CPU ops failed to build or load (%s); using the pure-torch "
                       "ops", exc)
        _module = None
    return _module


def _import(name: str, library: Path) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, library)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile(name: str, directory: Path) -> Any:
    from torch.utils.cpp_extension import load as load_extension

    directory.mkdir(parents=True, exist_ok=True)
    return load_extension(name=name, sources=[str(p) for p in (SOURCE, *EXTRA_SOURCES)],
                          extra_cflags=_FLAGS, build_directory=str(directory), verbose=False)


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
    ops = load()
    if ops is None or not tensors:
        return tensors
    sizes = [t.numel() * t.element_size() for t in tensors]
    starts = [0]
    for nbytes in sizes:
        starts.append(starts[-1] + -(-nbytes // _LINE) * _LINE)
    buffer = ops.huge_page_buffer(starts[-1])
    return [buffer[start:start + nbytes].view(t.dtype).view(t.shape).copy_(t)
            for t, start, nbytes in zip(tensors, starts, sizes, strict=False)]


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


def torch_rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                         heads: int, kv_heads: int) -> None:
    tokens = qkv.shape[0]
    dim = kv_cache.shape[-1]
    rows = qkv.view(tokens, heads + 2 * kv_heads, dim)
    qk = rows[:, :heads + kv_heads]
    c = cos[positions].unsqueeze(1)                                # [T, 1, D/2] fp32
    s = sin[positions].unsqueeze(1)
    x1, x2 = qk.float().chunk(2, dim=-1)
    qk.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
    k = rows[:, heads:heads + kv_heads]
    v = rows[:, heads + kv_heads:]
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


def torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def main() -> int:
    """Build the extension for this CPU (a no-op when built); exit 0 also when it cannot be
    built (kvloop then runs its pure-torch ops), saying so."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = load(build=True)
    print(f"kvloop CPU ops: {'built ' + extension_name() if module else 'not built'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
