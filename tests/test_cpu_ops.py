"""kvloop's fused C++ CPU ops against their pure-torch twins (the oracle), fp32 and bf16.

Shapes: SmolLM2's (9 heads, 3 KV heads, head_dim 64) and a tiny GQA one (4/2/16), blocks
of 16 and 4, ragged decode lengths, slots scattered over the pool. The ops are built by
`python -m kvloop.model.cpu_ops` (the Makefile's install step); where they are not built
the test says so and skips.
"""

from __future__ import annotations

import pytest
import torch

from kvloop.model import cpu_ops

pytestmark = pytest.mark.skipif(cpu_ops.load() is None,
                                reason="kvloop's CPU ops are not built (python -m "
                                       "kvloop.model.cpu_ops)")
SHAPES = [(9, 3, 64, 24, 16), (4, 2, 16, 20, 4)]     # heads, kv heads, head_dim, blocks, bs
DTYPES = [(torch.float32, 2e-6), (torch.bfloat16, 0.0)]


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    scale = max(b.abs().max().item(), 1.0)
    assert (a.float() - b.float()).abs().max().item() <= tol * scale


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm(dtype, tol, with_residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 576, generator=g).to(dtype)
    res = torch.randn(7, 576, generator=g).to(dtype) if with_residual else None
    w = torch.rand(576, generator=g).to(dtype)
    x1, r1 = x.clone(), None if res is None else res.clone()
    x2, r2 = x.clone(), None if res is None else res.clone()
    cpu_ops.load().add_rms_norm(x1, r1, w, 1e-5)
    cpu_ops.torch_add_rms_norm(x2, r2, w, 1e-5)
    _close(x1, x2, tol * 4)
    if res is not None:
        assert torch.equal(r1, r2)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim,blocks,bs", SHAPES)
