"""GGUF files: metadata and dequantized tensors.

Scope: open a GGUF file (its header read by `kvloop.gguf_format`, its tensors mapped from the
file as plain numpy arrays), expose its metadata as plain Python values, and yield each tensor
as a float32 numpy array in PyTorch's (row-major, out x in) shape; for the 4-bit and Q8_0
types also the undecoded blocks (`RawTensor`) and, for the 4-bit ones, the nibbles with
their per-32 scale and offset (`unpack_q4`), which `kvloop.model.quant` runs as they are.
Dequantization of the common types (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K,
Q6_K and the others `gguf` knows) is `gguf.quants.dequantize`. Mapping names to a model and
undoing llama.cpp's Q/K permutation is `loader.py`'s job.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvloop.gguf_format import GGUFHeader, TensorInfo, read_gguf_header

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K")


GROUP = 32                                  # weights per scale/zero group (all 4-bit types)
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT8_TYPES = ("Q8_0",)
_BLOCK_BYTES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "Q8_0": (32, 34)}
# types mapped as their elements (`gguf.quants.dequantize` takes the rest as bytes)
_ELEMENT_TYPES = {"F32": "f4", "F16": "f2", "F64": "f8", "I8": "i1", "I16": "i2", "I32": "i4",
                  "I64": "i8"}


@dataclass
class RawTensor:
    """One GGUF tensor's undecoded blocks: `data` uint8 [rows, row_bytes], PyTorch shape."""

    kind: str
    data: np.ndarray
    shape: tuple[int, int]

    def permute_rows(self, order: np.ndarray) -> RawTensor:
        """The same tensor with its rows reordered (blocks never cross rows)."""
        return RawTensor(self.kind, self.data[order], self.shape)

    def rows(self, start: int, stop: int) -> RawTensor:
        """Rows [start, stop) as a tensor of their own (a fused or stacked tensor's part)."""
        return RawTensor(self.kind, self.data[start:stop], (stop - start, self.shape[1]))


def is_raw_quantizable(kind: str, shape: tuple[int, ...]) -> bool:
    """True for a 2-D tensor of a type kvloop runs quantized (`RawTensor`)."""
    if kind not in _BLOCK_BYTES or len(shape) != 2:
        return False
    return shape[1] % _BLOCK_BYTES[kind][0] == 0


