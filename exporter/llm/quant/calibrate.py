"""AWQ's activation-aware scales for `int4_awq`, searched on calibration prompts run through the float model.

For each quantized linear module, with `x` its calibration inputs and `W` its float weight, the scale of input
channel k is `s_k = mean|x_k| ** alpha` (normalised so that `sqrt(max s * min s) = 1`), alpha from a grid over
`[0, 1)`; the alpha kept is the one whose `(x / s) Q(W s)^T` is closest to `x W^T` (mean squared error), Q being
int4 quantization and dequantization. Channels that carry large activations get their weights scaled up before
rounding, so they lose less precision; alpha = 0 is plain `int4_wo`, so no layer does worse than it on the
calibration inputs. Every layer sees the float model's activations (one forward pass, the search runs in hooks).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..config import QuantConfig
from .formats import QUANTIZED_LINEARS, QuantLayout, dequantize, quantize

if TYPE_CHECKING:
    from ..model import Decoder
    from ..tokenizer import Tokenizer

ALPHA_GRID = 20  # alpha in 0, 0.05, ..., 0.95
MAX_TOKENS = 4096  # calibration tokens run through the model
SEARCH_TOKENS = 1024  # of them, the tokens each layer's output error is measured on
ROW_TOKENS = 512  # tokens per calibration row


def calibration_prompts(calib_data: str | Path | None = None) -> list[str]:
    """The prompts of `calib_data` (a text file, one prompt per line), or the bundled ones."""
    if calib_data is None:
        text = (resources.files(__package__) / "calibration.txt").read_text(encoding="utf-8")
    else:
        path = Path(calib_data)
        if not path.is_file():
            raise ValueError(f"calib_data {path} is not a file; give a text file with one prompt per line")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"calib_data {path} is not UTF-8 text; give a text file with one prompt per "
                             "line") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"calib_data {calib_data} holds no prompts; give a text file with one prompt per line")
    return prompts


def calibration_ids(tokenizer: Tokenizer, prompts: list[str], max_len: int) -> Tensor:
    """The prompts' tokens (each after BOS) packed one after another into equal rows `[R, L]`, at most
    `MAX_TOKENS` in all, L at most `ROW_TOKENS` and `max_len`."""
    stream: list[int] = []
    for prompt in prompts:
        stream.extend(tokenizer.encode(prompt, add_bos=True))
        if len(stream) >= MAX_TOKENS:
            break
    length = min(ROW_TOKENS, max_len, len(stream))
    rows = min(len(stream), MAX_TOKENS) // length
    return torch.tensor(stream[: rows * length], dtype=torch.long).view(rows, length)


@torch.inference_mode()
def awq_scales(decoder: Decoder, ids: Tensor, config: QuantConfig) -> dict[str, Tensor]:
    """Per quantized linear module (`decoder.layers.<i>.<name>`), the input channel scales `s [K]` (float32) to
    quantize its weight with (`formats.quantize(..., channel_scale=s)`), searched on the inputs of its product
    (fc2 given fc1's `[gate; up]` and `gated_silu`: `silu(gate) * up`) while the float `decoder` runs the
    calibration `ids [R, L]`."""
    scales: dict[str, Tensor] = {}
    hooks = []
    for index, layer in enumerate(decoder.decoder.layers):
        for name in QUANTIZED_LINEARS:
            module = layer.get_submodule(name)
            key = f"decoder.layers.{index}.{name}"

            def search(module: torch.nn.Module, args: tuple[Tensor, ...], kwargs: dict, key: str = key) -> None:
                x = args[0] if kwargs.get("gated_silu") is None else kwargs["gated_silu"](args[0])
                scales[key] = search_scale(x.reshape(-1, x.shape[-1]), module.weight, config)

            hooks.append(module.register_forward_pre_hook(search, with_kwargs=True))
    try:
        decoder(decoder.embed(ids.to(decoder.device)))
    finally:
        for hook in hooks:
            hook.remove()
    return scales


def search_scale(x: Tensor, weight: Tensor, config: QuantConfig) -> Tensor:
    """The channel scales `[K]` for `weight [N, K]` given its inputs `x [T, K]` (see the module's docstring)."""
    layout = QuantLayout.of(config, *weight.shape)
    magnitude = x.float().abs().mean(dim=0).clamp(min=1e-6)
    sample = x[:: max(1, x.shape[0] // SEARCH_TOKENS)][:SEARCH_TOKENS].float()
    w = weight.float()
    reference = sample @ w.T
    best, best_error = torch.ones_like(magnitude), float("inf")
    for step in range(ALPHA_GRID):
        s = magnitude.pow(step / ALPHA_GRID)
        s = s / (s.max() * s.min()).sqrt()
        stored = quantize(w, layout, s, dtype=weight.dtype)
        effective = dequantize(layout, stored["weight"], stored["weight_scale"], stored["weight_zero"])
        output = (sample * stored["input_scale"].float()) @ effective.T
        error = (output - reference).square().mean().item()
        if error < best_error:
            best, best_error = s, error
    return best
