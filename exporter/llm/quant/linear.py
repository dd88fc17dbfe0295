"""`QuantLinear`: a decoder layer's linear module with its weight stored quantized (`formats.QuantLayout`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..config import QuantConfig
from .formats import QuantLayout
from .kernels import quantized_linear


class QuantLinear(nn.Module):
    """`y = x W^T (+ b)` with W held as the stored tensors of its method, under the names the engine saves
    (`weight`, `weight_scale`, `weight_zero`, `input_scale`, `bias`), so a quantized decoder loads with one
    `load_state_dict(assign=True)` like a float one. Built on the meta device, it has the stored shapes."""

    def __init__(self, in_features: int, out_features: int, bias: bool, config: QuantConfig):
        super().__init__()
        self.layout = QuantLayout.of(config, out_features, in_features)
        for name in ("weight_zero", "input_scale"):  # None unless the method stores them
            self.register_buffer(name, None)
        for name, (shape, dtype) in self.layout.shapes().items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype or torch.get_default_dtype()))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: Tensor, gated_silu: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """The product of `x`; `gated_silu`: of `silu(gate) * up` for `x` a gated MLP's `[gate; up]`
        (`quantized_linear`)."""
        return quantized_linear(x, self.layout, self.weight, self.weight_scale, self.weight_zero, self.input_scale,
                                self.bias, gated_silu)

    def extra_repr(self) -> str:
        layout = self.layout
        group = f", group={layout.group}" if layout.int4 else ""
        return f"in_features={layout.in_features}, out_features={layout.out_features}, {layout.method}{group}"
