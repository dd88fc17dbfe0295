"""The kernel warm-up of a first start, paid at export instead (as TensorRT pays its tuning at engine build).

A first start on a GPU with no kernel cache compiles the decoder's Triton kernels (ahead, in worker processes),
times the candidates of its matrix products and the autotuned kernels' configs, and captures the step graphs a
first request runs; the engine's kernel cache (`exporter.engine.kernel_cache`) keeps the outcome, so that a
restart skips all of it. `ExportKernelWarmUp` runs that same warm-up during an export on a GPU, on a thread of its
own beside the LLM weights' write (`export_engine`'s ``beside``): the decoder built over zeroed tensors of the
weights file's layout (kernel timing depends on shapes and types, not on values), the scheduler a `Pipeline`
serves the engine's limits with (`serving_scheduler`: the same kernel keys) over a small KV pool, its warm-up
run. The compiled kernels land in the engine folder's `.cache/kernels-<identity>/triton/` (the final folder:
`atomic.install` keeps `.cache/`), and the choices are saved there once the engine is installed: the first start
after the export is a kernel-cache hit. Every GPU tensor is freed and the compile workers stopped before the
export goes on; an error is a logged warning, never a failed export.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..engine.directory import torch_dtype
from ..engine.kernel_cache import KernelCache, compile_summary
from ..engine.limits import EngineLimits
from ..engine.progress import phase
from ..llm import gemv, paged_triton
from ..llm.config import DecoderConfig
from ..llm.model import Decoder
from ..llm.parallel_compile import start_workers, stop_workers
from .kv_cache import KVCacheOptions, block_bytes
from .pipeline import serving_scheduler

LOGGER = logging.getLogger(__name__)
# the KV pool's blocks: enough for the paged-attention kernels' tuning on representative work (it times over a pool
# of at least `paged_triton.TUNE_MIN_BLOCKS`), the null block, and a margin; the pool is at most what the serving
# scheduler would take (twice its rows at their longest)
POOL_BLOCKS = paged_triton.TUNE_MIN_BLOCKS + 8


@dataclass
class Warmed:
    """What `warm_up_kernels` did: the cache it fills, what `restore` found there first, the kernel choices
    (`gemv.fastest`: timed where a key has several candidates) and autotuned configs (timed) it added, and Triton's
    compiles in this process (`compile_summary`)."""

    cache: KernelCache
    restored: str
    choices: int
    autotuned: int
    compiled: str

    def describe(self) -> str:
        return (f"kernel cache {self.restored} before; {self.choices} kernel choices made and {self.autotuned} "
                f"autotuned configs chosen; {self.compiled or 'nothing compiled'}")


def warm_up_kernels(model_dir: Path, device: str, config: DecoderConfig, layout: dict[str, torch.Tensor],
                    dtype: torch.dtype, limits: EngineLimits) -> Warmed:
    """Run a first start's kernel warm-up for the engine that will be installed in ``model_dir`` on ``device``
    (CUDA): its kernel cache restored first (a re-export on the same GPU reuses it), the kernels compiled into its
    folder, the GPU memory freed after; the caller saves the cache (`KernelCache.save`) once the engine is in place.
    ``layout``: the LLM weights file's tensors (meta); ``dtype``: the engine's (as a start loads it)."""
    with torch.cuda.device(torch.device(device)):  # this thread's current device (streams, graphs): the engine's
        return _warm_up(model_dir, device, config, layout, dtype, limits)


def _warm_up(model_dir: Path, device: str, config: DecoderConfig, layout: dict[str, torch.Tensor],
             dtype: torch.dtype, limits: EngineLimits) -> Warmed:
    cache = KernelCache.for_device(model_dir, device)
    chosen = cache.use_compile_dirs()  # before anything compiles (process-wide: restored below)
    decoder = scheduler = None
    try:
        restored = cache.restore()
        hit = restored.reason == "hit"
        if not hit:
            start_workers()  # they start while the decoder is built
        choices_before, tuned_before = len(gemv.choices()), _autotuned()
        tensors = {name: torch.zeros(meta.shape, dtype=meta.dtype, device=device) for name, meta in layout.items()}
        decoder = Decoder.from_state_dict(config, tensors, dtype=dtype, device=device)
        del tensors
        pool = KVCacheOptions(max_bytes=POOL_BLOCKS * block_bytes(decoder, KVCacheOptions()))
        scheduler = serving_scheduler(decoder, limits, kv_cache=pool, compile_kernels_ahead=not hit)
        stop_workers()  # where the compile-ahead pass did not run (it stops them itself)
        scheduler.warm_up(rest_in_background=True)  # the graphs a first start captures before READY
        torch.cuda.synchronize(device)
        return Warmed(cache, restored.reason, len(gemv.choices()) - choices_before, _autotuned() - tuned_before,
                      compile_summary())
    finally:
        stop_workers()
        del scheduler, decoder
        gemv.release_timing_buffers()
        _release_memory()  # the step graphs and their memory pool, the KV pool, the zeroed weights
        for variable in chosen:
            os.environ.pop(variable, None)


def _release_memory() -> None:
    """Collect what is no longer referenced (graphs hold cycles) and hand the allocator's free GPU memory back."""
    gc.collect()
    torch.cuda.empty_cache()


