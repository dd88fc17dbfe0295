"""LITA and VITA: a video's per-frame features become spatial (frame) tokens plus temporal (per-frame mean) tokens.

The two types differ only in their checkpoints (LITA: CLIP, vicuna ``v1`` template, SentencePiece; VITA: SigLIP +
``mlp_downsample``, ``llama_3`` template with ``<|eot_id|>``, HF tokenizer), which the config carries.

Frames (``frame_sampling``, chosen at export; docs/fidelity.md has NeMo's source for both):
- ``"training"`` (default), as NeMo trained every video model: ``data.num_frames`` frames, evenly spaced
  (truncated ``linspace``), the last repeated when the video is shorter (``padded_indices``). ``T = num_frames``.
- ``"nemo-export"``, NeMo's export runtime: with ``im_vid_start_end`` every frame up to ``data.num_frames``, else
  ``round(len / ceil(len / num_frames))`` frames; with ``v1`` ``sample_frames`` frames; ``round(linspace)`` indices.

``mm_cfg.lita.visual_token_format`` / ``lita_video_arch``, over the ``T`` sampled frames (NeMo's
``LitaWordEmbeddingMixin.add_lita_layer``):
- ``im_vid_start_end`` / ``temporal_all_resolution`` (LITA 1.5, VITA): ``F = min(T, sample_frames)`` frames
  (``round(linspace(0, T-1, F))``) give ``S`` spatial tokens each, every frame one temporal token (the mean over its
  S tokens). The LLM sees ``(<im_start> S×feat <im_end>)×F <vid_start> T×feat <vid_end>``.
- ``v1`` / ``temporal_spatial_pool`` (LITA 1.0): T temporal tokens, then 2×2-average-pooled tokens of 4 frames;
  ``v1`` / ``temporal_spatial``: T temporal tokens, then the mean over the T frames of each spatial token.
  One plain span (framed by ``<im_start>``/``<im_end>`` when ``use_im_start_end``).
Special tokens: ``<extra_id_4>``/``<extra_id_5>`` (``<|reserved_special_token_4|>``/``_5|>`` when
``mm_cfg.llm.model_type`` is ``llama_3``) and ``<extra_id_8>``/``<extra_id_9>``.
An image is a video of one frame.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from ..llm.tokenizer import Tokenizer
from ..media_safety import MediaPolicy
from ..perception.image_preprocess import ImagePreprocessor
from ..perception.video import VideoLimits, lita_num_sample_frames, padded_indices, rounded_indices
from ..perception.vision_encoder import VisionEncoder
from .base import MultimodalInputError
from .neva import ImageModel
from .video_neva import Piece, VideoPerception, read_config_section, video_limits, write_config_section

VIDEO_ARCHS = {"im_vid_start_end": ("temporal_all_resolution",), "v1": ("temporal_spatial_pool", "temporal_spatial")}
POOL_FRAMES = 4  # temporal_spatial_pool: 2x2 pooling of 4 frames, fixed in training
TRAINING, NEMO_EXPORT = "training", "nemo-export"
FRAME_SAMPLINGS = (TRAINING, NEMO_EXPORT)


@dataclass(frozen=True)
class LitaSettings:
    """The LITA/VITA fields of a checkpoint config that the runtime needs, and the export's frame sampling."""

    visual_token_format: str
    video_arch: str
    sample_frames: int
    num_frames: int
    im_start: str = "<extra_id_4>"
    im_end: str = "<extra_id_5>"
    vid_start: str = "<extra_id_8>"
    vid_end: str = "<extra_id_9>"
    frame_sampling: str = TRAINING  # an engine exported before the choice existed samples as trained

    def __post_init__(self) -> None:
        check_frame_sampling(self.frame_sampling)

    @property
    def im_vid_start_end(self) -> bool:
        return self.visual_token_format == "im_vid_start_end"

    def frame_indices(self, length: int) -> list[int]:
        """The frames sampled from a video of ``length`` frames (repeats allowed)."""
        if self.frame_sampling == TRAINING:
            return padded_indices(length, self.num_frames)
        count = lita_num_sample_frames(length, self.num_frames, self.sample_frames, self.visual_token_format)
        return rounded_indices(length, count)

    @property
    def max_frames(self) -> int:
        """The most frames one video is sampled to (``T``)."""
        if self.frame_sampling == TRAINING or self.im_vid_start_end:
            return self.num_frames
        return self.sample_frames

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_frame_sampling(frame_sampling: str) -> None:
    """An error naming ``FRAME_SAMPLINGS`` unless ``frame_sampling`` is one of them."""
    if frame_sampling not in FRAME_SAMPLINGS:
        raise ValueError(f"unknown video_frame_sampling {frame_sampling!r}; use one of {', '.join(FRAME_SAMPLINGS)}")


