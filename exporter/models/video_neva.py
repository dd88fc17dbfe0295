"""Video-NeVA: NeVA over a fixed number of video frames, every frame's features frame-major at ``<video>``.

Training semantics (NeMo ``neva_dataset`` / ``MegatronNevaModel``):
- frames: ``data.num_frames`` evenly spaced ones (truncated ``linspace``), the last repeated when the video is
  shorter, or the single frame ``data.splice_single_frame`` names; each frame gets the tower's image preprocessing;
- features: per frame ``hidden_states[vision_select_layer]`` minus the class token (``patch``), then the projector;
  the video's block is ``[frames * tokens_per_frame, H]`` in frame-major order;
- prompt: the checkpoint's template (``data.conv_template``: nvgpt / nv_steerlm); training replaced ``<video>``
  (``<image>`` in the user's text is taken as the same placeholder); with ``use_im_start_end`` the block sits
  between ``<extra_id_4>`` and ``<extra_id_5>``.

``VideoPerception`` is the runtime half shared with LITA/VITA (``exporter.models.lita``).
"""

from __future__ import annotations

import json
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from wire.media import IMAGE, VIDEO

from ..media_safety import MediaPolicy
from ..perception.image_preprocess import ImagePreprocessor
from ..perception.video import SPLICE_SINGLE_FRAME, VideoLimits, read_frames, video_neva_indices
from ..perception.vision_encoder import VisionEncoder
from .base import media_list
from .neva import ImageModel, ImagePerception
from .templates import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER

Piece = list[int] | torch.Tensor


