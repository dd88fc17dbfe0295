"""Streaming stored tensor bytes (torch.save records) straight into preallocated destination views."""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO

import torch

from .archive import NemoCheckpointError

#: Bytes of stored tensor data read at a time.
STREAM_BLOCK_BYTES = 8 << 20

Piece = tuple[int, torch.Tensor]  # (first row of a stored tensor, destination view of the rows that follow)


@dataclass
class TensorStream:
    """Tensors of a checkpoint in the order its file stores them: `metas` (canonical name -> meta tensor: shape
    and stored dtype, in that order) known before any data is read, then `read()` yields `(name, tensor)` pairs
    in the same order, each read when asked (one tensor held at a time by the stream itself)."""

    metas: dict[str, torch.Tensor]
    read: Callable[[], Iterator[tuple[str, torch.Tensor]]]


def as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, with a 0-d tensor seen as one row."""
    return tensor if tensor.dim() else tensor.view(1)


def stored_offset(meta: torch.Tensor) -> int | None:
    """Offset of a meta-loaded tensor's data record in its torch.save stream (None if torch gives none)."""
    return getattr(meta.untyped_storage(), "_checkpoint_offset", None)


def fill(handle: IO[bytes], base: int, meta: torch.Tensor, pieces: list[Piece], load_real: Callable) -> None:
    """Copy the rows of a stored tensor into `pieces`.

    `meta` comes from torch.load(map_location="meta") of a torch.save stream starting at byte `base` of
    `handle`; its storage offset locates the data, read block by block straight into the destination. Without
    that offset (older torch) or for a non-contiguous stored tensor, `load_real()` loads the tensor instead.
    """
    offset = stored_offset(meta)
    if offset is None or not meta.is_contiguous():
        real = as_rows(load_real())
        for first, dest in pieces:
            dest.copy_(real[first:first + dest.shape[0]])
        return
    start = base + offset + meta.storage_offset() * meta.element_size()
    row_bytes = math.prod(meta.shape[1:]) * meta.element_size()
    rows_per_block = max(1, STREAM_BLOCK_BYTES // max(row_bytes, 1))
    for first, dest in pieces:
        for row in range(0, dest.shape[0], rows_per_block):
            part = dest[row:row + rows_per_block]
            handle.seek(start + (first + row) * row_bytes)
            block = part if part.is_contiguous() else torch.empty(part.shape, dtype=part.dtype)
            _read_exactly(handle, block)
            if block is not part:
                part.copy_(block)


def _read_exactly(handle: IO[bytes], tensor: torch.Tensor) -> None:
    """Fill contiguous `tensor` with the next bytes of `handle`, at most STREAM_BLOCK_BYTES per read."""
    view = memoryview(tensor.view(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")
    filled = 0
    while filled < len(view):
        got = handle.readinto(view[filled:filled + STREAM_BLOCK_BYTES])
        if not got:
            raise NemoCheckpointError("unexpected end of tensor data")
        filled += got


class Window(io.RawIOBase):
    """A read-only, seekable view of bytes `[offset, offset + length)` of another seekable file."""

    def __init__(self, handle: IO[bytes], offset: int, length: int):
        super().__init__()
        self._handle, self._start, self._length, self._pos = handle, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = (0, self._pos, self._length)[whence]
        self._pos = min(max(base + pos, 0), self._length)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        self._handle.seek(self._start + self._pos)
        got = self._handle.readinto(view[:max(0, min(len(view), self._length - self._pos))])
        self._pos += got or 0
        return got or 0
