"""kvloop's fused C++ CPU ops against their pure-torch twins (the oracle), fp32 and bf16 (and
the cache's ops on a bf16 cache beside fp32, `--kv-cache-dtype bfloat16`), on every kernel
variant this CPU runs (csrc/dispatch.cpp; the others are skipped, saying why).

Shapes: SmolLM2's (9 heads, 3 KV heads, head_dim 64) and a tiny GQA one (4/2/16), blocks
of 16 and 4, ragged decode lengths, slots scattered over the pool. The ops are built by
`python -m kvloop.model.cpu_ops` (the Makefile's install step); where they cannot be built
these tests fail (a broken build must not pass `make test` as skips). One end-to-end test
runs a tiny model with the extension off (`KVLOOP_CPU_OPS=0`), on every variant and under
transformers: the same greedy tokens, with an fp32 and with a bf16 KV cache.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from kvloop.model import cpu_ops
from kvloop.model.quant import q4_column_blocks, q8_column_blocks

VARIANTS = ("avx512_bf16", "avx512", "avx2", "generic")    # dispatch.cpp's kVariants, best first


@pytest.fixture(scope="module")
def ops():
    """The extension, built where absent; a build that fails fails the test."""
    try:
        return cpu_ops.build()
    except Exception as exc:  # noqa: BLE001 - the failure is the message
        pytest.fail(f"kvloop's CPU ops do not build: {exc}")


# A decode-attention case's inputs and its torch twin's output are built once for every
# kernel variant that runs it (`functools.cache` on the builders below; variants vary
# slowest: a case comes round again once per variant). Building was 2-4 ms of a case (the
# twin up to 13), the kernel 0.03-0.2; the kernels only read their inputs. Let go at the
# module's end.
@pytest.fixture(scope="module", autouse=True)
def _forget_cases() -> Iterator[None]:
    yield
    _long_context_case.cache_clear()
    _scattered_case.cache_clear()
    _prefill_cases.cache_clear()


@pytest.fixture(params=VARIANTS)
def variant(request, ops):
    """Each kernel variant in turn, where this CPU runs it (skipped otherwise, with why)."""
    info = {v.name: v for v in cpu_ops.kernel_variants()}[request.param]
    if not info.built:
        pytest.skip(f"{info.name} kernels are not built for this architecture")
    if not info.runs_here:
        pytest.skip(f"this CPU cannot run the {info.name} kernels (they need: {info.needs})")
    before = cpu_ops.kernels()
    cpu_ops.use_kernels(info.name)
    yield info.name
    cpu_ops.use_kernels(before)


def test_the_variants_are_the_ones_the_tests_run_and_the_best_is_chosen(ops):
    """The test's list is the extension's; the process runs the best variant this CPU runs
    (unless KVLOOP_CPU_ISA names one); an unknown or unrunnable name is a ValueError."""
    listed = cpu_ops.kernel_variants()
    assert tuple(v.name for v in listed) == VARIANTS
    assert listed[-1].built and listed[-1].runs_here     # generic: built and run everywhere
    best = next(v.name for v in listed if v.runs_here)
    assert cpu_ops.kernels() == os.environ.get(cpu_ops.KERNELS_ENV, best)
    with pytest.raises(ValueError, match="no CPU kernels named"):
        cpu_ops.use_kernels("sse9")
    for v in listed:
        if v.built and not v.runs_here:
            with pytest.raises(ValueError, match="cannot run"):
                cpu_ops.use_kernels(v.name)
    assert cpu_ops.kernels() == os.environ.get(cpu_ops.KERNELS_ENV, best)


@pytest.mark.processes
def test_kvloop_cpu_isa_forces_a_variant_and_rejects_one_the_cpu_cannot_run(ops):
    """`KVLOOP_CPU_ISA=generic` in a fresh process runs the generic kernels; a name the
    CPU cannot run (or no variant has) stops the load with a ValueError."""
    code = "from kvloop.model import cpu_ops; print(cpu_ops.kernels())"
    env = {**os.environ, cpu_ops.KERNELS_ENV: "generic"}
    env.pop(cpu_ops.ENV_SWITCH, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert out.split() == ["generic"]
    env[cpu_ops.KERNELS_ENV] = "sse9"
    failed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=120)
    assert failed.returncode != 0 and "no CPU kernels named 'sse9'" in failed.stderr


# heads, kv heads, head_dim, blocks, block size; scale head_dim ** -0.5 (for 128 not a power
# of two: q * scale is not a bf16 value)
SHAPES = [(9, 3, 64, 24, 16), (4, 2, 16, 20, 4), (8, 2, 128, 24, 16)]
DTYPES = [(torch.float32, 2e-6), (torch.bfloat16, 0.0)]
# (activations, KV cache, tolerance) of the cache's ops: the cache in the activations' dtype,
# or bf16 beside fp32 (--kv-cache-dtype bfloat16: read widened exactly, so fp32's tolerance)
KV_DTYPES = [(torch.float32, torch.float32, 2e-6), (torch.bfloat16, torch.bfloat16, 0.0),
             (torch.float32, torch.bfloat16, 2e-6)]


def _check_close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    """Assert a is within tol (relative to the largest |b|, at least 1) of b everywhere."""
    scale = max(b.abs().max().item(), 1.0)
    assert (a.float() - b.float()).abs().max().item() <= tol * scale


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm(ops, dtype, tol, with_residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 576, generator=g).to(dtype)
    res = torch.randn(7, 576, generator=g).to(dtype) if with_residual else None
    w = torch.rand(576, generator=g).to(dtype)
    x1, r1 = x.clone(), None if res is None else res.clone()
    x2, r2 = x.clone(), None if res is None else res.clone()
    ops.add_rms_norm(x1, r1, w, 1e-5)
    cpu_ops.torch_add_rms_norm(x2, r2, w, 1e-5)
    _check_close(x1, x2, tol * 4)
    if res is not None:
        assert torch.equal(r1, r2)


@pytest.mark.parametrize("dtype,cache_dtype,tol", KV_DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim,blocks,bs", SHAPES)
def test_rope_and_cache(ops, variant, dtype, cache_dtype, tol, heads, kv_heads, dim, blocks,
                        bs):
    g = torch.Generator().manual_seed(1)
    tokens = 9
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    positions = torch.randint(0, 300, (tokens,), generator=g)
    angles = torch.outer(torch.arange(300.0), torch.rand(dim // 2, generator=g))
    slots = torch.randperm(blocks * bs, generator=g)[:tokens]
    caches = [torch.zeros(2, kv_heads, blocks, bs, dim, dtype=cache_dtype) for _ in range(2)]
    outs = [qkv.clone(), qkv.clone()]
    ops.rope_and_cache(outs[0], positions, angles.cos(), angles.sin(), caches[0], slots,
                       heads, kv_heads)
    cpu_ops.torch_rope_and_cache(outs[1], positions, angles.cos(), angles.sin(), caches[1],
                                 slots, heads, kv_heads)
    _check_close(outs[0], outs[1], tol)
    assert caches[0].abs().sum() > 0
    if cache_dtype == dtype:
        _check_close(caches[0], caches[1], tol)
        return
    # a bf16 cache beside fp32: V (no RoPE) the same bits; K rounded from RoPE's fp32 result,
    # whose last bit may differ (FMA), so at most one bf16 step apart
    assert torch.equal(caches[0][1], caches[1][1])
    step = caches[1][0].float().abs() * 2 ** -7
    assert ((caches[0][0].float() - caches[1][0].float()).abs() <= step).all()
    written = caches[0].view(2, kv_heads, -1, dim)[:, :, slots]
    rows = outs[0].view(tokens, heads + 2 * kv_heads, dim)[:, heads:]      # this step's K, V
    assert torch.equal(written.float(), rows.view(tokens, 2, kv_heads, dim).permute(1, 2, 0, 3)
                       .to(cache_dtype).float())


# fp32 values whose bf16 rounding is an edge: ties to even (down and up), a carry into the
# exponent, the largest finite floats (to inf), infinities, zeros, subnormals, NaNs
BF16_EDGES = [1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 1 + 2 ** -8 + 2 ** -20,
              2 - 2 ** -9, 3.4028235e38, -3.4028235e38, 3.3961776e38, float("inf"),
              float("-inf"), 0.0, -0.0, 1e-45, -3e-39, 1.1754942e-38, float("nan"),
              -float("nan")]


@pytest.mark.parametrize("dim", [64, 24])           # 24: a tail after 16 (AVX-512) or 3 x 8
def test_the_bf16_cache_write_rounds_as_torch_does(ops, variant, dim):
    """Over a bf16 cache beside fp32 activations, V (no RoPE) is written as torch's
    `.to(torch.bfloat16)` writes it, bit for bit (round to nearest, ties to even), edge values
    included; a NaN stays a NaN (the kernels write c10's 0x7FC0, torch's vector loop 0xFFFF)."""
    g = torch.Generator().manual_seed(dim)
    heads, kv_heads, tokens, blocks, bs = 2, 2, 6, 8, 4
    v = torch.randn(tokens * kv_heads * dim, generator=g) * 100
    v[:len(BF16_EDGES)] = torch.tensor(BF16_EDGES)
    v[len(BF16_EDGES):2 * len(BF16_EDGES)] = torch.tensor(BF16_EDGES) * 2 ** -100
    qk = torch.randn(tokens, (heads + kv_heads) * dim, generator=g)
    qkv = torch.cat([qk, v.view(tokens, -1)], dim=1)
    positions = torch.arange(tokens)
    angles = torch.outer(torch.arange(tokens, dtype=torch.float32), torch.rand(dim // 2,
                                                                              generator=g))
    slots = torch.randperm(blocks * bs, generator=g)[:tokens]
    caches = [torch.zeros(2, kv_heads, blocks, bs, dim, dtype=torch.bfloat16) for _ in range(2)]
    ops.rope_and_cache(qkv.clone(), positions, angles.cos(), angles.sin(), caches[0], slots,
                       heads, kv_heads)
    cpu_ops.torch_rope_and_cache(qkv.clone(), positions, angles.cos(), angles.sin(), caches[1],
                                 slots, heads, kv_heads)
    got, want = caches[0][1], caches[1][1]
    nan = want.isnan()
    assert nan.sum() == 2 * 2 and torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert torch.equal(got.view(torch.int16)[nan], torch.full((4,), 0x7FC0, dtype=torch.int16))


@pytest.mark.parametrize("dtype,cache_dtype,tol", KV_DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim,blocks,bs", SHAPES)
def test_decode_attention(ops, variant, dtype, cache_dtype, tol, heads, kv_heads, dim, blocks,
                          bs):
    g = torch.Generator().manual_seed(2)
    cache = torch.randn(2, kv_heads, blocks, bs, dim, generator=g).to(cache_dtype)
    table = torch.randint(1, blocks, (4, 5), generator=g)
    seq_lens = torch.tensor([1, bs + 1, 5 * bs, 3 * bs - 2])
    q = torch.randn(4, heads, dim, generator=g).to(dtype)
    got = ops.decode_attention(q, cache, table, seq_lens, dim ** -0.5)
    want = cpu_ops.torch_decode_attention(q, cache, table, seq_lens, dim ** -0.5)
    assert got.shape == (4, heads * dim) and got.dtype == dtype
    _check_close(got, want, tol + (8e-3 if dtype == torch.bfloat16 else 0))


def test_a_cache_of_another_dtype_is_refused(ops):
    """The cache takes the activations' dtype, or bf16 beside fp32; nothing else."""
    cache = torch.zeros(2, 1, 4, 4, 16, dtype=torch.bfloat16)
    q = torch.zeros(1, 2, 16, dtype=torch.float16)
    table, lens = torch.ones(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="a KV cache of BFloat16 beside activations of Half"):
        ops.decode_attention(q, cache, table, lens, 0.25)
    with pytest.raises(RuntimeError, match="a KV cache of Float beside activations of BFloat16"):
        ops.decode_attention(q.bfloat16(), cache.float(), table, lens, 0.25)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_silu_and_mul(ops, variant, dtype, tol):
    x = torch.randn(5, 3072, generator=torch.Generator().manual_seed(3)).to(dtype)
    got = ops.silu_and_mul(x)
    assert got.shape == (5, 1536) and got.dtype == dtype
    _check_close(got, cpu_ops.torch_silu_and_mul(x), tol)


