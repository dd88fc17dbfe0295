"""Start-up and export reporting: each phase logged with its time, and a progress bar for long byte streams.

The bar is tqdm's on a terminal (stderr is a TTY and tqdm is installed); elsewhere (logs, CI, tests) a plain log
line every `LOG_EVERY_FRACTION` of the bytes.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator

LOGGER = logging.getLogger("exporter.startup")
LOG_EVERY_FRACTION = 0.25
_timeline: tuple[str, float] | None = None  # (what, its start on perf_counter) while a `timeline` block runs


@contextlib.contextmanager
def timeline(what: str) -> Iterator[None]:
    """Phases ending inside the block, on any thread, also log when they began and ended, in seconds since the
    block began (``from 1.03 to 9.97 s of <what>``): the log then shows which phases overlapped. One per process
    at a time (an export, say)."""
    global _timeline
    outer, _timeline = _timeline, (what, time.perf_counter())
    try:
        yield
    finally:
        _timeline = outer


@contextlib.contextmanager
def phase(name: str, logger: logging.Logger = LOGGER) -> Iterator[dict]:
    """Log `name` and its duration at INFO when the block ends; the yielded dict's `detail` is appended (after
    the phase's span inside a running `timeline`)."""
    note: dict = {}
    started = time.perf_counter()
    yield note
    ended = time.perf_counter()
    parts = [note["detail"]] if note.get("detail") else []
    if (span := _timeline) is not None:
        what, origin = span
        parts.insert(0, f"from {started - origin:.2f} to {ended - origin:.2f} s of {what}")
    detail = f" ({'; '.join(parts)})" if parts else ""
    logger.info("phase %s: %.2f s%s", name, ended - started, detail)


def thread_disk_reads() -> int | None:
    """Bytes the calling thread has had read from the storage layer so far (its reads and its page faults that
    missed the page cache: Linux's `/proc/thread-self/io`), None where the system does not say."""
    try:
        with open("/proc/thread-self/io") as counters:
            return next(int(line.split()[1]) for line in counters if line.startswith("read_bytes:"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None


@contextlib.contextmanager
def byte_progress(description: str, total: int, logger: logging.Logger = LOGGER
                  ) -> Iterator[Callable[[int], None]]:
    """A callback counting bytes done out of `total`, shown as a bar on a terminal, else as a few log lines."""
    bar = _terminal_bar(description, total)
    if bar is not None:
        try:
            yield bar.update
        finally:
            bar.close()
        return
    done, next_report = 0, LOG_EVERY_FRACTION

    def advance(nbytes: int) -> None:
        nonlocal done, next_report
        done += nbytes
        if total and done / total >= next_report and done < total:
            logger.info("%s: %.0f%% of %.2f GB", description, 100 * done / total, total / 1e9)
            while next_report <= done / total:
                next_report += LOG_EVERY_FRACTION

    yield advance


def _terminal_bar(description: str, total: int):
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=description, unit="B", unit_scale=True, unit_divisor=1024, leave=False)
