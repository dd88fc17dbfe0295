"""A throwaway model type, declared in this one file as a module of `exporter/models/` would be: a Neva whose
images go at `<picture>`, at most two per request, encoded three at a time by default.

`register_model_types(picture_model_type)` adds it to the registry; nothing else in the project names it.
"""

from __future__ import annotations

from exporter.models.neva import ImageModel, ImagePerception
from wire.media import IMAGE


class PicturePerception(ImagePerception):
    """Neva's runtime with another placeholder and limits."""

    media = (IMAGE,)
    placeholder = "<picture>"
    max_items = 2
    encoder_batch = 3


class PictureModel(ImageModel):
    """Neva's export and engine files, loaded as `PicturePerception`."""

    perception = PicturePerception


MODEL_TYPES = (PictureModel("picture-neva"),)