LONG_KV_DTYPES = [(torch.float32, torch.float32, 2e-6), (torch.bfloat16, torch.bfloat16, 8e-3),
                  (torch.float32, torch.bfloat16, 2e-6)]


@pytest.mark.parametrize("dtype,cache_dtype,tol", LONG_KV_DTYPES)
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5])
def test_decode_attention_over_long_contexts_and_every_tile_tail(ops, variant, dtype,
                                                                 cache_dtype, tol, group):
    """The vectorised path (head_dim a multiple of 64; fp32 or bf16 cache) at lengths around
    its 8-key tiles and far past a block, where the scores span many tiles; for every group
    of query heads per KV head: 2-4 share each key's load where AVX-512 gives the registers,
    1 and 5 take a head at a time."""
    q, cache, table, seq_lens, want = _long_context_case(group, dtype, cache_dtype)
    got = ops.decode_attention(q, cache, table, seq_lens, 0.125)
    assert got.shape == want.shape == (len(seq_lens), 3 * group * 64)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * max(want.float().abs().max().item(), 1.0), err


@functools.cache
def _long_context_case(group: int, dtype: torch.dtype, cache_dtype: torch.dtype
                       ) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(4 + group)
    cache = (torch.randn(2, 3, 90, 16, 64, generator=g) * 3).to(cache_dtype)   # large scores
    lens = [1, 7, 8, 9, 15, 16, 17, 300, 1400]
    table = torch.stack([torch.randperm(89, generator=g)[:88] + 1 for _ in lens])
    q = torch.randn(len(lens), 3 * group, 64, generator=g).to(dtype)
    seq_lens = torch.tensor(lens)
    return (q, cache, table, seq_lens,
            cpu_ops.torch_decode_attention(q, cache, table, seq_lens, 0.125))