def lita_settings(model_config: Any, frame_sampling: str = TRAINING) -> LitaSettings:
    """Read and check ``mm_cfg.lita`` (NeMo's defaults: ``temporal_spatial_pool``, ``v1``, 4 sample frames)."""
    check_frame_sampling(frame_sampling)
    mm_cfg = model_config.get("mm_cfg") or {}
    lita = mm_cfg.get("lita") or {}
    token_format = str(lita.get("visual_token_format") or "v1")
    arch = str(lita.get("lita_video_arch") or "temporal_spatial_pool")
    if token_format not in VIDEO_ARCHS:
        raise ValueError(f"mm_cfg.lita.visual_token_format {token_format!r} is not one of {', '.join(VIDEO_ARCHS)}")
    if arch not in VIDEO_ARCHS[token_format]:
        raise ValueError(f"mm_cfg.lita.lita_video_arch {arch!r} does not go with visual_token_format "
                         f"{token_format!r} (training supports {', '.join(VIDEO_ARCHS[token_format])})")
    sample_frames = int(lita.get("sample_frames") or 4)
    num_frames = int((model_config.get("data") or {}).get("num_frames") or -1)
    if num_frames < 1 and (frame_sampling == TRAINING or token_format == "im_vid_start_end"):
        raise ValueError(f"LITA/VITA need data.num_frames (the frames sampled per video, the temporal tokens) >= 1, "
                         f"got {num_frames}; set it to the value used in training (LITA/VITA: 256)")
    if token_format == "im_vid_start_end" and mm_cfg.get("use_im_start_end"):
        raise ValueError("visual_token_format im_vid_start_end with mm_cfg.use_im_start_end True has no "
                         "training layout to follow; LITA/VITA train with use_im_start_end False")
    if sample_frames < 1:
        raise ValueError(f"mm_cfg.lita.sample_frames must be at least 1, got {sample_frames}")
    llama_3 = (mm_cfg.get("llm") or {}).get("model_type") == "llama_3"
    image_tokens = ("<|reserved_special_token_4|>", "<|reserved_special_token_5|>") if llama_3 else ()
    return LitaSettings(token_format, arch, sample_frames, num_frames, *image_tokens, frame_sampling=frame_sampling)


def pooled_grid_side(tokens_per_frame: int) -> int:
    """Side of the square token grid ``temporal_spatial_pool`` pools 2×2 (``S = side²``, side even: training
    sized the span for ``S`` pooled-and-stacked tokens of 4 frames)."""
    side = math.isqrt(tokens_per_frame)
    if side * side != tokens_per_frame or side % 2:
        raise ValueError(f"temporal_spatial_pool needs a square grid of tokens per frame with an even side, got "
                         f"{tokens_per_frame} tokens")
    return side


def lita_features(frames: torch.Tensor, order: tuple[int, ...], settings: LitaSettings) -> torch.Tensor:
    """One video's feature block ``[n, H]`` in prompt order, from the features ``[distinct, S, H]`` of its distinct
    sampled frames; the ``T = len(order)`` sampled frames are ``frames[order[t]]``.

    ``im_vid_start_end``: ``F·S`` spatial rows (frames ``round(linspace(0, T-1, F))``), then ``T`` temporal rows.
    """
    count, (distinct, tokens, hidden) = len(order), frames.shape
    rows = torch.tensor(order, device=frames.device)
    temporal = frames.float().mean(dim=1).to(frames.dtype)[rows]
    if settings.im_vid_start_end:
        chosen = frames[rows[rounded_indices(count, min(count, settings.sample_frames))]]
        return torch.cat([chosen.reshape(-1, hidden), temporal])
    if settings.video_arch == "temporal_spatial":
        weights = torch.bincount(rows, minlength=distinct).float() / count  # frame repeats count in the mean
        spatial = torch.tensordot(weights, frames.float(), dims=1).to(frames.dtype)
        return torch.cat([temporal, spatial])
    side = pooled_grid_side(tokens)
    grids = frames[rows[rounded_indices(count, POOL_FRAMES)]].reshape(POOL_FRAMES, side, side, hidden)
    pooled = F.avg_pool2d(grids.permute(0, 3, 1, 2).float(), kernel_size=2).permute(0, 2, 3, 1)
    return torch.cat([temporal, pooled.reshape(-1, hidden).to(frames.dtype)])


