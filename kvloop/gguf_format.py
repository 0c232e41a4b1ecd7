"""The GGUF container, read with the standard library: its metadata and its tensor directory.

Scope: the header of GGUF versions 2 and 3 (either byte order): every metadata key with its
value as a plain Python value (ints, floats, bools, strings, lists of those), in the same form
as `gguf.GGUFReader(path).fields[key].contents()`, and each tensor's name, dimensions, type
and where its bytes start. The `gguf` package's reader builds a numpy view per array element
and per field part, which takes ~2.7 s of CPU for the 49,152 tokens and 48,900 merges of
SmolLM2's vocabulary; this reads the same header in ~0.1 s, so the API process, a simulated
worker and the model loader (`kvloop.model.gguf`) start fast. Non-goals: decoding tensors
(the model loader maps and dequantizes them), writing.

Layout (little-endian unless the version field reads byte-swapped):
    "GGUF" | u32 version | u64 tensor_count | u64 kv_count | kv_count x (string key,
    u32 value type, value) | tensor_count x (string name, u32 n_dims, n_dims x u64 dim
    (innermost first), u32 type, u64 offset) | padding to `general.alignment` (32 if absent)
    | the tensors' bytes, each at data start + its offset
A string is a u64 byte length and UTF-8 bytes; an array is a u32 item type, a u64 count and
the items.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

MAGIC = b"GGUF"
VERSIONS = (2, 3)
# value type -> struct format (without the byte-order prefix); 8 is STRING, 9 is ARRAY
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor directory: `dims` innermost first (as the file lists them),
    `ggml_type` the file's type id, `offset` from the start of the data section."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass(frozen=True)
class GGUFHeader:
    """What precedes the tensors' bytes: the metadata, the directory (file order), where the
    data section starts and the byte order ("<" or ">")."""

    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    data_start: int
    byte_order: str


class _Cursor:
    """Reads values from `buf` at `offset`, in one byte order."""

    def __init__(self, buf: Any, order: str):
        self.buf = buf
        self.order = order
        self.offset = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(self.order + fmt, self.buf, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        start = self.offset
        self.offset += n
        return str(self.buf[start:self.offset], "utf-8")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind} at byte {self.offset}")
        return self.scalar(_SCALARS[kind])

    def array(self) -> list[Any]:
        kind = self.scalar("I")
        n = self.scalar("Q")
        if kind in (_STRING, _ARRAY):
            return [self.value(kind) for _ in range(n)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF array item type {kind} at byte {self.offset}")
        fmt = f"{self.order}{n}{_SCALARS[kind]}"
        items = struct.unpack_from(fmt, self.buf, self.offset)
        self.offset += struct.calcsize(fmt)
        return list(items)


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """Every metadata key of the GGUF file at `path`; ValueError if it is not GGUF v2/v3."""
    return read_gguf_header(path).metadata


def read_gguf_header(path: str) -> GGUFHeader:
    """The metadata and tensor directory of the GGUF file at `path`; ValueError if it is not
    GGUF v2/v3, lists a tensor twice or its directory runs past the end of the file."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        cur = _Cursor(buf, _byte_order(buf, path))
        cur.offset = 4
        cur.scalar("I")   # version
        num_tensors = cur.scalar("Q")
        num_kv = cur.scalar("Q")
        metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar("I"))
        tensors = tuple(_tensor_info(cur) for _ in range(num_tensors))
        if len({t.name for t in tensors}) != len(tensors):
            raise ValueError(f"{path} lists a tensor name twice")
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cur.offset // alignment) * alignment
        return GGUFHeader(metadata, tensors, data_start, cur.order)


def _tensor_info(cur: _Cursor) -> TensorInfo:
    name = cur.string()
    dims = tuple(cur.scalar("Q") for _ in range(cur.scalar("I")))
    return TensorInfo(name, dims, cur.scalar("I"), cur.scalar("Q"))


def _byte_order(buf: Any, path: str) -> str:
    """"<" or ">": the order in which the version field reads 2 or 3."""
    for order in "<>":
        (version,) = struct.unpack_from(order + "I", buf, 4)
        if version in VERSIONS:
            return order
    raise ValueError(f"{path}: unsupported GGUF version (2 and 3 are read)")
