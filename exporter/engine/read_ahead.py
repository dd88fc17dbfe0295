"""What a restart reads besides the LLM weights, read before the weights' stream begins.

On a cold page cache the LLM weights' stream (`prefetch.py`'s threads, the fill beside the warm-up) keeps
the disk's queue full for seconds, and every other read of the start waits behind it: the perception's weights,
the tokenizer and configs, the kernel cache's files (`.cache/`: the choices, Triton's compiled kernels, each
kernel's whole folder read on a hit) and the modules the load and the warm-up import on first use. `read_ahead`
reads those files once into the page cache (through one small buffer per reader: nothing is kept in memory) on a
few threads while the calling thread imports the modules, and returns when both are done, so the stream that
follows finds the disk free of them. `TensorRTMMExporter` runs it before loading an exported engine.
"""

from __future__ import annotations

import importlib
import json
import os
import queue
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .directory import LLM_DIR, LLM_WEIGHTS
from .integrity import CACHE_DIR, MANIFEST, VERIFIED_MARKER
from .progress import phase

# imported on first use by the load (the perception built on the meta device) and the warm-up request (its image);
# the modules of a CUDA start are listed by `bench/late_reads.py`
LATE_MODULES = ("torch.utils._device", "PIL.ImageFile")
MAX_BYTES = 2 << 30  # files beyond it (smallest first) are left to be read when used
READERS = 4
BLOCK_BYTES = 1 << 20
NOT_READ_AT_LOAD = (".onnx",)  # an engine's ONNX encoder is for TensorRT builds, never loaded here


@dataclass
class ReadAhead:
    """What `read_ahead` did: files and bytes read, files left over the byte cap, modules imported."""

    files: int = 0
    nbytes: int = 0
    left: int = 0
    modules: int = 0

    def describe(self) -> str:
        left = f", {self.left} over the cap left to the load" if self.left else ""
        return f"{self.files} files, {self.nbytes / 1e6:.2f} MB{left}; {self.modules} modules imported"


def engine_files(model_dir: Path) -> list[Path]:
    """The files a load and its warm-up read besides the LLM weights: the engine's other files (the manifest's
    inventory, the manifest itself) and the kernel cache's, smallest first."""
    model_dir = Path(model_dir)
    names = [MANIFEST, VERIFIED_MARKER]
    try:
        names += list(json.loads((model_dir / MANIFEST).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # the load reports a bad manifest
    paths = [model_dir / name for name in names if not _llm_weights(name) and not name.endswith(NOT_READ_AT_LOAD)]
    paths += [path for path in sorted((model_dir / CACHE_DIR).rglob("*")) if path.is_file()]
    sizes = {path: _size(path) for path in paths}
    return sorted((path for path, size in sizes.items() if size is not None), key=lambda path: sizes[path])


def read_ahead(model_dir: Path, modules: Iterable[str] = LATE_MODULES) -> ReadAhead:
    """Read `engine_files(model_dir)` into the page cache (at most `MAX_BYTES`) on `READERS` threads while this
    thread imports `modules` (those not installed are skipped); logs `phase read ahead of the LLM weights`."""
    done = ReadAhead()
    with phase("read ahead of the LLM weights") as note:
        files: queue.SimpleQueue = queue.SimpleQueue()
        for path in engine_files(model_dir):
            size = _size(path) or 0
            if done.nbytes + size > MAX_BYTES:
                done.left += 1
                continue
            files.put(path)
            done.files += 1
            done.nbytes += size
        readers = [threading.Thread(target=_read_all, args=(files,), name="engine-read-ahead", daemon=True)
                   for _ in range(min(READERS, done.files))]
        for reader in readers:
            reader.start()
        for name in modules:
            try:
                importlib.import_module(name)
                done.modules += 1
            except ImportError:
                pass
        for reader in readers:
            reader.join()
        note["detail"] = done.describe()
    return done


def _read_all(files: queue.SimpleQueue) -> None:
    buffer = bytearray(BLOCK_BYTES)
    while True:
        try:
            path = files.get_nowait()
        except queue.Empty:
            return
        try:
            with open(path, "rb", buffering=0) as stream:
                while stream.readinto(buffer):
                    pass
        except OSError:
            pass  # left to the load, which says what is wrong


def _llm_weights(name: str) -> bool:
    """The LLM weights' files (one, or one per tensor-parallel rank): the stream reads them, not the read-ahead."""
    return name == LLM_WEIGHTS or (name.startswith(f"{LLM_DIR}/model.rank") and name.endswith(".safetensors"))


def _size(path: Path) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None
