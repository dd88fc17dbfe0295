"""Writing engine weights: tensors stream into a safetensors file, hashed as they are written.

The header is written first, from the tensors' shapes and (target) dtypes; then each tensor is cast, written at its
offset by a pool of threads (file writes and the casts release the GIL, so several proceed at once where the disk
allows) and dropped. The sha256 of the file is taken from the same bytes, in file order, as they go out, so the
file is never read back. The caller's dict is consumed: a tensor leaves it when it is written, so casting never
holds the model twice.
"""

from __future__ import annotations

import hashlib
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from .safetensors_format import Entry, plan

WRITERS = 4
MAX_WRITE_BYTES = 1 << 30  # one pwrite call at most (Linux writes at most 2 GiB - 4 KiB at a time)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if tensor.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
                  progress: Callable[[int], None] | None = None, writers: int = WRITERS) -> str:
    """Write `tensors` (cast to `dtype` if given) to the safetensors file `path`; return the file's sha256.

    Consumes `tensors`. `progress(nbytes)` is called after each tensor is written."""
    specs = [(name, dtype or t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    header, entries = plan(specs)
    digest = hashlib.sha256(header)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(descriptor, len(header) + (entries[-1].stop if entries else 0))
        _write_at(descriptor, memoryview(header), 0)
        base = len(header)

        def write(entry: Entry, tensor: torch.Tensor) -> torch.Tensor:
            data = tensor.to(entry.dtype).contiguous()
            del tensor
            _write_at(descriptor, tensor_bytes(data), base + entry.start)
            return data

        with ThreadPoolExecutor(writers, thread_name_prefix="engine-writer") as pool:
            pending: deque[Future] = deque()
            for entry in entries:
                pending.append(pool.submit(write, entry, tensors.pop(entry.name)))
                if len(pending) > 2 * writers:
                    _hash_next(pending, digest, progress)
            while pending:
                _hash_next(pending, digest, progress)
    finally:
        os.close(descriptor)
    return digest.hexdigest()


def _hash_next(pending: deque[Future], digest, progress: Callable[[int], None] | None) -> None:
    """Take the oldest written tensor into the hash (tensors finish writing in any order, hashing is in order)."""
    data = pending.popleft().result()
    view = tensor_bytes(data)
    digest.update(view)
    if progress is not None:
        progress(len(view))


def _write_at(descriptor: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(descriptor, data[done:done + MAX_WRITE_BYTES], offset + done)
