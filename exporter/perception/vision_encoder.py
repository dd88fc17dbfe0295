"""`VisionEncoder`: pixels `[B,3,S,S]` -> LLM-width features `[B,N,H_llm]`; rebuildable from spec + weights.

Feature semantics follow NeMo training (`encode_vision_x`):
`hidden_states[vision_select_layer]` of the HF tower, minus `class_token_length` tokens when
`vision_select_feature == "patch"` (CLIP only: SigLIP has no class token), then the projector.
The tower is trimmed to the selected layer, so later layers are never computed.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .image_preprocess import DEFAULT_MAX_IMAGE_PIXELS, ImagePreprocessor
from .projector import downsampled_tokens, load_projector, projector_from_weights
from .vision_tower import build_vision_tower, strip_hf_prefix
from .vit import VisionTransformer

SPEC_FORMAT = "nemo-mm-vision-encoder/1"
SELECT_FEATURES = ("patch", "cls_patch")


class VisionEncoderError(ValueError):
    """The multimodal config cannot describe a working vision encoder."""


def _tokens_per_image(spec: Mapping[str, Any]) -> int:
    grid = spec["image_size"] // spec["patch_size"]
    tokens = grid * grid + (1 if spec["tower"]["type"] == "clip" else 0) - spec["dropped_tokens"]
    return downsampled_tokens(tokens) if spec["projector"]["type"] == "mlp_downsample" else tokens


class VisionEncoder(nn.Module):
    """Vision tower (`vit.VisionTransformer`, trimmed to the feature layer) + token selection + NeMo projector."""

    def __init__(self, tower: VisionTransformer, projector: nn.Module, spec: Mapping[str, Any]):
        super().__init__()
        self.tower = tower
        self.projector = projector
        self._spec = copy.deepcopy(dict(spec))
        self._spec["tokens_per_image"] = _tokens_per_image(self._spec)

    @property
    def tokens_per_image(self) -> int:
        """Feature vectors produced per image (N)."""
        return self._spec["tokens_per_image"]

    @property
    def image_size(self) -> int:
        return self._spec["image_size"]

    @property
    def llm_hidden_size(self) -> int:
        return self._spec["projector"]["llm_hidden_size"]

    @property
    def dtype(self) -> torch.dtype:
        return next(self.tower.parameters()).dtype

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """`[B, 3, S, S]` pixels -> `[B, tokens_per_image, llm_hidden_size]` features."""
        hidden = self.tower(pixels.to(self.dtype))
        return self.projector(hidden[:, self._spec["dropped_tokens"] :])

    def spec(self) -> dict[str, Any]:
        """JSON-serialisable description: tower, token selection, projector, preprocessing."""
        return copy.deepcopy(self._spec)

    def preprocessor(self, **overrides: Any) -> ImagePreprocessor:
        """The image preprocessing this encoder was trained with (`overrides`, e.g. max_image_pixels, win)."""
        return ImagePreprocessor.from_spec(self._spec["preprocess"], **overrides)

    def state_dict_for_engine(self) -> dict[str, torch.Tensor]:
        """Weights to save next to `spec()`: `tower.<HF name without vision_model.>`, `projector.<name>`."""
        tower = strip_hf_prefix(self.tower.state_dict())
        weights = {f"tower.{k}": v.contiguous() for k, v in tower.items()}
        weights.update({f"projector.{k}": v.contiguous() for k, v in self.projector.state_dict().items()})
        return weights

    @classmethod
    def from_spec(
        cls,
        spec: Mapping[str, Any],
        state_dict: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype | None = None,
    ) -> VisionEncoder:
        """Rebuilds an encoder from `spec()` and `state_dict_for_engine()` (no checkpoint, no network).

        `dtype` defaults to the dtype of the stored weights.
        """
        if spec.get("format") != SPEC_FORMAT:
            raise VisionEncoderError(
                f"vision encoder spec format {spec.get('format')!r} is not {SPEC_FORMAT!r}"
            )
        tower_weights = {k[len("tower.") :]: v for k, v in state_dict.items() if k.startswith("tower.")}
        projector_weights = {
            k[len("projector.") :]: v for k, v in state_dict.items() if k.startswith("projector.")
        }
        if not tower_weights:
            raise VisionEncoderError("the vision encoder weights have no tower.* tensors")
        dtype = dtype or next(iter(tower_weights.values())).dtype
        try:
            tower = VisionTransformer.from_weights(spec["tower"]["type"], spec["tower"]["config"], tower_weights,
                                                   dtype)
        except ValueError as error:
            raise VisionEncoderError(str(error)) from None
        projector_spec = spec["projector"]
        projector = projector_from_weights(projector_spec["type"], projector_spec["vision_hidden_size"],
                                           projector_spec["llm_hidden_size"], projector_weights, dtype)
        return cls(tower, projector, spec)


def build_vision_encoder(
    model_cfg: Any,
    state_dict: Mapping[str, torch.Tensor],
    vision_tower_path: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> VisionEncoder:
    """The vision encoder of a NeMo multimodal model from its config (`mm_cfg`, `data`, `hidden_size`) and
    canonical state dict; the tower comes from the checkpoint or a local folder (see `vision_tower`)."""
    mm_cfg = model_cfg.get("mm_cfg")
    if mm_cfg is None:
        raise VisionEncoderError("the model config has no mm_cfg section (not a multimodal NeMo model)")
    vision_cfg = mm_cfg.get("vision_encoder") or {}
    select_layer = vision_cfg.get("vision_select_layer")
    select_layer = -2 if select_layer is None else int(select_layer)
    select_feature = vision_cfg.get("vision_select_feature") or "patch"
    if select_feature not in SELECT_FEATURES:
        raise VisionEncoderError(
            f"mm_cfg.vision_encoder.vision_select_feature {select_feature!r} is not one of {SELECT_FEATURES}"
        )
    class_tokens = vision_cfg.get("class_token_length")
    class_tokens = 1 if class_tokens is None else int(class_tokens)
    llm_hidden = model_cfg.get("hidden_size")
    if llm_hidden is None:
        raise VisionEncoderError("the model config has no hidden_size (the LLM width the projector maps to)")

    tower = build_vision_tower(
        mm_cfg,
        state_dict,
        vision_tower_path,
        select_layer=select_layer,
        dtype=dtype,
    )
    tower_hidden = int(tower.hf_config["hidden_size"])
    vision_hidden = int(vision_cfg.get("hidden_size") or tower_hidden)
    if vision_hidden != tower_hidden:
        raise VisionEncoderError(
            f"mm_cfg.vision_encoder.hidden_size is {vision_hidden} but the vision tower's hidden size is "
            f"{tower_hidden}; the tower does not match the one this model was trained with"
        )
    adapter_type = mm_cfg.get("mm_mlp_adapter_type") or "linear"
    projector = load_projector(adapter_type, vision_hidden, int(llm_hidden), state_dict)

    data_cfg = model_cfg.get("data") or {}
    crop_size = vision_cfg.get("crop_size")
    preprocess = ImagePreprocessor.for_tower(
        tower.tower_type,
        tower.image_size,
        aspect_ratio=data_cfg.get("image_aspect_ratio"),
        processor_config=tower.preprocessor_config,
        crop_size=None if crop_size is None else [int(c) for c in crop_size],
        max_image_pixels=max_image_pixels,
    )
    spec = {
        "format": SPEC_FORMAT,
        "tower": {"type": tower.tower_type, "config": tower.hf_config},
        "vision_select_layer": select_layer,
        "feature_layer": int(tower.hf_config["num_hidden_layers"]),
        "vision_select_feature": select_feature,
        "class_token_length": class_tokens,
        "dropped_tokens": class_tokens if select_feature == "patch" and tower.tower_type == "clip" else 0,
        "projector": {
            "type": adapter_type,
            "vision_hidden_size": vision_hidden,
            "llm_hidden_size": int(llm_hidden),
        },
        "image_size": tower.image_size,
        "patch_size": tower.patch_size,
        "preprocess": preprocess.to_spec(),
    }
    try:
        return VisionEncoder(tower.module, projector.to(dtype).eval().requires_grad_(False), spec)
    except ValueError as error:
        raise VisionEncoderError(f"{error} (mm_mlp_adapter_type {adapter_type!r})") from None
