"""Multimodal projectors (NeMo `mm_cfg.mm_mlp_adapter_type`) that map vision features to the LLM width."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import torch
from torch import nn
from torch.nn import functional as F

from ..meta_device import on_meta

PROJECTOR_PREFIX = "embedding.word_embeddings.adapter_layer.mm_projector_adapter.mm_projector."
SUPPORTED_PROJECTORS = ("linear", "mlp{N}x_gelu (e.g. mlp2x_gelu)", "mlp_downsample", "identity")
_MLP_GELU = re.compile(r"^mlp(\d+)x_gelu$")


class ProjectorError(ValueError):
    """The projector type or its weights do not fit the checkpoint."""


class DownSampleBlock(nn.Module):
    """Merges each 2x2 window of a square token grid into one token with 4x the channels.

    Input `[B, s*s, D]` (row-major grid). An odd grid gets one zero row and one zero column at the end.
    The output `[B, (s'/2)^2, 4D]` follows NeMo's order: token `(i, j)` (i = column pair, j = row pair) at
    index `i * s'/2 + j` holds the channels of grid cells `(2j, 2i), (2j, 2i+1), (2j+1, 2i), (2j+1, 2i+1)`.
    """

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        _batch, tokens, channels = features.shape
        side = math.isqrt(tokens)
        if side * side != tokens:
            raise ProjectorError(f"mlp_downsample needs a square token grid, got {tokens} tokens")
        grid = features.reshape(-1, side, side, channels)
        if side % 2:
            grid = F.pad(grid, (0, 0, 0, 1, 0, 1))
            side += 1
        half = side // 2
        grid = grid.reshape(-1, side, half, 2 * channels).transpose(1, 2)
        return grid.reshape(-1, half * half, 4 * channels)


def downsampled_tokens(tokens: int) -> int:
    """Token count after `DownSampleBlock` for a square grid of `tokens` tokens."""
    side = math.isqrt(tokens)
    if side * side != tokens:
        raise ProjectorError(
            f"mlp_downsample needs a square token grid, got {tokens} tokens; with a CLIP tower use "
            "vision_select_feature: patch so the class token is dropped"
        )
    return ((side + 1) // 2) ** 2


def build_projector(adapter_type: str, vision_hidden_size: int, llm_hidden_size: int) -> nn.Module:
    """An untrained projector of NeMo's layout for `adapter_type` (weights loaded separately)."""
    if adapter_type == "linear":
        return nn.Linear(vision_hidden_size, llm_hidden_size)
    if adapter_type == "identity":
        if vision_hidden_size != llm_hidden_size:
            raise ProjectorError(
                f"identity projector needs vision hidden size ({vision_hidden_size}) == LLM hidden size "
                f"({llm_hidden_size}); check mm_cfg.vision_encoder.hidden_size"
            )
        return nn.Identity()
    if adapter_type == "mlp_downsample":
        merged = 4 * vision_hidden_size
        return nn.Sequential(
            DownSampleBlock(),
            nn.LayerNorm(merged),
            nn.Linear(merged, llm_hidden_size),
            nn.GELU(),
            nn.Linear(llm_hidden_size, llm_hidden_size),
        )
    match = _MLP_GELU.match(adapter_type or "")
    if match and int(match.group(1)) >= 1:
        layers: list[nn.Module] = [nn.Linear(vision_hidden_size, llm_hidden_size)]
        for _ in range(int(match.group(1)) - 1):
            layers += [nn.GELU(), nn.Linear(llm_hidden_size, llm_hidden_size)]
        return nn.Sequential(*layers)
    raise ProjectorError(
        f"unknown mm_cfg.mm_mlp_adapter_type {adapter_type!r}; supported: {', '.join(SUPPORTED_PROJECTORS)}"
    )


def projector_weights(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The projector tensors of a canonical state dict, keyed by their names inside the projector."""
    return {k[len(PROJECTOR_PREFIX) :]: state_dict[k] for k in state_dict if k.startswith(PROJECTOR_PREFIX)}


def load_projector_weights(
    projector: nn.Module, weights: Mapping[str, torch.Tensor], adapter_type: str, dtype: torch.dtype | None = None
) -> None:
    """Strictly gives `projector` the tensors of `weights` (names inside the projector) as its parameters, in
    `dtype` (None: theirs); clear error otherwise. The tensors are assigned, not copied: a projector built on the
    meta device ends up on their device, holding them once."""
    expected = projector.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ProjectorError(
            f"projector weights do not fit mm_mlp_adapter_type {adapter_type!r}: "
            f"missing {[PROJECTOR_PREFIX + k for k in missing]}, "
            f"unexpected {[PROJECTOR_PREFIX + k for k in unexpected]}"
        )
    for name, tensor in expected.items():
        if tuple(weights[name].shape) != tuple(tensor.shape):
            raise ProjectorError(
                f"projector weight {PROJECTOR_PREFIX + name} has shape {tuple(weights[name].shape)}, "
                f"expected {tuple(tensor.shape)} from mm_cfg.vision_encoder.hidden_size and the LLM "
                "hidden_size"
            )
    projector.load_state_dict({k: weights[k].to(dtype or weights[k].dtype) for k in expected}, assign=True)


def projector_from_weights(adapter_type: str, vision_hidden_size: int, llm_hidden_size: int,
                           weights: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> nn.Module:
    """The projector for `adapter_type` holding `weights` (names inside the projector) in `dtype`, built on the
    meta device (no initialisation, no second copy of the weights), in eval mode without gradients."""
    with on_meta():
        projector = build_projector(adapter_type, vision_hidden_size, llm_hidden_size)
    load_projector_weights(projector, weights, adapter_type, dtype)
    return projector.eval().requires_grad_(False)


def load_projector(
    adapter_type: str,
    vision_hidden_size: int,
    llm_hidden_size: int,
    state_dict: Mapping[str, torch.Tensor],
) -> nn.Module:
    """The projector holding the canonical keys of `state_dict` (`projector_from_weights`)."""
    return projector_from_weights(adapter_type, vision_hidden_size, llm_hidden_size, projector_weights(state_dict))
