"""What every model type answers: what it takes, how media become features, and how a prompt is laid out.

A model type (one module per ``--model_type``) builds its perception engine at export, rebuilds it from the engine
directory at load, and turns one request (text + media) into a :class:`PromptLayout`: token-id pieces with feature
blocks between them. The runtime embeds the ids, splices the features as embeddings and runs the LLM.

What the rest of the system reads about a type is declared as class attributes of its :class:`Perception` (its
media kinds, placeholder, limits); :class:`ModelType` derives its modality from them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from wire.media import MediaKind

from ..llm.tokenizer import Tokenizer
from ..media_safety import MediaPolicy
from .templates import ChatTemplate, resolve_template


class MultimodalInputError(ValueError):
    """A request's text or media cannot be turned into a prompt (the message says what to change)."""


@dataclass
class PromptLayout:
    """One request's prompt: ``pieces`` alternate token-id lists and feature blocks ``[n, H]`` in sequence order."""

    pieces: list[list[int] | torch.Tensor]

    @property
    def length(self) -> int:
        return sum(len(p) if isinstance(p, list) else int(p.shape[0]) for p in self.pieces)

    def token_ids(self, media_id: int = -1) -> list[int]:
        """The prompt as ids, ``media_id`` at every feature position (for repetition penalty and accounting)."""
        ids: list[int] = []
        for piece in self.pieces:
            ids.extend(piece if isinstance(piece, list) else [media_id] * int(piece.shape[0]))
        return ids


def media_list(media: Any) -> list[Any]:
    """A request's media as a list of items: a list or tuple holds several, one item stands alone, None is none."""
    items = list(media) if isinstance(media, (list, tuple)) else [media]
    return [item for item in items if item is not None]


class ModelType(ABC):
    """The model-specific half of export and inference; the engine and runtime do the rest.

    A module of ``exporter.models`` registers its types in a module-level ``MODEL_TYPES`` tuple of instances.
    """

    name: str
    perception: type[Perception]  # the runtime half, whose class attributes declare what the type takes
    perception_dir: str  # "visual_engine" or "perception_engine"

    @property
    def modality(self) -> str:
        """``vision`` or ``audio``: the Triton inputs that carry the type's raw media."""
        return self.perception.media[0].modality

    @abstractmethod
    def build_perception(self, model_config: Any, state_dict: dict[str, torch.Tensor], *, dtype: torch.dtype,
                         vision_tower_path: str | None, audio_frontend: str | None = None) -> torch.nn.Module:
        """Build the perception encoder from the checkpoint's config and canonical weights. ``vision_tower_path``
        concerns vision types, ``audio_frontend`` (``"nemo-2.4"`` or ``"nemo-2.5"``) audio types; others ignore it."""

    @abstractmethod
    def save_perception(self, encoder: torch.nn.Module, directory: Path, model_config: Any, *,
                        video_frame_sampling: str | None = None) -> dict:
        """Write the encoder to ``directory``; return facts the manifest records (e.g. tokens per media item).
        ``video_frame_sampling`` (``"training"`` or ``"nemo-export"``) concerns LITA/VITA; others ignore it."""

    @abstractmethod
    def load_perception(self, directory: Path, *, device: str, dtype: torch.dtype | None,
                        media: MediaPolicy | None = None, encoder_batch: int | None = None) -> Perception:
        """Rebuild the runtime perception (preprocessing + encoder) from ``directory``; ``media`` caps what the
        perception decodes (pixels, frames, duration, bytes), None keeps its defaults; ``encoder_batch`` is the
        most items one encoder call takes (``vision_max_batch_size``; None: the perception's ``encoder_batch``)."""

    def chat_template(self, model_config: Any) -> ChatTemplate:
        """The prompt format the checkpoint was trained with (by default its conversation template)."""
        return resolve_template(model_config)

    def export_onnx(self, encoder: torch.nn.Module, directory: Path) -> None:
        """Write the perception encoder as ONNX into ``directory`` (by default the vision encoder's export)."""
        from ..perception.onnx_export import export_vision_onnx

        export_vision_onnx(encoder.float(), directory / "encoder.onnx")


class Perception(ABC):
    """Runtime side of a model type: media → features, and text + features → prompt layout.

    The class attributes are the type's declaration, read by the engine, the servers and (published in the Triton
    config) the clients: ``media`` the kinds a request carries, the default first (``wire.media``: how clients
    encode each); ``placeholder`` where media go in the text (None: the type places them itself) and the other
    spellings it accepts; ``max_items`` the media items one request may carry (None: any number);
    ``encoder_batch`` the default of ``vision_max_batch_size``, the most items one encoder call takes.
    """

    media: tuple[MediaKind, ...]
    placeholder: str | None = None
    placeholder_aliases: tuple[str, ...] = ()
    max_items: int | None = None
    encoder_batch: int = 16

    @property
    def media_name(self) -> str:
        """The noun for one media item of the default kind, as messages use it."""
        return self.media[0].noun

    def checked_items(self, items: list[Any]) -> list[Any]:
        """``items`` if there are no more than ``max_items``; MultimodalInputError otherwise."""
        if self.max_items is not None and len(items) > self.max_items:
            noun = self.media_name
            allowed = f"one {noun}" if self.max_items == 1 else f"at most {self.max_items} {noun}s"
            raise MultimodalInputError(f"this model takes {allowed} per request, got {len(items)} media items; "
                                       "send them in separate requests")
        return items

    @property
    @abstractmethod
    def features_per_item(self) -> int:
        """Feature vectors one media item contributes (the unit of ``max_multimodal_len``)."""

    @abstractmethod
    def load_media(self, media: Any) -> list[Any]:
        """Decode and preprocess one request's media into encoder inputs (one per item, a tensor or the type's
        own structure)."""

    def media_items(self, media: Any) -> list[Any] | None:
        """The request's media split into the items ``load_media`` turns into one encoder input each, unchanged
        (the runtime hashes them to reuse encoder outputs); None when this type does not split (no reuse)."""
        return None

    @abstractmethod
    def encode(self, items: list[Any]) -> list[torch.Tensor]:
        """Encode preprocessed items (from any number of requests) into one feature block ``[n, H]`` each."""

    @abstractmethod
    def layout(self, text: str, features: list[torch.Tensor], tokenizer: Tokenizer, template: ChatTemplate,
               apply_chat_template: bool) -> PromptLayout:
        """Place one request's feature blocks into its prompt."""
