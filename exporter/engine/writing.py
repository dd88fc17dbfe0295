"""Writing engine weights: tensors stream into a safetensors file, hashed as they are written.

The header is written first, from the tensors' shapes and (target) dtypes; then each tensor is cast, written at its
offset by a pool of threads (file writes and the casts release the GIL, so several proceed at once where the disk
allows) and dropped. The sha256 of the file is taken from the same bytes, in file order, as they go out, so the
file is never read back. The caller's dict is consumed: a tensor leaves it when it is written, so casting never
holds the model twice. `stream_tensors` writes tensors as a checkpoint reader yields them, in its order, with the
header computed first from their metadata: the whole model is never in memory at all.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from .safetensors_format import Entry, plan

WRITERS = 4
MAX_WRITE_BYTES = 1 << 30  # one pwrite call at most (Linux writes at most 2 GiB - 4 KiB at a time)
MAX_PENDING_BYTES = 1 << 30  # tensors handed to the writers and not yet hashed, beyond one
READ_AHEAD_BYTES = 512 << 20  # tensors read and waiting for the writers, beyond one
_DONE = object()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if tensor.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
                  progress: Callable[[int], None] | None = None, writers: int = WRITERS) -> str:
    """Write `tensors` (cast to `dtype` if given) to the safetensors file `path`; return the file's sha256.

    Consumes `tensors`. `progress(nbytes)` is called after each tensor is written."""
    header, entries = plan((name, dtype or t.dtype, tuple(t.shape)) for name, t in tensors.items())
    return _write_file(path, header, entries, ((e.name, tensors.pop(e.name)) for e in entries), progress, writers)


def stream_tensors(path: Path, metas: dict[str, torch.Tensor], source: Iterator[tuple[str, torch.Tensor]],
                   dtype: torch.dtype, progress: Callable[[int], None] | None = None, writers: int = WRITERS,
                   ahead_bytes: int | None = None, waits: dict[str, float] | None = None) -> str:
    """Write the tensors `source` yields, in the order of `metas` (name -> a tensor of the shape, meta will do),
    cast to `dtype`, to the safetensors file `path` in that order; return the file's sha256.

    The header comes from `metas` before any data; `source` runs on a reader thread of its own, at most
    `ahead_bytes` (default READ_AHEAD_BYTES) ahead of the writers, so reading, casting and writing overlap and only
    that much is held. `waits` (if given) receives the seconds the writers waited for the reader (`writers`) and
    the reader for the writers (`reader`): which side bounds the stream."""
    header, entries = plan(((name, dtype, tuple(meta.shape)) for name, meta in metas.items()), keep_order=True)
    if [e.name for e in entries] != list(metas):
        raise ValueError("streamed tensors must share one element size to keep their order")
    ahead = _read_ahead(source, READ_AHEAD_BYTES if ahead_bytes is None else ahead_bytes,
                        {} if waits is None else waits)
    return _write_file(path, header, entries, ahead, progress, writers)


def _write_file(path: Path, header: bytes, entries: list[Entry], tensors: Iterator[tuple[str, torch.Tensor]],
                progress: Callable[[int], None] | None, writers: int) -> str:
    """Write `header`, then each tensor (`tensors` yields them in the entries' order) at its entry's offset,
    hashing the file's bytes in order as they go out; the file's sha256."""
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
            held = 0
            for entry in entries:
                name, tensor = next(tensors)
                if name != entry.name or tuple(tensor.shape) != entry.shape:
                    raise ValueError(f"expected tensor {entry.name} {list(entry.shape)}, got {name} "
                                     f"{list(tensor.shape)}")
                pending.append(pool.submit(write, entry, tensor))
                held += entry.nbytes
                while len(pending) > 2 * writers or held > MAX_PENDING_BYTES:
                    held -= _hash_next(pending, digest, progress)
            while pending:
                _hash_next(pending, digest, progress)
    finally:
        os.close(descriptor)
        close = getattr(tensors, "close", None)
        if close is not None:
            close()  # a reader thread stops
    return digest.hexdigest()


def _read_ahead(source: Iterator[tuple[str, torch.Tensor]], limit: int,
                waits: dict[str, float]) -> Iterator[tuple[str, torch.Tensor]]:
    """`source`'s items, produced on a thread of its own while the consumer works, at most `limit` bytes ahead
    (one tensor at least); its errors are raised here; closing this generator stops the thread. `waits` gets the
    seconds each side waited for the other."""
    ready: deque = deque()
    state = threading.Condition()
    stop, held = False, 0

    def produce() -> None:
        nonlocal held
        try:
            for item in source:
                with state:
                    started = time.perf_counter()
                    while held and held + item[1].nbytes > limit and not stop:
                        state.wait()
                    waits["reader"] = waits.get("reader", 0.0) + time.perf_counter() - started
                    if stop:
                        return
                    held += item[1].nbytes
                    ready.append(item)
                    state.notify_all()
            outcome: object = _DONE
        except BaseException as error:  # noqa: BLE001 (raised again in the consumer)
            outcome = error
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()
        with state:
            ready.append(outcome)
            state.notify_all()

    thread = threading.Thread(target=produce, name="engine-reader", daemon=True)
    thread.start()
    try:
        while True:
            with state:
                started = time.perf_counter()
                while not ready:
                    state.wait()
                waits["writers"] = waits.get("writers", 0.0) + time.perf_counter() - started
                item = ready.popleft()
                if isinstance(item, tuple):
                    held -= item[1].nbytes
                    state.notify_all()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        with state:
            stop = True
            state.notify_all()
        thread.join()



def _hash_next(pending: deque[Future], digest, progress: Callable[[int], None] | None) -> int:
    """Take the oldest written tensor into the hash (tensors finish writing in any order, hashing is in order);
    its size in bytes."""
    data = pending.popleft().result()
    view = tensor_bytes(data)
    digest.update(view)
    if progress is not None:
        progress(len(view))
    return len(view)


def _write_at(descriptor: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(descriptor, data[done:done + MAX_WRITE_BYTES], offset + done)
