"""Mixture-of-experts maths as Megatron-core computes it: routing and the experts' grouped products.

A token's output is `sum_j w_j * expert_{e_j}(x)` over the `k` experts its router picked. The experts' weights are
stacked, `fc1 [E, R, H]` (R = 2F, `[gate; up]`, for gated activations, else F) and `fc2 [E, H, F]`. The tokens
are grouped by expert (a stable sort of the `N*k` (token, expert) pairs) so each expert multiplies all its tokens
at once and its weights are read once per call. On CUDA (with Triton) the two products are one grouped kernel
each, with no host synchronisation, so the layer can be captured in a CUDA graph; elsewhere a loop over the
experts that have tokens runs `F.linear`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from . import moe_triton


def route(logits: Tensor, topk: int, pre_softmax: bool, score_function: str = "softmax",
          scaling_factor: float | None = None) -> tuple[Tensor, Tensor]:
    """Router logits `[N, E]` -> (weights `[N, k]` float32, experts `[N, k]` int64), as Megatron's top-k router.

    softmax, `pre_softmax`: softmax over all experts, then the k largest probabilities (not renormalised).
    softmax otherwise: the k largest logits, then their softmax (what transformers' Mixtral computes).
    sigmoid: the k largest sigmoids, divided by their sum when k > 1. `scaling_factor` multiplies the weights.
    """
    logits = logits.float()
    if score_function == "sigmoid":
        weights, experts = torch.sigmoid(logits).topk(topk, dim=-1)
        if topk > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    elif pre_softmax:
        weights, experts = logits.softmax(-1).topk(topk, dim=-1)
    else:
        top, experts = logits.topk(topk, dim=-1)
        weights = top.softmax(-1)
    if scaling_factor:
        weights = weights * scaling_factor
    return weights, experts


def expert_mlp(x: Tensor, fc1: Tensor, fc2: Tensor, weights: Tensor, experts: Tensor,
               activate: Callable[[Tensor], Tensor], use_kernel: bool | None = None) -> Tensor:
    """`sum_j weights[:, j] * fc2[e_j] · activate(fc1[e_j] · x)` for tokens `x [N, H]` and routes `[N, k]`.

    `activate` maps fc1's output `[M, R]` to `[M, F]`. `use_kernel`: run the grouped Triton kernel (default: on
    CUDA when Triton is there; on the CPU only under `TRITON_INTERPRET=1`). Returns `[N, H]` in x's dtype.
    """
    tokens, k = experts.shape
    flat = experts.flatten()
    order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert, in token order within a group
    sources = order // k
    if x.is_cuda and moe_triton.available() if use_kernel is None else use_kernel:
        counts = torch.zeros(fc1.shape[0], dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        starts = counts.cumsum(0, dtype=torch.int32) - counts
        hidden = activate(moe_triton.grouped_matmul(x, fc1, starts, counts, rows=sources, tokens=tokens))
        grouped = moe_triton.grouped_matmul(hidden, fc2, starts, counts, tokens=tokens)
    else:
        grouped = _grouped_by_loop(x[sources], fc1, fc2, torch.bincount(flat, minlength=fc1.shape[0]), activate)
    per_slot = torch.empty_like(grouped).index_copy_(0, order, grouped).view(tokens, k, -1)
    return (per_slot.float() * weights[..., None]).sum(1).to(x.dtype)


def _grouped_by_loop(rows: Tensor, fc1: Tensor, fc2: Tensor, counts: Tensor,
                     activate: Callable[[Tensor], Tensor]) -> Tensor:
    """Rows grouped by expert (`counts[e]` consecutive rows each) through their expert's MLP, one expert at a
    time (the loop reads the counts on the host)."""
    out = rows.new_empty(rows.shape[0], fc2.shape[1])
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            block = slice(start, start + count)
            out[block] = F.linear(activate(F.linear(rows[block], fc1[expert])), fc2[expert])
            start += count
    return out
