"""Matrix products with quantized weights: `y = x W^T (+ b)` where W is stored as `formats.QuantLayout` says.

On CUDA (with Triton) each product has candidates, and the first call of each (method, weight shape, dtype, row
bucket) times them and keeps the fastest (`gemv.fastest`), so a candidate can only help:

- `fused`: one Triton kernel dequantizes each weight tile in registers and multiplies it. Up to 8 rows (decode)
  it accumulates with FMAs, streaming the weight at memory speed; more rows use tensor cores (`tl.dot`). Autotuned
  per (N, K, group, rows) over a wide space of tile shapes.
- `dequant`: a Triton kernel writes the whole weight in the activation dtype, then cuBLAS multiplies.
- `scaled_mm` (FP8 weights on GPUs with FP8, sm_89+): activations are quantized to e4m3 per row on the fly and
  `torch._scaled_mm` runs the product on FP8 tensor cores (per-row activation and per-channel weight scales).

Everywhere else (CPU, no Triton) the reference runs: `formats.dequantize`, then `F.linear`. Nothing here syncs
with the host once a key's choice is made (made outside graph capture: the capture's warm-up runs come first), so
all of it can be captured in CUDA graphs.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from ..gemv import fastest, register_tuned
from .formats import FP8_MAX, QuantLayout, dequantize

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (CPU-only installs): the reference everywhere
    triton = None

DECODE_ROWS = 8  # up to this many rows the fused kernel accumulates with FMAs; more use tensor cores


def quantized_linear(x: Tensor, layout: QuantLayout, weight: Tensor, scale: Tensor, zero: Tensor | None = None,
                     input_scale: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    """`x [..., K]` times the stored weight (the tensors `formats.quantize` made), plus `bias`: `[..., N]`."""
    if triton is None or not x.is_cuda:
        return reference_linear(x, layout, weight, scale, zero, input_scale, bias)
    flat = x.reshape(-1, layout.in_features)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    rows = flat.shape[0]
    fp8_gpu = _has_fp8(x.device.index if x.device.index is not None else torch.cuda.current_device())
    triton_reads_weight = layout.method != "fp8" or fp8_gpu  # Triton converts float8 e4m3 on sm_89+ only
    candidates = {"dequant": lambda: _dequant_linear(flat, layout, weight, scale, zero, input_scale, bias,
                                                     on_device=triton_reads_weight)}
    if triton_reads_weight:
        candidates["fused"] = lambda: fused_linear(flat, layout, weight, scale, zero, input_scale, bias)
    if (layout.method == "fp8" and fp8_gpu and x.dtype == torch.bfloat16
            and layout.in_features % 16 == 0 and layout.out_features % 16 == 0):
        candidates["scaled_mm"] = lambda: _fp8_scaled_mm(flat, weight, scale, bias)
    key = (layout.method, layout.out_features, layout.in_features, layout.group, x.dtype, _row_bucket(rows))
    return fastest(key, candidates, "dequant").view(*x.shape[:-1], layout.out_features)


def reference_linear(x: Tensor, layout: QuantLayout, weight: Tensor, scale: Tensor, zero: Tensor | None = None,
                     input_scale: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    """Dequantize, then `F.linear` in the activation dtype: the CPU path and what the kernels must equal."""
    if input_scale is not None:
        x = x * input_scale
    return F.linear(x, dequantize(layout, weight, scale, zero, x.dtype), bias)


def fused_linear(x: Tensor, layout: QuantLayout, weight: Tensor, scale: Tensor, zero: Tensor | None = None,
                 input_scale: Tensor | None = None, bias: Tensor | None = None,
                 config: dict[str, int] | None = None) -> Tensor:
    """The fused Triton kernel on `x [M, K]` (contiguous). `config` (BLOCK_N, BLOCK_K, and BLOCK_M above 8 rows)
    runs one tile shape instead of the autotuned choice: for tests, also under `TRITON_INTERPRET=1` on CPU."""
    rows, n, k = x.shape[0], layout.out_features, layout.in_features
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    dot = rows > DECODE_ROWS
    arguments = dict(
        INT4=layout.int4, G=layout.group or 1, HAS_INPUT_SCALE=input_scale is not None, HAS_BIAS=bias is not None,
        DOT=dot, PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    if not dot:
        arguments["BLOCK_M"] = triton.next_power_of_2(rows)
    dummy = scale
    tensors = (x, weight, scale, dummy if zero is None else zero, dummy if input_scale is None else input_scale,
               dummy if bias is None else bias, out)
    sizes = (rows, n, k, weight.shape[1], layout.groups, _row_bucket(rows))
    if config is None:
        kernel = _tuned_mm_kernel if dot else _tuned_mv_kernel
    else:
        kernel, arguments = _qlinear_kernel, arguments | config
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(rows, meta["BLOCK_M"]))  # noqa: E731
    kernel[grid](*tensors, *sizes, **arguments)
    return out


def dequantize_on_device(layout: QuantLayout, weight: Tensor, scale: Tensor, zero: Tensor | None,
                         dtype: torch.dtype) -> Tensor:
    """`formats.dequantize` as one Triton kernel (CUDA, or CPU under `TRITON_INTERPRET=1`)."""
    n, k = layout.out_features, layout.in_features
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    block_n, block_k = 32, layout.group or 256  # an int4 tile is one group
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        weight, scale, scale if zero is None else zero, out, n, k, weight.shape[1], layout.groups,
        INT4=layout.int4, G=layout.group or 1, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def _dequant_linear(x: Tensor, layout: QuantLayout, weight: Tensor, scale: Tensor, zero: Tensor | None,
                    input_scale: Tensor | None, bias: Tensor | None, on_device: bool = True) -> Tensor:
    """Dequantize the whole weight (by the Triton kernel, or by torch), then `F.linear` (cuBLAS)."""
    if not on_device:
        return reference_linear(x, layout, weight, scale, zero, input_scale, bias)
    if input_scale is not None:
        x = x * input_scale
    return F.linear(x, dequantize_on_device(layout, weight, scale, zero, x.dtype), bias)


def _fp8_scaled_mm(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    x_scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    x_fp8 = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=scale.float()[None, :], out_dtype=x.dtype)
    return out if bias is None else out + bias


@functools.cache
def _has_fp8(device_index: int) -> bool:
    """Whether the GPU computes with float8 e4m3 (Ada and Hopper, sm_89 and later)."""
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def _row_bucket(rows: int) -> int:
    """Rows rounded up to a power of two: products in one bucket share a timing choice and an autotuned tile."""
    return 1 << max(rows - 1, 0).bit_length()


if triton is not None:

    @triton.jit
    def _int4_tiles(w_ptr, s_ptr, z_ptr, rows, row_ok, k, W_STRIDE, NG, G: tl.constexpr, SUB: tl.constexpr):
        """Weight rows `rows` x columns `[k, k + SUB)`, inside one group (SUB <= G), dequantized to float32 and
        split by parity: the even columns (low nibbles) and the odd ones (high nibbles), each `[rows, SUB // 2]`.
        The group's scale and zero are one value a row, broadcast along the columns."""
        half = k // 2 + tl.arange(0, SUB // 2)
        packed = tl.load(w_ptr + rows[:, None] * W_STRIDE + half[None, :],
                         mask=row_ok[:, None] & (half < W_STRIDE)[None, :], other=0, eviction_policy="evict_first")
        group = k // G + 0 * rows  # the group of every row (a vector, for the mask)
        offsets = rows * NG + group
        group_ok = row_ok & (group < NG)  # a tile may reach past the last group
        s = tl.load(s_ptr + offsets, mask=group_ok, other=0.0).to(tl.float32)[:, None]
        z = tl.load(z_ptr + offsets, mask=group_ok, other=0.0).to(tl.float32)[:, None]
        low = ((packed & 15).to(tl.float32) - z) * s
        high = ((packed >> 4).to(tl.float32) - z) * s
        return low, high

    @triton.jit
    def _channel_tile(w_ptr, rows, row_ok, cols, col_ok, W_STRIDE):
        """Weight rows `rows` x columns `cols` of an int8 or fp8 weight in float32, unscaled (the per-row scale
        multiplies the finished product)."""
        return tl.load(w_ptr + rows[:, None] * W_STRIDE + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                       other=0.0, eviction_policy="evict_first").to(tl.float32)

    @triton.jit
    def _activations(x_ptr, xs_ptr, tokens, token_ok, cols, col_ok, K, HAS_INPUT_SCALE: tl.constexpr):
        """x[tokens, cols] in float32, times AWQ's input scale of each column."""
        x = tl.load(x_ptr + tokens[:, None] * K + cols[None, :], mask=token_ok[:, None] & col_ok[None, :],
                    other=0.0).to(tl.float32)
        if HAS_INPUT_SCALE:
            x = x * tl.load(xs_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        return x

    @triton.jit
    def _qlinear_kernel(x_ptr, w_ptr, s_ptr, z_ptr, xs_ptr, b_ptr, y_ptr, M, N, K, W_STRIDE, NG, M_BUCKET,
                        INT4: tl.constexpr, G: tl.constexpr, HAS_INPUT_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                        DOT: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
        """y[m, n] = sum_k x[m, k] (* xs[k]) W[n, k] (+ b[n]) for a BLOCK_M x BLOCK_N tile, in float32.

        DOT: tensor-core products of each dequantized tile (BLOCK_M >= 16), its operands rounded to the activation
        dtype as the reference's are; otherwise FMAs into a per-thread accumulator reduced once at the end (few
        rows: the weight read dominates). int4 tiles are multiplied as their even and odd columns. M_BUCKET only
        keys the autotuning."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        tokens = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < N
        token_ok = tokens < M
        dtype = x_ptr.dtype.element_ty
        if INT4:  # a tile is taken one group (or one part of a group) at a time: SUB columns
            if BLOCK_K >= G:
                SUB: tl.constexpr = G
            else:
                SUB: tl.constexpr = BLOCK_K
            WIDTH: tl.constexpr = SUB // 2
        else:
            WIDTH: tl.constexpr = BLOCK_K
        if DOT:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N, WIDTH), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if INT4:
                for part in tl.static_range(BLOCK_K // SUB):
                    k = k0 + part * SUB
                    even = k + 2 * tl.arange(0, SUB // 2)
                    x_even = _activations(x_ptr, xs_ptr, tokens, token_ok, even, even < K, K, HAS_INPUT_SCALE)
                    x_odd = _activations(x_ptr, xs_ptr, tokens, token_ok, even + 1, even + 1 < K, K, HAS_INPUT_SCALE)
                    low, high = _int4_tiles(w_ptr, s_ptr, z_ptr, rows, row_ok, k, W_STRIDE, NG, G, SUB)
                    if DOT:
                        acc = tl.dot(x_even.to(dtype), tl.trans(low.to(dtype)), acc, input_precision=PRECISION)
                        acc = tl.dot(x_odd.to(dtype), tl.trans(high.to(dtype)), acc, input_precision=PRECISION)
                    else:
                        acc += low[None, :, :] * x_even[:, None, :] + high[None, :, :] * x_odd[:, None, :]
            else:
                cols = k0 + tl.arange(0, BLOCK_K)
                x = _activations(x_ptr, xs_ptr, tokens, token_ok, cols, cols < K, K, HAS_INPUT_SCALE)
                w = _channel_tile(w_ptr, rows, row_ok, cols, cols < K, W_STRIDE)
                if DOT:
                    acc = tl.dot(x.to(dtype), tl.trans(w.to(dtype)), acc, input_precision=PRECISION)
                else:
                    acc += w[None, :, :] * x[:, None, :]
        if DOT:
            y = acc
        else:
            y = tl.sum(acc, axis=2)
        if not INT4:
            y = y * tl.load(s_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + tokens[:, None] * N + rows[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=token_ok[:, None] & row_ok[None, :])

    @triton.jit
    def _dequantize_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, W_STRIDE, NG, INT4: tl.constexpr, G: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[n, k] = W[n, k] in out's dtype, for a BLOCK_N x BLOCK_K tile."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(1) * BLOCK_K
        row_ok = rows < N
        out_rows = out_ptr + rows[:, None] * K
        if INT4:  # BLOCK_K <= G: the tile lies inside one group
            low, high = _int4_tiles(w_ptr, s_ptr, z_ptr, rows, row_ok, k0, W_STRIDE, NG, G, BLOCK_K)
            even = k0 + 2 * tl.arange(0, BLOCK_K // 2)
            tl.store(out_rows + even[None, :], low.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & (even < K)[None, :])
            tl.store(out_rows + even[None, :] + 1, high.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & (even + 1 < K)[None, :])
        else:
            cols = k0 + tl.arange(0, BLOCK_K)
            w = _channel_tile(w_ptr, rows, row_ok, cols, cols < K, W_STRIDE)
            w = w * tl.load(s_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(out_rows + cols[None, :], w.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & (cols < K)[None, :])

    def _bench(kernel_call, quantiles):
        return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)

    def _fits_registers(configs, named_args, **kwargs):
        """FMA tiles whose accumulator stays within 128 float32 registers a thread at this BLOCK_M (an int4 tile
        accumulates one group of byte columns at a time), and int4 tiles of at most 8 groups (each group is
        unrolled)."""
        rows, group = kwargs.get("BLOCK_M", 1), kwargs.get("G", 1)
        kept = []
        for config in configs:
            block_n, block_k = config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"]
            width = min(block_k, group) // 2 if kwargs.get("INT4") else block_k
            if rows * block_n * width <= 128 * 32 * config.num_warps and (not kwargs.get("INT4") or
                                                                          block_k <= 8 * group):
                kept.append(config)
        return kept or configs[:1]

    def _fits_rows(configs, named_args, **kwargs):
        """Tensor-core tiles no taller than the rows (rounded up to a power of two, at least 16)."""
        bucket = named_args.get("M_BUCKET", kwargs.get("M_BUCKET", 16))
        kept = [c for c in configs if c.kwargs["BLOCK_M"] <= max(16, bucket)]
        return kept or configs[:1]

    _AUTOTUNE_KEY = ["N", "K", "G", "HAS_INPUT_SCALE"]
    _tuned_mv_kernel = register_tuned("quant_mv", triton.autotune(
        configs=[
            triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=warps, num_stages=stages)
            for n, k, warps, stages in (
                (2, 1024, 4, 3), (2, 2048, 8, 3), (4, 512, 4, 3), (4, 1024, 4, 3), (4, 1024, 8, 4), (8, 256, 4, 4),
                (8, 512, 4, 3), (8, 1024, 8, 3), (16, 256, 4, 3), (16, 256, 8, 4), (16, 512, 8, 3), (32, 128, 4, 4),
                (32, 256, 8, 3), (64, 128, 8, 3),
            )
        ],
        key=[*_AUTOTUNE_KEY, "BLOCK_M"],
        prune_configs_by={"early_config_prune": _fits_registers},
        do_bench=_bench,
    )(_qlinear_kernel))
    _tuned_mm_kernel = register_tuned("quant_mm", triton.autotune(
        configs=[
            triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=warps, num_stages=stages)
            for m, n, k, warps, stages in (
                (16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (32, 64, 128, 4, 4), (32, 128, 128, 4, 3),
                (64, 64, 128, 4, 3), (64, 128, 64, 4, 4), (64, 128, 128, 8, 3), (128, 128, 64, 8, 3),
                (128, 128, 128, 8, 3), (128, 256, 64, 8, 3),
            )
        ],
        key=[*_AUTOTUNE_KEY, "M_BUCKET"],
        prune_configs_by={"early_config_prune": _fits_rows},
        do_bench=_bench,
    )(_qlinear_kernel))
