"""The safetensors file layout, as this package writes and reads engine weights without a copy of the model.

A file is an 8-byte little-endian header length, a JSON header (padded with spaces to a multiple of 8 bytes) of
`{name: {"dtype", "shape", "data_offsets": [start, stop]}}`, then the data: every tensor's bytes, back to back,
offsets relative to the end of the header. Tensors are laid out by element size, largest first (then by name, or
in the order they are streamed from a checkpoint), so every tensor starts at a multiple of its element size: the
data can be viewed in place as each tensor's dtype.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import BinaryIO

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
CODES = {dtype: code for code, dtype in DTYPES.items()}
LENGTH_BYTES = 8
ALIGNMENT = 8
MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: its place in the data section, in bytes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


def plan(specs: Iterable[tuple[str, torch.dtype, Sequence[int]]],
         keep_order: bool = False) -> tuple[bytes, list[Entry]]:
    """The header bytes (length prefix included) and the entries, in file order, of tensors given as
    `(name, dtype, shape)`: by element size, then by name, or in the given order (`keep_order`: a stream's)."""
    ordered = sorted(enumerate(specs), key=lambda item: (-item[1][1].itemsize, item[0] if keep_order else item[1][0]))
    ordered = [spec for _, spec in ordered]
    entries, offset = [], 0
    for name, dtype, shape in ordered:
        if dtype not in CODES:
            raise ValueError(f"tensor {name} has dtype {dtype}, which the engine format does not store")
        size = math.prod(shape) * dtype.itemsize
        entries.append(Entry(name, dtype, tuple(int(s) for s in shape), offset, offset + size))
        offset += size
    header = json.dumps({e.name: {"dtype": CODES[e.dtype], "shape": list(e.shape), "data_offsets": [e.start, e.stop]}
                         for e in entries}, separators=(",", ":")).encode()
    header += b" " * (-(LENGTH_BYTES + len(header)) % ALIGNMENT)
    return struct.pack("<Q", len(header)) + header, entries


def read_header(stream: BinaryIO, file_size: int) -> tuple[int, list[Entry]]:
    """The byte offset where the data begins and the entries in data order; ValueError (one line) when the header
    is not a valid layout of a file of `file_size` bytes."""
    prefix = stream.read(LENGTH_BYTES)
    if len(prefix) < LENGTH_BYTES:
        raise ValueError("the file is too short for a safetensors header")
    (length,) = struct.unpack("<Q", prefix)
    if length > min(MAX_HEADER_BYTES, file_size - LENGTH_BYTES):
        raise ValueError(f"the header length {length} does not fit the file")
    try:
        header = json.loads(stream.read(length))
    except ValueError:
        raise ValueError("the header is not JSON") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    header.pop("__metadata__", None)
    data_start = LENGTH_BYTES + length
    entries = sorted((_entry(name, record) for name, record in header.items()), key=lambda e: e.start)
    end = 0
    for entry in entries:
        if entry.start != end:
            raise ValueError(f"tensor {entry.name} does not follow the one before it in the data")
        end = entry.stop
    if data_start + end != file_size:
        raise ValueError(f"the header describes {data_start + end} bytes, the file has {file_size}")
    return data_start, entries


def _entry(name: str, record: object) -> Entry:
    try:
        dtype = DTYPES[record["dtype"]]  # type: ignore[index]
        shape = tuple(int(s) for s in record["shape"])  # type: ignore[index]
        start, stop = (int(o) for o in record["data_offsets"])  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"tensor {name!r} has no valid dtype, shape and data_offsets") from None
    if min(shape, default=0) < 0 or stop - start != math.prod(shape) * dtype.itemsize or start < 0:
        raise ValueError(f"tensor {name!r}: its shape and dtype do not match its data_offsets")
    return Entry(name, dtype, shape, start, stop)
