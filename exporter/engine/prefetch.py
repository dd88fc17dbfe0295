"""The LLM weights read into the page cache in the background while a start goes on.

On a cold disk a start would otherwise read the weights as the load needs them; `prefetch_engine` keeps the disk
busy meanwhile: CUDA starts, the perception loads and the warm-up runs (the LLM weights are filled in beside it)
while its threads read. It reads what `read_ahead` (`read_ahead.py`) left: the LLM weights' files and any file
over the read-ahead's byte cap, never a file the read-ahead read. The load runs it after the read-ahead, once the
exporter's modules are imported: on the H100 with the page cache dropped, a prefetch begun before the import held
the import's own reads back (docs/performance.md, "Cold start").
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from .page_cache import Readers, Span, whole_files
from .progress import LOGGER

THREADS = 4
BLOCK_BYTES = 64 << 20


def prefetch_engine(files: Sequence[Path]) -> bool:
    """Start `THREADS` background threads reading `files` (`ReadAhead.stream`), largest first, in `BLOCK_BYTES`
    blocks into the page cache; their end logs `phase prefetch the engine files (in the background)`. Best
    effort: returns False, starting nothing, when none of the files is there, the available memory cannot be read
    or the files would take more than half of it; read errors are left to the load."""
    spans = sorted(whole_files(files), key=lambda span: -span.length)
    try:
        with open("/proc/meminfo") as meminfo:
            available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, ValueError, IndexError, StopIteration):
        return False
    total = sum(span.length for span in spans)
    if not spans or total > available // 2:
        return False
    started = time.perf_counter()

    def done() -> None:
        LOGGER.info("phase prefetch the engine files (in the background): %.2f s (%.2f GB)",
                    time.perf_counter() - started, total / 1e9)

    readers = Readers("engine-prefetch", THREADS, BLOCK_BYTES, when_done=done)
    readers.read(Span(span.path, offset, min(BLOCK_BYTES, span.length - offset))
                 for span in spans for offset in range(0, span.length, BLOCK_BYTES))
    readers.close()
    return True
