"""A GGUF file's metadata and tensors, read in one pass over the header with the tensor data memory-mapped.

The gguf package's GGUFReader makes numpy views for every part of every field: on a 49k-token vocabulary with its
merges that is ~250k memmap slices and seconds of start-up. This reads the same header with struct over one bytes
buffer (layout: ggml/docs/gguf.md; little-endian files, versions 2 and 3).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
LENGTH = struct.Struct("<Q")  # of a string, before its UTF-8 bytes
PLAIN_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}


@dataclass
class GGUFTensor:
    """What dequantize needs of a tensor: dims fastest-first (as GGUF lists them) and its data, a view of the map
    shaped as GGUFReader shapes it (F32 and F16 in their dtype, other types as uint8 rows of packed blocks)."""

    name: str
    shape: np.ndarray
    tensor_type: GGMLQuantizationType
    data: np.ndarray


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError("truncated or damaged")
        text = bytes(self.buf[self.pos: self.pos + n]).decode("utf-8")
        self.pos += n
        return text

    def strings(self, count: int) -> list[str]:
        buf, pos, length, out = self.buf, self.pos, LENGTH.unpack_from, []
        for _ in range(count):
            n = length(buf, pos)[0]
            pos += 8
            out.append(str(buf[pos: pos + n], "utf-8"))
            pos += n
        if pos > len(buf):
            raise ValueError("truncated or damaged")
        self.pos = pos
        return out

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item in SCALARS:
                dtype = np.dtype(SCALARS[item])
                values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
                self.pos += count * dtype.itemsize
                return values
            if item == STRING:  # a vocabulary and its merges: ~100k strings, so the loop is kept tight
                return self.strings(count)
            return [self.value(item) for _ in range(count)]
        if kind not in SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self.take(SCALARS[kind])


def read_gguf(path: str | os.PathLike) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """(metadata as plain Python values, tensors); ValueError for a file that is not GGUF."""
    data = np.memmap(path, np.uint8, mode="r")
    cursor = _Cursor(memoryview(data))
    if bytes(data[:4]) != MAGIC:
        raise ValueError("GGUF magic invalid")
    cursor.pos = 4
    version = cursor.take("<I")
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version}")
    num_tensors, num_fields = cursor.take("<Q"), cursor.take("<Q")
    meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": num_tensors, "GGUF.kv_count": num_fields}
    for _ in range(num_fields):
        key = cursor.string()
        meta[key] = cursor.value(cursor.take("<I"))
    infos = []
    for _ in range(num_tensors):
        name = cursor.string()
        dims = [cursor.take("<Q") for _ in range(cursor.take("<I"))]
        infos.append((name, dims, GGMLQuantizationType(cursor.take("<I")), cursor.take("<Q")))
    alignment = meta.get("general.alignment", 32)
    start = -(-cursor.pos // alignment) * alignment
    tensors = []
    for name, dims, kind, offset in infos:
        count = int(np.prod(dims))
        block, block_bytes = GGML_QUANT_SIZES[kind]
        nbytes = count // block * block_bytes
        raw = data[start + offset: start + offset + nbytes]
        if len(raw) != nbytes:
            raise ValueError(f"truncated or damaged (tensor {name} runs past the end)")
        if kind in PLAIN_DTYPES:
            tensor_data = raw.view(PLAIN_DTYPES[kind]).reshape(dims[::-1])
        else:
            tensor_data = raw.reshape(-1, dims[0] // block * block_bytes)
        tensors.append(GGUFTensor(name, np.array(dims, np.uint64), kind, tensor_data))
    return meta, tensors
