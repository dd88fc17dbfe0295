"""An autotuned kernel's candidates compiled in parallel before they are timed (`exporter.llm.parallel_compile`).

The kernels are really compiled, for the H100 (sm_90) without a GPU: in a child pytest without the interpreter,
with Triton's active driver replaced by one that names that target and launches nothing, and each autotuned kernel
timed by a fake benchmark that notes how many compiles had finished when each candidate's timing began. Triton's
`compile` is wrapped to note the threads that ran it and how many ran at once (in this process: a compile in a
worker process of `compiles_only` shows as the parent's compile finding its kernel in the test's own, empty, disk
cache).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

import triton.compiler  # noqa: E402, F811
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

from exporter.engine import kernel_cache  # noqa: E402
from exporter.llm import compile_worker, gemv, paged_triton, parallel_compile  # noqa: E402
from support.kernels import run_child_pytest  # noqa: E402

CHILD = os.environ.get("SM90_COMPILES") == "1"
N = 1024
BLOCKS = (64, 128, 256, 512)  # one candidate each
TOO_LARGE = 2048  # a candidate that fails to compile (the kernel's static assert)


def test_real_compiles_in_a_child_process():
    if CHILD:
        pytest.skip("this is the child run")
    run_child_pytest(__file__, {"SM90_COMPILES": "1", "TRITON_INTERPRET": None})


def _double(x_ptr, y_ptr, N, BLOCK: tl.constexpr):
    tl.static_assert(BLOCK <= 1024)
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < N) * 2, mask=offsets < N)


@triton.jit
def _scale(x_ptr, y_ptr, N, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < N) * FACTOR, mask=offsets < N)


@triton.jit
def _triple(x_ptr, y_ptr, N, BLOCK: tl.constexpr):
    """A kernel a worker process can import by its name (`_double` is jitted inside the tests)."""
    _scale(x_ptr, y_ptr, N, 3, BLOCK)


@triton.autotune([triton.Config({"BLOCK": block}, num_warps=4) for block in BLOCKS], key=["N"],
                 do_bench=gemv.time_candidate)
@triton.jit
def _triple_tuned(x_ptr, y_ptr, N, BLOCK: tl.constexpr):
    """`_triple` autotuned: a worker process finds its kernel under the autotuner its name holds."""
    _scale(x_ptr, y_ptr, N, 3, BLOCK)


class NoLaunch(RuntimeError):
    """What the fake driver raises where a kernel would be loaded or launched."""


class SM90Driver:
    """Triton's active driver for a machine with an H100 as device 0 that launches nothing."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def __getattr__(self, name: str):
        raise NoLaunch(f"no GPU here ({name})")


@dataclass
class Compiles:
    """What Triton's compile did: the threads that ran it, the most running at once, how many had finished (the
    failed ones too) when each timing began, and how many finished."""

    threads: set[str] = field(default_factory=set)
    running: int = 0
    most: int = 0
    finished: int = 0
    at_timings: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wrap(self, compile_: Callable) -> Callable:
        def counted(*args, **kwargs):
            with self.lock:
                self.threads.add(threading.current_thread().name)
                self.running += 1
                self.most = max(self.most, self.running)
            try:
                time.sleep(0.2)  # compiles of one batch overlap even where one takes milliseconds
                return compile_(*args, **kwargs)
            finally:
                with self.lock:
                    self.running -= 1
                    self.finished += 1
        return counted

    def bench(self, kernel_call: Callable[[], None], quantiles) -> list[float]:
        """The autotuner's timing of one candidate: its run compiles it if needed (a failed compile raises, as in
        a real timing), and its launch is skipped."""
        with self.lock:
            self.at_timings.append(self.finished)
        try:
            kernel_call()
        except NoLaunch:
            pass
        return [1.0] * len(quantiles)


