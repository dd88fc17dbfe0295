"""An autotuned Triton kernel's candidate configs compiled together, on a thread pool, before they are timed.

Triton's autotuner compiles each candidate config lazily, inside its timing loop, one after another; most of a
compile (the MLIR passes, ptxas) runs without the GIL. `compile_candidates_ahead(kernel)` makes an autotuned kernel
that meets a new autotune key first hand the compiles of all its candidates (those left after its pruning, with
the call's own arguments) to a thread pool through Triton's `AsyncCompileMode`, and wait for them: the timing loop
then finds each one compiled, in memory and in Triton's disk cache. A candidate that fails to compile is left out
of the batch; the timing loop compiles it again and meets its error as before (the autotuner skips it, or raises).
A key the kernel already has a config for (timed, or seeded by the kernel cache) compiles nothing here. Where
Triton has no `AsyncCompileMode`, and under its interpreter, candidates compile one by one in the timing loop.
`batches` tells what the batches did, for the warm-up's log line (`kernel_cache.compile_summary`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

try:
    from triton import knobs
    from triton.runtime._async_compile import AsyncCompileMode, FutureKernel
except ImportError:  # no Triton, or a Triton without asynchronous compiles: the timing loop compiles
    AsyncCompileMode = None


class _Batches:
    """Kernels compiled ahead in this process, and the wall seconds their batches took (threads may add at once)."""

    def __init__(self) -> None:
        self.kernels = 0
        self.seconds = 0.0
        self._lock = threading.Lock()

    def add(self, kernels: int, seconds: float) -> None:
        with self._lock:
            self.kernels += kernels
            self.seconds += seconds

    def totals(self) -> tuple[int, float]:
        with self._lock:
            return self.kernels, self.seconds


_BATCHES = _Batches()


def batches() -> tuple[int, float]:
    """`(kernels, seconds)`: the kernels compiled ahead of the timing in this process, and the wall time their
    batches took."""
    return _BATCHES.totals()


def compile_candidates_ahead(kernel: Any) -> None:
    """Make the `triton.autotune`d `kernel` compile all its candidates for a new autotune key on a thread pool
    before it times them (no change where Triton lacks `AsyncCompileMode`, or interprets kernels)."""
    if AsyncCompileMode is None or knobs.runtime.interpret:
        return
    prune = kernel.prune_configs  # the autotuner calls it for a key it has no config for, before the timing

    def prune_and_compile(kwargs: dict[str, Any]) -> list:
        configs = prune(kwargs)
        if len(configs) > 1:
            _compile(kernel, configs, kwargs)
        return configs

    kernel.prune_configs = prune_and_compile


def _compile(kernel: Any, configs: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Compile `configs` of `kernel` for the call being tuned (its positional arguments are in `kernel.nargs`,
    `kwargs` the rest) together, each as a warm-up call (compiled, not launched); wait for all of them."""
    args = tuple(kernel.nargs.values())
    started = time.perf_counter()
    threads = min(len(configs), os.cpu_count() or 1)
    with ThreadPoolExecutor(threads, thread_name_prefix="triton-compile") as pool, \
            AsyncCompileMode(pool, ignore_errors=True):  # leaving it waits for every compile
        submitted = [_submit(kernel.fn, args, {**kwargs, **config.all_kwargs(), "grid": None, "warmup": True})
                     for config in configs]
    compiled = sum(isinstance(future, FutureKernel) and future.kernel is not None for future in submitted)
    _BATCHES.add(compiled, time.perf_counter() - started)


def _submit(fn: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """`fn.run` as a warm-up under `AsyncCompileMode`: a compile submitted (a `FutureKernel`), the kernel already
    compiled, or None where the call failed before compiling (the timing loop's own call meets that error)."""
    try:
        return fn.run(*args, **kwargs)
    except Exception:  # noqa: BLE001 - reported where it was before: by the timing loop's call of this config
        return None