@pytest.mark.parametrize("dtype,cache_dtype,tol", LONG_KV_DTYPES)
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
def test_decode_attention_over_scattered_blocks_and_ragged_lengths(ops, variant, dtype,
                                                                   cache_dtype, tol, group,
                                                                   block_size):
    """Requests of ragged lengths over blocks scattered through the cache: lengths at and
    around a block's end, at and around the read-ahead distance (where it runs past a pass's
    end) and past both; block sizes that do and do not divide them."""
    q, cache, table, seq_lens, want = _scattered_case(group, block_size,
                                                      ops.attention_prefetch_tokens, dtype,
                                                      cache_dtype)
    got = ops.decode_attention(q, cache, table, seq_lens, 0.125)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * max(want.float().abs().max().item(), 1.0), err


@functools.cache
def _scattered_case(group: int, block_size: int, ahead: int, dtype: torch.dtype,
                    cache_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(100 * group + block_size)
    around = [1, block_size - 1, block_size, block_size + 1, ahead - 1, ahead, ahead + 1,
              2 * ahead + 3, 97, 260]
    lens = sorted({n for n in around if n >= 1})
    width = -(-max(lens) // block_size)
    blocks = width * len(lens) + 1
    cache = (torch.randn(2, 2, blocks, block_size, 64, generator=g) * 2).to(cache_dtype)
    table = (torch.randperm(blocks - 1, generator=g) + 1)[:width * len(lens)]
    table = table.view(len(lens), width)
    q = torch.randn(len(lens), 2 * group, 64, generator=g).to(dtype)
    seq_lens = torch.tensor(lens)
    return (q, cache, table, seq_lens,
            cpu_ops.torch_decode_attention(q, cache, table, seq_lens, 0.125))


def _random_q4(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // 32, generator=g) * 0.02
    return qs, scale, -8 * scale + torch.rand(n, k // 32, generator=g) * 0.01


def _dequantized_q4(qs: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    n = qs.shape[0]      # byte i of a group: weight i (low nibble), weight i + 16 (high)
    q = torch.cat([(qs & 15).view(n, -1, 16), (qs >> 4).view(n, -1, 16)], -1).double()
    return (q * scale.double()[..., None] + offset.double()[..., None]).view(n, -1)


def _q8_matmul(ops, x: torch.Tensor, q8: torch.Tensor, s8: torch.Tensor) -> torch.Tensor:
    """`q8_matmul` on int8 q8 [N, K] and scales s8 [N, K / 32] (as `Int8Weight` lays them out)."""
    return ops.q8_matmul(x, *q8_column_blocks(q8, s8, ops.q8_block_columns), q8.shape[0])


def _q8_argmax(ops, x: torch.Tensor, q8: torch.Tensor, s8: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = q8_column_blocks(q8, s8, ops.q8_block_columns)
    return ops.q8_matmul_argmax(x, *blocks, q8.shape[0])


def _dequantized_q8(q8: torch.Tensor, s8: torch.Tensor) -> torch.Tensor:
    n, k = q8.shape
    return (q8.double().view(n, -1, 32) * s8.double()[..., None]).view(n, k)


@pytest.mark.parametrize(("k", "n"), [(32, 13), (96, 40), (576, 200), (1536, 72), (64, 1)])
def test_q8_matmul_at_every_row_count_on_edge_shapes(ops, variant, k, n):
    """The 8-bit kernel (the LM head's) on W in blocks of 16 columns (`q8_column_blocks`) at
    1-17 rows (AVX-512: tiles of 8 rows, 1-4 rows two blocks at a time; AVX2: tiles of 3):
    each y within 1e-4 of the largest of x @ W.T in fp64 (x rounded to int16 per group);
    N of 1 column, 13 (under one block), 40 and 72 (a last block half full) and 200 (pool
    chunks); K of one group to 48. A row's y does not depend on the rows beside it: each
    equals, bit for bit, that row's y alone (so the argmax at any row count is the one of
    the logits at any other), and the argmax kernel's is the matmul's. (The row counts run
    in one test: 340 cases of a few ms each were mostly pytest's own time.)"""
    for rows in range(1, 18):
        g = torch.Generator().manual_seed(rows * 101 + k + n)
        x = torch.randn(rows, k, generator=g)
        q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        s8 = torch.rand(n, k // 32, generator=g) * 0.01
        want = x.double() @ _dequantized_q8(q8, s8).T
        got = _q8_matmul(ops, x, q8, s8)
        assert got.shape == (rows, n)
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-4, rows
        alone = torch.cat([_q8_matmul(ops, x[m:m + 1], q8, s8) for m in range(rows)])
        assert torch.equal(got, alone), rows
        columns, values = _q8_argmax(ops, x, q8, s8)
        assert torch.equal(columns, got.argmax(-1)), rows
        assert torch.equal(values, got.max(-1).values), rows


@pytest.mark.parametrize("k", [576, 96])            # 18 groups (8 + 8 + 2), 3 groups
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16, 33])
def test_quantized_matmuls_on_every_path(ops, variant, rows, k):
    """q4 and q8 matmuls against their dequantized weights in fp64, on each kernel: 1-2 rows
    (int16 activations, 8 groups' sums in one vector, then the groups left over), 3 and more
    (q4: fp32 rows against weights dequantized in registers, in tiles of 4 rows or, on
    AVX-512, all rows in vector lanes; q8: the columns in vector lanes at every row count).
    The integer kernels round x to 16 bits per group (~2^-16 of its largest value); the fp32
    ones only sum in another order. 200 columns: from K = 576 the pool splits them in chunks."""
    g = torch.Generator().manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k, generator=g)
    qs, scale, offset = _random_q4(200, k, g)
    want = x.double() @ _dequantized_q4(qs, scale, offset).T
    got = ops.q4_matmul(x, qs, scale, offset)
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err < (1e-6 if rows >= 3 else 1e-4), err
    q8 = torch.randint(-127, 128, (200, k), dtype=torch.int8, generator=g)
    s8 = torch.rand(200, k // 32, generator=g) * 0.01
    want8 = x.double() @ _dequantized_q8(q8, s8).T
    got8 = _q8_matmul(ops, x, q8, s8)
    assert ((got8.double() - want8).abs().max() / want8.abs().max()).item() < 1e-4


@pytest.mark.parametrize("k", [576, 96])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 11, 33])
def test_quantized_matmuls_on_bf16_rows(ops, variant, rows, k):
    """The same matmuls with bf16 x, as `--dtype bfloat16` runs them: 1-2 rows (and q8 at
    every count) the integer kernel, x rounded to int16 per group (on AVX-512 VNNI, the
    `dpwssd` one); 3 and more q4 rows (11 = 4 + 4 + 3) the fp32 kernel on x widened exactly,
    or on AVX-512 BF16 the nibbles against x in `vdpbf16ps` products: both exact but for
    the order of their fp32 sums, so each y is the exact product rounded to bf16, give or
    take its last bit."""
    g = torch.Generator().manual_seed(rows * 1000 + k + 7)
    x = torch.randn(rows, k, generator=g).bfloat16()
    qs, scale, offset = _random_q4(200, k, g)
    want = x.double() @ _dequantized_q4(qs, scale, offset).T
    got = ops.q4_matmul(x, qs, scale, offset)
    assert got.dtype == torch.bfloat16
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-2
    if rows >= 3:         # one bf16 step (2^-8 relative) and the fp32 sums' rounding
        assert ((got.double() - want).abs() <= want.abs() * 2 ** -8 + 3e-6).all()
    q8 = torch.randint(-127, 128, (200, k), dtype=torch.int8, generator=g)
    s8 = torch.rand(200, k // 32, generator=g) * 0.01
    want8 = x.double() @ _dequantized_q8(q8, s8).T
    got8 = _q8_matmul(ops, x, q8, s8)
    assert ((got8.double() - want8).abs().max() / want8.abs().max()).item() < 1e-2


@pytest.mark.parametrize(("k", "n"), [(32, 13), (288, 200), (1536, 72)])
@pytest.mark.parametrize("rows", [3, 13, 17, 20, 32, 45, 130])
def test_q4_matmul_at_many_rows_on_edge_shapes(ops, variant, rows, k, n):
    """The fp32 4-bit kernels on shapes that end mid-tile: K of one group, of 9 and of 48
    (the lane kernel's scratch holds 16 of them, its partial sums 4); rows in 4-row tiles
    alone (3), in lanes padded to a vector (13, 45 = 32 + 13), in lanes then tiles (17, 20 =
    16 + 4, 130 = 128 + 2: more than one pass of 128 rows), in whole vectors (32); 13
    columns (under one tile of 16) and 200 (a last pool chunk of 8). Each y within 1e-6 of
    the largest, as the 4-row tiles alone."""
    g = torch.Generator().manual_seed(rows * 7 + k + n)
    x = torch.randn(rows, k, generator=g)
    qs, scale, offset = _random_q4(n, k, g)
    want = x.double() @ _dequantized_q4(qs, scale, offset).T
    got = ops.q4_matmul(x, qs, scale, offset)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-6


@pytest.mark.parametrize(("k", "n"), [(32, 13), (96, 40), (576, 200), (1536, 72)])
def test_q4_matmul_rounds_fp32_rows_to_bf16_only_under_bf16_x(ops, variant, k, n):
    """`bf16_x` (the mixed precision's layer matmuls): on AVX512_BF16 every row of the
    fp kernels (3+) is rounded to bf16 and runs in exact `vdpbf16ps` products with the
    nibbles, fp32 sums: the lane kernel's rows (`bf16_lane_rows`: whole vectors of 16, 13-15
    padded to one, then 8 in a half vector where 8-12 are left) and the 4-row tiles' past
    them (`bf16_columns`). Each y within 1e-6 of the largest of x rounded to bf16 @ W.T in
    fp64 (and not of the unrounded x's, 2^-9 away). Every row on the other variants and
    every row without `bf16_x` stay the fp32 kernels' (x not rounded, within 1e-6). The
    argmax kernel rounds as the matmul does. (The row counts run in one test.)"""
    for rows in (3, 8, 12, 13, 15, 16, 17, 24, 29, 32, 45, 48, 130, 200):
        _check_bf16_x_rounding(ops, variant, rows, k, n)


def _check_bf16_x_rounding(ops, variant: str, rows: int, k: int, n: int) -> None:
    """`test_q4_matmul_rounds_fp32_rows_to_bf16_only_under_bf16_x` at one row count."""
    g = torch.Generator().manual_seed(rows * 13 + k + n)
    x = torch.randn(rows, k, generator=g)
    qs, scale, offset = _random_q4(n, k, g)
    w = _dequantized_q4(qs, scale, offset)
    exact, rounded = x.double() @ w.T, x.bfloat16().double() @ w.T
    bf16 = variant == "avx512_bf16"
    want = rounded if bf16 else exact

    def err(got: torch.Tensor, want: torch.Tensor) -> float:
        return ((got.double() - want).abs().max() / want.abs().max()).item()

    got = ops.q4_matmul(x, qs, scale, offset, bf16_x=True)
    assert err(got, want) < 1e-6, rows
    if bf16:                            # the lanes' rows and the tiles' both rounded
        lanes = ops.bf16_lane_rows(rows)
        parts = [p for p in (slice(0, lanes), slice(lanes, rows)) if p.stop > p.start]
        assert all(err(got[p], exact[p]) > 1e-5 for p in parts), rows
    assert err(ops.q4_matmul(x, qs, scale, offset), exact) < 1e-6, rows
    columns, values = ops.q4_matmul_argmax(x, qs, scale, offset, bf16_x=True)
    assert torch.equal(columns, got.argmax(-1)), rows
    assert torch.equal(values, got.max(-1).values), rows


def test_q4_column_blocks_lay_each_block_s_bytes_side_by_side(ops):
    """`q4_column_blocks` writes kernels.h's layout: byte (b, g, i, j) is byte i of group g of
    column 16b + j, scales and offsets (b, g, j) those of column 16b + j, the columns past N
    zero."""
    g = torch.Generator().manual_seed(3)
    qs, scale, offset = _random_q4(21, 96, g)
    columns = ops.q4_block_columns
    bq, bs, bo = q4_column_blocks(qs, scale, offset, columns)
    assert columns == 16 and bq.shape == (32, 48) and bs.shape == bo.shape == (32, 3)
    flat_q, flat_s, flat_o = bq.flatten(), bs.flatten(), bo.flatten()
    for b, grp, i, j in [(0, 0, 0, 0), (0, 2, 15, 7), (1, 1, 3, 4), (1, 0, 9, 15)]:
        n = 16 * b + j
        at = ((b * 3 + grp) * 16 + i) * 16 + j
        assert flat_q[at] == (qs[n, 16 * grp + i] if n < 21 else 0)
        at = (b * 3 + grp) * 16 + j
        assert flat_s[at] == (scale[n, grp] if n < 21 else 0)
        assert flat_o[at] == (offset[n, grp] if n < 21 else 0)


@pytest.mark.parametrize(("k", "n"), [(32, 13), (96, 40), (576, 200), (1536, 72)])
def test_q4_matmul_on_column_blocks(ops, variant, k, n):
    """W also in column blocks (`blocks`, as `Int4Weight` holds it under `bf16_x`): on a
    variant with the block kernel every row of 3+ (tiles of up to 8 rows: 9 = 8 + 1, 33 = 4
    x 8 + 1) is rounded to bf16 and runs in exact `vdpbf16ps` products with the nibbles, the
    columns in lanes, fp32 sums: each y within 1e-6 of the largest of x rounded to bf16 @ W.T
    in fp64 (and not of the unrounded x's), bf16 x likewise (within a bf16 step). 13 columns:
    under one block; 40, 72: a last block partly past N; 200: pool chunks. Elsewhere (1-2
    rows, other variants, no `bf16_x`) the blocks are not read: y is the row layout's, bit
    for bit. (The row counts run in one test.)"""
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 33):
        _check_column_blocks(ops, rows, k, n)


def _check_column_blocks(ops, rows: int, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(rows * 17 + k + n)
    x = torch.randn(rows, k, generator=g)
    qs, scale, offset = _random_q4(n, k, g)
    blocks = q4_column_blocks(qs, scale, offset, ops.q4_block_columns)
    w = _dequantized_q4(qs, scale, offset)
    exact, rounded = x.double() @ w.T, x.bfloat16().double() @ w.T

    def err(got: torch.Tensor, want: torch.Tensor) -> float:
        return ((got.double() - want).abs().max() / want.abs().max()).item()

    got = ops.q4_matmul(x, qs, scale, offset, bf16_x=True, blocks=blocks)
    if ops.has_q4_block_kernel() and rows >= 3:
        assert err(got, rounded) < 1e-6 and err(got, exact) > 1e-5
        xb = x.bfloat16()
        got_b = ops.q4_matmul(xb, qs, scale, offset, blocks=blocks)
        want_b = xb.double() @ w.T
        assert ((got_b.double() - want_b).abs() <= want_b.abs() * 2 ** -8 + 3e-6).all()
    else:
        assert torch.equal(got, ops.q4_matmul(x, qs, scale, offset, bf16_x=True))
    assert torch.equal(ops.q4_matmul(x, qs, scale, offset, blocks=blocks),
                       ops.q4_matmul(x, qs, scale, offset))


def test_q4_matmul_refuses_blocks_of_another_shape(ops):
    g = torch.Generator().manual_seed(5)
    qs, scale, offset = _random_q4(40, 96, g)
    blocks = q4_column_blocks(qs[:16], scale[:16], offset[:16], ops.q4_block_columns)
    with pytest.raises(RuntimeError, match="column blocks"):
        ops.q4_matmul(torch.randn(3, 96), qs, scale, offset, bf16_x=True, blocks=blocks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 20])
def test_the_lm_head_argmax_is_the_argmax_of_its_logits_exactly(ops, variant, rows, dtype):
    """`q8_matmul_argmax` / `q4_matmul_argmax` (greedy decoding's LM head, the logits row
    never written whole) give, per row, exactly `argmax` of the matmul's own output (in
    x's dtype) and that maximum; equal logits (duplicated weight rows, among them each
    row's winner) go to the first column, as torch.argmax does. 1,000 columns: many
    tasks on the pool, and a last one shorter than the rest."""
    g = torch.Generator().manual_seed(rows * 31 + (dtype == torch.bfloat16))
    n, k = 1000, 96
    x = torch.randn(rows, k, generator=g).to(dtype)
    q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    s8 = torch.rand(n, k // 32, generator=g) * 0.01
    qs, scale, offset = _random_q4(n, k, g)
    winners = _q8_matmul(ops, x, q8, s8).float().argmax(-1)
    for i, w in enumerate(winners.tolist()):     # a copy of row w's weights further on
        q8[900 + i], s8[900 + i] = q8[w], s8[w]
        q8[10 + i], s8[10 + i] = q8[w], s8[w]        # ... and one before it
    for got, logits in [
            (_q8_argmax(ops, x, q8, s8), _q8_matmul(ops, x, q8, s8)),
            (ops.q4_matmul_argmax(x, qs, scale, offset), ops.q4_matmul(x, qs, scale, offset))]:
        columns, values = got
        assert logits.dtype == dtype and columns.dtype == torch.int64
        assert torch.equal(columns, logits.float().argmax(-1))
        assert torch.equal(values, logits.float().max(-1).values)
    assert (_q8_argmax(ops, x, q8, s8)[0] < 100).all()   # the copies


def _huge_page_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (smaps)."""
    inside = False
    with open("/proc/self/smaps", encoding="ascii") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(part, 16) for part in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    return 0


def _thp_fault_fallbacks() -> int:
    """The kernel's count of page faults in huge-page regions served with small pages."""
    with open("/proc/vmstat", encoding="ascii") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("thp_fault_fallback "))


def test_huge_page_copies_hold_the_same_values_in_one_buffer_of_huge_pages(ops):
    tensors = [torch.randint(0, 256, (3072, 288), dtype=torch.uint8),
               torch.randn(3072, 18), torch.randint(-128, 128, (7, 5), dtype=torch.int8),
               torch.randn(4096, 144)]
    fallbacks = _thp_fault_fallbacks()
    copies = cpu_ops.huge_page_copies(tensors)
    for t, c in zip(tensors, copies, strict=True):
        assert c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous()
        assert torch.equal(c, t) and c.data_ptr() % 64 == 0
    base = copies[0].untyped_storage().data_ptr()
    assert all(c.untyped_storage().data_ptr() == base for c in copies)   # one buffer
    assert base % (2 << 20) == 0
    with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="ascii") as f:
        thp = f.read()
    if "[never]" not in thp:      # the kernel grants 2 MiB pages on request here, unless
        # it has none free (memory fragmented by a busy machine): then it counts the fault's
        # fallback to 4 KiB pages, which shows the buffer asked for them all the same
        assert (_huge_page_bytes_at(base) >= 2 << 20
                or _thp_fault_fallbacks() > fallbacks), "no huge page and no fallback counted"
    assert cpu_ops.huge_page_copies([]) == []


def _thp_mode() -> str:
    """The kernel's transparent huge page mode: "always", "madvise" or "never"."""
    with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="ascii") as f:
        found = re.search(r"\[(\w+)\]", f.read())
    assert found is not None
    return found.group(1)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_the_kv_cache_is_zeroed_in_one_buffer_of_huge_pages(ops, kv_cache_dtype):
    """`allocate_kv_caches` on CPU (`cpu_ops.huge_page_zeros`): every layer's cache zeroed,
    all in one buffer from a 2 MiB boundary, and the kernel backs it with huge pages
    (smaps' AnonHugePages), unless it had none free and counted the fallback."""
    from kvloop.model.kv_quant import kv_quant_for
    from kvloop.model.loader import ModelConfig
    from kvloop.model.runner import allocate_kv_caches

    if _thp_mode() == "never":
        pytest.skip("transparent huge pages are off here (/sys/kernel/mm/"
                    "transparent_hugepage/enabled says never): the cache stays in 4 KiB pages")
    config = ModelConfig(architecture="llama", vocab_size=100, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=4, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64)
    quant = kv_quant_for(kv_cache_dtype)
    fallbacks = _thp_fault_fallbacks()
    caches = allocate_kv_caches(config, 100, 16, torch.float32, torch.device("cpu"), quant)
    row, dtype = (64, torch.float32) if quant is None else (68, torch.uint8)
    assert len(caches) == 4 and len({c.data_ptr() for c in caches}) == 4
    for c in caches:
        assert c.shape == (2, 3, 100, 16, row) and c.dtype == dtype and c.is_contiguous()
        assert not c.any() and c.data_ptr() % 64 == 0
    base = caches[0].untyped_storage().data_ptr()
    assert all(c.untyped_storage().data_ptr() == base for c in caches)
    assert base % (2 << 20) == 0
    assert (_huge_page_bytes_at(base) >= 2 << 20
            or _thp_fault_fallbacks() > fallbacks), "no huge page and no fallback counted"


def test_the_build_is_keyed_by_source_torch_flags_and_architecture():
    """`build_key` of the same inputs is the same name; a changed source file, another file,
    another torch version, other compiler flags or another architecture each give another.
    The CPU's features are no input: one build serves every CPU of its architecture."""
    sources = {p.name: p.read_bytes() for p in cpu_ops.source_files()}
    assert {"generic.cpp", "dispatch.cpp", "kernels.h", "pool.h"} <= set(sources)
    inputs = (sources, "2.13.0", ["-O3", "-fopenmp"], "x86_64")
    name = cpu_ops.build_key(*inputs)
    assert name.startswith("kvloop_cpu_ops_") and name == cpu_ops.build_key(*inputs)
    changed = {
        "source": ({**sources, "generic.cpp": sources["generic.cpp"] + b"\n"}, *inputs[1:]),
        "header": ({**sources, "pool.h": sources["pool.h"] + b" "}, *inputs[1:]),
        "file added": ({**sources, "x86_amx.cpp": b""}, *inputs[1:]),
        "file renamed": ({("a" + k if k == "pool.h" else k): v for k, v in sources.items()},
                         *inputs[1:]),
        "torch": (sources, "2.13.0+cpu", *inputs[2:]),
        "flags": (sources, "2.13.0", ["-O2", "-fopenmp"], "x86_64"),
        "architecture": (*inputs[:3], "aarch64"),
    }
    names = {what: cpu_ops.build_key(*args) for what, args in changed.items()}
    assert len({name, *names.values()}) == 1 + len(changed), names
    assert cpu_ops.extension_name() == cpu_ops.build_key(
        sources, torch.__version__, cpu_ops._FLAGS, __import__("platform").machine())
    assert "-march=native" not in cpu_ops._FLAGS


_WIDE = re.compile(r"%[yz]mm\d|%xmm(1[6-9]|2\d|3[01])\b|%k[1-7]\b")      # AVX and AVX-512
_EVEX = re.compile(r"%zmm\d|%[xy]mm(1[6-9]|2\d|3[01])\b|%k[1-7]\b")      # AVX-512 only


@pytest.mark.processes                   # objdump
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 variants")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump")
def test_wide_instructions_live_only_in_their_variants_code(ops):
    """The library runs on any x86-64 CPU: every function that touches a 256- or 512-bit
    register (or an AVX-512 mask) belongs to one instruction set's namespace, AVX-512
    registers only to the AVX-512 ones, every namespace does use its own (their target
    regions took effect), and the BF16 one its `vdpbf16ps`. A shared inline function
    compiled wide would break this."""
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", ops.__file__],
                             capture_output=True, text=True, timeout=120, check=True).stdout
    wide: dict[str, set[str]] = {}
    function = ""
    for line in listing.splitlines():
        if line.endswith(">:"):
            function = line[line.index("<") + 1:-2]
        elif _WIDE.search(line):
            kinds = wide.setdefault(function, set())
            kinds.add("evex" if _EVEX.search(line) else "avx")
            if "vdpbf16ps" in line:
                kinds.add("bf16")

    def isa(function: str) -> str | None:
        return next((name for name in VARIANTS if f"kvloop::{name}::" in function), None)

    assert [f for f in wide if isa(f) is None] == []
    assert [f for f in wide if isa(f) == "avx2" and "evex" in wide[f]] == []
    assert any(isa(f) == "avx2" for f in wide)
    for name in ("avx512", "avx512_bf16"):
        assert any(isa(f) == name and "evex" in kinds for f, kinds in wide.items()), name
    assert [f for f, kinds in wide.items() if "bf16" in kinds and isa(f) != "avx512_bf16"] == []
    assert any(isa(f) == "avx512_bf16" and "bf16" in kinds for f, kinds in wide.items())