def features_per_video(settings: LitaSettings, tokens_per_frame: int) -> int:
    """The most feature rows one video contributes (the unit of ``max_multimodal_len``)."""
    frames = settings.max_frames
    if settings.im_vid_start_end:
        return min(frames, settings.sample_frames) * tokens_per_frame + frames
    if settings.video_arch == "temporal_spatial":
        return frames + tokens_per_frame
    return frames + POOL_FRAMES * (pooled_grid_side(tokens_per_frame) // 2) ** 2


def split_im_vid_block(block: torch.Tensor, tokens_per_frame: int,
                       sample_frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Undo ``lita_features`` for ``im_vid_start_end``: ``(frames [F, S, H], temporal [T, H])``.

    ``n = F·S + T`` with ``F = min(T, sample_frames)`` has one solution: ``T = n - sample_frames·S`` when
    ``n >= sample_frames·(S + 1)``, else ``T = F = n / (S + 1)``.
    """
    rows = int(block.shape[0])
    if rows >= sample_frames * (tokens_per_frame + 1):
        frames = sample_frames
    elif rows % (tokens_per_frame + 1) == 0:
        frames = rows // (tokens_per_frame + 1)
    else:
        raise ValueError(f"a block of {rows} rows is not F*{tokens_per_frame} spatial + T temporal rows")
    spatial = frames * tokens_per_frame
    return block[:spatial].reshape(frames, tokens_per_frame, -1), block[spatial:]


def im_vid_pieces(frames: torch.Tensor, temporal: torch.Tensor, ids: dict[str, int]) -> list[Piece]:
    """``(<im_start> frame <im_end>)`` for each frame, then ``<vid_start> temporal <vid_end>``."""
    pieces: list[Piece] = []
    for frame in frames:
        pieces += [[ids["im_start"]], frame, [ids["im_end"]]]
    return pieces + [[ids["vid_start"]], temporal, [ids["vid_end"]]]


class LitaPerception(VideoPerception):
    """LITA/VITA runtime: frames by the settings' sampling, spatial + temporal tokens, the token layout."""

    def __init__(self, encoder: VisionEncoder, preprocessor: ImagePreprocessor, use_im_start_end: bool,
                 limits: VideoLimits | None, settings: LitaSettings, max_encoder_batch: int | None = None):
        super().__init__(encoder, preprocessor, use_im_start_end, limits, max_encoder_batch)
        self.settings = settings

    @property
    def features_per_item(self) -> int:
        return features_per_video(self.settings, self.encoder.tokens_per_image)

    def frame_indices(self, length: int) -> list[int]:
        return self.settings.frame_indices(length)

    def features_from_frames(self, frames: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
        return lita_features(frames, order, self.settings)

    def media_pieces(self, block: torch.Tensor, tokenizer: Tokenizer) -> list[Piece]:
        if self.settings.im_vid_start_end:
            ids = self._token_ids(tokenizer, ("im_start", "im_end", "vid_start", "vid_end"))
            frames, temporal = split_im_vid_block(block, self.encoder.tokens_per_image, self.settings.sample_frames)
            return im_vid_pieces(frames, temporal, ids)
        if self.use_im_start_end:
            ids = self._token_ids(tokenizer, ("im_start", "im_end"))
            return [[ids["im_start"]], block, [ids["im_end"]]]
        return [block]

    def _token_ids(self, tokenizer: Tokenizer, roles: tuple[str, ...]) -> dict[str, int]:
        tokens = {role: getattr(self.settings, role) for role in roles}
        ids = {role: tokenizer.token_to_id(token) for role, token in tokens.items()}
        missing = [tokens[role] for role, token_id in ids.items() if token_id is None]
        if missing:
            raise MultimodalInputError(
                f"the tokenizer has no {', '.join(missing)}; the {self.settings.visual_token_format} video layout "
                "frames features with them, so use the tokenizer the model was trained with"
            )
        return ids  # type: ignore[return-value]


class LitaModel(ImageModel):
    """Export/load half of LITA and VITA: Neva's encoder and files plus the LITA settings."""

    perception = LitaPerception

    def save_perception(self, encoder: VisionEncoder, directory: Path, model_config: Any, *,
                        video_frame_sampling: str | None = None) -> dict:
        settings = lita_settings(model_config, video_frame_sampling or TRAINING)
        features = features_per_video(settings, encoder.tokens_per_image)  # checks the pooled grid
        super().save_perception(encoder, directory, model_config)
        write_config_section(directory, "lita", settings.to_dict())
        return {"features_per_item": features}

    def load_perception(self, directory: Path, *, device: str, dtype: torch.dtype | None,
                        media: MediaPolicy | None = None, encoder_batch: int | None = None) -> LitaPerception:
        parts = self.load_encoder(directory, device=device, dtype=dtype, media=media)
        settings = LitaSettings(**read_config_section(directory, "lita"))
        return LitaPerception(*parts, video_limits(media), settings, encoder_batch)


MODEL_TYPES = (LitaModel("lita"), LitaModel("vita"))
