"""The engine's files read into the page cache in the background while a start goes on.

On a cold disk a start would otherwise read the engine file by file as the load needs it; `prefetch_engine` keeps
the disk busy meanwhile: CUDA starts, the perception loads and the warm-up runs (the LLM weights are filled in
beside it) while its threads read. The load runs it after `read_ahead` (`read_ahead.py`), once the exporter's
modules are imported: on the H100 with the page cache dropped, a prefetch begun before the import held the
import's own reads back (docs/performance.md, "Cold start").
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from pathlib import Path

from .integrity import MANIFEST
from .progress import LOGGER

THREADS = 4
BLOCK_BYTES = 64 << 20


def prefetch_engine(model_dir: Path) -> bool:
    """Start `THREADS` background threads reading the engine's files (the manifest's inventory, largest first)
    into the page cache; their end logs `phase prefetch the engine files (in the background)`. Best effort:
    returns False, starting nothing, when the manifest or the available memory cannot be read or the files would
    take more than half of that memory; read errors are left to the load."""
    model_dir = Path(model_dir)
    try:
        files = json.loads((model_dir / MANIFEST).read_text())["files"]
        sizes = {model_dir / name: int(record["size"]) for name, record in files.items()}
        with open("/proc/meminfo") as meminfo:
            available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, StopIteration):
        return False
    total = sum(sizes.values())
    if total > available // 2:
        return False
    blocks: queue.SimpleQueue = queue.SimpleQueue()
    for path, size in sorted(sizes.items(), key=lambda item: -item[1]):
        for offset in range(0, size, BLOCK_BYTES):
            blocks.put((path, offset))
    started, running = time.perf_counter(), [THREADS]
    lock = threading.Lock()

    def read() -> None:
        buffer = bytearray(BLOCK_BYTES)
        while True:
            try:
                path, offset = blocks.get_nowait()
            except queue.Empty:
                break
            try:
                with open(path, "rb", buffering=0) as stream:
                    os.preadv(stream.fileno(), [buffer], offset)
            except OSError:
                pass
        with lock:
            running[0] -= 1
            if not running[0]:
                LOGGER.info("phase prefetch the engine files (in the background): %.2f s (%.2f GB)",
                            time.perf_counter() - started, total / 1e9)

    for _ in range(THREADS):
        threading.Thread(target=read, name="engine-prefetch", daemon=True).start()
    return True
