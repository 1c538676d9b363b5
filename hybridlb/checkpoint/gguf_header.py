"""A GGUF file's header — its metadata and tensor table — read in one pass over the mapped bytes.

The ``gguf`` package's ``GGUFReader`` makes a numpy view of every part of every field: for a 49k-token
vocabulary and its merges that is ~250k views and 3.5 s on this machine, paid by each engine and each API
server at every start (and every rank restart). The container (llama.cpp's ``gguf.md``: little-endian
``GGUF``, version, counts, typed key/value pairs, then name/dims/type/offset per tensor, the data at the
next ``general.alignment`` boundary) is read here with ``struct`` in ~0.1 s; the gguf package still
supplies the tensor types, their block sizes and every dequantizer. A file this reader does not take
(big-endian, another version) goes to ``GGUFReader`` unchanged; tests/unit/test_gguf_header.py checks
both give the same fields and tensors.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import numpy as np

VERSIONS = (2, 3)
STRING, ARRAY = 8, 9
# GGUF value type -> struct format (little-endian) and numpy dtype of an array of it.
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
ARRAYS = {kind: np.dtype(fmt) for kind, fmt in SCALARS.items()}
# What the gguf package maps each tensor type's bytes to; other types are uint8 rows of blocks.
ELEMENTS = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
            "I32": np.int32, "I64": np.int64}


class Unsupported(Exception):
    """Not a file this reader takes: GGUFReader reads it (or says what is wrong)."""


class _Cursor:
    def __init__(self, data: bytes | mmap.mmap):
        self.data, self.at = data, 0

    def take(self, fmt: str):
        value = struct.unpack_from(fmt, self.data, self.at)[0]
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.take("<Q")
        start, self.at = self.at, self.at + size
        return self.data[start : self.at].decode("utf-8")

    def value(self, kind: int):
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            inner, count = self.take("<I"), self.take("<Q")
            if inner == STRING:
                return [self.string() for _ in range(count)]
            if inner not in ARRAYS:
                raise Unsupported(f"array of value type {inner}")
            dtype = ARRAYS[inner]
            values = np.frombuffer(self.data, dtype, count, self.at)
            self.at += count * dtype.itemsize
            return values.tolist()
        if kind not in SCALARS:
            raise Unsupported(f"value type {kind}")
        return self.take(SCALARS[kind])


def read_header(path: Path) -> tuple[dict[str, object], list[tuple[str, object, np.dtype, tuple[int, ...], int]]]:
    """(fields, tensors): every metadata key's value as ``ReaderField.contents()`` gives it (the
    ``GGUF.*`` counts included), and per tensor (name, gguf type, numpy dtype, array shape, data offset),
    the shape and dtype being those of the array the gguf package reads. Raises Unsupported for anything
    it cannot read (a truncated or empty file, bad UTF-8, an unknown tensor type, ...)."""
    try:
        return _read(path)
    except (struct.error, UnicodeDecodeError, ValueError, OSError) as exc:
        raise Unsupported(f"{type(exc).__name__}: {exc}") from None


def _read(path: Path):
    from gguf import GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        cursor = _Cursor(data)
        if data[:4] != b"GGUF":
            raise Unsupported("no GGUF magic")
        version = cursor.take("<4xI")
        if version not in VERSIONS:
            raise Unsupported(f"version {version}")
        tensor_count, kv_count = cursor.take("<Q"), cursor.take("<Q")
        fields: dict[str, object] = {"GGUF.version": version, "GGUF.tensor_count": tensor_count,
                                     "GGUF.kv_count": kv_count}
        for _ in range(kv_count):
            key = cursor.string()
            fields[key] = cursor.value(cursor.take("<I"))
        table = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = [cursor.take("<Q") for _ in range(cursor.take("<I"))]
            table.append((name, dims, GGMLQuantizationType(cursor.take("<I")), cursor.take("<Q")))
        alignment = fields.get("general.alignment", 32)
        start = cursor.at + (-cursor.at) % alignment
    tensors = []
    for name, dims, kind, offset in table:
        shape = tuple(reversed(dims))
        dtype = ELEMENTS.get(kind.name)
        if dtype is None:
            dtype, shape = np.uint8, quant_shape_to_byte_shape(shape, kind)
        tensors.append((name, kind, np.dtype(dtype), tuple(shape), start + offset))
    if len({t[0] for t in tensors}) != len(tensors):
        raise Unsupported("duplicated tensor names")
    return fields, tensors
