"""Quantize a decoder's canonical weights at export: the layers' QKV, proj, fc1 and fc2 weights, one at a time."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import Tensor

from ..config import DecoderConfig, QuantConfig
from ..model import Decoder
from ..tokenizer import Tokenizer
from .calibrate import awq_scales, calibration_ids, calibration_prompts
from .formats import QUANTIZED_LINEARS, QuantLayout, quantize


def quantize_decoder_weights(config: DecoderConfig, weights: dict[str, Tensor], quantization: QuantConfig,
                             calibration_ids: Tensor | None = None,
                             device: torch.device | str | None = None) -> DecoderConfig:
    """Replace, in `weights` (canonical names, model dtype), each layer linear weight by its stored quantized
    tensors, and return the config that records the method (a `Decoder` built from it loads the result).

    Each weight is quantized on `device` (default: where it is) and comes back to where it was, so only one float
    weight at a time is copied. `int4_awq` first runs the float model on `calibration_ids [R, L]` on `device`
    (which then holds a float copy of the decoder while it calibrates)."""
    if config.num_moe_experts:
        raise ValueError("quantization covers dense layers only, and this checkpoint's MLPs are mixtures of "
                         f"{config.num_moe_experts} experts; export it without quantization")
    channel_scales: dict[str, Tensor] = {}
    if quantization.method == "int4_awq":
        if calibration_ids is None:
            raise ValueError("int4_awq needs calibration prompts")
        float_model = Decoder.from_state_dict(config, weights, device=device)
        channel_scales = awq_scales(float_model, calibration_ids, quantization)
        del float_model
    for index in range(config.num_layers):
        for name in QUANTIZED_LINEARS:
            prefix = f"decoder.layers.{index}.{name}."
            weight = weights.pop(prefix + "weight")
            layout = QuantLayout.of(quantization, *weight.shape)
            scale = channel_scales.get(prefix[:-1])
            stored = quantize(weight.to(device), layout, None if scale is None else scale.to(device))
            weights.update({prefix + suffix: tensor.to(weight.device) for suffix, tensor in stored.items()})
            del weight
    return dataclasses.replace(config, quantization=quantization)


@dataclasses.dataclass(frozen=True)
class ExportQuantization:
    """An export's quantization request, checked before anything is read: the method, the calibration prompts
    (`int4_awq`: the `calib_data` file's, else the bundled ones) and the device that quantizes."""

    config: QuantConfig
    prompts: tuple[str, ...] = ()
    device: str = "cpu"

    @classmethod
    def from_options(cls, method: str, calib_data: str | Path | None = None,
                     device: str = "cpu") -> ExportQuantization:
        if calib_data is not None and method != "int4_awq":
            raise ValueError(f"calib_data is used by quantization int4_awq only (quantization is {method})")
        config = QuantConfig(method)
        prompts = tuple(calibration_prompts(calib_data)) if method == "int4_awq" else ()
        return cls(config, prompts, device)

    def apply(self, config: DecoderConfig, weights: dict[str, Tensor], tokenizer: Tokenizer) -> DecoderConfig:
        """`quantize_decoder_weights` with the calibration prompts tokenized by the model's tokenizer."""
        ids = calibration_ids(tokenizer, list(self.prompts), config.max_position_embeddings) if self.prompts else None
        return quantize_decoder_weights(config, weights, self.config, ids, self.device)
