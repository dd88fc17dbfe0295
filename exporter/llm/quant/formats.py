"""How one linear layer's weight is stored quantized, and the torch reference of quantizing and dequantizing it.

Every method stores `weight` (the quantized values) and `weight_scale`; int4 adds `weight_zero`, AWQ `input_scale`:

- `int8_wo`: `weight` int8 `[N, K]`, `weight_scale` `[N]`; `W = weight * scale` (symmetric, per output channel).
- `fp8`: `weight` float8 e4m3 `[N, K]`, `weight_scale` `[N]`; `W = weight * scale` (per output channel).
- `int4_wo`, `int4_awq`: `weight` uint8 `[N, Kp / 2]`, two 4-bit values per byte (column `2j` in the low nibble,
  `2j + 1` in the high one), `weight_scale` and `weight_zero` `[N, Kp / G]`; `W = (q - zero) * scale` per group of
  G columns (asymmetric: min and max of each group map to 0 and 15). Kp is K rounded up to a multiple of G; the
  padded columns hold zeros and meet no input. `int4_awq` also stores `input_scale` `[K]`: the layer computes
  `(x * input_scale) W^T`, its weight having been quantized as `W / input_scale` (activation-aware scaling).

Scales and zero points have the model dtype. Dequantizing computes in float32 and rounds once to the target dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import INT4_GROUP_SIZES, QuantConfig

# The decoder layers' linear modules that are quantized (the embedding and the output head are not).
QUANTIZED_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
FP8_MAX = 448.0  # the largest float8 e4m3 value
_STORED_DTYPES = {"int8_wo": torch.int8, "fp8": torch.float8_e4m3fn, "int4_wo": torch.uint8, "int4_awq": torch.uint8}


def group_size_for(in_features: int, preferred: int) -> int:
    """The int4 group for a layer of `in_features` inputs: the largest of 128/64/32, at most `preferred`, that
    divides it; else 32 (the weight is then zero-padded to a multiple of 32)."""
    for size in INT4_GROUP_SIZES:
        if size <= preferred and in_features % size == 0:
            return size
    return INT4_GROUP_SIZES[-1]


@dataclass(frozen=True)
class QuantLayout:
    """The stored form of one `[out_features, in_features]` weight under a method (the group is per layer)."""

    method: str
    out_features: int
    in_features: int
    group: int | None = None

    @classmethod
    def of(cls, config: QuantConfig, out_features: int, in_features: int) -> QuantLayout:
        group = group_size_for(in_features, config.group_size) if config.group_size else None
        return cls(config.method, out_features, in_features, group)

    @property
    def int4(self) -> bool:
        return self.group is not None

    @property
    def padded_in_features(self) -> int:
        """K rounded up to a whole number of groups (int4), else K."""
        return -(-self.in_features // self.group) * self.group if self.int4 else self.in_features

    @property
    def groups(self) -> int:
        return self.padded_in_features // self.group if self.int4 else 1

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        """Stored tensor name -> (shape, dtype); dtype None means the model dtype."""
        n = self.out_features
        if not self.int4:
            return {"weight": ((n, self.in_features), _STORED_DTYPES[self.method]), "weight_scale": ((n,), None)}
        shapes = {"weight": ((n, self.padded_in_features // 2), torch.uint8), "weight_scale": ((n, self.groups), None),
                  "weight_zero": ((n, self.groups), None)}
        if self.method == "int4_awq":
            shapes["input_scale"] = ((self.in_features,), None)
        return shapes


def quantize(weight: Tensor, layout: QuantLayout, channel_scale: Tensor | None = None,
             dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """The stored tensors of `weight [N, K]` (on its device). `channel_scale [K]` (int4_awq, required there):
    quantize `weight * channel_scale` and store `input_scale = 1 / channel_scale`. Scales get `dtype` (default
    the weight's); the values are rounded against the stored scales, so dequantizing reproduces them."""
    if tuple(weight.shape) != (layout.out_features, layout.in_features):
        raise ValueError(f"weight of shape {tuple(weight.shape)} does not match the layout "
                         f"[{layout.out_features}, {layout.in_features}]")
    if (channel_scale is not None) != (layout.method == "int4_awq"):
        raise ValueError("channel_scale is required by int4_awq and taken by no other method")
    dtype = dtype or weight.dtype
    tiny = torch.finfo(dtype).tiny
    w = weight.float()
    stored: dict[str, Tensor] = {}
    if channel_scale is not None:
        w = w * channel_scale.float()
        stored["input_scale"] = (1.0 / channel_scale.float()).to(dtype)
    if layout.method == "int8_wo":
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=tiny).to(dtype)
        stored["weight"] = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
        stored["weight_scale"] = scale
    elif layout.method == "fp8":
        scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=tiny).to(dtype)
        stored["weight"] = (w / scale.float()[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        stored["weight_scale"] = scale
    else:
        n, padded = layout.out_features, layout.padded_in_features
        if padded > layout.in_features:
            w = torch.nn.functional.pad(w, (0, padded - layout.in_features))
        grouped = w.view(n, layout.groups, layout.group)
        low, high = grouped.amin(dim=2), grouped.amax(dim=2)
        scale = ((high - low) / 15.0).clamp(min=tiny).to(dtype)
        zero = (-low / scale.float()).to(dtype)
        q = torch.round(grouped / scale.float()[..., None] + zero.float()[..., None]).clamp(0, 15).to(torch.uint8)
        q = q.view(n, padded)
        stored["weight"] = q[:, 0::2] | (q[:, 1::2] << 4)
        stored["weight_scale"], stored["weight_zero"] = scale, zero
    return stored


def dequantize(layout: QuantLayout, weight: Tensor, scale: Tensor, zero: Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> Tensor:
    """The `[N, K]` weight the stored tensors stand for (without AWQ's input scale), in `dtype`."""
    if not layout.int4:
        return (weight.float() * scale.float()[:, None]).to(dtype)
    n = layout.out_features
    q = torch.stack([weight & 15, weight >> 4], dim=-1).view(n, layout.groups, layout.group).float()
    w = (q - zero.float()[..., None]) * scale.float()[..., None]
    return w.view(n, layout.padded_in_features)[:, : layout.in_features].to(dtype)
