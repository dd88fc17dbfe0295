"""SALM modality adapters (NeMo's `modality_adapter` config): features [B, D, T] + lengths -> [B, D', T'] + lengths.

Supported `_target_` classes: `ConformerEncoder` (NeMo-1 and speechlm2 SALM), `IdentityConnector(s)`
(speechlm2, NeMo-1) and `PoolingMLPConnectors` with `pooling: cat`. Others are refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .conformer import ConformerEncoder
from .errors import AudioPerceptionError


class IdentityConnector(nn.Module):
    """Passes encoder outputs through unchanged."""

    def forward(self, features: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        return features, lengths


class ConcatPooling(nn.Module):
    """Concatenates every `factor` frames along features; trailing `T % factor` frames are dropped."""

    def __init__(self, factor: int):
        super().__init__()
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        batch, time, dim = x.shape
        groups = time // self.factor
        return x[:, : groups * self.factor].reshape(batch, groups, dim * self.factor)


class MultiLayerPerceptron(nn.Module):
    """NeMo's MultiLayerPerceptron without log-softmax: `layer0` Linear, `layer1` activation, ..., last Linear."""

    def __init__(self, hidden: int, out: int, num_layers: int, activation: str):
        super().__init__()
        act = getattr(torch, activation, None)
        if not callable(act):
            raise AudioPerceptionError(f"modality_adapter activation={activation!r} is not a torch function")
        self.n_modules = 2 * num_layers - 1
        for index in range(num_layers - 1):
            self.add_module(f"layer{2 * index}", nn.Linear(hidden, hidden))
        self.add_module(f"layer{self.n_modules - 1}", nn.Linear(hidden, out))
        self.activation = act

    def forward(self, x: Tensor) -> Tensor:
        for index in range(0, self.n_modules, 2):
            x = getattr(self, f"layer{index}")(x)
            if index + 1 < self.n_modules:
                x = self.activation(x)
        return x


class PoolingMLPConnector(nn.Module):
    """PoolingMLPConnectors with `pooling: cat`: concat-pool -> Linear -> MLP; lengths floor-divided."""

    def __init__(self, input_dim: int, hidden_dim: int, output_dim: int, num_layers: int, activation: str,
                 factor: int):
        super().__init__()
        if num_layers == 1:
            hidden_dim = output_dim
        self.preprocess = nn.Sequential(ConcatPooling(factor), nn.Linear(input_dim * factor, hidden_dim))
        self.mlp = nn.Identity() if num_layers == 1 else MultiLayerPerceptron(hidden_dim, output_dim, num_layers,
                                                                               activation)
        self.factor = factor

    def forward(self, features: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        out = self.mlp(self.preprocess(features.transpose(1, 2)))
        return out.transpose(1, 2), torch.div(lengths, self.factor, rounding_mode="floor")


def build_modality_adapter(cfg: Mapping[str, Any], frontend: str, *, input_dim: int) -> tuple[nn.Module, int]:
    """The adapter for a SALM `modality_adapter` config and its output width; `input_dim` = encoder output width."""
    target = str(cfg.get("_target_", "")).rsplit(".", 1)[-1]
    if target == "ConformerEncoder":
        adapter = ConformerEncoder.from_config(cfg, frontend, feat_in=input_dim)
        return adapter, adapter.output_dim
    if target in ("IdentityConnector", "IdentityConnectors"):
        return IdentityConnector(), input_dim
    if target == "PoolingMLPConnectors":
        pooling = cfg.get("pooling", "mean")
        if pooling != "cat":
            raise AudioPerceptionError(f"PoolingMLPConnectors pooling={pooling!r} is not supported (NeMo's 'mean' "
                                       "pools over features and cannot run); use pooling: cat")
        in_dim = int(cfg.get("input_dim") or input_dim)
        out_dim = int(cfg.get("output_dim") or in_dim)
        adapter = PoolingMLPConnector(in_dim, int(cfg["hidden_dim"]), out_dim, int(cfg.get("num_layers", 2)),
                                      str(cfg.get("activation", "relu")), int(cfg.get("pooling_factor", 2)))
        return adapter, out_dim
    raise AudioPerceptionError(
        f"modality adapter {cfg.get('_target_')!r} is not supported; supported: ConformerEncoder, "
        "IdentityConnector(s), PoolingMLPConnectors (pooling: cat)"
    )
