"""Loading engine weights: a safetensors file straight to its device, every tensor a view of one buffer.

- CPU: the file is memory-mapped (private, copy-on-write) and each tensor is a view of the mapping: nothing is
  copied, pages are read from disk as they are first touched, and the process holds the weights once.
- CUDA: one device buffer holds the whole data section. Threads read chunks of the file (`preadv`, several at
  once, so the disk sees a queue) into a ring of pinned host buffers; each chunk is copied to its place in the
  device buffer on a side stream while the next ones are read, so disk reads and PCIe transfers overlap. A
  pinned buffer is read into again only after its previous copy has finished.

With a `digest`, the file's bytes are hashed in file order as they stream (the integrity check without a second
read of the file). Per-tensor Python work is only the creation of the views.

`PendingWeights` is the same read in the background: the tensors exist at once (zeroed, at their final
addresses) and a thread fills them, so that work needing only the tensors' addresses (compiling kernels, timing
them, capturing CUDA graphs) runs while the bytes arrive; `wait()` says when their values may be used.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .safetensors_format import Entry, read_header

LOGGER = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20
GPU_ALIGNMENT = 16
VIEW_ALIGNMENT = {"cuda": GPU_ALIGNMENT}  # device type -> the bytes a view's start is aligned to (else 1)
PINNED_BUFFERS = 4
HASH_BLOCK_BYTES = 32 << 20  # CPU: read and hashed two blocks at a time


@dataclass
class LoadStats:
    """What a load did: bytes, wall time, and the time spent reading the file (summed over reader threads)."""

    nbytes: int = 0
    seconds: float = 0.0
    read_seconds: float = 0.0

    def describe(self) -> str:
        rate = self.nbytes / self.seconds / 1e9 if self.seconds else 0.0
        return f"{self.nbytes / 1e9:.2f} GB in {self.seconds:.2f} s ({rate:.2f} GB/s)"


def load_tensors(path: Path, device: torch.device | str = "cpu", digest=None,
                 progress: Callable[[int], None] | None = None, stats: LoadStats | None = None,
                 ) -> dict[str, torch.Tensor]:
    """The tensors of safetensors file `path` on `device`, in file order; ValueError if the file is not a valid one.

    `digest` (a hashlib object) is fed every byte of the file in order; `progress(nbytes)` is called as data
    arrives; `stats` is filled in."""
    device = torch.device(device)
    stats = stats if stats is not None else LoadStats()
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as stream:
        size = os.fstat(stream.fileno()).st_size
        data_start, entries = read_header(stream, size)
        if digest is not None:
            stream.seek(0)
            digest.update(stream.read(data_start))
        if device.type == "cuda":
            data = _to_cuda(stream.fileno(), data_start, size, device, digest, progress, stats)
        else:
            data = _mapped(stream.fileno(), data_start, size, digest, progress)
    stats.nbytes, stats.seconds = size - data_start, time.perf_counter() - started
    return {entry.name: _view(data, entry) for entry in entries}


def _view(data: torch.Tensor, entry: Entry) -> torch.Tensor:
    """Tensor `entry` of the uint8 data section, as a view where it is aligned (else a copy): for its dtype, and
    on a GPU to 16 bytes as well (kernels load 16 bytes at a time from aligned addresses only)."""
    raw = data[entry.start:entry.stop]
    if raw.data_ptr() % max(entry.dtype.itemsize, VIEW_ALIGNMENT.get(data.device.type, 1)):
        raw = raw.clone()
    return raw.view(entry.dtype).view(entry.shape)


def _mapped(descriptor: int, data_start: int, size: int, digest, progress) -> torch.Tensor:
    """The data section of the file as a uint8 tensor over a private mapping. With a digest the file is hashed by
    reads (which also fill the page cache), not through the mapping: the process's own pages stay untouched."""
    if digest is not None:
        blocks = [torch.empty(max(1, min(HASH_BLOCK_BYTES, size - data_start)), dtype=torch.uint8) for _ in range(2)]
        stream_chunks(descriptor, data_start, size - data_start, blocks, lambda *_: None, digest, progress)
    elif progress is not None:
        progress(size - data_start)
    if size == data_start:
        return torch.empty(0, dtype=torch.uint8)
    mapping = mmap.mmap(descriptor, size, access=mmap.ACCESS_COPY)
    return torch.frombuffer(mapping, dtype=torch.uint8, offset=data_start, count=size - data_start)


