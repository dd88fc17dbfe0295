"""bf16 matrix products of 16 to 128 rows on LLaVA-1.5-7B's linear shapes: cuBLAS against a Triton split-K kernel.

The decode steps of 16 to 128 rows (and a short prefill's chunk bucket) take their bf16 products from cuBLAS
(`F.linear`; `exporter.llm.gemv` has a Triton candidate for one row only). This probe asks whether a Triton
tensor-core kernel with K split over 1 to 8 programs (a float32 buffer added to atomically, then one cast) would
read the weights faster: for each shape (qkv 12288x4096, o 4096x4096, fc1 22016x4096, fc2 4096x11008, lm_head
32000x4096) and row count it times cuBLAS and every tile shape of the kernel as the engine times its candidates
(`gemv.measure_ms`: a CUDA graph, the L2 cache evicted before each run), and prints each as a share of its roofline
(weight bytes over the copy bandwidth measured in the same run). Writes ``$OUT/skinny_probe.json``.

    python bench/skinny_probe.py                # about 100 s on an H100
    python bench/skinny_probe.py --rows 32 64 --budget-s 120
    python bench/skinny_probe.py --tiny         # tiny float32 shapes on the CPU under Triton's interpreter
"""

from __future__ import annotations

import os
import sys

if "--tiny" in sys.argv:  # Triton reads this only when first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import functools  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from exporter.llm.gemv import measure_ms  # noqa: E402

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "fc1": (22016, 4096), "fc2": (4096, 11008),
          "head": (32000, 4096)}
TINY_SHAPES = {"o": (128, 256), "fc2": (128, 344)}
# (BLOCK_N, BLOCK_K, stages, K split) tried for each row count; rows are padded to a power-of-two tile >= 16
TILES = list(itertools.product((64, 128), (64, 128, 256), (3, 4), (1, 2, 4, 8)))


@triton.jit
def _split_k_kernel(x_ptr, w_ptr, y_ptr, M, N, K, K_PER, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DIRECT: tl.constexpr):
    """y[:M, n-tile] (+)= x[:M, k-slice] @ W[n-tile, k-slice]^T; DIRECT stores in y's dtype, else adds atomically."""
    rows = tl.arange(0, BLOCK_M)
    cols_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(1) * K_PER
    k_end = tl.minimum(K, k_start + K_PER)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        cols_k = k + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rows[:, None] * K + cols_k[None, :], mask=(rows[:, None] < M) & (cols_k[None, :] < k_end),
                    other=0.0)
        b = tl.load(w_ptr + cols_n[None, :] * K + cols_k[:, None], mask=cols_k[:, None] < k_end, other=0.0,
                    eviction_policy="evict_first")
        acc = tl.dot(a, b, acc)
    out = y_ptr + rows[:, None] * N + cols_n[None, :]
    if DIRECT:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=rows[:, None] < M)
    else:
        tl.atomic_add(out, acc, mask=rows[:, None] < M, sem="relaxed")


def split_k_linear(x: torch.Tensor, weight: torch.Tensor, block_n: int, block_k: int, stages: int,
                   split: int) -> torch.Tensor:
    """`x @ weight.T` by `_split_k_kernel` (N a multiple of `block_n`)."""
    rows, depth = x.shape
    n = weight.shape[0]
    block_m = max(16, triton.next_power_of_2(rows))
    k_per = triton.cdiv(triton.cdiv(depth, block_k), split) * block_k
    grid = (n // block_n, triton.cdiv(depth, k_per))
    options = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=8 if block_m >= 128 else 4,
                   num_stages=stages)
    if grid[1] == 1:
        y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        _split_k_kernel[grid](x, weight, y, rows, n, depth, k_per, DIRECT=True, **options)
        return y
    partial = torch.zeros(rows, n, dtype=torch.float32, device=x.device)
    _split_k_kernel[grid](x, weight, partial, rows, n, depth, k_per, DIRECT=False, **options)
    return partial.to(x.dtype)


def copy_bandwidth() -> float:
    """Bytes read and written per second by a 1 GiB device copy."""
    source = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        target.copy_(source)
    end.record()
    end.synchronize()
    return 2 * 10 * source.numel() / (start.elapsed_time(end) / 1e3)


def wall_ms(run: Callable[[], object]) -> float:
    """The CPU's stand-in for `measure_ms` (--tiny: the number means nothing)."""
    started = time.perf_counter()
    run()
    return (time.perf_counter() - started) * 1e3


def probe(rows_list: list[int], budget_s: float, tiny: bool) -> dict:
    device, dtype = ("cpu", torch.float32) if tiny else ("cuda", torch.bfloat16)
    timer = wall_ms if tiny else measure_ms
    bandwidth = 1e11 if tiny else copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    deadline = time.time() + budget_s
    results = []
    torch.manual_seed(0)
    for name, (n, depth) in (TINY_SHAPES if tiny else SHAPES).items():
        weight = torch.randn(n, depth, dtype=dtype, device=device) / 64
        roofline = n * depth * 2 / bandwidth * 1e3
        for rows in rows_list:
            if time.time() > deadline:
                break
            x = torch.randn(rows, depth, dtype=dtype, device=device)
            reference = F.linear(x.float(), weight.float())
            cublas = timer(lambda: F.linear(x, weight))
            best = None
            for tile in TILES[:4] if tiny else TILES:
                if n % tile[0]:
                    continue
                try:
                    error = (split_k_linear(x, weight, *tile).float() - reference).abs().max() / reference.abs().max()
                    if error > 2e-2:
                        raise AssertionError(f"{name} {rows} rows {tile}: relative error {error:.3g}")
                    ms = timer(functools.partial(split_k_linear, x, weight, *tile))
                except triton.runtime.errors.OutOfResources:  # the tile's stages exceed shared memory
                    continue
                if best is None or ms < best[0]:
                    best = (ms, dict(zip(("block_n", "block_k", "stages", "split"), tile)))
            results.append(dict(shape=name, N=n, K=depth, rows=rows, roofline_ms=roofline, cublas_ms=cublas,
                                cublas_share=roofline / cublas, triton_ms=best[0], triton_share=roofline / best[0],
                                triton_tile=best[1]))
            print(f"{name:5s} {rows:4d} rows: cuBLAS {cublas * 1e3:6.1f} us ({roofline / cublas:.2f}), Triton "
                  f"{best[0] * 1e3:6.1f} us ({roofline / best[0]:.2f}) {best[1]}", flush=True)
        del weight
    return dict(copy_bandwidth=bandwidth, results=results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--budget-s", type=float, default=400.0, help="stop starting new shapes after this")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (Triton's interpreter)")
    args = parser.parse_args()
    result = probe([5] if args.tiny else args.rows, args.budget_s, args.tiny)
    path = os.path.join(os.environ.get("OUT", "."), "skinny_probe.json")
    with open(path, "w") as file:
        json.dump(result, file, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
