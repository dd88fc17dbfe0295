"""The one-row matrix product of batch-1 decoding, `x [1, K] @ W[N, K]^T`, at the speed of reading W.

A batch-1 decode step is the weights read once: each linear layer is a matrix-vector product whose time is its
weight bytes over memory bandwidth. On CUDA a Triton kernel streams the weight rows (autotuned per shape); the
first call of each weight shape times it against cuBLAS and keeps the faster, so it can only help. Other shapes,
devices and row counts use `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (CPU-only installs): F.linear everywhere
    triton = None

# (N, K, dtype) -> whether the Triton kernel beat cuBLAS on this device
_CHOICES: dict[tuple[int, int, torch.dtype], bool] = {}


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)`; a single row of `x` on CUDA goes to the faster of Triton's kernel and cuBLAS."""
    if triton is None or not x.is_cuda or x.numel() != x.shape[-1] or weight.dtype not in (torch.bfloat16,
                                                                                            torch.float16):
        return F.linear(x, weight, bias)
    key = (weight.shape[0], weight.shape[1], weight.dtype)
    if key not in _CHOICES:
        if torch.cuda.is_current_stream_capturing():  # no timing inside a capture: keep cuBLAS
            return F.linear(x, weight, bias)
        _CHOICES[key] = _triton_is_faster(x, weight, bias)
    return _gemv(x, weight, bias) if _CHOICES[key] else F.linear(x, weight, bias)


def choices() -> dict[str, str]:
    """Which kernel each weight shape uses, for reports: `"NxK dtype" -> "triton" | "cublas"`."""
    return {f"{n}x{k} {dtype}": "triton" if fast else "cublas" for (n, k, dtype), fast in _CHOICES.items()}


def _triton_is_faster(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    if not weight.is_contiguous() or x.dtype != weight.dtype:
        return False
    ours = triton.testing.do_bench(lambda: _gemv(x, weight, bias), warmup=10, rep=40)
    theirs = triton.testing.do_bench(lambda: F.linear(x, weight, bias), warmup=10, rep=40)
    return ours < theirs


def _gemv(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    rows, depth = weight.shape
    out = torch.empty(*x.shape[:-1], rows, dtype=x.dtype, device=x.device)
    vector = x.reshape(depth).contiguous()
    _tuned_gemv_kernel[lambda meta: (triton.cdiv(rows, meta["BLOCK_N"]),)](
        vector, weight, bias if bias is not None else weight, out, rows, depth, HAS_BIAS=bias is not None)
    return out


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        """y[n] = sum_k W[n, k] x[k] (+ b[n]) for BLOCK_N rows per program, accumulated in float32."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                        other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptr + cols, mask=col_ok, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)

    _tuned_gemv_kernel = triton.autotune(
        configs=[
            triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=warps, num_stages=stages)
            for n, k, warps, stages in (
                (4, 1024, 4, 4), (4, 2048, 8, 3), (8, 512, 4, 4), (8, 1024, 4, 3), (8, 1024, 8, 4),
                (16, 256, 4, 4), (16, 512, 4, 3), (16, 512, 8, 4), (32, 256, 4, 3), (32, 256, 8, 4),
            )
        ],
        key=["N", "K"],
    )(_gemv_kernel)
