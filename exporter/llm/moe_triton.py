"""The experts' matrix products of a mixture-of-experts layer on CUDA: one grouped Triton kernel for all experts.

Rows are grouped by expert: expert e owns rows `[starts[e], starts[e] + counts[e])` of the output, and row r
multiplies input row `rows[r]` (a gather: fc1 reads the tokens where they are) or row r (fc2 reads fc1's
grouped output). The grid is static, `(experts x tiles, column blocks)` with enough tiles for one expert to own
every token, and a program whose tile is past its expert's count does nothing: an expert no token chose is never
read, and no count goes to the host, so the call can be captured in a CUDA graph.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from .gemv import register_tuned, time_candidate

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the experts run through the loop in exporter.llm.moe
    triton = None


def available() -> bool:
    """Whether the Triton kernel can run (Triton is importable)."""
    return triton is not None


def grouped_matmul(a: Tensor, weight: Tensor, starts: Tensor, counts: Tensor, *, tokens: int,
                   rows: Tensor | None = None) -> Tensor:
    """`out[r] = a[rows[r]] @ weight[e].T` (or `a[r]` without `rows`) for every row r of expert e.

    a: `[*, K]`; weight: `[E, N, K]`; starts, counts: `[E]` int32 on a's device, the rows of each expert;
    rows: `[M]` source rows (a gather), else `M = a.shape[0]`; tokens: no expert owns more rows than this (the
    static grid's size). Returns `[M, N]` in a's dtype, accumulated in float32.
    """
    experts, columns, depth = weight.shape
    a, weight = a.contiguous(), weight.contiguous()
    out = a.new_empty(rows.numel() if rows is not None else a.shape[0], columns)
    block_m = 16 if tokens <= 16 else 32 if tokens <= 64 else 64
    tiles = triton.cdiv(tokens, block_m)

    def grid(meta):
        return experts * tiles, triton.cdiv(columns, meta["BLOCK_N"])

    _tuned_kernel[grid](
        a, rows if rows is not None else counts, weight, out, starts, counts, columns, depth, tiles,
        a.stride(0), weight.stride(0), out.stride(0), GATHER=rows is not None, BLOCK_M=block_m,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )
    return out


if triton is not None:

    @triton.jit
    def _grouped_matmul_kernel(a_ptr, rows_ptr, w_ptr, out_ptr, starts_ptr, counts_ptr, N, K, tiles,
                               stride_a, stride_we, stride_out, GATHER: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        """One (expert, row tile) x column block of the grouped product, accumulated in float32."""
        expert = tl.program_id(0) // tiles
        first = (tl.program_id(0) % tiles) * BLOCK_M
        count = tl.load(counts_ptr + expert)
        if first < count:
            offsets = first + tl.arange(0, BLOCK_M)
            row_ok = offsets < count
            out_rows = tl.load(starts_ptr + expert) + offsets
            if GATHER:
                src = tl.load(rows_ptr + out_rows, mask=row_ok, other=0)
            else:
                src = out_rows
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            w_rows = w_ptr + expert.to(tl.int64) * stride_we + cols[:, None].to(tl.int64) * K
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for start in range(0, K, BLOCK_K):
                depth = start + tl.arange(0, BLOCK_K)
                depth_ok = depth < K
                a = tl.load(a_ptr + src[:, None].to(tl.int64) * stride_a + depth[None, :],
                            mask=row_ok[:, None] & depth_ok[None, :], other=0.0)
                w = tl.load(w_rows + depth[None, :], mask=col_ok[:, None] & depth_ok[None, :], other=0.0)
                acc += tl.dot(a, tl.trans(w), input_precision=PRECISION)
            tl.store(out_ptr + out_rows[:, None].to(tl.int64) * stride_out + cols[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    _CONFIGS = [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=warps, num_stages=stages)
        for n, k, warps, stages in ((64, 64, 4, 3), (32, 128, 4, 4), (64, 128, 4, 4), (128, 64, 4, 3),
                                    (128, 128, 8, 3), (16, 256, 4, 4))
    ]
    # The interpreter (TRITON_INTERPRET=1, CPU checks) cannot time configurations: it runs the first.
    _tuned_kernel = register_tuned("moe_grouped", triton.autotune(
        configs=_CONFIGS[:1] if os.environ.get("TRITON_INTERPRET") == "1" else _CONFIGS,
        key=["N", "K", "BLOCK_M"], do_bench=time_candidate,
    )(_grouped_matmul_kernel))
