"""Warm-up work paid once per engine and GPU, not at every start: kept in the engine directory's `.cache/`.

    model_dir/.cache/kernels-<key>/     key: a hash of the identity below
        choices.json    {"format", "identity", "choices", "autotune", "tuned_kinds"}: the candidate
                        `gemv.fastest` picked per key (the bf16 matrix-vector and the quantized products), each
                        registered autotuned Triton kernel's chosen config per autotune key (`gemv.TUNED`: the
                        matrix-vector, quantized, MoE and paged-attention kernels), and the kinds of paged-attention
                        call whose configs were timed on representative work (`paged_triton.tuned_kinds`)
        triton/         TRITON_CACHE_DIR: the compiled Triton kernels (the decoder's fused elementwise kernels, the
                        matrix-vector, quantized and paged-attention ones)

The identity is the GPU's name and compute capability and the torch, CUDA, Triton and package versions: another
GPU or another version uses another folder, so its choices are measured (and its kernels compiled) again. A file
that cannot be read, is not this format, or names another identity is ignored and rewritten: the cache can make
a start faster, never fail one. `.cache/` is no part of the engine's inventory (`integrity`); an export keeps it
(`atomic`); deleting it is always safe. The compile folder is used only where the user has not set its
variable. A folder that cannot be written (read-only engine) keeps nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# every module that registers an autotuned kernel in `gemv.TUNED` (`register_tuned`, at its import): imported here,
# so that `restore`, which may run before the engine is loaded, seeds each of them
from ..llm import gemv, moe_triton, paged_triton, parallel_compile  # noqa: F401 - moe_triton: its kernel registered
from ..llm.quant import kernels as quant_kernels  # noqa: F401 - its kernels registered
from .directory import package_version
from .integrity import CACHE_DIR

LOGGER = logging.getLogger(__name__)
FORMAT = 1
CHOICES_FILE = "choices.json"
COMPILE_DIRS = {"TRITON_CACHE_DIR": "triton"}
_KEY_ITEM_TYPES = (bool, int, float, str, type(None))


def device_identity(device: torch.device | str) -> dict[str, Any]:
    """What compiled kernels and timing choices depend on: the GPU and the software versions."""
    properties = torch.cuda.get_device_properties(torch.device(device))
    return {"gpu": properties.name, "capability": f"{properties.major}.{properties.minor}",
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": getattr(gemv.triton, "__version__", None), "package": package_version()}


@dataclass
class Restored:
    """What `KernelCache.restore` found: `reason` is "hit", "missing", "corrupt" or "other identity"; `seconds`:
    how long the restore took."""

    reason: str
    choices: int = 0
    autotuned: int = 0
    seconds: float = 0.0

    @property
    def hit(self) -> bool:
        """Whether the saved choices were restored: this start's kernels were chosen (and compiled) before."""
        return self.reason == "hit"

    def describe(self) -> str:
        if not self.hit:
            return f"kernel cache {self.reason}: kernels are chosen by timing"
        return f"kernel cache hit: {self.choices} kernel choices and {self.autotuned} autotuned configs reused"


class KernelCache:
    """The cache folder of one engine on one GPU and software identity."""

    def __init__(self, model_dir: Path, identity: dict[str, Any]):
        self.identity = identity
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
        self.folder = Path(model_dir) / CACHE_DIR / f"kernels-{digest}"

    @classmethod
    def for_device(cls, model_dir: Path, device: torch.device | str) -> KernelCache:
        return cls(model_dir, device_identity(device))

    def use_compile_dirs(self) -> dict[str, str]:
        """Point Triton's on-disk cache into the folder (only if the user has not set it, and only if the folder
        can be written), and count Triton's compiles from now on (`count_compiles`); returns the variables set."""
        count_compiles()
        if not self._writable():
            return {}
        chosen = {}
        for variable, name in COMPILE_DIRS.items():
            if variable not in os.environ:
                path = self.folder / name
                path.mkdir(parents=True, exist_ok=True)
                os.environ[variable] = chosen[variable] = str(path)
        return chosen

    def restore(self) -> Restored:
        """Hand the saved choices to `gemv` and the saved autotune configs to their kernels; anything unreadable
        or of another identity is ignored."""
        started = time.perf_counter()
        restored = self._restore()
        restored.seconds = time.perf_counter() - started
        return restored

    def _restore(self) -> Restored:
        try:
            saved = json.loads((self.folder / CHOICES_FILE).read_text())
        except FileNotFoundError:
            return Restored("missing")
        except (OSError, ValueError):
            return Restored("corrupt")
        if not isinstance(saved, dict) or saved.get("format") != FORMAT:
            return Restored("corrupt")
        if saved.get("identity") != self.identity:
            return Restored("other identity")
        choices, autotune = saved.get("choices"), saved.get("autotune")
        if not isinstance(choices, dict) or not isinstance(autotune, dict):
            return Restored("corrupt")
        gemv.remember({str(key): str(name) for key, name in choices.items()})
        kinds = saved.get("tuned_kinds", [])  # absent in files written before it was kept
        if isinstance(kinds, list):
            paged_triton.remember_tuned(kind for kind in kinds if isinstance(kind, str))
        return Restored("hit", len(choices), sum(_seed(gemv.TUNED.get(kernel), entries)
                                                 for kernel, entries in autotune.items()))

    def save(self) -> bool:
        """Write the choices made so far (with those restored) atomically; False if the folder cannot be written."""
        if not self._writable():
            return False
        content = {"format": FORMAT, "identity": self.identity, "choices": gemv.choices(remembered=True),
                   "autotune": {name: _tuned_entries(kernel) for name, kernel in gemv.TUNED.items()},
                   "tuned_kinds": paged_triton.tuned_kinds()}
        target = self.folder / CHOICES_FILE
        staged = target.with_name(f"{CHOICES_FILE}.{os.getpid()}.{threading.get_ident()}")  # a save per thread
        try:
            staged.write_text(json.dumps(content, indent=1))
            os.replace(staged, target)
        except OSError as error:
            LOGGER.info("kernel cache not saved (%s)", error)
            staged.unlink(missing_ok=True)
            return False
        return True

    def _writable(self) -> bool:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            return False
        return os.access(self.folder, os.W_OK)


