"""GGUF files: metadata and dequantized tensors (the `gguf` package does the format work).

Scope: open a GGUF file, expose its metadata as plain Python values, and yield each tensor
as a float32 numpy array in PyTorch's (row-major, out x in) shape. Dequantization of the
common types (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K and the others `gguf`
knows) is `gguf.quants.dequantize`. Mapping names to a model and undoing llama.cpp's Q/K
permutation is `loader.py`'s job.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K")


class GGUFFile:
    """A read-only view of one GGUF file (memory-mapped by `gguf.GGUFReader`)."""

    def __init__(self, path: str):
        from gguf import GGUFReader

        self.path = path
        self._reader = GGUFReader(path)
        self.metadata: dict[str, Any] = {
            name: _field_value(field) for name, field in self._reader.fields.items()
            if not name.startswith("tokenizer.ggml.")}

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "llama"))

    def arch_value(self, key: str, default: Any = None) -> Any:
        """`<architecture>.<key>` from the metadata (e.g. "block_count")."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def tensor_names(self) -> list[str]:
        return [t.name for t in self._reader.tensors]

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """A tensor's PyTorch shape (GGUF lists dimensions innermost first)."""
        for t in self._reader.tensors:
            if t.name == name:
                return tuple(int(d) for d in reversed(t.shape))
        raise KeyError(f"{self.path} has no tensor {name!r}")

    def tensor_types(self) -> dict[str, str]:
        return {t.name: t.tensor_type.name for t in self._reader.tensors}

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yield (name, float32 array) for every tensor, dequantized, in file order."""
        for t in self._reader.tensors:
            yield t.name, dequantize_tensor(t)


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """One `gguf.ReaderTensor` as float32, shaped like PyTorch (GGUF lists dims reversed)."""
    from gguf.quants import dequantize

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise ValueError(f"tensor {tensor.name}: GGUF type {kind} is not supported "
                         f"(supported: {', '.join(SUPPORTED_TYPES)})")
    values = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    array = np.ascontiguousarray(values.reshape(shape), dtype=np.float32)
    return array if array.flags.writeable else array.copy()  # F32 tensors map the file


def _field_value(field: Any) -> Any:
    value = field.contents()
    if isinstance(value, np.generic):
        return value.item()
    return value