@pytest.fixture
def compiles(monkeypatch, tmp_path) -> Compiles:
    if not CHILD:
        pytest.skip("runs in the child pytest (real compiles for sm_90)")
    monkeypatch.setattr(driver, "_active", SM90Driver())
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # every kernel compiled, none from an earlier test
    monkeypatch.setattr(os, "cpu_count", lambda: 4)  # more threads than candidates' compiles a test needs
    monkeypatch.setattr(gemv, "TUNED", {})
    monkeypatch.setattr(parallel_compile, "_BATCHES", parallel_compile._Batches())
    monkeypatch.setattr(parallel_compile, "_AHEAD", parallel_compile._Batches())
    monkeypatch.setattr(parallel_compile, "_IN_WORKERS", parallel_compile._Batches())
    monkeypatch.setattr(kernel_cache, "_COMPILES", kernel_cache._TritonCompiles())
    kernel_cache.count_compiles()
    recorded = Compiles()
    monkeypatch.setattr(triton.compiler, "compile", recorded.wrap(triton.compiler.compile))
    # CPython 3.11.7 (CI's) can fail an `ast.parse` run beside another thread's ("AST constructor recursion depth
    # mismatch"); Triton parses a kernel's source on each compile. Such a candidate is left out of its batch and
    # compiled again by its timing (harmless), which would make these counts vary: the tests parse one at a time.
    parse, parsing = ast.parse, threading.Lock()

    def parse_alone(*args, **kwargs):
        with parsing:
            return parse(*args, **kwargs)

    monkeypatch.setattr(ast, "parse", parse_alone)
    return recorded


def registered(name: str, compiles: Compiles, blocks=BLOCKS):
    """A fresh autotuned `_double` over `blocks`, registered as the engine's kernels are."""
    configs = [triton.Config({"BLOCK": block}, num_warps=4) for block in blocks]
    return gemv.register_tuned(name, triton.autotune(configs, key=["N"], do_bench=compiles.bench)(triton.jit(_double)))


def call(kernel, n: int = N) -> None:
    """One call of `kernel` on n numbers (tuned, compiled; the launch itself is skipped)."""
    x = torch.zeros(n, dtype=torch.float16)
    with pytest.raises(NoLaunch):
        kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, torch.empty_like(x), n)


def test_all_candidates_are_compiled_on_several_threads_before_the_first_timing(compiles):
    kernel = registered("double", compiles)
    call(kernel)
    assert compiles.at_timings == [len(BLOCKS)] * len(BLOCKS)
    assert compiles.most > 1 and threading.current_thread().name not in compiles.threads
    assert compiles.finished == len(BLOCKS)  # the timings and the call found every candidate compiled
    assert re.fullmatch(rf"Triton: {len(BLOCKS)} kernels in [0-9.]+ s, 0 from the compile cache, {len(BLOCKS)} in "
                        r"parallel batches \([0-9.]+ s wall\)", kernel_cache.compile_summary())


def test_a_candidate_that_fails_to_compile_leaves_the_others_compiled(compiles):
    kernel = registered("double", compiles, blocks=(TOO_LARGE, *BLOCKS))
    call(kernel)
    assert compiles.at_timings[0] == len(BLOCKS) + 1  # all attempted at once, the failed one too
    failed = kernel.configs[0]
    assert kernel.configs_timings[failed] == [float("inf")] * 3  # its timing met its error, as before: skipped
    assert all(kernel.configs_timings[config] == [1.0] * 3 for config in kernel.configs[1:])
    assert kernel.cache[(N, "torch.float16", "torch.float16")] == kernel.configs[1]
    assert parallel_compile.batches()[0] == len(BLOCKS)


def test_a_key_already_chosen_compiles_only_its_config_on_the_caller(compiles):
    kernel = registered("double", compiles)
    kernel.cache[(N, "torch.float16", "torch.float16")] = kernel.configs[2]  # as the kernel cache seeds it
    call(kernel)
    assert compiles.at_timings == [] and compiles.finished == 1
    assert compiles.threads == {threading.current_thread().name}
    assert parallel_compile.batches() == (0, 0.0)


def test_two_threads_tuning_two_kernels_at_once_count_every_compile(compiles):
    kernels = [registered(f"double{index}", compiles) for index in range(2)]
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def tune(kernel) -> None:
        start.wait()
        try:
            call(kernel)
        except BaseException as error:  # noqa: BLE001 - shown by the assert below
            errors.append(error)

    threads = [threading.Thread(target=tune, args=(kernel,)) for kernel in kernels]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert compiles.finished == parallel_compile.batches()[0] == kernel_cache._COMPILES.kernels == 2 * len(BLOCKS)