def test_rope_and_cache(dtype, tol, heads, kv_heads, dim, blocks, bs):
    g = torch.Generator().manual_seed(1)
    tokens = 9
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    positions = torch.randint(0, 300, (tokens,), generator=g)
    angles = torch.outer(torch.arange(300.0), torch.rand(dim // 2, generator=g))
    slots = torch.randperm(blocks * bs, generator=g)[:tokens]
    caches = [torch.zeros(2, kv_heads, blocks, bs, dim, dtype=dtype) for _ in range(2)]
    outs = [qkv.clone(), qkv.clone()]
    cpu_ops.load().rope_and_cache(outs[0], positions, angles.cos(), angles.sin(), caches[0],
                                  slots, heads, kv_heads)
    cpu_ops.torch_rope_and_cache(outs[1], positions, angles.cos(), angles.sin(), caches[1],
                                 slots, heads, kv_heads)
    _close(outs[0], outs[1], tol)
    _close(caches[0], caches[1], tol)
    assert caches[0].abs().sum() > 0


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim,blocks,bs", SHAPES)
def test_decode_attention(dtype, tol, heads, kv_heads, dim, blocks, bs):
    g = torch.Generator().manual_seed(2)
    cache = torch.randn(2, kv_heads, blocks, bs, dim, generator=g).to(dtype)
    table = torch.randint(1, blocks, (4, 5), generator=g)
    seq_lens = torch.tensor([1, bs + 1, 5 * bs, 3 * bs - 2])
    q = torch.randn(4, heads, dim, generator=g).to(dtype)
    got = cpu_ops.load().decode_attention(q, cache, table, seq_lens, dim ** -0.5)
    want = cpu_ops.torch_decode_attention(q, cache, table, seq_lens, dim ** -0.5)
    assert got.shape == (4, heads * dim) and got.dtype == dtype
    _close(got, want, tol + (8e-3 if dtype == torch.bfloat16 else 0))


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_silu_and_mul(dtype, tol):
    x = torch.randn(5, 3072, generator=torch.Generator().manual_seed(3)).to(dtype)
    got = cpu_ops.load().silu_and_mul(x)
    assert got.shape == (5, 1536) and got.dtype == dtype
    _close(got, cpu_ops.torch_silu_and_mul(x), tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5])
def test_decode_attention_over_long_contexts_and_every_tile_tail(dtype, tol, group):
    """The vectorised path (head_dim a multiple of 64; fp32 or bf16 cache) at lengths around
    its 8-key tiles and far past a block, where the scores span many tiles; for every group
    of query heads per KV head: 2-4 share each key's load where AVX-512 gives the registers,
    1 and 5 take a head at a time."""
    g = torch.Generator().manual_seed(4 + group)
    cache = (torch.randn(2, 3, 90, 16, 64, generator=g) * 3).to(dtype)   # large scores
    lens = [1, 7, 8, 9, 15, 16, 17, 300, 1400]
    table = torch.stack([torch.randperm(89, generator=g)[:88] + 1 for _ in lens])
    q = torch.randn(len(lens), 3 * group, 64, generator=g).to(dtype)
    seq_lens = torch.tensor(lens)
    got = cpu_ops.load().decode_attention(q, cache, table, seq_lens, 0.125)
    want = cpu_ops.torch_decode_attention(q, cache, table, seq_lens, 0.125)
    assert got.shape == want.shape == (len(lens), 3 * group * 64)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * max(want.float().abs().max().item(), 1.0), err


def _random_q4(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // 32, generator=g) * 0.02
    return qs, scale, -8 * scale + torch.rand(n, k // 32, generator=g) * 0.01


def _dequantized_q4(qs: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    n = qs.shape[0]      # byte i of a group: weight i (low nibble), weight i + 16 (high)
    q = torch.cat([(qs & 15).view(n, -1, 16), (qs >> 4).view(n, -1, 16)], -1).double()
    return (q * scale.double()[..., None] + offset.double()[..., None]).view(n, -1)


@pytest.mark.parametrize("k", [576, 96])            # 18 groups (8 + 8 + 2), 3 groups
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
def test_quantized_matmuls_on_every_path(rows, k):
    """q4 and q8 matmuls against their dequantized weights in fp64, on each kernel: 1-2 rows
    (int16 activations, 8 groups' sums in one vector, then the groups left over), 3 and more
    (q4: fp32 rows against weights dequantized in registers; q8: 4-row integer tiles). The
    integer kernels round x to 16 bits per group (~2^-16 of its largest value); the fp32
    one only sums in another order. 200 columns: from K = 576 the pool splits them in chunks."""
    g = torch.Generator().manual_seed(rows * 1000 + k)
    ops = cpu_ops.load()
    x = torch.randn(rows, k, generator=g)
    qs, scale, offset = _random_q4(200, k, g)
    want = x.double() @ _dequantized_q4(qs, scale, offset).T
    got = ops.q4_matmul(x, qs, scale, offset)
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err < (1e-6 if rows >= 3 else 1e-4), err
    q8 = torch.randint(-127, 128, (200, k), dtype=torch.int8, generator=g)
    s8 = torch.rand(200, k // 32, generator=g) * 0.01
    want8 = x.double() @ (q8.double().view(200, -1, 32) * s8.double()[..., None]).view(200, k).T
    got8 = ops.q8_matmul(x, q8.view(torch.uint8), s8)
    assert ((got8.double() - want8).abs().max() / want8.abs().max()).item() < 1e-4


@pytest.mark.parametrize("k", [576, 96])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 11])
def test_quantized_matmuls_on_bf16_rows(rows, k):
    """The same matmuls with bf16 x, as `--dtype bfloat16` runs them: 1-2 rows (and q8 at
    every count) the integer kernel, x rounded to int16 per group (on AVX-512 VNNI, the
    `dpwssd` one); 3 and more q4 rows the fp32 kernel on x widened exactly (11 = 4 + 4 + 3
    rows). Each y is rounded to bf16 (2^-9 relative)."""
    g = torch.Generator().manual_seed(rows * 1000 + k + 7)
    ops = cpu_ops.load()
    x = torch.randn(rows, k, generator=g).bfloat16()
    qs, scale, offset = _random_q4(200, k, g)
    want = x.double() @ _dequantized_q4(qs, scale, offset).T
    got = ops.q4_matmul(x, qs, scale, offset)
    assert got.dtype == torch.bfloat16
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-2
    q8 = torch.randint(-127, 128, (200, k), dtype=torch.int8, generator=g)
    s8 = torch.rand(200, k // 32, generator=g) * 0.01
    want8 = x.double() @ (q8.double().view(200, -1, 32) * s8.double()[..., None]).view(200, k).T
    got8 = ops.q8_matmul(x, q8.view(torch.uint8), s8)
    assert ((got8.double() - want8).abs().max() / want8.abs().max()).item() < 1e-2


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


def test_huge_page_copies_hold_the_same_values_in_one_buffer_of_huge_pages():
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


def test_the_build_is_keyed_by_source_torch_and_cpu(monkeypatch, tmp_path):
    """The same inputs give the same name; a changed source or header, another torch version
    or other CPU flags each give another (a build never loads where it was not built)."""
    name = cpu_ops.extension_name()
    assert name.startswith("kvloop_cpu_ops_") and name == cpu_ops.extension_name()
    source, header = tmp_path / "cpu_ops.cpp", tmp_path / "pool.h"
    source.write_bytes(cpu_ops.SOURCE.read_bytes() + b"\n// one more line\n")
    header.write_bytes(cpu_ops.HEADERS[0].read_bytes() + b"\n")
    flags = cpu_ops._cpu_flags()
    changes = {"source": (cpu_ops, "SOURCE", source),
               "header": (cpu_ops, "HEADERS", [header, *cpu_ops.HEADERS[1:]]),
               "torch": (torch, "__version__", torch.__version__ + ".post1"),
               "cpu flag added": (cpu_ops, "_cpu_flags", lambda: flags.rstrip() + " amx_fp16"),
               "cpu flag gone": (cpu_ops, "_cpu_flags", lambda: flags.rsplit(None, 1)[0])}
    names = {}
    for what, (owner, attr, value) in changes.items():
        with monkeypatch.context() as m:
            m.setattr(owner, attr, value)
            names[what] = cpu_ops.extension_name()
    assert len({name, *names.values()}) == 1 + len(changes), names
    assert cpu_ops.extension_name() == name   # and back


# --- kvloop's thread pool (csrc/pool.h) -----------------------------------------------------
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_pool_runs_every_chunk_exactly_once(threads):
    """`pool_run_ids` fails inside if a chunk runs twice or never; on every size, also more
    threads than cores."""
    ops = cpu_ops.load()
    try:
        ops.set_pool_threads(threads)
        assert ops.pool_threads() == threads
        for n in [0, 1, 2, 7, 1000, 100_000]:
            assert (ops.pool_run_ids(n) >= 0).all()
    finally:
        ops.set_pool_threads(torch.get_num_threads())


def test_concurrent_callers_share_the_pool_without_deadlock():
    """One caller at a time runs on the workers; another meanwhile runs its chunks itself."""
    import threading

    ops = cpu_ops.load()
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
def test_a_forked_child_rebuilds_the_pool():
    """The workers do not survive fork(); the child's first call builds a fresh pool."""
    import os

    ops = cpu_ops.load()
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
def test_jobs_of_changing_sizes_back_to_back_never_lose_a_chunk():
    """200,000 jobs of 2-64 chunks back to back on 2 threads, in a child process (a lost
    job hangs its caller: the child is killed after 120 s). The pool used to hang here
    within seconds: a worker leaving one job checked its stale claim against the next
    job's larger chunk count and ran a chunk twice."""
    import subprocess
    import sys

    code = ("from kvloop.model import cpu_ops; cpu_ops.set_pool_threads(2); "
            "print(cpu_ops.load().pool_stress(200_000))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, check=True).stdout
    except subprocess.TimeoutExpired:
        pytest.fail("a job of the pool never finished (the caller hung)")
    assert out.split() == ["0"]
