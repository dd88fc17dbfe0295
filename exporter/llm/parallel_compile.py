"""An autotuned Triton kernel's candidate configs compiled together, on a thread pool, before they are timed.

Triton's autotuner compiles each candidate config lazily, inside its timing loop, one after another; the PTX
assembler runs as its own process, so a few compiles overlap on threads. `compile_candidates_ahead(kernel)` makes an
autotuned kernel that meets a new autotune key first hand the compiles of all its candidates (those left after its
pruning, with the call's own arguments) to a thread pool through Triton's `AsyncCompileMode`, and wait for them: the
timing loop then finds each one compiled, in memory and in Triton's disk cache. A candidate that fails to compile
is left out of the batch; the timing loop compiles it again and meets its error as before (the autotuner skips it,
or raises).
A key the kernel already has a config for (timed, or seeded by the kernel cache) compiles nothing here. Where
Triton has no `AsyncCompileMode`, and under its interpreter, candidates compile one by one in the timing loop.
`batches` tells what the batches did, for the warm-up's log line (`kernel_cache.compile_summary`).

`compiles_only()` goes further, for a first start: inside it, in the calling thread only, a Triton kernel call is
a warm-up (compiled, not launched) and its compile is submitted to one thread pool shared by every kernel the
thread meets; an autotuned kernel meeting a new key submits all its candidates there and times nothing (the
autotuners' benchmarks return zeros under it, `compiling_only()`), and the configs it picked that way are dropped
when the context is left, which waits for the pool once. The eager steps after it find every kernel compiled, in
memory. `ahead` tells what that batch did.

Most of a compile holds the GIL (Triton's Python frontend, the MLIR passes' bindings), so threads of one process
barely scale past a few. Under `compiles_only()` each submitted compile of a kernel that worker processes can import
again (a `JITFunction` reachable from its module by its qualified name, its arguments picklable) first runs in one
of them (`start_workers`), which writes Triton's disk cache: the pool's thread sends it to a free worker, waits for
it, then runs Triton's own compile, now a disk-cache hit (the pool has a few more threads than there are workers,
so that each worker freed meanwhile takes the next compile at once). The workers are plain subprocesses running
`exporter.llm.compile_worker`, not `multiprocessing`'s spawned children, which would import the user's main script
again (a script without a `__main__` guard would load the engine once per worker). A kernel that cannot be shipped,
or whose worker compile fails, is compiled by the thread itself: the parent builds or loads every kernel it runs in
all cases.
"""

from __future__ import annotations

import functools
import importlib
import io
import os
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .compile_worker import WorkerPool

try:
    from triton import knobs
    from triton.runtime._async_compile import AsyncCompileMode, FutureKernel
    from triton.runtime.jit import JITFunction
except ImportError:  # no Triton, or a Triton without asynchronous compiles: the timing loop compiles
    AsyncCompileMode = None

# the most worker processes `compiles_only` ships compiles to (one per core up to it)
AHEAD_PROCESSES = 16
# `compiles_only`'s pool has a thread per worker process and these more: each thread holds a worker only while its
# compile runs there, then loads the kernel in this process (a disk-cache hit), so the extra ones keep every worker
# busy meanwhile. On the H100 (docs/performance.md, tenth run e) a worker's compile took 0.9 s and the parent's load
# 0.1 s on average: about 16 * 0.1 / 1.0 = 1.6 of 16 threads loading at once; 4 leaves room for their GIL waits.
# The threads also compile in this process what no worker can (not shippable, failed, worker lost).
AHEAD_EXTRA_THREADS = 4
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
_IN_WORKERS = _Batches()  # of `_AHEAD`'s kernels, those compiled in worker processes, and their compile seconds
_WORKERS: WorkerPool | None = None  # `start_workers`' pool, until `compiles_only` ends
_WORKERS_LOCK = threading.Lock()


def batches() -> tuple[int, float]:
    """`(kernels, seconds)`: the kernels compiled ahead of the timing in this process, and the wall time their
    batches took."""
    return _BATCHES.totals()


def ahead() -> tuple[int, float]:
    """`(kernels, seconds)`: the kernels compiled under `compiles_only` in this process, and the wall time of its
    passes (the pass's own work and its wait for the pool)."""
    return _AHEAD.totals()


def ahead_in_workers() -> tuple[int, float]:
    """`(kernels, seconds)`: those of `ahead`'s kernels compiled in worker processes (the parent's compile of each
    a disk-cache hit), and the seconds their compiles took there, added up."""
    return _IN_WORKERS.totals()


def compiling_only() -> bool:
    """Whether the calling thread is inside `compiles_only()`: Triton kernels are compiled, not launched, and
    nothing may be timed (a benchmark returns zeros)."""
    return _COMPILING.get()


