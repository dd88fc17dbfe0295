"""The media kinds a served model takes, and how a server tells its clients which ones.

A model type (`exporter.models.<type>`) names its kinds; the server publishes them, with the model type's name, as
parameters of the Triton model config, so a client needs no table of model types: it reads what the model takes
and encodes its media by kind (`query.media`):

- `image`: a file (checked to decode; pixels and PIL images are sent as PNG) in `input_media_bytes`, or with raw
  pixels one uint8 `[1, H, W, 3]` picture in `input_media`;
- `video`: the file's bytes as they are, or its decoded uint8 frames `[T, H, W, 3]` in `input_media` (an array
  always goes as frames); the server samples the frames;
- `audio`: the file's bytes as they are, or the mono float32 waveform in `input_signal` + `input_signal_length` (an
  array always goes as a waveform).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MediaKind:
    """A kind of media: its name, the modality (Triton input set) that carries it, the noun messages use for one
    item, and the OpenAI content part that sends it."""

    name: str
    modality: str
    noun: str
    openai_part: str


IMAGE = MediaKind("image", "vision", "image", "image_url")
VIDEO = MediaKind("video", "vision", "video", "video_url")
AUDIO = MediaKind("audio", "audio", "audio clip", "input_audio")
MEDIA_KINDS: dict[str, MediaKind] = {kind.name: kind for kind in (IMAGE, VIDEO, AUDIO)}

MODALITIES: tuple[str, ...] = tuple(dict.fromkeys(kind.modality for kind in MEDIA_KINDS.values()))
"""The modalities (`vision`, `audio`): each serves its own raw-media inputs (`wire.tensors`)."""

MODEL_TYPE_PARAMETER = "model_type"
MEDIA_PARAMETER = "media"


def served_parameters(model_type: str, media: Sequence[MediaKind]) -> dict[str, str]:
    """The Triton model-config parameters a server publishes: the model type and its media kinds, first the one
    requests carry by default."""
    return {MODEL_TYPE_PARAMETER: model_type, MEDIA_PARAMETER: ",".join(kind.name for kind in media)}


@dataclass(frozen=True)
class ServedModel:
    """What a served model's Triton config says about it: its model type (None when the server does not say), the
    media kinds it takes (the first is the default) and the most rows one request may hold."""

    model_type: str | None
    media: tuple[MediaKind, ...]
    max_batch_size: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ServedModel:
        """From a Triton model config in its JSON form. A server that publishes no media kinds (not
        `deploy_triton.py`) is taken to take audio when it serves `input_signal`, images otherwise."""
        parameters = {name: value.get("string_value", "") for name, value in (config.get("parameters") or {}).items()}
        names = parameters.get(MEDIA_PARAMETER)
        if names:
            media = tuple(media_kind(name) for name in names.split(","))
        else:
            inputs = {tensor.get("name") for tensor in config.get("input") or ()}
            media = (AUDIO,) if "input_signal" in inputs else (IMAGE,)
        return cls(parameters.get(MODEL_TYPE_PARAMETER) or None, media, int(config.get("max_batch_size") or 0))


def media_kind(name: str) -> MediaKind:
    """The media kind called `name`; ValueError naming the known kinds otherwise."""
    try:
        return MEDIA_KINDS[name]
    except KeyError:
        raise ValueError(f"unknown media kind {name!r}; known: {', '.join(MEDIA_KINDS)}") from None