def test_a_triton_without_asynchronous_compiles_compiles_one_by_one_in_the_timing(compiles, monkeypatch):
    monkeypatch.setattr(parallel_compile, "AsyncCompileMode", None)  # what the import falls back to
    kernel = registered("double", compiles)
    call(kernel)
    assert compiles.at_timings == list(range(len(BLOCKS)))  # each compiled as its timing began, as before
    assert compiles.threads == {threading.current_thread().name}
    assert parallel_compile.batches() == (0, 0.0)


def test_the_interpreter_keeps_the_autotuner_as_it_is(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel = triton.autotune([triton.Config({"BLOCK": block}) for block in BLOCKS], key=["N"])(triton.jit(_double))
    parallel_compile.compile_candidates_ahead(kernel)
    assert "prune_configs" not in vars(kernel)


def launch(kernel, n: int = N) -> None:
    """`kernel` on n numbers, the launch itself not expected to fail (under `compiles_only` there is none)."""
    x = torch.zeros(n, dtype=torch.float16)
    kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, torch.empty_like(x), n, **(
        {} if isinstance(kernel, triton.runtime.Autotuner) else {"BLOCK": 32}))  # a block no candidate has


@pytest.fixture
def timed(compiles, monkeypatch) -> Compiles:
    """`compiles`, with Triton's benchmark (what `gemv.time_candidate` runs) replaced by its fake timing."""
    monkeypatch.setattr(triton.testing, "do_bench", lambda kernel_call, quantiles, **_: compiles.bench(
        kernel_call, quantiles))
    return compiles


def tuned(name: str) -> object:
    """A fresh autotuned `_double` over `BLOCKS`, timed by `gemv.time_candidate`, registered as ours are."""
    configs = [triton.Config({"BLOCK": block}, num_warps=4) for block in BLOCKS]
    return gemv.register_tuned(name, triton.autotune(configs, key=["N"], do_bench=gemv.time_candidate)(
        triton.jit(_double)))


