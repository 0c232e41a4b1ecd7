"""The quantized KV cache's format and ops (kvloop.model.kv_quant): the pure-torch twins'
round trip bounds, the C++ ops (csrc/attn_kvq.cpp) against the twins, and the block budget
(a bf16 cache beside fp32 activations, `--kv-cache-dtype bfloat16`, included).

Shapes: SmolLM2's (9 heads, 3 KV heads, head_dim 64) and a tiny GQA one (4/2/16); blocks of
16 and 4, ragged decode lengths, slots scattered over the pool.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvloop.config import resolve_kv_cache_dtype
from kvloop.model import cpu_ops, kv_quant
from kvloop.model.kv_quant import FORMATS, KVQuant, kv_quant_for
from kvloop.model.loader import ModelConfig
from kvloop.model.precision import Precision, resolve_precision
from kvloop.model.setup import num_kv_blocks

CPU = torch.device("cpu")

needs_ops = pytest.mark.skipif(cpu_ops.load() is None,
                               reason="kvloop's CPU ops are not built (python -m "
                                      "kvloop.model.cpu_ops)")
# heads, kv heads, head_dim, blocks, bs (head_dim 24: int8 rows are stored unrotated)
SHAPES = [(9, 3, 64, 24, 16), (4, 2, 16, 20, 4), (4, 2, 24, 20, 4)]
QUANTS = list(FORMATS.values())


def _torch_ops() -> object:
    return getattr(torch.ops, cpu_ops.load().__name__)


def test_names_follow_vllm():
    assert resolve_kv_cache_dtype("fp8") == "fp8_e4m3"
    assert kv_quant_for("auto") is None
    assert kv_quant_for("fp8") is FORMATS["fp8_e4m3"]
    assert [kv_quant_for(n).name for n in ("fp8_e5m2", "int8")] == ["fp8_e5m2", "int8"]
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of"):
        resolve_kv_cache_dtype("q4")


def test_a_bf16_cache_is_the_precision_s_kv_dtype():
    """`--kv-cache-dtype bfloat16` (vLLM's name) stores values, not codes: the Precision's
    KV cache dtype, beside fp32 activations; under bf16 activations it is "auto"'s cache."""
    assert resolve_kv_cache_dtype("bfloat16") == "bfloat16" and kv_quant_for("bfloat16") is None
    fp32 = resolve_precision("float32", CPU, "bfloat16")
    assert fp32 == Precision(torch.float32, torch.float32, torch.bfloat16)
    assert fp32.kv_cache == torch.bfloat16 and fp32.describe() == "fp32, bf16 KV cache"
    assert resolve_precision("float32", CPU, "int8").kv_cache == torch.float32   # codes instead
    bf16 = resolve_precision("bfloat16", CPU, "bfloat16")
    assert bf16 == resolve_precision("bfloat16", CPU) == Precision.uniform(torch.bfloat16)
    auto = resolve_precision("auto", CPU, "bfloat16")
    assert (auto.activations, auto.kv_cache) == (torch.float32, torch.bfloat16)
    with pytest.raises(ValueError, match="--kv-cache-dtype bfloat16 needs fp32 or bf16"):
        resolve_precision("float16", CPU, "bfloat16")


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.name)
def test_round_trip_error_is_bounded_per_row(quant: KVQuant):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 64, generator=g) * torch.rand(50, 1, generator=g) * 20
    x[3] = 0.0                                   # an all-zero row: scale 0, codes 0
    rows = kv_quant.quantize_rows(x, quant)
    assert rows.shape == (50, 68) and rows.dtype == torch.uint8
    back = kv_quant.dequantize_rows(rows, quant, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    # int8: half a code step of the rotated row, each element, so in L2 norm sqrt(64) x that
    # (H is orthogonal); e4m3 (3 mantissa bits): 1/16 relative, e5m2 (2 bits): 1/8, and at
    # least the smallest subnormal step of the row's scale
    err = (back - x).abs()
    if quant.name == "int8":
        assert quant.rotates(64)
        rotated_amax = (x @ kv_quant.hadamard(64)).abs().amax(-1)
        assert (err.norm(dim=-1) <= 8 * rotated_amax / 127 / 2 * 1.0001 + 1e-6).all()
        # the rotation's gain, on rows with one channel far larger than the rest (a small
        # model's keys): less than a third of the unrotated rows' error
        spiky = torch.randn(50, 64, generator=g)
        spiky[:, 5] = 60.0
        plain = dataclasses.replace(quant, rotated=False)
        errs = [(kv_quant.dequantize_rows(kv_quant.quantize_rows(spiky, q), q, torch.float32)
                 - spiky).abs().mean() for q in (quant, plain)]
        assert errs[0] < 0.3 * errs[1]
    else:
        rel = {"fp8_e4m3": 1 / 16, "fp8_e5m2": 1 / 8}[quant.name]
        tiny = amax / quant.qmax * {"fp8_e4m3": 2 ** -9, "fp8_e5m2": 2 ** -16}[quant.name]
        assert (err <= x.abs() * rel + tiny + 1e-7).all()
    assert torch.equal(back[3], torch.zeros(64))
    if not quant.rotated:     # each row's largest element is exact up to the scale's rounding
        top = x.abs().argmax(-1)
        assert torch.allclose(back.gather(1, top[:, None]).abs(), amax, rtol=1e-6)


def test_hadamard_is_orthogonal_and_symmetric():
    h = kv_quant.hadamard(16)
    assert torch.equal(h, h.T)
    assert torch.allclose(h @ h, torch.eye(16), atol=1e-6)
    assert set((h * 4).unique().tolist()) == {-1.0, 1.0}
    assert not FORMATS["int8"].rotates(24) and not FORMATS["fp8_e4m3"].rotates(64)


def _config(layers: int = 30, kv_heads: int = 3, head_dim: int = 64) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=100, hidden_size=576,
                       intermediate_size=1536, num_hidden_layers=layers,
                       num_attention_heads=9, num_key_value_heads=kv_heads,
                       head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=1e4,
                       max_position_embeddings=8192, tie_word_embeddings=True)


