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

`compiles_only()` goes further, for a first start: inside it, in the calling thread only, a Triton kernel call is
a warm-up (compiled, not launched) and its compile is submitted to one thread pool shared by every kernel the
thread meets; an autotuned kernel meeting a new key submits all its candidates there and times nothing (the
autotuners' benchmarks return zeros under it, `compiling_only()`), and the configs it picked that way are dropped
when the context is left, which waits for the pool once. The eager steps after it find every kernel compiled, in
memory. `ahead` tells what that batch did.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

try:
    from triton import knobs
    from triton.runtime._async_compile import AsyncCompileMode, FutureKernel
    from triton.runtime.jit import JITFunction
except ImportError:  # no Triton, or a Triton without asynchronous compiles: the timing loop compiles
    AsyncCompileMode = None

# the pool of `compiles_only()`: on the H100 machine's 16 cores a first start's 73 kernels took 24.5 s in one batch
# on 8 threads against 27.4 s on 16 (each compile longer: parts of it hold the GIL; docs/performance.md, Cold start)
AHEAD_THREADS = 8
# True in a thread inside `compiles_only()` (a context variable: other threads, and the compile pool's, see False)
_COMPILING: ContextVar[bool] = ContextVar("compiling_only", default=False)
# the autotuned kernels `compile_candidates_ahead` hooked: their configs picked under `compiles_only` are dropped
_HOOKED: weakref.WeakSet = weakref.WeakSet()


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
_AHEAD = _Batches()


def batches() -> tuple[int, float]:
    """`(kernels, seconds)`: the kernels compiled ahead of the timing in this process, and the wall time their
    batches took."""
    return _BATCHES.totals()


def ahead() -> tuple[int, float]:
    """`(kernels, seconds)`: the kernels compiled under `compiles_only` in this process, and the wall time of its
    passes (the pass's own work and its wait for the pool)."""
    return _AHEAD.totals()


def compiling_only() -> bool:
    """Whether the calling thread is inside `compiles_only()`: Triton kernels are compiled, not launched, and
    nothing may be timed (a benchmark returns zeros)."""
    return _COMPILING.get()


@contextmanager
def compiles_only() -> Iterator[None]:
    """In the calling thread, make every Triton kernel call a warm-up whose compile goes to one pool of
    `AHEAD_THREADS` threads at most (a failed one is left for its later launch to meet), an autotuned kernel submitting
    all its candidates for a new key; leaving waits for the pool, drops the autotune configs picked meanwhile
    (untimed) and adds the batch to `ahead`. Outputs of the kernels are left unwritten. No change where Triton
    lacks `AsyncCompileMode`, or interprets kernels."""
    if AsyncCompileMode is None or knobs.runtime.interpret:
        yield
        return
    _run_as_warm_up_when_compiling()
    known = {kernel: set(kernel.cache) for kernel in list(_HOOKED)}
    started = time.perf_counter()
    flag = _COMPILING.set(True)
    try:
        with ThreadPoolExecutor(min(AHEAD_THREADS, os.cpu_count() or 1), thread_name_prefix="triton-compile") as pool, \
                AsyncCompileMode(pool, ignore_errors=True) as mode:  # leaving it waits for every compile
            try:
                yield
            finally:
                submitted = list(mode.future_kernels.values())
    finally:
        _COMPILING.reset(flag)
        for kernel, keys in known.items():
            for key in set(kernel.cache) - keys:
                kernel.cache.pop(key, None)
    _AHEAD.add(sum(future.kernel is not None for future in submitted), time.perf_counter() - started)


@functools.cache
def _run_as_warm_up_when_compiling() -> None:
    """Wrap `JITFunction.run` (once): inside `compiles_only`, a call is a warm-up (compiled, not launched)."""
    run = JITFunction.run

    @functools.wraps(run)
    def run_or_compile(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        return run(self, *args, grid=grid, warmup=warmup or _COMPILING.get(), **kwargs)

    JITFunction.run = run_or_compile


def compile_candidates_ahead(kernel: Any) -> None:
    """Make the `triton.autotune`d `kernel` compile all its candidates for a new autotune key on a thread pool
    before it times them (no change where Triton lacks `AsyncCompileMode`, or interprets kernels)."""
    if AsyncCompileMode is None or knobs.runtime.interpret:
        return
    prune = kernel.prune_configs  # the autotuner calls it for a key it has no config for, before the timing

    def prune_and_compile(kwargs: dict[str, Any]) -> list:
        configs = prune(kwargs)
        if _COMPILING.get():  # into the pool of `compiles_only`
            _submit_all(kernel, configs, kwargs)
        elif len(configs) > 1:
            _compile(kernel, configs, kwargs)
        return configs

    kernel.prune_configs = prune_and_compile
    _HOOKED.add(kernel)


def _compile(kernel: Any, configs: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Compile `configs` of `kernel` for the call being tuned (its positional arguments are in `kernel.nargs`,
    `kwargs` the rest) together, each as a warm-up call (compiled, not launched); wait for all of them."""
    started = time.perf_counter()
    threads = min(len(configs), os.cpu_count() or 1)
    with ThreadPoolExecutor(threads, thread_name_prefix="triton-compile") as pool, \
            AsyncCompileMode(pool, ignore_errors=True):  # leaving it waits for every compile
        submitted = _submit_all(kernel, configs, kwargs)
    compiled = sum(isinstance(future, FutureKernel) and future.kernel is not None for future in submitted)
    _BATCHES.add(compiled, time.perf_counter() - started)


def _submit_all(kernel: Any, configs: Sequence[Any], kwargs: dict[str, Any]) -> list:
    """Each of `configs` of `kernel` for the call being tuned, as a warm-up call under the active
    `AsyncCompileMode` (`_submit`)."""
    args = tuple(kernel.nargs.values())
    return [_submit(kernel.fn, args, {**kwargs, **config.all_kwargs(), "grid": None, "warmup": True})
            for config in configs]


def _submit(fn: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """`fn.run` as a warm-up under `AsyncCompileMode`: a compile submitted (a `FutureKernel`), the kernel already
    compiled, or None where the call failed before compiling (the timing loop's own call meets that error)."""
    try:
        return fn.run(*args, **kwargs)
    except Exception:  # noqa: BLE001 - reported where it was before: by the timing loop's call of this config
        return None
