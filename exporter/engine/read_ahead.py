"""What a restart reads besides the LLM weights, read before the weights' stream begins.

On a cold page cache the LLM weights' stream (`prefetch.py`'s threads, the fill beside the warm-up) keeps
the disk's queue full for seconds, and every other read of the start waits behind it: the perception's weights,
the tokenizer and configs, this start's kernel cache (`.cache/kernels-<key>/`: the choices, Triton's compiled
kernels, each kernel's whole folder read on a hit) and the modules the load and the warm-up import on first use.
`read_ahead` reads those files once into the page cache (`page_cache.Readers`: nothing is kept in memory) on a
few threads while the calling thread finds the kernel cache's folder and imports the modules, and returns when
all is done with what it left to the stream, so the stream that follows finds the disk free of them.
`TensorRTMMExporter` runs it before loading an exported engine, then hands the prefetch what it left.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from .directory import LLM_DIR, LLM_WEIGHTS
from .integrity import MANIFEST, VERIFIED_MARKER
from .kernel_cache import KernelCache
from .page_cache import Readers, Span, whole_files
from .progress import phase

# imported on first use by the load (the perception built on the meta device) and the warm-up request (its image);
# the modules of a CUDA start are listed by `bench/late_reads.py`
LATE_MODULES = ("torch.utils._device", "PIL.ImageFile")
MAX_BYTES = 2 << 30  # files beyond it (smallest first) are left to the stream
READERS = 4
BUFFER_BYTES = 1 << 20
NOT_READ_AT_LOAD = (".onnx",)  # an engine's ONNX encoder is for TensorRT builds, never loaded here


class EngineFiles(NamedTuple):
    """The files of an engine a load reads: the LLM weights' (the stream's) and the others (smallest first)."""

    weights: list[Path]
    others: list[Span]


@dataclass
class ReadAhead:
    """What `read_ahead` did: files and bytes read, this start's kernel cache folder (None on the CPU), modules
    imported, and the files it left to the stream (`stream`: the LLM weights', then those over the byte cap)."""

    files: int = 0
    nbytes: int = 0
    kernel_folder: Path | None = None
    modules: int = 0
    weights: list[Path] = field(default_factory=list)
    left: list[Path] = field(default_factory=list)

    @property
    def stream(self) -> list[Path]:
        return self.weights + self.left

    def describe(self) -> str:
        left = f", {len(self.left)} over the cap left to the stream" if self.left else ""
        kernels = f"; kernel cache {self.kernel_folder.name}" if self.kernel_folder is not None else ""
        return f"{self.files} files, {self.nbytes / 1e6:.2f} MB{left}{kernels}; {self.modules} modules imported"

    def within_cap(self, spans: Iterable[Span]) -> list[Span]:
        """The spans read while the bytes stay within `MAX_BYTES` (counted); the others are kept in `left`."""
        taken = []
        for span in spans:
            if self.nbytes + span.length > MAX_BYTES:
                self.left.append(span.path)
                continue
            taken.append(span)
            self.files += 1
            self.nbytes += span.length
        return taken


def engine_files(model_dir: Path) -> EngineFiles:
    """The manifest's inventory, the manifest itself and `.verified`, split into the LLM weights' files and the
    others but the ONNX encoder."""
    model_dir = Path(model_dir)
    names = [MANIFEST, VERIFIED_MARKER]
    try:
        names += list(json.loads((model_dir / MANIFEST).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # the load reports a bad manifest
    others = whole_files(model_dir / name for name in names
                         if not _llm_weights(name) and not name.endswith(NOT_READ_AT_LOAD))
    return EngineFiles([model_dir / name for name in names if _llm_weights(name)], _smallest_first(others))


def kernel_folder(model_dir: Path, device: str) -> Path | None:
    """This start's kernel cache folder (`KernelCache`: the GPU's and the software's identity; asking the GPU
    initialises CUDA, which the load would do next); None on the CPU, which keeps none, or where CUDA fails (the
    load says why)."""
    if not device.startswith("cuda"):
        return None
    try:
        return KernelCache.for_device(model_dir, device).folder
    except (RuntimeError, AssertionError, ValueError):
        return None


def kernel_files(folder: Path | None) -> list[Span]:
    """The files of a kernel cache folder, smallest first (none for None or a folder not there)."""
    return [] if folder is None else _smallest_first(whole_files(sorted(folder.rglob("*"))))


def read_ahead(model_dir: Path, device: str, modules: Iterable[str] = LATE_MODULES) -> ReadAhead:
    """Read `engine_files(model_dir)`'s others, then the files of the kernel cache `device` uses, into the page
    cache (at most `MAX_BYTES`) on `READERS` threads while this thread finds that folder (beside the first reads)
    and imports `modules` (those not installed are skipped); logs `phase read ahead of the LLM weights`."""
    done = ReadAhead()
    with phase("read ahead of the LLM weights") as note:
        files = engine_files(model_dir)
        done.weights = files.weights
        readers = Readers("engine-read-ahead", READERS, BUFFER_BYTES)
        readers.read(done.within_cap(files.others))
        done.kernel_folder = kernel_folder(model_dir, device)
        readers.read(done.within_cap(kernel_files(done.kernel_folder)))
        readers.close()
        for name in modules:
            try:
                importlib.import_module(name)
                done.modules += 1
            except ImportError:
                pass
        readers.join()
        note["detail"] = done.describe()
    return done


def _smallest_first(spans: list[Span]) -> list[Span]:
    return sorted(spans, key=lambda span: span.length)


def _llm_weights(name: str) -> bool:
    """The LLM weights' files (one, or one per tensor-parallel rank): the stream reads them, not the read-ahead."""
    return name == LLM_WEIGHTS or (name.startswith(f"{LLM_DIR}/model.rank") and name.endswith(".safetensors"))