def test_block_budget_rises_by_the_byte_ratio():
    """SmolLM2's shape (30 layers, 3 KV heads, head_dim 64), blocks of 16, 64 MiB:
    fp32 rows are 256 bytes, bf16 128, a quantized row 64 codes + 4 scale bytes = 68."""
    cfg, memory = _config(), 64 << 20
    rows_per_block = 2 * 30 * 3 * 16
    assert num_kv_blocks(cfg, 16, torch.float32, memory, None) == memory // (
        rows_per_block * 256) == 91
    assert num_kv_blocks(cfg, 16, torch.bfloat16, memory, None) == 182
    # a bf16 cache beside fp32 activations weighs as bf16's
    kv_dtype = resolve_precision("float32", CPU, "bfloat16").kv_cache
    assert num_kv_blocks(cfg, 16, kv_dtype, memory, None, kv_quant_for("bfloat16")) == 182
    for name in ("int8", "fp8", "fp8_e4m3", "fp8_e5m2"):
        blocks = num_kv_blocks(cfg, 16, torch.float32, memory, None, kv_quant_for(name))
        assert blocks == memory // (rows_per_block * 68) == 342
        # the dtype of the activations does not matter to a quantized cache
        assert num_kv_blocks(cfg, 16, torch.bfloat16, memory, None, kv_quant_for(name)) == 342
    # an override stays what it says
    assert num_kv_blocks(cfg, 16, torch.float32, memory, 40, kv_quant_for("int8")) == 40


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("heads,kv_heads,dim,blocks,bs", SHAPES)
def test_rope_and_cache_matches_twin(dtype, quant, heads, kv_heads, dim, blocks, bs):
    g = torch.Generator().manual_seed(1)
    tokens = 9
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g) * 3).to(dtype)
    positions = torch.randint(0, 300, (tokens,), generator=g)
    angles = torch.outer(torch.arange(300.0), torch.rand(dim // 2, generator=g))
    slots = torch.randperm(blocks * bs, generator=g)[:tokens]
    caches = [torch.zeros(2, kv_heads, blocks, bs, dim + 4, dtype=torch.uint8)
              for _ in range(2)]
    outs = [qkv.clone(), qkv.clone()]
    _torch_ops().kvq_rope_and_cache(outs[0], positions, angles.cos(), angles.sin(),
                                    caches[0], slots, heads, kv_heads, quant.kind)
    kv_quant.torch_rope_and_cache(outs[1], positions, angles.cos(), angles.sin(), caches[1],
                                  slots, heads, kv_heads, quant)
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    assert (outs[0].float() - outs[1].float()).abs().max() <= tol * outs[1].abs().max()
    # V (no RoPE) unrotated: the same bytes; K, and a rotated V: RoPE's last bit (FMA) and
    # the rotation's (a butterfly against a matmul) may differ, so one code step, compared
    # as stored (the rotated row's codes times its scale)
    if not quant.rotates(dim):
        assert torch.equal(caches[0][1], caches[1][1])
    as_stored = dataclasses.replace(quant, rotated=False)
    for kv in (0, 1):
        rows = [kv_quant.dequantize_rows(c[kv], as_stored, torch.float32) for c in caches]
        step = rows[1].abs().amax(-1, keepdim=True) * {"int8": 1 / 127, "fp8_e4m3": 1 / 8,
                                                       "fp8_e5m2": 1 / 4}[quant.name]
        assert ((rows[0] - rows[1]).abs() <= step * 1.001 + 1e-6).all()
    written = torch.zeros(blocks * bs, dtype=torch.bool)
    written[slots] = True
    untouched = caches[0].view(2, kv_heads, blocks * bs, dim + 4)[:, :, ~written]
    assert not untouched.any()


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("heads,kv_heads,dim,blocks,bs", SHAPES)
def test_decode_attention_matches_twin(dtype, quant, heads, kv_heads, dim, blocks, bs):
    g = torch.Generator().manual_seed(2)
    values = torch.randn(2, kv_heads, blocks, bs, dim, generator=g) * 2
    cache = kv_quant.quantize_rows(values, quant)
    seq_lens = torch.tensor([1, bs * 3 + 2, bs + 1, 2 * bs])
    max_blocks = 4
    table = torch.stack([torch.randperm(blocks - 1, generator=g)[:max_blocks] + 1
                         for _ in seq_lens])
    q = torch.randn(len(seq_lens), heads, dim, generator=g).to(dtype)
    got = _torch_ops().kvq_decode_attention(q, cache, table, seq_lens, dim ** -0.5,
                                            quant.kind)
    want = kv_quant.torch_decode_attention(q, cache, table, seq_lens, dim ** -0.5, quant)
    assert got.shape == want.shape == (len(seq_lens), heads * dim)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (got.float() - want.float()).abs().max() <= tol * max(want.abs().max(), 1.0)
    # and the twin is attention over the dequantized values
    keys = kv_quant.dequantize_rows(cache, quant, torch.float32)
    first = keys[:, :, table[1]].reshape(2, kv_heads, -1, dim)[:, :, :seq_lens[1]]
    qf = q[1].float().view(kv_heads, heads // kv_heads, dim)
    probs = torch.softmax(qf @ first[0].transpose(-1, -2) * dim ** -0.5, -1)
    ref = (probs @ first[1]).reshape(-1)
    assert (want[1].float() - ref).abs().max() <= tol * max(ref.abs().max(), 1.0)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
def test_decode_attention_over_scattered_blocks_and_ragged_lengths(dtype, quant, group,
                                                                   block_size):
    """Every format's kernel (the quantized kernel has one portable version, whatever the
    CPU variant) over requests of ragged lengths in blocks scattered through the cache:
    lengths at and around a block's end, at and around the read-ahead distance (where it
    runs past a pass's end) and past both; block sizes that do and do not divide them."""
    g = torch.Generator().manual_seed(100 * group + block_size)
    ahead = cpu_ops.load().attention_prefetch_tokens
    around = [1, block_size - 1, block_size, block_size + 1, ahead - 1, ahead, ahead + 1,
              2 * ahead + 3, 97, 260]
    lens = sorted({n for n in around if n >= 1})
    width = -(-max(lens) // block_size)
    blocks = width * len(lens) + 1
    cache = kv_quant.quantize_rows(torch.randn(2, 2, blocks, block_size, 64, generator=g) * 2,
                                   quant)
    table = (torch.randperm(blocks - 1, generator=g) + 1)[:width * len(lens)]
    table = table.view(len(lens), width)
    q = torch.randn(len(lens), 2 * group, 64, generator=g).to(dtype)
    seq_lens = torch.tensor(lens)
    got = _torch_ops().kvq_decode_attention(q, cache, table, seq_lens, 0.125, quant.kind)
    want = kv_quant.torch_decode_attention(q, cache, table, seq_lens, 0.125, quant)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (got.float() - want.float()).abs().max() <= tol * max(want.abs().max(), 1.0)


def test_the_router_learns_a_quantized_p_s_bytes_per_token():
    """A prefill answer's `kv_fingerprint` names the format; the router prices its transfer
    by the bytes stored (codes and scales), not by 1 byte an element."""
    from kvloop.router.pd import fingerprint_bytes_per_token

    shape = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64}
    assert fingerprint_bytes_per_token({**shape, "dtype": "float32"}) == 46080.0
    assert fingerprint_bytes_per_token({**shape, "dtype": "bfloat16"}) == 23040.0
    for name in ("int8", "fp8_e4m3", "fp8_e5m2"):
        assert fingerprint_bytes_per_token({**shape, "dtype": name}) == 2 * 30 * 3 * 68