def test_compiles_only_compiles_every_kernel_and_key_in_one_batch_launching_and_keeping_nothing(timed,
                                                                                              monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    plain, kernel = triton.jit(_double), tuned("double")
    ran = []
    with parallel_compile.compiles_only():
        launch(plain)
        for n in (N, N + 1):  # two autotune keys, compiled apart (N is specialized on its divisibility by 16)
            launch(kernel, n)
        product = gemv.fastest(("ahead test",), {"a": lambda: ran.append("a") or 1, "b": lambda: ran.append("b")},
                               "a")
        assert gemv.measure_ms(lambda: 1 / 0) == 0.0
    total = 1 + 2 * len(BLOCKS)
    assert timed.finished == total and timed.most > len(BLOCKS)  # both keys' candidates at once
    assert timed.at_timings == [] and kernel.cache == {}  # nothing timed, no config kept
    assert (product, sorted(ran), gemv.chosen(("ahead test",))) == (1, ["a", "b"], None)
    assert parallel_compile.ahead()[0] == total and parallel_compile.batches() == (0, 0.0)
    assert re.fullmatch(rf"Triton: {total} kernels in [0-9.]+ s, 0 from the compile cache, compiled ahead: "
                        rf"{total} kernels in one batch \([0-9.]+ s wall, 0 in worker processes: 0.00 s there\), 0 in "
                        r"parallel batches \(0.00 s wall\)",
                        kernel_cache.compile_summary())
    with pytest.raises(NoLaunch):  # launched now, compiled before
        launch(plain)
    for n in (N, N + 1):
        call(kernel, n)
    assert timed.finished == total and timed.at_timings == [total] * (2 * len(BLOCKS))
    assert len(kernel.cache) == 2


def test_compiles_only_compiles_just_the_config_of_a_key_seeded_before(timed):
    kernel = tuned("double")
    kernel.cache[(N, "torch.float16", "torch.float16")] = kernel.configs[2]  # as the kernel cache seeds it
    with parallel_compile.compiles_only():
        launch(kernel)
    assert timed.finished == 1 and parallel_compile.ahead()[0] == 1
    assert kernel.cache == {(N, "torch.float16", "torch.float16"): kernel.configs[2]}


def test_compiles_only_leaves_other_threads_launching(compiles):
    plain, errors = triton.jit(_double), []

    def other() -> None:
        try:
            launch(plain, 2 * N)
        except BaseException as error:  # noqa: BLE001 - shown by the assert below
            errors.append(error)

    with parallel_compile.compiles_only():
        thread = threading.Thread(target=other, name="other")
        thread.start()
        thread.join()
    assert [type(error) for error in errors] == [NoLaunch]  # compiled on its own thread, then launched
    assert "other" in compiles.threads and parallel_compile.ahead()[0] == 0


def test_a_triton_without_asynchronous_compiles_makes_compiles_only_a_no_op(compiles, monkeypatch):
    monkeypatch.setattr(parallel_compile, "AsyncCompileMode", None)
    with parallel_compile.compiles_only(), pytest.raises(NoLaunch):
        launch(triton.jit(_double))
    assert compiles.threads == {threading.current_thread().name} and parallel_compile.ahead() == (0, 0.0)


def test_the_representative_call_of_a_kind_runs_under_compiles_only_and_is_recorded_after(compiles, monkeypatch):
    monkeypatch.setattr(paged_triton, "_tuned", set())
    ran = []
    with parallel_compile.compiles_only():
        paged_triton._tune_first(("ahead test",), 2, lambda: ran.append("ahead"))  # a pool too small to time on
    assert ran == ["ahead"] and paged_triton.tuned_kinds() == []
    paged_triton._tune_first(("ahead test",), paged_triton.TUNE_MIN_BLOCKS, lambda: ran.append("timed"))
    assert ran == ["ahead", "timed"] and paged_triton.tuned_kinds() == [repr(("ahead test",))]


def forget_compiled(kernel, monkeypatch) -> None:
    """Leave the module-level `kernel` without the kernels compiled in this process (for this test)."""
    monkeypatch.setattr(kernel, "device_caches", type(kernel.device_caches)(kernel.device_caches.default_factory))


@pytest.fixture
def triple(compiles, monkeypatch) -> Callable[[], object]:
    """`_triple` with nothing compiled in this process; calling the result launches it (the compiled kernel)."""
    forget_compiled(_triple, monkeypatch)
    return lambda: launch(_triple)


def compiled_triple():
    """The kernel `_triple` compiled for `launch`'s call (the only one it has)."""
    (kernel,) = _triple.device_caches[0][0].values()
    return kernel


def test_compiles_only_compiles_an_importable_kernel_in_a_worker_process_and_loads_it_from_the_disk_cache(
        triple, compiles, monkeypatch, tmp_path):
    with parallel_compile.compiles_only():
        triple()
    # the cache folder is this test's own: the parent's one compile found the kernel there, written by a worker
    assert compiles.finished == 1 and kernel_cache._COMPILES.cached == 1
    assert parallel_compile.ahead()[0] == 1 and parallel_compile.ahead_in_workers()[0] == 1
    assert re.search(r"compiled ahead: 1 kernels in one batch \([0-9.]+ s wall, 1 in worker processes: "
                     r"[0-9.]+ s there\)", kernel_cache.compile_summary())
    shipped = compiled_triple()
    forget_compiled(_triple, monkeypatch)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "parent"))
    with pytest.raises(NoLaunch):
        triple()  # compiled here, from nothing
    assert kernel_cache._COMPILES.cached == 1 and kernel_cache._COMPILES.kernels == 2
    here = compiled_triple()
    assert (shipped.hash, shipped.asm["ptx"], shipped.asm["cubin"]) == (here.hash, here.asm["ptx"], here.asm["cubin"])


def test_a_kernel_a_worker_cannot_import_is_compiled_in_the_parent_without_starting_workers(compiles, monkeypatch):
    monkeypatch.setattr(parallel_compile, "_workers", lambda: pytest.fail("worker processes started"))
    with parallel_compile.compiles_only():
        launch(triton.jit(_double))  # not reachable by its name: `_double` is the plain function
    assert compiles.finished == 1 and kernel_cache._COMPILES.cached == 0
    assert parallel_compile.ahead()[0] == 1 and parallel_compile.ahead_in_workers()[0] == 0


