"""The key-value metadata of a GGUF file, read without touching its tensors.

Scope: the header of GGUF versions 2 and 3 (either byte order): every metadata key with its
value as a plain Python value (ints, floats, bools, strings, lists of those), in the same form
as `gguf.GGUFReader(path).fields[key].contents()`. The `gguf` package's reader builds a numpy
view per array element and indexes every tensor first, which takes seconds for the 49,152
tokens and 48,900 merges of SmolLM2's vocabulary; this reads them in ~0.1 s, so the API
process (and a simulated worker) starts fast. Non-goals: tensors, writing.

Layout (little-endian unless the version field reads byte-swapped):
    "GGUF" | u32 version | u64 tensor_count | u64 kv_count | kv_count x (string key,
    u32 value type, value) | tensor infos ... (not read)
A string is a u64 byte length and UTF-8 bytes; an array is a u32 item type, a u64 count and
the items.
"""

from __future__ import annotations

import mmap
import struct
from typing import Any

MAGIC = b"GGUF"
VERSIONS = (2, 3)
# value type -> struct format (without the byte-order prefix); 8 is STRING, 9 is ARRAY
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9


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
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        cur = _Cursor(buf, _byte_order(buf, path))
        cur.offset = 4
        cur.scalar("I")   # version
        cur.scalar("Q")   # tensor count
        num_kv = cur.scalar("Q")
        out: dict[str, Any] = {}
        for _ in range(num_kv):
            key = cur.string()
            out[key] = cur.value(cur.scalar("I"))
        return out


def _byte_order(buf: Any, path: str) -> str:
    """"<" or ">": the order in which the version field reads 2 or 3."""
    for order in "<>":
        (version,) = struct.unpack_from(order + "I", buf, 4)
        if version in VERSIONS:
            return order
    raise ValueError(f"{path}: unsupported GGUF version (2 and 3 are read)")
