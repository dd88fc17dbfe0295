"""The one-row matrix product of batch-1 decoding, `x [1, K] @ W[N, K]^T`, at the speed of reading W.

A batch-1 decode step is the weights read once: each linear layer is a matrix-vector product whose time is its
weight bytes over memory bandwidth. On CUDA a Triton kernel streams the weight rows (autotuned per shape); the
first call of each weight shape times it against cuBLAS and keeps the faster, so it can only help (`fastest`, which
the quantized products in `exporter.llm.quant` use too). Other shapes, devices and row counts use `F.linear`.

Candidates are timed as a captured decode step runs them (`measure_ms`): replayed from a CUDA graph, so launch
overhead does not count, with what they read evicted from the L2 cache before each run, so the weight comes from
memory as in a step. A gated product (fc2 reading a SwiGLU MLP's `[gate; up]`) has each kernel that computes the
gate as it reads its input twice: so, and after the activation kernel on the plain input (`activation_first`),
since computing the gate in every output tile's program can cost more than the activation kernel saves.

The choices made, and the results of the autotuned kernels registered in `TUNED`, are what
`exporter.engine.kernel_cache` keeps per engine and GPU: `remember` hands back the choices of an earlier run, so a
restart times nothing it timed before. `release_timing_buffers` frees what the timing keeps once it is over.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .parallel_compile import compile_candidates_ahead, compiling_only
from .triton_launch import dependent_launch

try:
    import triton
    import triton.language as tl

    from .triton_launch import start_dependents, wait_for_producers
except ImportError:  # no Triton (CPU-only installs): F.linear everywhere
    triton = None

# key -> the name of the candidate that was fastest for it on this device
_CHOICES: dict[tuple, str] = {}
# key_text(key) -> candidate, chosen by an earlier run on this GPU and software (`remember`)
_KNOWN: dict[str, str] = {}
# name -> a `triton.autotune`d kernel whose choices (its `cache`) are kept with the others
TUNED: dict[str, object] = {}


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None,
           gated_silu: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """`F.linear(x, weight, bias)`; a single row of `x` on CUDA goes to the faster of Triton's kernel and cuBLAS.

    `gated_silu`: `x` is a gated MLP's `[gate; up]` (`[..., 2K]`) and the product's input is `silu(gate) * up`,
    which `gated_silu(x)` computes; Triton's kernel computes it as it reads x (no kernel of its own)."""
    if not _runs_gemv(x if gated_silu is None else x.narrow(-1, 0, x.shape[-1] // 2), weight):
        return F.linear(x if gated_silu is None else gated_silu(x), weight, bias)
    if gated_silu is None:
        return fastest((weight.shape[0], weight.shape[1], weight.dtype), {
            "cublas": lambda: F.linear(x, weight, bias), "triton": lambda: _gemv(x, weight, bias)}, "cublas")
    return fastest((weight.shape[0], weight.shape[1], weight.dtype, "gated"), {
        "cublas": lambda: F.linear(gated_silu(x), weight, bias), "triton": lambda: _gemv(x, weight, bias, True),
        **activation_first({"triton": lambda h: _gemv(h, weight, bias)}, x, gated_silu)}, "cublas")


# the name prefix of a gated product's candidate that runs the activation kernel, then the plain product
ACTIVATION_FIRST = "act+"


def activation_first(products: Mapping[str, Callable[[Tensor], Tensor]], x: Tensor,
                     gated_silu: Callable[[Tensor], Tensor]) -> dict[str, Callable[[], Tensor]]:
    """Candidates of a gated product of `x` (`[gate; up]`): each of `products` (the plain product of an input)
    on `gated_silu(x)`, named `ACTIVATION_FIRST + name`."""
    return {ACTIVATION_FIRST + name: functools.partial(lambda product: product(gated_silu(x)), product)
            for name, product in products.items()}


def _runs_gemv(x: Tensor, weight: Tensor) -> bool:
    """Whether `linear` may take Triton's kernel for `x` (one row on CUDA, in the 16-bit dtype of `weight`)."""
    return (triton is not None and x.is_cuda and x.numel() == x.shape[-1] and x.shape[-1] == weight.shape[1]
            and weight.dtype in (torch.bfloat16, torch.float16) and x.dtype == weight.dtype
            and weight.is_contiguous())


def fastest(key: tuple, candidates: Mapping[str, Callable[[], Tensor]], default: str) -> Tensor:
    """Run the candidate (equivalent ways to compute one product) that was fastest the first time `key` was seen
    on this device; that first time times each of them. An unseen key inside a CUDA graph capture, where nothing
    may be timed, runs `default`; under `parallel_compile.compiles_only`, every candidate runs once (their kernels
    compiled) and `default`'s output is returned, nothing chosen."""
    choice = _CHOICES.get(key)
    if choice is None:
        known = _KNOWN.get(key_text(key))
        if known in candidates:
            choice = _CHOICES[key] = known
        elif len(candidates) == 1:
            choice = _CHOICES[key] = next(iter(candidates))
        elif compiling_only():
            return {name: run() for name, run in candidates.items()}[default]
        elif torch.cuda.is_current_stream_capturing():
            return candidates[default]()
        else:
            times = {name: measure_ms(run) for name, run in candidates.items()}
            choice = _CHOICES[key] = min(times, key=times.__getitem__)
    return candidates[choice]()


def chosen(key: tuple) -> str | None:
    """The candidate `fastest` runs for `key` on this device, once it has chosen one (None before)."""
    return _CHOICES.get(key)


def measure_ms(run: Callable[[], object], repeats: int = 20, replays: int = 5) -> float:
    """Milliseconds one `run()` takes on the current GPU as a captured decode step runs it: a CUDA graph of
    `repeats` runs, each after a read of twice the L2 cache's size has evicted what the run read before (a step
    reads each weight once, from memory; a read leaves no dirty lines to write back during the run, as zeroing a
    buffer would), less a graph of the evicting reads alone; the median of `replays` replays of both. The first
    run is eager (it tunes kernels and makes the copies a candidate reads). A run that cannot be captured is timed
    eagerly (`triton.testing.do_bench`, which overwrites the L2 cache). Under `parallel_compile.compiles_only`:
    0.0, nothing run."""
    if compiling_only():
        return 0.0
    _count_timing()
    run()
    device = torch.cuda.current_device()
    evict = _EVICT.get(device)
    if evict is None:
        size = 2 * max(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0), 64 << 20)
        evict = _EVICT[device] = torch.zeros(size // 4, dtype=torch.float32, device=torch.device("cuda", device))
    torch.cuda.synchronize()
    try:
        timed = _graph_of(lambda: (evict.sum(), run()), repeats)
        evictions = _graph_of(evict.sum, repeats)
    except RuntimeError:  # a candidate that cannot be captured
        torch.cuda.synchronize()
        return triton.testing.do_bench(run, warmup=10, rep=40)
    differences = sorted(_replay_ms(timed) - _replay_ms(evictions) for _ in range(replays))
    return max(differences[replays // 2], 0.0) / repeats


# device index -> a buffer of twice the GPU's L2 cache, read before each timed run
_EVICT: dict[int, Tensor] = {}
_TIMINGS = [0]  # candidates and autotune configurations timed in this process so far


def _count_timing() -> None:
    _TIMINGS[0] += 1


def timings() -> int:
    """How many candidates (`measure_ms`) and autotune configurations (`time_candidate`) this process has timed:
    code during which it grew chose kernels."""
    return _TIMINGS[0]


def release_timing_buffers() -> None:
    """Drop the buffers `measure_ms` reads to evict the L2 cache (twice its size a GPU, 128 MB at least), for
    when the timing is over (the scheduler's warm-up and background captures done); a later `measure_ms` (a shape
    first met later) makes its GPU's again."""
    _EVICT.clear()


def _graph_of(fn: Callable[[], object], repeats: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `repeats` calls of `fn`, captured on a side stream (another thread may use the device;
    unlike `torch.cuda.graph`, no garbage collection and no emptying of the allocator's cache each time)."""
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            for _ in range(repeats):
                fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    return graph


def _replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    """Milliseconds one replay of `graph` takes on the GPU."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def key_text(key: tuple) -> str:
    """A choice's key as text (`"4096 11008 torch.bfloat16"`), the form reports and the kernel cache use."""
    return " ".join(map(str, key))


def choices(remembered: bool = False) -> dict[str, str]:
    """Which candidate each key (weight shape and dtype, and for quantized weights the method and row bucket)
    uses, for reports; with `remembered`, also the choices handed to `remember` that this run did not use."""
    made = {key_text(key): name for key, name in list(_CHOICES.items())}  # a snapshot: another thread may add
    return {**_KNOWN, **made} if remembered else made


def remember(saved: Mapping[str, str]) -> None:
    """Take `saved` (`choices()` of an earlier run on the same GPU and software) as made: those keys are not
    timed again (a name that is not among a key's candidates is ignored, and that key timed)."""
    _KNOWN.update(saved)


# An autotune candidate is timed for 5 ms of warm-up and 25 ms of runs, not Triton's default 25 + 100 ms: on the
# H100 a first start timed ~110 candidates for 14.3 s before READY (eighth coldstart run); a candidate runs for
# 0.01-0.5 ms, so 25 ms still holds about 40 runs or more for the median the autotuner compares (Triton counts the
# runs from an estimate that includes the flush of its 256 MB buffer out of the L2 before each, ~0.1 ms).
TUNE_WARMUP_MS, TUNE_REP_MS = 5, 25


def time_candidate(kernel_call: Callable[[], object], quantiles: Sequence[float] | None) -> list[float] | float:
    """An autotune candidate's time at `quantiles`, as the autotuners' `do_bench`: Triton's benchmark over
    `TUNE_WARMUP_MS` + `TUNE_REP_MS`; zeros, nothing run, under `parallel_compile.compiles_only` (the candidates
    are compiled there, timed later)."""
    if compiling_only():
        return 0.0 if quantiles is None else [0.0] * len(quantiles)
    _count_timing()
    return triton.testing.do_bench(kernel_call, warmup=TUNE_WARMUP_MS, rep=TUNE_REP_MS, quantiles=quantiles)


def register_tuned(name: str, kernel):
    """Add a `triton.autotune`d kernel to `TUNED` (its choices are kept by the kernel cache), its candidates for a
    new autotune key compiled in parallel before they are timed (`parallel_compile`); returns it."""
    TUNED[name] = kernel
    compile_candidates_ahead(kernel)
    return kernel


def _gemv(x: Tensor, weight: Tensor, bias: Tensor | None, gated: bool = False) -> Tensor:
    """Triton's kernel on one row `x` (`gated`: `[gate; up]`, twice as wide, silu(gate) * up the input)."""
    rows, depth = weight.shape
    out = torch.empty(*x.shape[:-1], rows, dtype=x.dtype, device=x.device)
    vector = x.reshape(-1).contiguous()
    pdl = dependent_launch(x.device)
    _tuned_gemv_kernel[lambda meta: (triton.cdiv(rows, meta["BLOCK_N"]),)](
        vector, weight, bias if bias is not None else weight, out, rows, depth, HAS_BIAS=bias is not None,
        GATED=gated, PDL=pdl, launch_pdl=pdl)
    return out


if triton is not None:

    @triton.jit
    def silu_gated(gate_ptr, offsets, mask, K):
        """`silu(gate) * up` at `offsets` of a `[gate; up]` row (up K elements after gate), in float32, rounded to
        the input's dtype as the separate activation kernel's output is."""
        gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_ptr + offsets + K, mask=mask, other=0.0).to(tl.float32)
        return (gate * tl.sigmoid(gate) * up).to(gate_ptr.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _gemv_weights(w_ptr, rows, row_ok, start, K, BLOCK_K: tl.constexpr):
        """The weight tile `rows x [start, start + BLOCK_K)` in float32 (columns past K: 0)."""
        cols = start + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=row_ok[:, None] & (cols < K)[None, :],
                    other=0.0, eviction_policy="evict_first")
        return w.to(tl.float32)

    @triton.jit
    def _gemv_input(x_ptr, start, K, GATED: tl.constexpr, BLOCK_K: tl.constexpr):
        """The input's columns `[start, start + BLOCK_K)` in float32 (past K: 0)."""
        cols = start + tl.arange(0, BLOCK_K)
        if GATED:
            x = silu_gated(x_ptr, cols, cols < K, K)
        else:
            x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        return x

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
        """y[n] = sum_k W[n, k] x[k] (+ b[n]) for BLOCK_N rows per program, accumulated in float32; GATED: x is
        `[gate; up]` (2K long) and the input silu(gate) * up. PDL (launched as a dependent, `triton_launch`): the
        first weight tile is loaded before the wait for x."""
        start_dependents(PDL)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        first = 0
        if PDL:
            w = _gemv_weights(w_ptr, rows, row_ok, 0, K, BLOCK_K)
            wait_for_producers(PDL)
            acc += w * _gemv_input(x_ptr, 0, K, GATED, BLOCK_K)[None, :]
            first = BLOCK_K
        for start in range(first, K, BLOCK_K):
            acc += _gemv_weights(w_ptr, rows, row_ok, start, K, BLOCK_K) * _gemv_input(x_ptr, start, K, GATED,
                                                                                      BLOCK_K)[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)

    _tuned_gemv_kernel = register_tuned("gemv", triton.autotune(
        configs=[
            triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=warps, num_stages=stages)
            for n, k, warps, stages in (
                (4, 1024, 4, 4), (4, 2048, 8, 3), (8, 512, 4, 4), (8, 1024, 4, 3), (8, 1024, 8, 4),
                (16, 256, 4, 4), (16, 512, 4, 3), (16, 512, 8, 4), (32, 256, 4, 3), (32, 256, 8, 4),
            )
        ],
        key=["N", "K", "GATED"], do_bench=time_candidate,
    )(_gemv_kernel))
