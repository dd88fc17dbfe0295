"""Files read into the page cache on background threads, for a start from a cold disk.

A `Span` is a byte range of a file; `Readers` reads the spans it is given on a few daemon threads, each through one
buffer of its own (nothing is kept: the pages stay in the kernel's cache for the load to find). The read-ahead
(`read_ahead.py`) reads whole files with it, the prefetch (`prefetch.py`) 64 MB blocks of the LLM weights.
"""

from __future__ import annotations

import os
import queue
import stat
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple


class Span(NamedTuple):
    """`length` bytes of the file at `path` from `offset`."""

    path: Path
    offset: int
    length: int


def whole_files(paths: Iterable[Path]) -> list[Span]:
    """A span per regular file of `paths`, in their order; those that cannot be found are left out (the load
    reports them)."""
    spans = []
    for path in paths:
        try:
            status = os.stat(path)
        except OSError:
            continue
        if stat.S_ISREG(status.st_mode):
            spans.append(Span(Path(path), 0, status.st_size))
    return spans


class Readers:
    """`threads` daemon threads named `name` reading the spans given to `read`, in that order, through one
    `buffer_bytes` buffer each, until `close`; the last thread to end calls `when_done`. Read errors are left to
    the load, which says what is wrong."""

    def __init__(self, name: str, threads: int, buffer_bytes: int, when_done: Callable[[], None] | None = None):
        self._spans: queue.SimpleQueue[Span | None] = queue.SimpleQueue()
        self._buffer_bytes = buffer_bytes
        self._when_done = when_done
        self._running = threads
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, name=name, daemon=True) for _ in range(threads)]
        for thread in self._threads:
            thread.start()

    def read(self, spans: Iterable[Span]) -> None:
        for span in spans:
            self._spans.put(span)

    def close(self) -> None:
        """No more spans: each thread ends once those given are read."""
        for _ in self._threads:
            self._spans.put(None)

    def join(self) -> None:
        for thread in self._threads:
            thread.join()

    def _run(self) -> None:
        buffer = memoryview(bytearray(self._buffer_bytes))
        while (span := self._spans.get()) is not None:
            try:
                read_span(span, buffer)
            except OSError:
                pass
        with self._lock:
            self._running -= 1
            last = not self._running
        if last and self._when_done is not None:
            self._when_done()


def read_span(span: Span, buffer: memoryview) -> None:
    """Read `span` through `buffer` (up to its end or the file's)."""
    with open(span.path, "rb", buffering=0) as stream:
        position, end = span.offset, span.offset + span.length
        while position < end:
            count = os.preadv(stream.fileno(), [buffer[:end - position]], position)
            if not count:
                return
            position += count