class _TritonCompiles:
    """Triton's compiles in this process once `listen` was called (Triton's compilation listener, chained to one
    already set): kernels, seconds, and how many came from Triton's on-disk cache."""

    def __init__(self) -> None:
        self.kernels = self.cached = 0
        self.seconds = 0.0
        self._chained: Any = None
        self._lock = threading.Lock()

    def listen(self) -> None:
        """Become Triton's compilation listener (once; nothing where Triton is missing or has no such hook)."""
        knobs = getattr(getattr(gemv.triton, "knobs", None), "compilation", None)
        if not hasattr(knobs, "listener"):
            return
        with self._lock:
            if knobs.listener is not self:
                self._chained, knobs.listener = knobs.listener, self

    def __call__(self, *, src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool) -> None:
        with self._lock:
            self.kernels += 1
            self.cached += bool(cache_hit)
            self.seconds += times.total / 1e6
        if self._chained is not None:
            self._chained(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)


_COMPILES = _TritonCompiles()


def count_compiles() -> None:
    """Count Triton's compiles in this process from now on, for `compile_summary` (again: no change)."""
    _COMPILES.listen()


def compile_summary() -> str:
    """Triton's compiles in this process since `count_compiles` (`KernelCache.use_compile_dirs` calls it), for a
    phase line: kernels, seconds and how many came from the compile cache ("" where nothing was compiled), and how
    many of them were compiled ahead in one batch (`parallel_compile.compiles_only`, where it ran; how many of
    those in its worker processes, with their compile seconds there: here each is a cache hit) and how many
    were autotuned candidates compiled in later parallel batches (`parallel_compile`), with the batches' wall
    time; the others compiled one by one at their first call. A kernel from the cache costs milliseconds (its
    binary loaded); one compiled, about a second; the seconds add up each kernel's compile, so parallel ones count
    in full."""
    if not _COMPILES.kernels:
        return ""
    batched, wall = parallel_compile.batches()
    ahead, ahead_wall = parallel_compile.ahead()
    in_workers, worker_seconds = parallel_compile.ahead_in_workers()
    ahead_part = (f"compiled ahead: {ahead} kernels in one batch ({ahead_wall:.2f} s wall, {in_workers} in worker "
                  f"processes: {worker_seconds:.2f} s there), ") if ahead_wall else ""
    return (f"Triton: {_COMPILES.kernels} kernels in {_COMPILES.seconds:.2f} s, {_COMPILES.cached} from the "
            f"compile cache, {ahead_part}{batched} in parallel batches ({wall:.2f} s wall)")


def _tuned_entries(kernel: Any) -> list[list]:
    """`[[autotune key as a list, config as text], ...]` of an autotuned kernel (keys JSON cannot hold left out)."""
    cache = getattr(kernel, "cache", None) or {}
    return [[list(key), str(config)] for key, config in list(cache.items())
            if isinstance(key, tuple) and all(isinstance(item, _KEY_ITEM_TYPES) for item in key)]


def _seed(kernel: Any, entries: Any) -> int:
    """Put saved `[key, config text]` entries into an autotuned kernel's cache, where the config is one of its own;
    the number seeded."""
    configs = {str(config): config for config in getattr(kernel, "configs", ())}
    if not configs or not isinstance(entries, list):
        return 0
    seeded = 0
    for entry in entries:
        if (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list)
                and isinstance(entry[1], str) and entry[1] in configs):
            kernel.cache.setdefault(tuple(entry[0]), configs[entry[1]])
            seeded += 1
    return seeded
