"""The per-row LoRA update on CUDA as two Triton kernels that add into the base output in place.

``y[m] += B[s]^T (A[s] x[m])`` for each token ``m`` whose row names slot ``s`` (``s = slots[m // T]``; 0: no
adapter, the row is neither read nor written), with ``a [S + 1, R, in]`` and ``b [S + 1, R, out]`` (scale folded
in) as :class:`exporter.llm.lora_layers.LoraSlots` holds them. Tokens are taken in blocks of ``BLOCK_M``; a block
works once per slot its rows use (one tensor-core product over the block, the other rows masked), so an adapter's
weights are read once per block rather than once per row, and a block without adapter rows exits at once.

- shrink, grid ``(blocks, K splits, slots)``: the program of slot ``s`` sums ``x A[s]^T`` over its input columns,
  up to the slot's own rank, and stores the float32 partial sums of the block's rows that use ``s`` (each row is
  written by exactly one slot's program of each split; nothing is zeroed beforehand).
- expand, grid ``(blocks, output tiles)``: sums the partials, rounds them to the model dtype (NeMo's ``linear_in``
  output), multiplies by ``B[s]`` for each slot the block uses (the padding past a slot's rank is zeros), and adds
  into ``y`` where a row has an adapter.

Nothing is gathered, scattered or zeroed outside the two kernels and nothing is synchronized with the host, so a
captured CUDA graph replays them for any mix of slots. Offsets are 32-bit: each tensor has under 2**31 elements.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: `add_lora_` is never called
    triton = None

MAX_SPLITS = 8  # input-column splits of the shrink at most (the expand sums this many partials a row)


def tiles(tokens: int, depth: int, rank: int) -> dict[str, int]:
    """Block sizes for ``tokens`` rows, ``depth`` input columns and a bank of ``rank``: rows per block, rank
    padded for the tensor cores, input columns per step and per program, output columns per program, and each
    kernel's warps (enough that neither spills registers on an H100)."""
    block_m = min(64, max(16, triton.next_power_of_2(tokens)))
    block_r = max(16, triton.next_power_of_2(rank))
    block_k = max(16, min(128, 2048 // block_r))
    per_program = max(2 * block_k, triton.next_power_of_2(triton.cdiv(depth, MAX_SPLITS)))
    return {"BLOCK_M": block_m, "BLOCK_R": block_r, "BLOCK_K": block_k, "K_PER_PROGRAM": per_program,
            "BLOCK_N": 128 if block_m <= 32 else 64, "shrink_warps": 4 if block_m <= 32 else 8, "expand_warps": 8}


def add_lora_(y: Tensor, x: Tensor, slots: Tensor, a: Tensor, b: Tensor, ranks: Tensor) -> Tensor:
    """Add each row's update to ``y [B, T, out]`` in place (and return it): ``x [B, T, in]``, ``slots [B]``
    each row's slot, ``a``/``b``/``ranks`` the bank's tensors. ``x``, ``y``, ``a`` and ``b`` are contiguous."""
    batch, per_row, depth = x.shape
    tokens, width, capacity, rank = batch * per_row, y.shape[-1], a.shape[0] - 1, a.shape[1]
    sizes = tiles(tokens, depth, rank)
    blocks = triton.cdiv(tokens, sizes["BLOCK_M"])
    splits = triton.cdiv(depth, sizes["K_PER_PROGRAM"])
    parts = torch.empty(splits, tokens, sizes["BLOCK_R"], dtype=torch.float32, device=x.device)
    _shrink_kernel[(blocks, splits, capacity)](
        x, a, slots, ranks, parts, tokens, depth, per_row, rank, BLOCK_M=sizes["BLOCK_M"], BLOCK_R=sizes["BLOCK_R"],
        BLOCK_K=sizes["BLOCK_K"], K_PER_PROGRAM=sizes["K_PER_PROGRAM"], num_warps=sizes["shrink_warps"])
    _expand_kernel[(blocks, triton.cdiv(width, sizes["BLOCK_N"]))](
        y, parts, b, slots, tokens, width, per_row, rank, capacity, SPLITS=splits,
        BLOCK_M=sizes["BLOCK_M"], BLOCK_R=sizes["BLOCK_R"], BLOCK_N=sizes["BLOCK_N"],
        num_warps=sizes["expand_warps"])
    return y


if triton is not None:

    @triton.jit
    def _shrink_kernel(x_ptr, a_ptr, slot_ptr, rank_ptr, part_ptr, M, K, T, R, BLOCK_M: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, K_PER_PROGRAM: tl.constexpr):
        """part[split, m] = A[s] x[m] over this split's input columns, for the block's rows ``m`` of slot ``s``."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        split = tl.program_id(1)
        slot = tl.program_id(2) + 1
        row_ok = rows < M
        uses = (tl.load(slot_ptr + rows // T, mask=row_ok, other=0) == slot) & row_ok
        if tl.max(uses.to(tl.int32), axis=0) == 0:
            return
        r = tl.arange(0, BLOCK_R)
        r_ok = r < tl.load(rank_ptr + slot)
        a_slot = a_ptr + slot * R * K
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for step in range(0, K_PER_PROGRAM, BLOCK_K):
            cols = split * K_PER_PROGRAM + step + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            x = tl.load(x_ptr + rows[:, None] * K + cols[None, :],
                        mask=uses[:, None] & col_ok[None, :], other=0.0)
            a = tl.load(a_slot + r[None, :] * K + cols[:, None], mask=r_ok[None, :] & col_ok[:, None], other=0.0)
            acc = tl.dot(x, a, acc)
        tl.store(part_ptr + (split * M + rows[:, None]) * BLOCK_R + r[None, :], acc,
                 mask=uses[:, None])

    @triton.jit
    def _expand_kernel(y_ptr, part_ptr, b_ptr, slot_ptr, M, N, T, R, S, SPLITS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
        """y[m] += B[s]^T (the partials' sum in the model dtype) for BLOCK_N output columns of the block's rows;
        rows without an adapter are neither read nor written."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        slots = tl.load(slot_ptr + rows // T, mask=row_ok, other=0)
        adapted = row_ok & (slots != 0)
        if tl.max(adapted.to(tl.int32), axis=0) == 0:
            return
        r = tl.arange(0, BLOCK_R)
        down = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for split in tl.static_range(SPLITS):
            down += tl.load(part_ptr + (split * M + rows[:, None]) * BLOCK_R + r[None, :],
                            mask=adapted[:, None], other=0.0)
        down = down.to(y_ptr.dtype.element_ty)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        where = rows[:, None] * N + cols[None, :]
        keep = adapted[:, None] & col_ok[None, :]
        y = tl.load(y_ptr + where, mask=keep, other=0.0)  # issued before the products, its latency hidden
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # The slots from the block's lowest to its highest; B of a slot no row uses is masked off (not read). No
        # branch in the loop, so Triton's pipeliner issues the next slot's B loads during this slot's product.
        first = tl.min(tl.where(adapted, slots, S + 1), axis=0)
        for slot in range(first, tl.max(slots, axis=0) + 1):
            uses = slots == slot
            live = tl.max(uses.to(tl.int32), axis=0)  # 1 when a row uses this slot, else 0: no rank rows read
            b = tl.load(b_ptr + slot * R * N + r[:, None] * N + cols[None, :],
                        mask=(r[:, None] < R * live) & col_ok[None, :], other=0.0)
            acc = tl.dot(tl.where(uses[:, None], down, 0.0).to(b.dtype), b, acc)
        tl.store(y_ptr + where, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=keep)
