"""The decoder's elementwise work between two matrix products on CUDA, one Triton kernel each
(`exporter.llm.model` calls them; its own functions are the op-by-op reference and the CPU path).

- `norm`: LayerNorm (weight and bias) or RMSNorm of each token's row, optionally after the residual add
  `x + delta` (the sum rounded to the model dtype, then normalised), zero-centred γ (γ-1 stored) or not; one
  program a row holding the whole row (`NORM_BLOCK_LIMIT`: wider rows run op by op).
- `split_heads`: NeMo's fused QKV output into queries and keys/values, NeoX RoPE on the first `rotary_dim` dims
  (or none), and the keys and values written to a cache layer at each token's (row, position) or (block, offset),
  through the cache's strides (the contiguous static cache and the paged pool's head-major transposed view alike),
  a float8 cache storing `clamp(kv / kv_scale, ±FP8_MAX)`; one program a (token, KV group).
- `activate`: `act(gate) * up` of a `[gate; up]` row or `act(h)`, for SiLU, ReLU, squared ReLU and GELU (erf or
  tanh); a program a (token, block of 1024 columns).

Each computes in float32 and rounds where the op-by-op code rounds (the residual sum, RoPE's output, the
activation before the gate's product), so a float32 model matches it to float32 rounding and a 16-bit one to
within one rounding step. Nothing reads a host value, and the token count N is the grid's size (a program a
token), not a kernel argument (only the split's value offset, N rows of keys, is one, which Triton specialises by
its divisibility by 16 alone), so one compiled kernel serves every N and every launch can be captured in a CUDA
graph. Block sizes and warps follow the shape (no autotuning: nothing is timed at start-up); the compiled
kernels are kept in Triton's on-disk cache (`exporter.engine.kernel_cache`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .paged_attention import FP8_MAX
from .triton_launch import dependent_launch

try:
    import triton
    import triton.language as tl

    from .triton_launch import start_dependents, wait_for_producers
except ImportError:  # no Triton: the decoder runs its op-by-op functions
    triton = None

NORM_BLOCK_LIMIT = 16384  # the widest row (padded to a power of two) one norm program holds
ACTIVATION_BLOCK = 1024  # columns per activation program
ACTIVATIONS = {"swiglu": 0, "reglu": 1, "squared-relu": 2, "gelu": 3, "geglu": 3, "openai-gelu": 4}  # kernel code
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def available() -> bool:
    """Whether the kernels can run (Triton is importable)."""
    return triton is not None


def fits_norm(x: Tensor) -> bool:
    """Whether `norm` takes rows `x [N, H]` (a float dtype, unit stride along H, H within one program's block)."""
    return x.dtype in _FLOAT_DTYPES and x.stride(-1) == 1 and triton.next_power_of_2(x.shape[-1]) <= NORM_BLOCK_LIMIT


def fits(x: Tensor) -> bool:
    """Whether `split_heads` and `activate` take `x [N, ...]` (a float dtype, unit stride along the last dim)."""
    return x.dtype in _FLOAT_DTYPES and x.stride(-1) == 1


def norm(x: Tensor, delta: Tensor | None, weight: Tensor, bias: Tensor | None, eps: float,
         zero_centered: bool) -> tuple[Tensor, Tensor]:
    """`(s, norm(s))` for `s = x + delta` (rounded to x's dtype; `s` is `x` itself without `delta`) of rows
    `[N, H]`: LayerNorm with `bias`, else RMSNorm, γ = weight (+ 1 where `zero_centered`), in float32."""
    tokens, width = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    total = x if delta is None else torch.empty_like(out)
    if tokens:
        block = triton.next_power_of_2(width)
        pdl = dependent_launch(x.device)
        _fused_norm_kernel[(tokens,)](
            x, x if delta is None else delta, total, weight, weight if bias is None else bias, out, width,
            x.stride(0), 0 if delta is None else delta.stride(0), eps, RESIDUAL=delta is not None,
            LAYERNORM=bias is not None, ZERO_CENTERED=zero_centered, BLOCK=block, PDL=pdl,
            num_warps=min(16, max(1, block // 512)), launch_pdl=pdl)
    return total, out


def split_heads(qkv: Tensor, cos: Tensor | None, sin: Tensor | None, cache_layer: Tensor | None,
                cache_rows: Tensor | None, cache_positions: Tensor | None, kv_scale: Tensor | None, groups: int,
                q_per_group: int, rotary_dim: int) -> tuple[Tensor, Tensor]:
    """`exporter.llm.model._split_heads` in one kernel: queries `[N, heads, d]` and keys/values `[2, N, groups, d]`
    of `qkv [N, groups*(q_per_group+2)*d]`, written to `cache_layer` (any strides) too where given."""
    tokens = qkv.shape[0]
    dim = qkv.shape[1] // (groups * (q_per_group + 2))
    q = torch.empty(tokens, groups * q_per_group, dim, dtype=qkv.dtype, device=qkv.device)
    kv = torch.empty(2, tokens, groups, dim, dtype=qkv.dtype, device=qkv.device)
    if not tokens:
        return q, kv
    rotary = cos is not None
    cache = cache_layer is not None
    scaled = kv_scale is not None
    if rotary:  # the angles and the slots are read with unit strides (no copy where they have them already)
        cos, sin = cos.contiguous(), sin.contiguous()
    if cache:
        cache_rows, cache_positions = cache_rows.contiguous(), cache_positions.contiguous()
    cache_strides = cache_layer.stride() if cache else (0,) * 5
    pdl = dependent_launch(qkv.device)
    _fused_split_heads_kernel[(tokens, groups)](
        qkv, cos if rotary else qkv, sin if rotary else qkv, q, kv, cache_layer if cache else qkv,
        cache_rows if cache else qkv, cache_positions if cache else qkv, kv_scale if scaled else qkv,
        qkv.stride(0), cos.stride(0) if rotary else 0, sin.stride(0) if rotary else 0, kv.stride(0),
        *cache_strides, kv_scale.stride(0) if scaled else 0, kv_scale.stride(2) if scaled else 0, FP8_MAX,
        QPG=q_per_group, DIM=dim, ROTARY=rotary_dim if rotary else 0, CACHE=cache, SCALED=scaled,
        BLOCK_Q=triton.next_power_of_2(q_per_group), BLOCK_D=triton.next_power_of_2(dim), PDL=pdl,
        num_warps=4 if q_per_group * dim >= 2048 else 1 if q_per_group * dim <= 256 else 2, launch_pdl=pdl)
    return q, kv


def activate(h: Tensor, activation: str, gated: bool, gelu_approximation: str) -> Tensor:
    """`act(gate) * up` of rows `h [N, 2F]` (`[gate; up]`), or `act(h)` of `[N, F]`; GELU ("gelu", "geglu") with
    `gelu_approximation` ("none": erf, "tanh"), "openai-gelu" always tanh."""
    tokens = h.shape[0]
    width = h.shape[1] // 2 if gated else h.shape[1]
    code = ACTIVATIONS[activation]
    if code == 3 and gelu_approximation == "tanh":
        code = 4
    out = torch.empty(tokens, width, dtype=h.dtype, device=h.device)
    if tokens and width:
        pdl = dependent_launch(h.device)
        _fused_activate_kernel[(tokens, triton.cdiv(width, ACTIVATION_BLOCK))](
            h, out, width, h.stride(0), ACTIVATION=code, GATED=gated, BLOCK=ACTIVATION_BLOCK, PDL=pdl, num_warps=4,
            launch_pdl=pdl)
    return out


if triton is not None:

    @triton.jit
    def _fused_norm_kernel(x_ptr, delta_ptr, total_ptr, w_ptr, b_ptr, out_ptr, H, x_stride, delta_stride, eps,
                           RESIDUAL: tl.constexpr, LAYERNORM: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                           BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """One row: (x + delta, rounded) and its norm, in float32, rounded to the input's dtype. PDL: launched as
        a dependent (`triton_launch`), γ is read before the wait."""
        start_dependents(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < H
        gamma = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        wait_for_producers(PDL)
        x = tl.load(x_ptr + row * x_stride + cols, mask=inside, other=0.0)
        if RESIDUAL:
            delta = tl.load(delta_ptr + row * delta_stride + cols, mask=inside, other=0.0)
            x = (x.to(tl.float32) + delta.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(total_ptr + row * H + cols, x, mask=inside)
        x = x.to(tl.float32)
        if ZERO_CENTERED:
            gamma = gamma + 1.0
        if LAYERNORM:
            mean = tl.sum(x, axis=0) / H
            centred = tl.where(inside, x - mean, 0.0)
            variance = tl.sum(centred * centred, axis=0) / H
            beta = tl.load(b_ptr + cols, mask=inside, other=0.0).to(tl.float32)
            out = centred * tl.math.rsqrt(variance + eps) * gamma + beta
        else:
            out = x * tl.math.rsqrt(tl.sum(x * x, axis=0) / H + eps) * gamma
        tl.store(out_ptr + row * H + cols, out.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _rotated(x, partner, cos, sin, sign, rotary_lanes):
        """NeoX RoPE of the rotary lanes of `x` (`partner`: the lane half a rotary width away), rounded to x's
        dtype; the other lanes unchanged."""
        rotated = x.to(tl.float32) * cos + sign * partner.to(tl.float32) * sin
        return tl.where(rotary_lanes, rotated.to(x.dtype), x)

    @triton.jit
    def _fused_split_heads_kernel(
            qkv_ptr, cos_ptr, sin_ptr, q_ptr, kv_ptr, cache_ptr, rows_ptr, positions_ptr, scale_ptr,
            qkv_stride, cos_stride, sin_stride, kv_stride,
            cache_kv_stride, cache_row_stride, cache_position_stride, cache_head_stride, cache_dim_stride,
            scale_kv_stride, scale_head_stride, FP8_MAX,
            QPG: tl.constexpr, DIM: tl.constexpr, ROTARY: tl.constexpr, CACHE: tl.constexpr, SCALED: tl.constexpr,
            BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
        """One token's KV group: its QPG query heads, key and value (rows `[q.., k, v]` of `DIM` each). PDL:
        launched as a dependent (`triton_launch`), it waits first."""
        start_dependents(PDL)
        wait_for_producers(PDL)
        token = tl.program_id(0).to(tl.int64)
        group = tl.program_id(1)
        groups = tl.num_programs(1)
        dims = tl.arange(0, BLOCK_D)
        heads = tl.arange(0, BLOCK_Q)
        dim_ok = dims < DIM
        q_ok = (heads < QPG)[:, None] & dim_ok[None, :]
        base = qkv_ptr + token * qkv_stride + group * ((QPG + 2) * DIM)
        q_offsets = heads[:, None] * DIM + dims[None, :]
        q = tl.load(base + q_offsets, mask=q_ok, other=0.0)
        k = tl.load(base + QPG * DIM + dims, mask=dim_ok, other=0.0)
        v = tl.load(base + (QPG + 1) * DIM + dims, mask=dim_ok, other=0.0)
        if ROTARY > 0:
            half: tl.constexpr = ROTARY // 2
            rotary_lanes = dims < ROTARY
            first_half = dims < half
            partner = tl.where(first_half, dims + half, dims - half)
            sign = tl.where(first_half, -1.0, 1.0)
            cos = tl.load(cos_ptr + token * cos_stride + dims, mask=rotary_lanes, other=1.0)
            sin = tl.load(sin_ptr + token * sin_stride + dims, mask=rotary_lanes, other=0.0)
            q_partner = tl.load(base + heads[:, None] * DIM + partner[None, :],
                                mask=q_ok & rotary_lanes[None, :], other=0.0)
            q = _rotated(q, q_partner, cos[None, :], sin[None, :], sign[None, :], rotary_lanes[None, :])
            k_partner = tl.load(base + QPG * DIM + partner, mask=rotary_lanes, other=0.0)
            k = _rotated(k, k_partner, cos, sin, sign, rotary_lanes)
        tl.store(q_ptr + (token * groups + group) * (QPG * DIM) + q_offsets, q, mask=q_ok)
        kv_out = kv_ptr + (token * groups + group) * DIM + dims
        tl.store(kv_out, k, mask=dim_ok)
        tl.store(kv_out + kv_stride, v, mask=dim_ok)
        if CACHE:
            row = tl.load(rows_ptr + token).to(tl.int64)
            position = tl.load(positions_ptr + token).to(tl.int64)
            slot = (cache_ptr + row * cache_row_stride + position * cache_position_stride
                    + group * cache_head_stride + dims * cache_dim_stride)
            if SCALED:  # float8: the value over its KV head's scale, clamped to the largest finite value
                k_scale = tl.load(scale_ptr + group * scale_head_stride)
                v_scale = tl.load(scale_ptr + scale_kv_stride + group * scale_head_stride)
                k = tl.minimum(tl.maximum(tl.div_rn(k.to(tl.float32), k_scale), -FP8_MAX), FP8_MAX)
                v = tl.minimum(tl.maximum(tl.div_rn(v.to(tl.float32), v_scale), -FP8_MAX), FP8_MAX)
            tl.store(slot, k.to(cache_ptr.dtype.element_ty), mask=dim_ok)
            tl.store(slot + cache_kv_stride, v.to(cache_ptr.dtype.element_ty), mask=dim_ok)

    @triton.jit
    def _activation(x, ACTIVATION: tl.constexpr):
        """The activation of float32 `x`: 0 SiLU, 1 ReLU, 2 squared ReLU, 3 GELU (erf), 4 GELU (tanh, written
        with 0.5·(1 + tanh(z)) = sigmoid(2z))."""
        if ACTIVATION == 0:
            return x * tl.sigmoid(x)
        elif ACTIVATION == 1:
            return tl.maximum(x, 0.0)
        elif ACTIVATION == 2:
            return tl.maximum(x, 0.0) * tl.maximum(x, 0.0)
        elif ACTIVATION == 3:
            return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
        else:
            inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            return x * tl.sigmoid(2.0 * inner)

    @triton.jit
    def _fused_activate_kernel(h_ptr, out_ptr, F, h_stride, ACTIVATION: tl.constexpr, GATED: tl.constexpr,
                               BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """One token's block of output columns: act(gate) rounded to the dtype, times up where GATED. PDL:
        launched as a dependent (`triton_launch`), it waits first."""
        start_dependents(PDL)
        wait_for_producers(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < F
        gate = tl.load(h_ptr + row * h_stride + cols, mask=inside, other=0.0)
        out = _activation(gate.to(tl.float32), ACTIVATION).to(gate.dtype)
        if GATED:
            up = tl.load(h_ptr + row * h_stride + F + cols, mask=inside, other=0.0)
            out = (out.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
        tl.store(out_ptr + row * F + cols, out, mask=inside)