# --- kvloop's thread pool (csrc/pool.h) -----------------------------------------------------
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_pool_runs_every_chunk_exactly_once(ops, threads):
    """`pool_run_ids` fails inside if a chunk runs twice or never; on every size, also more
    threads than cores."""
    try:
        ops.set_pool_threads(threads)
        assert ops.pool_threads() == threads
        for n in [0, 1, 2, 7, 1000, 100_000]:
            assert (ops.pool_run_ids(n) >= 0).all()
    finally:
        ops.set_pool_threads(torch.get_num_threads())


def test_concurrent_callers_share_the_pool_without_deadlock(ops):
    """One caller at a time runs on the workers; another meanwhile runs its chunks itself."""
    import threading

    ops.set_pool_threads(2)
    errors: list[BaseException] = []

    def hammer():
        try:
            for _ in range(200):
                ops.pool_run_ids(500)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)


@pytest.mark.processes
def test_a_forked_child_rebuilds_the_pool(ops):
    """The workers do not survive fork(); the child's first call builds a fresh pool."""
    ops.set_pool_threads(2)
    ops.pool_run_ids(1000)                    # the parent's workers exist
    pid = os.fork()
    if pid == 0:                              # child: must not hang or fail
        try:
            ok = bool((ops.pool_run_ids(1000) >= 0).all()) and ops.pool_threads() == 2
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0