def unpack_q4(raw: RawTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> q uint8 [rows, cols] in 0..15, scale and offset float32 [rows, cols / 32];
    weight[r, c] = q[r, c] * scale[r, c // 32] + offset[r, c // 32]."""
    rows, cols = raw.shape
    per_block, nbytes = _BLOCK_BYTES[raw.kind]
    blocks = raw.data.reshape(rows * cols // per_block, nbytes)
    if raw.kind == "Q4_K":
        q, scale, offset = _unpack_q4_k(blocks)
    else:
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        if raw.kind == "Q4_1":
            offset = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
            nibbles = blocks[:, 4:]
        else:
            offset = -8.0 * d
            nibbles = blocks[:, 2:]
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1)      # [blocks, 32]
        scale = d
    groups = cols // GROUP
    return (q.reshape(rows, cols), scale.reshape(rows, groups).astype(np.float32),
            offset.reshape(rows, groups).astype(np.float32))


def unpack_q8(raw: RawTensor) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 -> q int8 [rows, cols], scale float32 [rows, cols / 32]; weight = q * scale."""
    rows, cols = raw.shape
    blocks = raw.data.reshape(rows * cols // GROUP, 34)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 2:].copy().view(np.int8)
    return q.reshape(rows, cols), scale.reshape(rows, cols // GROUP)


def dequantize_raw(raw: RawTensor) -> np.ndarray:
    """The tensor as float32 [rows, cols] (`gguf`'s dequantization)."""
    from gguf.quants import dequantize

    values = dequantize(raw.data, GGMLQuantizationType[raw.kind])
    return np.ascontiguousarray(values.reshape(raw.shape), dtype=np.float32)


def _unpack_q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks [n, 144] -> q [n * 8, 32], scale and offset [n * 8, 1]."""
    from gguf.quants import Q4_K

    n = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)          # [n, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])                             # [n, 8] each
    qs = blocks[:, 16:].reshape(n, 4, 32)            # chunk j: sub-blocks 2j (low), 2j+1 (high)
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n * 8, 32)
    scale = (d * sc.astype(np.float32)).reshape(n * 8, 1)
    offset = (-dmin * mn.astype(np.float32)).reshape(n * 8, 1)
    return q, scale, offset


@dataclass(frozen=True)
class MappedTensor:
    """One tensor of a mapped file: `data` as `gguf.quants.dequantize` takes it (the
    elements for F32 and F16, else bytes with the last dimension in bytes), numpy's order."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]          # innermost first, as the file lists them
    data: np.ndarray


class GGUFFile:
    """A read-only view of one GGUF file: the header parsed once, the data section mapped;
    each tensor's array is a view of the mapping (plain ndarray: `np.memmap` slices cost
    numpy a subclass hook per block in `gguf.quants`)."""

    def __init__(self, path: str):
        header = read_gguf_header(path)
        self.path = path
        self.metadata: dict[str, Any] = {
            name: value for name, value in header.metadata.items()
            if not name.startswith("tokenizer.ggml.")}
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._tensors = [_mapped(self._map, t, header, path) for t in header.tensors]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "llama"))

    def arch_value(self, key: str, default: Any = None) -> Any:
        """`<architecture>.<key>` from the metadata (e.g. "block_count")."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def tensor_names(self) -> list[str]:
        return [t.name for t in self._tensors]

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """A tensor's PyTorch shape (GGUF lists dimensions innermost first)."""
        return tuple(reversed(self._find(name).shape))

    def tensor(self, name: str) -> np.ndarray:
        """One tensor by name, dequantized (float32, PyTorch shape)."""
        return dequantize_tensor(self._find(name))

    def tensor_types(self) -> dict[str, str]:
        return {t.name: t.tensor_type.name for t in self._tensors}

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yield (name, float32 array) for every tensor, dequantized, in file order."""
        for t in self._tensors:
            yield t.name, dequantize_tensor(t)

    def raw_tensors(self) -> Iterator[tuple[str, RawTensor]]:
        """Yield (name, undecoded blocks) for every 2-D tensor of a type `kvloop.model.quant`
        keeps quantized (the 4-bit and Q8_0 ones), in file order; a 3-D one (a mixture of
        experts' stacked experts, [experts, out, in]) comes as [experts * out, in]."""
        for t in self._tensors:
            kind = t.tensor_type.name
            dims = list(t.shape)                      # innermost first
            rows, cols = (int(np.prod(dims[1:])), dims[0]) if len(dims) in (2, 3) else (0, 0)
            if rows and is_raw_quantizable(kind, (rows, cols)):
                yield t.name, RawTensor(kind, t.data.reshape(rows, -1), (rows, cols))

    def _find(self, name: str) -> MappedTensor:
        for t in self._tensors:
            if t.name == name:
                return t
        raise KeyError(f"{self.path} has no tensor {name!r}")


def _mapped(buf: mmap.mmap, info: TensorInfo, header: GGUFHeader, path: str) -> MappedTensor:
    """`info`'s bytes in `buf` as the array `gguf.quants.dequantize` takes; ValueError for an
    unknown type, a tensor past the end of the file, or quantized blocks in a big-endian file
    (their scales would be read in the wrong byte order)."""
    try:
        kind = GGMLQuantizationType(info.ggml_type)
    except ValueError:
        raise ValueError(f"{path}: tensor {info.name} has unknown GGML type "
                         f"{info.ggml_type}") from None
    block, type_bytes = GGML_QUANT_SIZES[kind]
    count = int(np.prod(info.dims)) if info.dims else 1
    nbytes = count // block * type_bytes
    start = header.data_start + info.offset
    if start + nbytes > len(buf):
        raise ValueError(f"{path}: tensor {info.name} runs past the end of the file")
    shape = tuple(reversed(info.dims))
    raw = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=start)
    element = _ELEMENT_TYPES.get(kind.name)
    if element is not None:
        data = raw.view(np.dtype(header.byte_order + element)).reshape(shape)
    elif header.byte_order == ">":
        raise ValueError(f"{path}: {kind.name} tensor {info.name} in a big-endian GGUF file "
                         "is not supported")
    else:
        data = raw.reshape(*shape[:-1], shape[-1] // block * type_bytes)
    return MappedTensor(info.name, kind, info.dims, data)


def dequantize_tensor(tensor: MappedTensor) -> np.ndarray:
    """One mapped tensor as float32, shaped like PyTorch (GGUF lists dims reversed)."""
    from gguf.quants import dequantize

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise ValueError(f"tensor {tensor.name}: GGUF type {kind} is not supported "
                         f"(supported: {', '.join(SUPPORTED_TYPES)})")
    values = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(reversed(tensor.shape))
    array = np.ascontiguousarray(values.reshape(shape), dtype=np.float32)
    return array if array.flags.writeable else array.copy()  # F32 tensors map the file


def _field_value(field: Any) -> Any:
    value = field.contents()
    if isinstance(value, np.generic):
        return value.item()
    return value