def _to_cuda(descriptor: int, data_start: int, size: int, device: torch.device, digest, progress,
             stats: LoadStats) -> torch.Tensor:
    """The data section of the file read into one device buffer: reads, hashing and copies overlapped."""
    total = size - data_start
    target = torch.empty(total, dtype=torch.uint8, device=device)
    if total:
        _fill(descriptor, data_start, target, _staging(target), torch.cuda.Stream(device), digest, progress, stats)
    return target


def _staging(target: torch.Tensor) -> list[torch.Tensor]:
    """The ring of host buffers the file is read into on its way to `target` (pinned for a GPU)."""
    total = len(target)
    return [torch.empty(min(CHUNK_BYTES, total), dtype=torch.uint8, pin_memory=target.is_cuda)
            for _ in range(min(PINNED_BUFFERS, -(-total // CHUNK_BYTES)))]


def _fill(descriptor: int, data_start: int, target: torch.Tensor, staging: list[torch.Tensor],
          stream: torch.cuda.Stream | None, digest, progress, stats: LoadStats | None,
          stop: threading.Event | None = None) -> None:
    """Read the file's data section into `target` through `staging`: on a GPU each chunk copied on the side
    `stream` while the next are read (returned once every copy has landed), on the CPU copied at once. `stop`,
    once set, ends the fill at the next chunk (`FillStopped`)."""

    def put(offset: int, chunk: torch.Tensor) -> torch.cuda.Event | None:
        if stop is not None and stop.is_set():
            raise FillStopped("the load was abandoned")
        if stream is None:
            target[offset:offset + len(chunk)].copy_(chunk)
            return None
        with torch.cuda.stream(stream):
            target[offset:offset + len(chunk)].copy_(chunk, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    try:
        stream_chunks(descriptor, data_start, len(target), staging, put, digest, progress, stats)
    finally:
        if stream is not None:
            stream.synchronize()


class FillStopped(RuntimeError):
    """A background fill was stopped before it ended (`PendingWeights.cancel`)."""


class PendingWeights:
    """The tensors of safetensors file `path` on `device`, in file order, before their bytes have arrived.

    `tensors` exist at once: views of one zeroed buffer (zeroed: the kernels that run on them meanwhile meet no
    NaN bit patterns), at the addresses they keep. `start()` fills the buffer from the file on a thread of its
    own (CUDA: `load_tensors`' pinned ring and side stream; elsewhere plain copies); `wait()` returns once every
    byte is in place and re-raises the fill's error (ValueError: not a valid file, or it ended early). Nothing
    computed from the tensors' values before `wait()` returns is right. A tensor the loader had to copy (not
    aligned for a view) is copied again by `wait()`. ValueError at once if the header is not a valid one."""

    def __init__(self, path: Path, device: torch.device | str = "cpu"):
        self.path, self.device = Path(path), torch.device(device)
        with open(path, "rb", buffering=0) as stream:
            self.size = os.fstat(stream.fileno()).st_size
            self.data_start, entries = read_header(stream, self.size)
        self._data = torch.zeros(self.size - self.data_start, dtype=torch.uint8, device=self.device)
        self.tensors: dict[str, torch.Tensor] = {}
        self._copies: list[tuple[torch.Tensor, Entry]] = []  # a copy made for alignment, and its place
        for entry in entries:
            tensor = self.tensors[entry.name] = _view(self._data, entry)
            if tensor.untyped_storage().data_ptr() != self._data.untyped_storage().data_ptr():
                self._copies.append((tensor, entry))
        self._staging = _staging(self._data) if len(self._data) else []
        self._stream = None
        if self.device.type == "cuda":  # made here, not on the fill's thread: the side stream after the zeroing
            self._stream = torch.cuda.Stream(self.device)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        self._stop = threading.Event()
        self._future: Future | None = None

    def fill(self, digest=None, progress: Callable[[int], None] | None = None, stats: LoadStats | None = None
             ) -> None:
        """Read the file into the tensors now (what `start` runs on its thread by default): `digest` fed the whole
        file in order, `progress(nbytes)` called as data arrives, `stats` filled in."""
        stats = stats if stats is not None else LoadStats()
        started = time.perf_counter()
        try:
            with open(self.path, "rb", buffering=0) as stream:
                if digest is not None:
                    digest.update(os.pread(stream.fileno(), self.data_start, 0))
                if len(self._data):
                    _fill(stream.fileno(), self.data_start, self._data, self._staging, self._stream, digest,
                          progress, stats, self._stop)
        finally:
            self._staging = []  # the pinned ring is freed whether the fill ended well or not
        stats.nbytes, stats.seconds = len(self._data), time.perf_counter() - started

    def start(self, job: Callable[[], None] | None = None) -> PendingWeights:
        """Run `job` (default `fill()`; one that calls `fill`, logging around it, say) on a thread of its own;
        `wait()` raises its error."""
        pool = ThreadPoolExecutor(1, thread_name_prefix="engine-fill")
        self._future = pool.submit(job or self.fill)
        pool.shutdown(wait=False)
        return self

    def done(self) -> bool:
        """Whether the fill has ended (well or not)."""
        return self._future is not None and self._future.done()

    def wait(self) -> None:
        """Block until the tensors hold the file's bytes; the fill's error if it failed."""
        if self._future is None:
            raise RuntimeError("PendingWeights.wait() before start()")
        self._future.result()
        for copy, entry in self._copies:
            copy.copy_(_view(self._data, entry))
        self._copies = []

    def cancel(self) -> None:
        """Stop the fill (the load is abandoned) and wait for its thread; its error, if any, is dropped."""
        self._stop.set()
        if self._future is not None:
            with contextlib.suppress(Exception):
                self._future.result()


def stream_chunks(descriptor: int, data_start: int, total: int, staging: list[torch.Tensor],
                  put: Callable[[int, torch.Tensor], Any], digest=None, progress: Callable[[int], None] | None = None,
                  stats: LoadStats | None = None) -> None:
    """Read bytes `[data_start, data_start + total)` of a file chunk by chunk into the `staging` buffers (uint8,
    one reader thread each) and hand each chunk, in file order, to `put(offset in the data, chunk)`, which starts
    its copy and returns what to `synchronize()` on before that buffer is read into again (None: nothing). The
    digest is fed in order."""
    chunk_bytes = len(staging[0])
    chunks = [(offset, min(chunk_bytes, total - offset)) for offset in range(0, total, chunk_bytes)]
    slots = len(staging)
    released: list[Any] = [None] * slots
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(descriptor, data_start, total, os.POSIX_FADV_SEQUENTIAL)

    def read(index: int) -> float:
        slot = index % slots
        if released[slot] is not None:
            released[slot].synchronize()  # the chunk this buffer held has been copied out
        offset, length = chunks[index]
        began = time.perf_counter()
        view = memoryview(staging[slot].numpy())[:length]
        filled = 0
        while filled < length:
            got = os.preadv(descriptor, [view[filled:]], data_start + offset + filled)
            if not got:
                raise ValueError("the file ended before its data did")
            filled += got
        return time.perf_counter() - began

    with ThreadPoolExecutor(slots, thread_name_prefix="engine-reader") as pool:
        reads: dict[int, Future] = {i: pool.submit(read, i) for i in range(min(slots, len(chunks)))}
        for index, (offset, length) in enumerate(chunks):
            seconds = reads.pop(index).result()
            if stats is not None:
                stats.read_seconds += seconds
            chunk = staging[index % slots][:length]
            if digest is not None:
                digest.update(memoryview(chunk.numpy()))
            released[index % slots] = put(offset, chunk)
            if index + slots < len(chunks):
                reads[index + slots] = pool.submit(read, index + slots)
            if progress is not None:
                progress(length)
