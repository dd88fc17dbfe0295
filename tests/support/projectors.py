"""NeMo's multimodal projectors written by hand, the references the perception is checked against: linear,
mlpNx_gelu, identity and mlp_downsample, whose 2x2 merge is an explicit loop over windows (independent of the
exporter's reshape code)."""

from __future__ import annotations

import math

import torch


def gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU, the erf form."""
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last axis."""
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def downsample_by_windows(x: torch.Tensor) -> torch.Tensor:
    """NeMo's DownSampleBlock on `[B, s*s, D]` (row-major grids), one 2x2 window at a time.

    An odd grid gets a zero row and column at the end. Output token ``i * h + j`` (``i`` = column pair, ``j`` =
    row pair, ``h`` = half the side) holds cells (2j, 2i), (2j, 2i+1), (2j+1, 2i), (2j+1, 2i+1) in that order.
    """
    batch, tokens, dim = x.shape
    side = math.isqrt(tokens)
    padded = side + side % 2
    grid = torch.zeros(batch, padded, padded, dim, dtype=x.dtype)
    grid[:, :side, :side] = x.reshape(batch, side, side, dim)
    half = padded // 2
    out = torch.empty(batch, half * half, 4 * dim, dtype=x.dtype)
    for i in range(half):  # column pair: the outer (slow) index of the output, as NeMo's transposed grid
        for j in range(half):  # row pair
            cells = [
                grid[:, 2 * j, 2 * i],
                grid[:, 2 * j, 2 * i + 1],
                grid[:, 2 * j + 1, 2 * i],
                grid[:, 2 * j + 1, 2 * i + 1],
            ]
            out[:, i * half + j] = torch.cat(cells, dim=-1)
    return out


def project(kind: str, weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The projector `kind` on features `x` (`[T, D]` or `[B, T, D]`) from its NeMo weights, named below
    ``mm_projector.`` (``0.weight``, ...)."""
    if kind == "identity":
        return x
    if kind == "linear":
        return x @ weights["weight"].T + weights["bias"]
    if kind == "mlp_downsample":
        merged = downsample_by_windows(x if x.dim() == 3 else x[None])
        merged = merged if x.dim() == 3 else merged[0]
        hidden = layer_norm(merged, weights["1.weight"], weights["1.bias"])
        return gelu(hidden @ weights["2.weight"].T + weights["2.bias"]) @ weights["4.weight"].T + weights["4.bias"]
    depth = int(kind[3])  # mlp<depth>x_gelu
    x = x @ weights["0.weight"].T + weights["0.bias"]
    for index in range(2, 2 * depth, 2):
        x = gelu(x) @ weights[f"{index}.weight"].T + weights[f"{index}.bias"]
    return x