def write_config_section(directory: Path, section: str, values: dict[str, Any]) -> None:
    """Add ``section`` to the perception ``config.json`` that ``ImageModel.save_perception`` wrote."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config[section] = values
    path.write_text(json.dumps(config, indent=2))


def read_config_section(directory: Path, section: str) -> dict[str, Any]:
    """One section of the perception ``config.json`` (an engine exported for another type lacks it)."""
    config = json.loads((directory / "config.json").read_text())
    if section not in config:
        raise ValueError(f"{directory}/config.json has no {section!r} section; export the checkpoint again "
                         f"with the right model_type")
    return config[section]


def video_limits(media: MediaPolicy | None) -> VideoLimits | None:
    """The caps ``media`` puts on decoding one video (None: ``VideoLimits``' defaults)."""
    if media is None:
        return None
    return VideoLimits(max_frames=media.max_video_frames, max_duration_s=media.max_video_duration_s,
                       max_frame_pixels=media.max_frame_pixels)


@dataclass(frozen=True)
class VideoPixels:
    """One video's encoder input: its distinct sampled frames and the order the sampling takes them in."""

    pixels: torch.Tensor  # [distinct, 3, S, S]
    order: tuple[int, ...]  # the i-th sampled frame is pixels[order[i]]


class VideoPerception(ImagePerception):
    """Runtime of the video types: one video (or image, a one-frame video) per request → sampled frames →
    per-frame pixels → per-frame features → the type's feature block, placed at ``<video>``. A frame sampled
    several times (a short video padded with its last frame) is preprocessed and encoded once."""

    media = (VIDEO, IMAGE)  # an image is a one-frame video
    placeholder = VIDEO_PLACEHOLDER
    placeholder_aliases = (IMAGE_PLACEHOLDER,)
    max_items = 1

    def __init__(self, encoder: VisionEncoder, preprocessor: ImagePreprocessor, use_im_start_end: bool = False,
                 limits: VideoLimits | None = None, max_encoder_batch: int | None = None):
        super().__init__(encoder, preprocessor, use_im_start_end, max_encoder_batch)
        self.limits = limits or VideoLimits()

    @abstractmethod
    def frame_indices(self, length: int) -> list[int]:
        """Indices of the frames to encode, given the video's frame count."""

    @abstractmethod
    def features_from_frames(self, frames: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
        """The video's feature block ``[n, H]`` from the features ``[distinct, N, H]`` of its distinct sampled
        frames; the i-th sampled frame is ``frames[order[i]]``."""

    def media_items(self, media: Any) -> list[Any]:
        return self.checked_items(media_list(media))

    def load_media(self, media: Any) -> list[VideoPixels]:
        return [self._pixels(item) for item in self.media_items(media)]

    def _pixels(self, source: Any) -> VideoPixels:
        frames = read_frames(source, self.frame_indices, self.limits)
        return VideoPixels(torch.stack([self.preprocessor.preprocess_one(frame) for frame in frames.frames]),
                           frames.order)

    def encode(self, items: list[VideoPixels]) -> list[torch.Tensor]:
        frame_features = super().encode([frame for video in items for frame in video.pixels])
        blocks, start = [], 0
        for video in items:
            count = len(video.pixels)
            blocks.append(self.features_from_frames(torch.stack(frame_features[start:start + count]), video.order))
            start += count
        return blocks


class VideoNevaPerception(VideoPerception):
    """Video-NeVA runtime: ``num_frames`` frames (or one spliced frame), features frame-major."""

    def __init__(self, encoder: VisionEncoder, preprocessor: ImagePreprocessor, use_im_start_end: bool,
                 limits: VideoLimits | None, *, num_frames: int, splice_single_frame: str | None = None,
                 max_encoder_batch: int | None = None):
        super().__init__(encoder, preprocessor, use_im_start_end, limits, max_encoder_batch)
        self.num_frames = num_frames
        self.splice_single_frame = splice_single_frame

    @property
    def frames_per_video(self) -> int:
        return 1 if self.splice_single_frame else self.num_frames

    @property
    def features_per_item(self) -> int:
        return self.frames_per_video * self.encoder.tokens_per_image

    def frame_indices(self, length: int) -> list[int]:
        return video_neva_indices(length, self.num_frames, self.splice_single_frame)

    def features_from_frames(self, frames: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
        return frames[list(order)].reshape(-1, frames.shape[-1])


def video_neva_settings(model_config: Any) -> dict[str, Any]:
    """``data.num_frames`` and ``data.splice_single_frame`` of a Video-NeVA config, checked."""
    data = model_config.get("data") or {}
    splice = data.get("splice_single_frame") or None
    if splice is not None and splice not in SPLICE_SINGLE_FRAME:
        raise ValueError(f"data.splice_single_frame {splice!r} is not one of {', '.join(SPLICE_SINGLE_FRAME)}")
    num_frames = data.get("num_frames")
    if splice is None and (num_frames is None or int(num_frames) < 1):
        raise ValueError(
            f"Video-NeVA needs a fixed frame count but data.num_frames is {num_frames} (-1 means every frame); "
            "set data.num_frames to the count the model was trained with (NeMo's default is 8)"
        )
    return {"num_frames": int(num_frames) if num_frames is not None else 1, "splice_single_frame": splice}


class VideoNevaModel(ImageModel):
    """Export/load half of Video-NeVA: Neva's encoder and files plus the frame settings."""

    perception = VideoNevaPerception

    def build_perception(self, model_config: Any, state_dict: dict[str, torch.Tensor], *, dtype: torch.dtype,
                         vision_tower_path: str | None, audio_frontend: str | None = None) -> VisionEncoder:
        video_neva_settings(model_config)
        return super().build_perception(model_config, state_dict, dtype=dtype, vision_tower_path=vision_tower_path)

    def save_perception(self, encoder: VisionEncoder, directory: Path, model_config: Any, *,
                        video_frame_sampling: str | None = None) -> dict:
        super().save_perception(encoder, directory, model_config)
        settings = video_neva_settings(model_config)
        write_config_section(directory, "video", settings)
        frames = 1 if settings["splice_single_frame"] else settings["num_frames"]
        return {"features_per_item": frames * encoder.tokens_per_image}

    def load_perception(self, directory: Path, *, device: str, dtype: torch.dtype | None,
                        media: MediaPolicy | None = None, encoder_batch: int | None = None) -> VideoNevaPerception:
        parts = self.load_encoder(directory, device=device, dtype=dtype, media=media)
        return VideoNevaPerception(*parts, video_limits(media), max_encoder_batch=encoder_batch,
                                   **read_config_section(directory, "video"))


MODEL_TYPES = (VideoNevaModel("video-neva"),)