@pytest.mark.processes
def test_jobs_of_changing_sizes_back_to_back_never_lose_a_chunk(ops):
    """200,000 jobs of 2-64 chunks back to back on 2 threads, in a child process (a lost
    job hangs its caller: the child is killed after 120 s). The pool used to hang here
    within seconds: a worker leaving one job checked its stale claim against the next
    job's larger chunk count and ran a chunk twice."""
    code = ("from kvloop.model import cpu_ops; cpu_ops.set_pool_threads(2); "
            "print(cpu_ops.build().pool_stress(200_000))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, check=True).stdout
    except subprocess.TimeoutExpired:
        pytest.fail("a job of the pool never finished (the caller hung)")
    assert out.split() == ["0"]


# --- end to end: a tiny model with the extension, without it, and under transformers -------
E2E_PROMPTS = [[5, 6, 7], list(range(40, 61)), [9] * 37]     # 3, 21 and 37 tokens
E2E_TOKENS = 8
_GREEDY_SCRIPT = """
import json, sys
from kvloop import LLM, SamplingParams
from kvloop.model import cpu_ops
llm = LLM(sys.argv[1], dtype="float32", device="cpu", block_size=16, num_threads=1,
          num_gpu_blocks_override=32, kv_cache_dtype=sys.argv[4])
params = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3]), ignore_eos=True)
outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])], params,
                    use_tqdm=False)
print(json.dumps({"kernels": cpu_ops.kernels(),
                  "tokens": [o.outputs[0].token_ids for o in outs]}))
llm.shutdown()
"""


def _greedy_in_process(path, variants, kv_cache_dtype="auto"):
    """variant -> greedy tokens of E2E_PROMPTS, in a child process per variant (None: the
    extension off)."""
    out = {}
    for name in variants:
        env = {k: v for k, v in os.environ.items()
               if k not in (cpu_ops.ENV_SWITCH, cpu_ops.KERNELS_ENV)}
        env.update({cpu_ops.ENV_SWITCH: "0"} if name is None else {cpu_ops.KERNELS_ENV: name})
        run = subprocess.run([sys.executable, "-c", _GREEDY_SCRIPT, str(path),
                              json.dumps(E2E_PROMPTS), str(E2E_TOKENS), kv_cache_dtype],
                             env=env,
                             capture_output=True, text=True, timeout=300, check=True)
        result = json.loads(run.stdout.strip().splitlines()[-1])
        assert result["kernels"] == name
        out[name] = result["tokens"]
    return out


@pytest.mark.processes
def test_a_tiny_model_gives_transformers_greedy_tokens_with_and_without_the_extension(
        ops, tmp_path):
    """A tiny fp32 Llama (head_dim 64: the vectorised attention; 2 query heads per KV head)
    on kvloop with `KVLOOP_CPU_OPS=0` (the pure-torch twins), and on each kernel variant
    this CPU runs: every run's greedy tokens equal transformers' (fp32, argmax each step)."""
    from tests.test_model_tiny import tiny_hf_model, write_tiny_gguf

    model = tiny_hf_model(seed=21, hidden_size=256, intermediate_size=192,
                          num_attention_heads=4, num_key_value_heads=2)
    path = write_tiny_gguf(model, tmp_path / "t.gguf")
    want = []
    with torch.no_grad():                   # greedy, EOS included (kvloop's ignore_eos)
        for prompt in E2E_PROMPTS:
            ids = torch.tensor([prompt])
            for _ in range(E2E_TOKENS):
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
            want.append(ids[0, len(prompt):].tolist())
    runnable = [v.name for v in cpu_ops.kernel_variants() if v.runs_here]
    got = _greedy_in_process(path, [None, *runnable])
    assert all(len(t) == E2E_TOKENS for t in want)
    assert got == {name: want for name in [None, *runnable]}
    # a bf16 cache beside the fp32 activations (--kv-cache-dtype bfloat16): the twins and
    # every variant agree, and on this model keep transformers' fp32 tokens
    assert _greedy_in_process(path, [None, *runnable], "bfloat16") == got


# Prefill (chunk) attention: heads, KV heads (GQA groups 1-4 and MHA), head_dim (64 and 128
# take the vector kernels, 96 the AVX2 one (whole passes of 32 dims) and the portable one on
# AVX-512 (passes of 64), 16 the portable one everywhere)
PREFILL_SHAPES = [(9, 3, 64), (4, 4, 64), (8, 4, 64), (6, 3, 64), (8, 2, 128), (16, 4, 128),
                  (4, 2, 96), (4, 2, 16)]
# (context, chunk): fresh and over a cached prefix; chunks of 1 and 2 tokens, and lengths
# off the kernels' tiles (48 query rows, blocks of 128 keys) on both sides of a block's end
PREFILL_LENGTHS = [(0, 1), (0, 2), (0, 17), (0, 130), (0, 300), (5, 1), (100, 7),
                   (127, 50), (128, 128), (300, 33)]


def _prefill_case(g: torch.Generator, heads: int, kv_heads: int, dim: int, keys: int,
                  chunk: int, block_size: int, dtype: torch.dtype, cache_dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [chunk, heads, dim] as a view of fused qkv rows (rows apart, as the model passes
    it), a cache with spare blocks, and the slots of `keys` keys through a block table
    scattered over it (a partial last block)."""
    width = -(-keys // block_size)
    blocks = 2 * width + 3
    cache = (torch.randn(2, kv_heads, blocks, block_size, dim, generator=g) * 2).to(cache_dtype)
    table = (torch.randperm(blocks - 1, generator=g) + 1)[:width]
    slots = (table.unsqueeze(1) * block_size + torch.arange(block_size)).reshape(-1)[:keys]
    rows = torch.randn(chunk, heads + 2 * kv_heads, dim, generator=g).to(dtype)
    return rows[:, :heads], cache, slots


def _exact_prefill(q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, scale: float,
                   window: int = 0) -> torch.Tensor:
    """The twin in fp64 (the fp32 kernels and SDPA alike are ~1e-6 of the values from it)."""
    return cpu_ops.torch_prefill_attention(q.double(), cache.double(), slots, scale, window)


# (activations, cache, tolerance against fp64): fp32 sums in another order; bf16 output
PREFILL_DTYPES = [(torch.float32, torch.float32, 3e-6), (torch.bfloat16, torch.bfloat16, 8e-3),
                  (torch.float32, torch.bfloat16, 3e-6)]


@functools.cache
def _prefill_cases(heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
                   cache_dtype: torch.dtype) -> list[tuple[tuple[int, int, int], torch.Tensor,
                                                          torch.Tensor, torch.Tensor,
                                                          torch.Tensor]]:
    """((context, chunk, block_size), q, cache, slots, the fp64 twin's output) for every
    length in `PREFILL_LENGTHS` in blocks of 16 and 5: built once for all the variants (the
    inputs and the twin were 0.09 s of a grid cell's 0.1 s; the kernels only read them)."""
    g = torch.Generator().manual_seed(heads * 1000 + kv_heads * 10 + dim)
    cases = []
    for context, chunk in PREFILL_LENGTHS:
        for block_size in (16, 5):
            q, cache, slots = _prefill_case(g, heads, kv_heads, dim, context + chunk, chunk,
                                            block_size, dtype, cache_dtype)
            want = _exact_prefill(q, cache, slots, dim ** -0.5)
            cases.append(((context, chunk, block_size), q, cache, slots, want))
    return cases


@pytest.mark.parametrize("heads,kv_heads,dim", PREFILL_SHAPES)
def test_prefill_attention(ops, variant, heads, kv_heads, dim):
    """A chunk's causal attention over its cached context and itself (keys read in place
    through a scattered block table) equals the twin's (SDPA over the keys gathered, here in
    fp64), fresh and over a context, for every length around the kernels' tiles and
    blocks; every variant but generic has a vector kernel (`cpu_ops.prefill_attention` runs
    the op there), generic runs the portable one. fp32 here: the variants' kernels see only
    fp32 (the shared driver widens q and the cache and writes the output's dtype), so the
    other dtypes run on the process's own variant (`test_prefill_attention_in_every_dtype`)."""
    assert ops.has_prefill_kernel() == (variant != "generic")   # (else SDPA serves)
    _check_prefill(ops, heads, kv_heads, dim, *PREFILL_DTYPES[0])


@pytest.mark.parametrize("dtype,cache_dtype,tol", PREFILL_DTYPES[1:])
@pytest.mark.parametrize("heads,kv_heads,dim", PREFILL_SHAPES)
def test_prefill_attention_in_every_dtype(ops, dtype, cache_dtype, tol, heads, kv_heads, dim):
    """The same grid with bf16 activations and a bf16 cache, and fp32 over a bf16 cache, on
    the variant this CPU runs: the driver's widening and its output's rounding."""
    _check_prefill(ops, heads, kv_heads, dim, dtype, cache_dtype, tol)


def _check_prefill(ops, heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
                   cache_dtype: torch.dtype, tol: float) -> None:
    """Asserts every case of `_prefill_cases` within `tol` of the largest fp64 output."""
    for where, q, cache, slots, want in _prefill_cases(heads, kv_heads, dim, dtype,
                                                       cache_dtype):
        got = ops.prefill_attention(q, cache, slots, dim ** -0.5, 0)
        assert got.shape == (q.shape[0], heads * dim) and got.dtype == dtype
        err = (got.float() - want.float()).abs().max().item()
        assert err <= tol * max(want.float().abs().max().item(), 1.0), (where, err)


@pytest.mark.parametrize("window", [1, 7, 40, 200])
@pytest.mark.parametrize("context,chunk", [(0, 90), (48, 70), (256, 31)])
def test_prefill_attention_with_a_sliding_window(ops, variant, window, context, chunk):
    """With a window W, query i sees keys j with n - c + i - W < j <= n - c + i (the slots
    from a block-aligned first key): as the twin's mask says."""
    g = torch.Generator().manual_seed(window + context)
    q, cache, slots = _prefill_case(g, 9, 3, 64, context + chunk, chunk, 16, torch.float32,
                                    torch.bfloat16)
    got = ops.prefill_attention(q, cache, slots, 0.125, window)
    _check_close(got, _exact_prefill(q, cache, slots, 0.125, window), 3e-6)


def test_the_prefill_mask_is_lower_right_causal_and_windowed():
    """The twin's mask: query i (at key position kv_len - q_len + i) sees keys up to itself,
    and with a window W only the last W of them; None where SDPA's top-left `is_causal` says
    the same (no context, no window)."""
    cpu = torch.device("cpu")
    assert cpu_ops.prefill_mask(4, 4, 0, cpu) is None
    assert cpu_ops.prefill_mask(2, 5, 0, cpu).tolist() == [[True, True, True, True, False],
                                                           [True, True, True, True, True]]
    assert cpu_ops.prefill_mask(3, 5, 2, cpu).tolist() == [[False, True, True, False, False],
                                                           [False, False, True, True, False],
                                                           [False, False, False, True, True]]
    assert cpu_ops.prefill_mask(3, 3, 1, cpu).tolist() == [[True, False, False],
                                                           [False, True, False],
                                                           [False, False, True]]