def _autotuned() -> int:
    """The configs the autotuned kernels hold (timed, or restored)."""
    return sum(len(getattr(kernel, "cache", None) or {}) for kernel in gemv.TUNED.values())


class ExportKernelWarmUp:
    """`BesideLlmWrite` for an export into ``model_dir`` on a CUDA ``device``, of an engine in ``dtype`` (its name) with
    ``limits``: `warm_up_kernels` on a thread from the layout's arrival, waited for before the engine is installed,
    its cache saved once it is. Its phase line, logged by its thread, spans the warm-up itself in the export's
    timeline and says what it did and whether it ended before the LLM weights' write; the export's wait for it,
    where there is one, is a phase of its own."""

    def __init__(self, model_dir: str | Path, device: str, dtype: str, limits: EngineLimits):
        self.model_dir, self.device, self.dtype, self.limits = Path(model_dir), device, torch_dtype(dtype), limits
        self.warmed: Warmed | None = None
        self._thread: threading.Thread | None = None
        self._written: float | None = None  # when the LLM weights' write ended
        self._error: str | None = None

    def start(self, config: DecoderConfig, layout: dict[str, torch.Tensor]) -> None:
        self._thread = threading.Thread(target=self._run, args=(config, layout), name="export-kernel-warm-up",
                                        daemon=True)
        self._thread.start()

    def _run(self, config: DecoderConfig, layout: dict[str, torch.Tensor]) -> None:
        with phase("kernel warm-up for this GPU (beside the LLM weights' write)") as note:
            try:
                self.warmed = warm_up_kernels(self.model_dir, self.device, config, layout, self.dtype, self.limits)
            except Exception as error:  # noqa: BLE001 - the export goes on without the cache
                self._error = f"{type(error).__name__}: {error}"  # not the error: its frames hold GPU tensors
            if self._error is not None and torch.cuda.is_available():
                _release_memory()  # what the failed warm-up's frames held
            written = self._written
            when = "before the weights' write ended" if written is None else \
                f"{time.perf_counter() - written:.2f} s after the weights' write ended"
            note["detail"] = f"{self.warmed.describe() if self._error is None else 'failed: ' + self._error}; {when}"

    def written(self) -> None:
        self._written = time.perf_counter()

    def wait(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        if thread.is_alive():
            with phase("wait for the kernel warm-up"):
                thread.join()
        thread.join()
        if self._error is not None:
            LOGGER.warning("the kernel warm-up at export failed (%s); the engine is exported without its kernel "
                           "cache: the first start warms up", self._error)

    def installed(self) -> None:
        if self.warmed is not None and not self.warmed.cache.save():
            LOGGER.warning("the kernel cache of %s could not be saved: the first start warms up", self.model_dir)