def test_a_compile_that_fails_in_its_worker_is_compiled_in_the_parent(triple, compiles, monkeypatch):
    payload = parallel_compile._payload
    monkeypatch.setattr(parallel_compile, "_payload", lambda compile_fn: payload(compile_fn) and b"not a pickle")
    with parallel_compile.compiles_only():
        triple()
    assert compiles.finished == 1 and kernel_cache._COMPILES.cached == 0  # compiled here, not found on the disk
    assert parallel_compile.ahead()[0] == 1 and parallel_compile.ahead_in_workers()[0] == 0
    with pytest.raises(NoLaunch):
        triple()  # compiled before: launched now
    assert compiles.finished == 1


def test_a_compile_whose_worker_died_is_compiled_in_the_parent_and_the_worker_dropped(triple, compiles, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    workers = parallel_compile._workers()
    workers.starter.join()
    (worker,) = workers.processes
    worker.kill()
    worker.wait()
    with parallel_compile.compiles_only():
        triple()
    assert compiles.finished == 1 and kernel_cache._COMPILES.cached == 0 and workers.alive == 0
    assert parallel_compile.ahead()[0] == 1 and parallel_compile.ahead_in_workers()[0] == 0


def test_an_autotuned_kernel_s_candidates_compile_in_worker_processes(timed, monkeypatch):
    forget_compiled(_triple_tuned.fn, monkeypatch)
    monkeypatch.setattr(_triple_tuned, "prune_configs", _triple_tuned.prune_configs)  # undone after the test
    kernel = gemv.register_tuned("triple", _triple_tuned)
    with parallel_compile.compiles_only():
        launch(kernel)
    assert parallel_compile.ahead()[0] == parallel_compile.ahead_in_workers()[0] == len(BLOCKS)
    assert timed.finished == kernel_cache._COMPILES.cached == len(BLOCKS)  # each from the disk cache
    assert timed.at_timings == [] and kernel.cache == {}



def test_the_pool_s_own_threads_keep_every_worker_busy_then_load_each_kernel_here(timed, monkeypatch):
    """One pool: the thread that hands a compile to a worker process (no sender threads of the worker pool) waits
    for it and loads the kernel here; with more compiles than workers, every worker has one at once."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # 2 workers for the 4 candidates
    forget_compiled(_triple_tuned.fn, monkeypatch)
    monkeypatch.setattr(_triple_tuned, "prune_configs", _triple_tuned.prune_configs)  # undone after the test
    in_workers = Compiles()  # the parent's waits for a worker's answer: the jobs in workers at once
    monkeypatch.setattr(compile_worker, "read_message", in_workers.wrap(compile_worker.read_message))
    kernel = gemv.register_tuned("triple", _triple_tuned)
    with parallel_compile.compiles_only():
        launch(kernel)
    assert parallel_compile.ahead_in_workers()[0] == in_workers.finished == len(BLOCKS) and in_workers.most == 2
    assert timed.finished == kernel_cache._COMPILES.cached == len(BLOCKS)  # each from the disk cache
    assert in_workers.threads <= timed.threads and all(name.startswith("triton-compile_")
                                                      for name in timed.threads)


USER_SCRIPT = """
    import sys
    with open(sys.argv[1], "a") as runs:  # top-level code, no `if __name__ == "__main__":`
        runs.write("ran\\n")
    from triton.runtime.driver import driver
    import test_parallel_compile as tests
    from exporter.llm import parallel_compile
    driver._active = tests.SM90Driver()
    parallel_compile.start_workers()
    with parallel_compile.compiles_only():
        tests.launch(tests._triple)
    print("in workers:", parallel_compile.ahead_in_workers()[0])
"""


def test_a_user_script_without_a_main_guard_runs_once_while_its_kernel_compiles_in_a_worker(tmp_path):
    if CHILD:
        pytest.skip("runs in the parent pytest")
    script, runs = tmp_path / "user_script.py", tmp_path / "runs.txt"
    script.write_text(textwrap.dedent(USER_SCRIPT))
    tests = Path(__file__).resolve().parent
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (tests, tests.parent))),
                   "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    environment.pop("TRITON_INTERPRET", None)
    user = subprocess.run([sys.executable, str(script), str(runs)], env=environment, capture_output=True, text=True,
                          timeout=300)
    assert user.returncode == 0, user.stderr[-3000:]
    assert runs.read_text() == "ran\n"  # the workers did not run the script again
    assert "in workers: 1" in user.stdout, user.stdout + user.stderr[-3000:]