@contextmanager
def compiles_only() -> Iterator[None]:
    """In the calling thread, make every Triton kernel call a warm-up whose compile goes to one pool of threads (one
    per worker process and `AHEAD_EXTRA_THREADS`; a failed compile is left for its later launch to meet), an
    autotuned kernel submitting all its candidates for a new key; a compile that can be shipped runs first in a
    worker process (`_ShippedFirst`).
    Leaving waits for the pool, stops the worker processes, drops the autotune configs picked meanwhile (untimed)
    and adds the batch to `ahead`. Outputs of the kernels are left unwritten. No change where Triton lacks
    `AsyncCompileMode`, or interprets kernels."""
    if AsyncCompileMode is None or knobs.runtime.interpret:
        yield
        return
    _run_as_warm_up_when_compiling()
    known = {kernel: set(kernel.cache) for kernel in list(_HOOKED)}
    started = time.perf_counter()
    flag = _COMPILING.set(True)
    try:
        with ThreadPoolExecutor(_worker_count() + AHEAD_EXTRA_THREADS, thread_name_prefix="triton-compile") as pool, \
                AsyncCompileMode(_ShippedFirst(pool), ignore_errors=True) as mode:  # leaving waits for each compile
            try:
                yield
            finally:
                submitted = list(mode.future_kernels.values())
    finally:
        _COMPILING.reset(flag)
        stop_workers()
        for kernel, keys in known.items():
            for key in set(kernel.cache) - keys:
                kernel.cache.pop(key, None)
    _AHEAD.add(sum(future.kernel is not None for future in submitted), time.perf_counter() - started)


def start_workers() -> None:
    """Start `compiles_only`'s worker processes now (`_worker_count()`), in the background,
    each importing what a compile needs, so that their start overlaps other work; again: no change. Where this is
    not called, they start at the first compile shipped to them. None where `compiles_only` changes nothing."""
    if AsyncCompileMode is not None and not knobs.runtime.interpret:
        _workers()


def stop_workers() -> None:
    """Stop the worker processes (`WorkerPool.stop`; no change where none run)."""
    global _WORKERS
    with _WORKERS_LOCK:
        workers, _WORKERS = _WORKERS, None
    if workers is not None:
        workers.stop()


def _workers() -> WorkerPool:
    """The pool of worker processes, started if needed."""
    # imported here: `python -m exporter.llm.compile_worker` imports this package first, which must not hold it yet
    from .compile_worker import WorkerPool

    global _WORKERS
    with _WORKERS_LOCK:
        if _WORKERS is None:
            _WORKERS = WorkerPool(_worker_count())
        return _WORKERS


def _worker_count() -> int:
    """How many worker processes `compiles_only` ships compiles to: one per core, `AHEAD_PROCESSES` at most."""
    return min(os.cpu_count() or 1, AHEAD_PROCESSES)


class _ShippedFirst(Executor):
    """`AsyncCompileMode`'s executor under `compiles_only`: a submitted compile (Triton's `async_compile` closure)
    runs on one of `threads`, which first runs the same compile in a worker process where it can be shipped there
    (`_payload`), so that it then loads what the worker wrote to the disk cache."""

    def __init__(self, threads: ThreadPoolExecutor) -> None:
        self.threads = threads

    def submit(self, compile_fn: Callable[[], Any], /, *args: Any, **kwargs: Any) -> Future:
        return self.threads.submit(_in_worker_first, _payload(compile_fn), compile_fn)


def _in_worker_first(payload: bytes | None, compile_fn: Callable[[], Any]) -> Any:
    """Run the compile `payload` in a free worker process (waiting for one), then `compile_fn()` here (a failed
    worker compile leaves the compile to it; None: no worker is asked)."""
    if payload is not None:
        try:
            _IN_WORKERS.add(1, _workers().run(payload))
        except Exception:  # noqa: BLE001 - compiled here instead; a real error of the kernel is met here again
            pass
    return compile_fn()


class _ByReference(pickle.Pickler):
    """Pickles a `JITFunction` (the kernel, or a constexpr argument that is one) as its module and qualified name."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, JITFunction):
            name = (obj.fn.__module__, obj.fn.__qualname__)
            if name[0] == "__main__" or _resolve(*name) is not obj:
                raise pickle.PicklingError(f"{obj} cannot be imported by its name")
            return _resolve, name
        return NotImplemented


def _payload(compile_fn: Callable[[], Any]) -> bytes | None:
    """What a worker needs to run the compile of Triton's `async_compile` closure `compile_fn` (`JITFunction
    ._do_compile`'s: its cells `src`, `target`, `options`, `env_vars`) with Triton's cache folder, pickled; None
    where it cannot be."""
    cells = dict(zip(compile_fn.__code__.co_freevars, (cell.cell_contents for cell in compile_fn.__closure__ or ())))
    try:
        src = cells["src"]
        job = (knobs.cache.dir, src.fn, src.signature, src.constants, src.attrs, cells["target"],
               cells["options"].__dict__, cells["env_vars"])
        buffer = io.BytesIO()
        _ByReference(buffer).dump(job)
    except Exception:  # noqa: BLE001 - not shippable (another Triton's closure, a local kernel): compiled here
        return None
    return buffer.getvalue()


def _resolve(module: str, qualname: str) -> Any:
    """The `JITFunction` named by `module` and `qualname` (under its `triton.autotune`/`heuristics` wrappers), or
    whatever that name holds where it is not one."""
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    while not isinstance(found, JITFunction) and getattr(found, "fn", None) is not None:
        found = found.fn
    return found


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
