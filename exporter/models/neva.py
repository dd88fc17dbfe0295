"""Neva (LLaVA-style image model): one vision encoder, image features spliced at each ``<image>``.

VILA shares everything but its defaults (SigLIP tower, ``mlp_downsample``, ``resize`` aspect mode, several images per
prompt), which come from the checkpoint's own config, so it is registered as the same class under another name.
Requests carry images (any number, one ``<image>`` each).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from wire.media import IMAGE

from ..llm.sampling import moved_without_waiting
from ..llm.tokenizer import Tokenizer
from ..media_safety import MediaPolicy
from ..perception.image_preprocess import ImagePreprocessor
from ..perception.vision_encoder import VisionEncoder, build_vision_encoder
from ..runtime.cuda_graphs import GraphedCall
from .base import ModelType, MultimodalInputError, Perception, PromptLayout, media_list
from .templates import IMAGE_PLACEHOLDER, ChatTemplate

IM_START_TOKEN = "<extra_id_4>"
IM_END_TOKEN = "<extra_id_5>"


class ImagePerception(Perception):
    """Runtime: images → pixels → features; ``<image>`` placeholders → feature blocks."""

    media = (IMAGE,)
    placeholder = IMAGE_PLACEHOLDER
    encoder_batch = 16

    def __init__(self, encoder: VisionEncoder, preprocessor: ImagePreprocessor, use_im_start_end: bool = False,
                 max_encoder_batch: int | None = None):
        self.encoder = encoder
        self.preprocessor = preprocessor
        self.use_im_start_end = use_im_start_end
        self.max_encoder_batch = max_encoder_batch or self.encoder_batch
        self._graphed: GraphedCall | None = None

    @property
    def features_per_item(self) -> int:
        return self.encoder.tokens_per_image

    def media_items(self, media: Any) -> list[Any]:
        if isinstance(media, np.ndarray) and media.ndim == 4:  # NeMo's wire shape: [images, H, W, 3]
            media = list(media)
        return self.checked_items(media_list(media))

    def load_media(self, media: Any) -> list[torch.Tensor]:
        return [self.preprocessor.preprocess_one(item) for item in self.media_items(media)]

    @torch.inference_mode()
    def encode(self, items: list[torch.Tensor]) -> list[torch.Tensor]:
        parameter = next(self.encoder.parameters())
        blocks: list[torch.Tensor] = []
        for start in range(0, len(items), self.max_encoder_batch):
            pixels = torch.stack(items[start:start + self.max_encoder_batch])
            pixels = moved_without_waiting(pixels, parameter.device).to(parameter.dtype)
            blocks.extend(self._graphed_encoder(pixels).clone().unbind(0))  # clone: the graph reuses its output
        return blocks

    def _graphed_encoder(self, pixels: torch.Tensor) -> torch.Tensor:
        """The encoder on ``pixels [n, 3, H, W]``: a CUDA graph per batch bucket on the GPU, eager elsewhere."""
        if self._graphed is None:
            self._graphed = GraphedCall(self.encoder, tuple(pixels.shape[1:]), pixels.dtype, pixels.device,
                                        self.max_encoder_batch)
        return self._graphed(pixels)

    def layout(self, text: str, features: list[torch.Tensor], tokenizer: Tokenizer, template: ChatTemplate,
               apply_chat_template: bool) -> PromptLayout:
        for alias in self.placeholder_aliases:
            text = text.replace(alias, self.placeholder)
        prompt = template.render(text, self.placeholder if features else "") if apply_chat_template else text
        parts = prompt.split(self.placeholder)
        if len(parts) - 1 != len(features):
            raise MultimodalInputError(
                f"the prompt has {len(parts) - 1} {self.placeholder} placeholder(s) but the request carries "
                f"{len(features)} {self.media_name}(s); put one {self.placeholder} in the text for each "
                f"{self.media_name}, or none to have the chat template put it first"
            )
        pieces: list[list[int] | torch.Tensor] = []
        add_bos = apply_chat_template and template.add_bos
        for index, part in enumerate(parts):
            ids = tokenizer.encode(part, add_bos=add_bos and index == 0) if (part or add_bos) else []
            if ids:
                pieces.append(ids)
            if index < len(features):
                pieces.extend(self.media_pieces(features[index], tokenizer))
        return PromptLayout(pieces)

    def media_pieces(self, block: torch.Tensor, tokenizer: Tokenizer) -> list[list[int] | torch.Tensor]:
        """What replaces one placeholder: the feature block, framed by the image start/end tokens when trained so."""
        if not self.use_im_start_end:
            return [block]
        start, end = tokenizer.token_to_id(IM_START_TOKEN), tokenizer.token_to_id(IM_END_TOKEN)
        if start is None or end is None:
            raise MultimodalInputError(f"use_im_start_end needs {IM_START_TOKEN} and {IM_END_TOKEN} in the tokenizer")
        return [[start], block, [end]]


class ImageModel(ModelType):
    """Export/load half of an image-text model type."""

    perception = ImagePerception
    perception_dir = "visual_engine"

    def __init__(self, name: str):
        self.name = name

    def build_perception(self, model_config: Any, state_dict: dict[str, torch.Tensor], *, dtype: torch.dtype,
                         vision_tower_path: str | None, audio_frontend: str | None = None) -> VisionEncoder:
        return build_vision_encoder(model_config, state_dict, vision_tower_path, dtype=dtype)

    def save_perception(self, encoder: VisionEncoder, directory: Path, model_config: Any, *,
                        video_frame_sampling: str | None = None) -> dict:
        directory.mkdir(parents=True, exist_ok=True)
        mm_cfg = model_config.get("mm_cfg") or {}
        config = {"model_type": self.name, "encoder": encoder.spec(),
                  "use_im_start_end": bool(mm_cfg.get("use_im_start_end", False))}
        (directory / "config.json").write_text(json.dumps(config, indent=2))
        save_file(encoder.state_dict_for_engine(), str(directory / "model.safetensors"))
        return {"features_per_item": encoder.tokens_per_image}

    def load_perception(self, directory: Path, *, device: str, dtype: torch.dtype | None,
                        media: MediaPolicy | None = None, encoder_batch: int | None = None) -> ImagePerception:
        return self.perception(*self.load_encoder(directory, device=device, dtype=dtype, media=media),
                               max_encoder_batch=encoder_batch)

    def load_encoder(self, directory: Path, *, device: str, dtype: torch.dtype | None,
                     media: MediaPolicy | None) -> tuple[VisionEncoder, ImagePreprocessor, bool]:
        """The vision encoder, its image preprocessing (capped by ``media``) and ``use_im_start_end``, as
        ``save_perception`` wrote them."""
        config = json.loads((directory / "config.json").read_text())
        with safe_open(directory / "model.safetensors", framework="pt", device=str(device)) as stored:
            # straight to the device, one tensor at a time in the serving dtype: the weights are held once
            weights = {name: stored.get_tensor(name).to(dtype) if dtype else stored.get_tensor(name)
                       for name in stored.keys()}
        encoder = VisionEncoder.from_spec(config["encoder"], weights, dtype=dtype)  # the tensors become its weights
        overrides = {} if media is None else {"max_image_pixels": media.max_image_pixels}
        return encoder, encoder.preprocessor(**overrides), config["use_im_start_end"]

MODEL_TYPES = (ImageModel("neva"), ImageModel("vila"))
