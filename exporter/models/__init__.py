"""Model types by their ``--model_type`` name; adding a model type means adding one module and one entry here."""

from __future__ import annotations

from .base import ModelType, MultimodalInputError, Perception, PromptLayout
from .lita import LitaModel
from .neva import ImageModel
from .salm import SalmModel
from .video_neva import VideoNevaModel

MODEL_TYPES: dict[str, ModelType] = {
    "neva": ImageModel("neva"),
    "vila": ImageModel("vila"),
    "video-neva": VideoNevaModel("video-neva"),
    "lita": LitaModel("lita"),
    "vita": LitaModel("vita"),
    "salm": SalmModel(),
}


def get_model_type(name: str) -> ModelType:
    """The model type registered as ``name``; an unknown name is an error listing the known ones."""
    if name not in MODEL_TYPES:
        raise ValueError(f"unsupported model_type {name!r}; supported: {', '.join(sorted(MODEL_TYPES))}")
    return MODEL_TYPES[name]


__all__ = ["MODEL_TYPES", "ModelType", "MultimodalInputError", "Perception", "PromptLayout", "get_model_type"]
