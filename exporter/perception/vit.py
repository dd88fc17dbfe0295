"""The CLIP / SigLIP vision transformer of a served engine, built from its config and weights alone.

Serving reads an engine's tower with these modules instead of transformers' model classes (whose import is slow
and pulls in more packages): the same computation up to the last kept encoder layer, whose output is the image
feature. Module and weight names are transformers' (without `vision_model.`), so an engine's `tower.*` weights
load as they are. The modules are built on the meta device and take the given tensors as their parameters
(``load_state_dict(assign=True)``), so weights loaded onto the GPU are never copied through the host.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..meta_device import on_meta

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
_IGNORED = ("embeddings.position_ids", "head.")  # a buffer some versions save; SigLIP's pooling head (unused)


class _Embeddings(nn.Module):
    def __init__(self, channels: int, hidden: int, patch: int, image: int, class_token: bool):
        super().__init__()
        self.patch_embedding = nn.Conv2d(channels, hidden, patch, stride=patch, bias=not class_token)
        positions = (image // patch) ** 2 + class_token
        self.class_embedding = nn.Parameter(torch.empty(hidden)) if class_token else None
        self.position_embedding = nn.Embedding(positions, hidden)

    def forward(self, pixels: Tensor) -> Tensor:
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [B, grid², H]
        if self.class_embedding is not None:
            patches = torch.cat([self.class_embedding.expand(patches.shape[0], 1, -1), patches], 1)  # traceable batch
        return patches + self.position_embedding.weight


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        batch, tokens, hidden = x.shape
        q, k, v = (proj(x).view(batch, tokens, self.heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(hidden // self.heads))
        return self.out_proj(out.transpose(1, 2).reshape(batch, tokens, hidden))


class _Mlp(nn.Module):
    def __init__(self, hidden: int, intermediate: int, activation: str):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, intermediate), nn.Linear(intermediate, hidden)
        self.activation = _ACTIVATIONS[activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.activation(self.fc1(x)))


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, activation: str, eps: float):
        super().__init__()
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(hidden, eps=eps), nn.LayerNorm(hidden, eps=eps)
        self.self_attn = _Attention(hidden, heads)
        self.mlp = _Mlp(hidden, intermediate, activation)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Module):
    def __init__(self, layers: list[_Layer]):
        super().__init__()
        self.layers = nn.ModuleList(layers)


class VisionTransformer(nn.Module):
    """A CLIP (class token, pre-norm) or SigLIP vision tower: ``forward(pixels [B, 3, S, S])`` is the output of
    its last encoder layer ``[B, tokens, hidden]`` (what transformers' ``encoder(...).last_hidden_state`` is)."""

    def __init__(self, tower_type: str, config: Mapping[str, Any], layers: int):
        super().__init__()
        hidden, eps = int(config["hidden_size"]), float(config.get("layer_norm_eps", 1e-5))
        activation = config.get("hidden_act", "quick_gelu" if tower_type == "clip" else "gelu_pytorch_tanh")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"vision tower activation {activation!r} is not one of {sorted(_ACTIVATIONS)}")
        clip = tower_type == "clip"
        self.embeddings = _Embeddings(int(config.get("num_channels", 3)), hidden, int(config["patch_size"]),
                                      int(config["image_size"]), class_token=clip)
        self.pre_layrnorm = nn.LayerNorm(hidden, eps=eps) if clip else None
        self.encoder = _Encoder([_Layer(hidden, int(config["num_attention_heads"]),
                                        int(config["intermediate_size"]), activation, eps) for _ in range(layers)])
        self.post_layernorm = nn.LayerNorm(hidden, eps=eps)  # kept with the weights, not part of the feature

    @classmethod
    def from_weights(cls, tower_type: str, config: Mapping[str, Any], weights: Mapping[str, Tensor],
                     dtype: torch.dtype) -> VisionTransformer:
        """The tower holding ``weights`` (transformers' names without ``vision_model.``; the layers they have),
        on their device in ``dtype``; a missing or extra weight is a ValueError naming it."""
        kept = {name: tensor for name, tensor in weights.items() if not name.startswith(_IGNORED)}
        layers = len({name.split(".")[2] for name in kept if name.startswith("encoder.layers.")})
        with on_meta():
            tower = cls(tower_type, config, layers)
        expected = set(tower.state_dict())
        missing, extra = sorted(expected - set(kept)), sorted(set(kept) - expected)
        if missing or extra:
            raise ValueError(f"vision tower weights do not match the {tower_type} config: missing {missing[:8]}, "
                             f"unexpected {extra[:8]}")
        try:
            tower.load_state_dict({name: tensor.to(dtype) for name, tensor in kept.items()}, assign=True)
        except RuntimeError as error:  # a shape that does not match the config
            details = "; ".join(str(error).splitlines()[1:4])
            raise ValueError(f"vision tower weights do not match the {tower_type} config: {details}") from None
        return tower.eval().requires_grad_(False)

    def forward(self, pixels: Tensor) -> Tensor:
        hidden = self.embeddings(pixels)
        if self.pre_layrnorm is not None:
            hidden = self.pre_layrnorm(hidden)
        for layer in self.encoder.layers:
            hidden = layer(hidden)
        return hidden
