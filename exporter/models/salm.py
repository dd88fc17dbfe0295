"""SALM (NeMo-1 ``speech_llm``): audio in, text out; the clip's features come first, then the text prompt.

Training semantics (NeMo ``ModularAudioGPTModel`` with ``TextProcessing``, reference §1.3):
- checkpoint: one ``.nemo`` with ``perception.*`` and ``model.*`` weights (LoRA merged at export, exporter.lora), or
  NeMo's split export layout: a perception folder (``model_config.yaml`` = the perception section,
  ``model_weights.ckpt`` without the ``perception.`` prefix) plus the LLM ``.nemo`` as ``llm_checkpoint_path``;
- prompt: ``data.train_ds.prompt_template`` (default ``"Q: {context}\\nA: {answer}"``) with the question as the
  context and the answer cut off, stripped of spaces, ``add_bos`` as trained (no BOS by default);
- sequence: ``[audio features ; prompt tokens]`` (one clip per request), each clip with its own features only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from safetensors.torch import load_file, save_file

from wire.media import AUDIO

from ..llm.tokenizer import Tokenizer
from ..media_safety import MediaPolicy
from ..perception.audio import AudioPerception, export_audio_onnx
from ..perception.audio_io import AudioLimits, load_audio
from .base import ModelType, MultimodalInputError, Perception, PromptLayout, media_list
from .templates import ChatTemplate

DEFAULT_PROMPT_TEMPLATE = "Q: {context}\nA: {answer}"
DEFAULT_QUESTION = "what's the transcription of the audio?"
_SENTINEL = "\x00question\x00"


class SalmPerception(Perception):
    """Runtime: one clip (file, bytes or waveform) → mono waveform at the model's rate → features ``[n, H]``."""

    media = (AUDIO,)
    max_items = 1
    encoder_batch = 8

    def __init__(self, perception: AudioPerception, features_per_second: int, limits: AudioLimits | None = None,
                 max_encoder_batch: int | None = None):
        self.perception = perception
        self.limits = limits or AudioLimits()
        self.max_encoder_batch = max_encoder_batch or self.encoder_batch
        self._features_per_second = features_per_second

    @property
    def features_per_item(self) -> int:
        """Features per second of audio (a clip's count grows with its length)."""
        return self._features_per_second

    def media_items(self, media: Any) -> list[Any]:
        return self.checked_items(media_list(media))

    def load_media(self, media: Any) -> list[torch.Tensor]:
        rate = self.perception.sample_rate
        return [torch.from_numpy(load_audio(item, rate, self.limits)) for item in self.media_items(media)]

    @torch.inference_mode()
    def encode(self, items: list[torch.Tensor]) -> list[torch.Tensor]:
        """Clips of equal length share an encoder batch; any other clip runs apart, so each clip's features are
        what it gets alone (NeMo's front end up to 2.4 lets padding leak into the last frames)."""
        device = next(self.perception.parameters()).device
        by_length: dict[int, list[int]] = {}
        for index, item in enumerate(items):
            by_length.setdefault(int(item.shape[0]), []).append(index)
        blocks: list[torch.Tensor | None] = [None] * len(items)
        for length, indices in by_length.items():
            for start in range(0, len(indices), self.max_encoder_batch):
                chunk = indices[start:start + self.max_encoder_batch]
                signal = torch.stack([items[i] for i in chunk]).to(device)
                lengths = torch.full((len(chunk),), length, dtype=torch.long, device=device)
                encoded, encoded_lengths = self.perception(signal, lengths)
                for row, index in enumerate(chunk):
                    blocks[index] = encoded[row, :int(encoded_lengths[row])]
        return blocks  # type: ignore[return-value]

    def layout(self, text: str, features: list[torch.Tensor], tokenizer: Tokenizer, template: ChatTemplate,
               apply_chat_template: bool) -> PromptLayout:
        if len(features) != 1:
            raise MultimodalInputError("SALM answers about one audio clip; send a WAV, FLAC, OGG or MP3 file "
                                       "(input_media_bytes) or the waveform (input_signal)")
        prompt = salm_prompt(text, template) if apply_chat_template else text
        add_bos = apply_chat_template and template.add_bos
        ids = tokenizer.encode(prompt, add_bos=add_bos) if (prompt or add_bos) else []
        return PromptLayout([features[0], ids] if ids else [features[0]])


class SalmModel(ModelType):
    """Export/load half of SALM: NeMo's audio perception module as ``perception_engine/``."""

    name = "salm"
    perception = SalmPerception
    perception_dir = "perception_engine"

    def build_perception(self, model_config: Any, state_dict: dict[str, torch.Tensor], *, dtype: torch.dtype,
                         vision_tower_path: str | None, audio_frontend: str | None = None) -> AudioPerception:
        """The perception module in float32 (NeMo computes audio features in float32), weights loaded."""
        section, weights = perception_section(model_config, state_dict)
        if not any(name.startswith("encoder.") for name in weights):
            raise ValueError("the checkpoint holds no perception.encoder weights: NeMo leaves a frozen audio encoder "
                             "out of SALM checkpoints (freeze_audio_encoder) and reloads it from "
                             "model.pretrained_audio_model; save a checkpoint that holds the encoder weights")
        perception = AudioPerception.from_config(section, frontend=audio_frontend)
        perception.load_state_dict(weights)
        return perception.float().eval()

    def save_perception(self, encoder: AudioPerception, directory: Path, model_config: Any, *,
                        video_frame_sampling: str | None = None) -> dict:
        directory.mkdir(parents=True, exist_ok=True)
        section, _ = perception_section(model_config, {})
        per_second = features_per_second(encoder)
        config = {"model_type": self.name, "perception": {**_container(section), "frontend": encoder.frontend},
                  "features_per_second": per_second}
        (directory / "config.json").write_text(json.dumps(config, indent=2))
        weights = {name: tensor.detach().contiguous() for name, tensor in encoder.state_dict().items()}
        save_file(weights, str(directory / "model.safetensors"))
        return {"features_per_item": per_second}

    def load_perception(self, directory: Path, *, device: str, dtype: torch.dtype | None,
                        media: MediaPolicy | None = None, encoder_batch: int | None = None) -> SalmPerception:
        config = json.loads((directory / "config.json").read_text())
        if "perception" not in config:
            raise ValueError(f"{directory}/config.json has no 'perception' section; export the checkpoint again "
                             "with model_type salm")
        perception = AudioPerception.from_config(config["perception"])
        perception.load_state_dict(load_file(str(directory / "model.safetensors")))
        limits = None if media is None else AudioLimits(max_bytes=media.max_bytes,
                                                        max_duration_s=media.max_audio_duration_s)
        return SalmPerception(perception.float().eval().to(device), config["features_per_second"], limits,
                              encoder_batch)

    def chat_template(self, model_config: Any) -> ChatTemplate:
        return salm_template(model_config)

    def export_onnx(self, encoder: AudioPerception, directory: Path) -> None:
        export_audio_onnx(encoder, directory / "encoder.onnx")



def salm_prompt(text: str, template: ChatTemplate) -> str:
    """The prompt training formed for the question ``text`` (the default question when empty).

    A text already in the template's form, such as NeMo's runner default ``"Q: <question> A:"``, is taken as its
    question and formed again the way training did.
    """
    question = text.strip() or DEFAULT_QUESTION
    prefix, suffix = (part.strip() for part in template.render(_SENTINEL, placeholder="").split(_SENTINEL))
    if prefix and suffix and len(question) > len(prefix) + len(suffix) \
            and question.startswith(prefix) and question.endswith(suffix):
        question = question[len(prefix):-len(suffix)].strip()
    return template.render(question, placeholder="").strip(" ")


def salm_template(model_config: Any) -> ChatTemplate:
    """The checkpoint's prompt template as a :class:`ChatTemplate` whose message is the question.

    Read as NeMo's ``TextProcessing`` reads it: ``prompt_template`` (escapes such as ``\\n`` unescaped), the
    ``context_key`` / ``answer_key`` placeholders (``input`` / ``output`` when those are what it holds), the answer
    placeholder last; ``add_bos``; ``end_string`` ends the answer when it is one token.
    """
    data = _plain(model_config).get("data") or {}
    datasets = [data.get(name) or {} for name in ("train_ds", "validation_ds", "test_ds")]
    settings = next((ds for ds in datasets if _is_value(ds.get("prompt_template"))), datasets[0])
    raw = settings.get("prompt_template") if _is_value(settings.get("prompt_template")) else DEFAULT_PROMPT_TEMPLATE
    text = str(raw).encode("utf-8").decode("unicode_escape")
    context_key, answer_key = settings.get("context_key") or "context", settings.get("answer_key") or "answer"
    if f"{{{context_key}}}" not in text or f"{{{answer_key}}}" not in text:
        if "{input}" in text and "{output}" in text:
            context_key, answer_key = "input", "output"
    context, answer = f"{{{context_key}}}", f"{{{answer_key}}}"
    if context not in text or not text.endswith(answer):
        raise ValueError(f"data.train_ds.prompt_template {raw!r} must hold {context} and end with {answer}")
    escaped = text[:-len(answer)].strip(" ").replace("{", "{{").replace("}", "}}")
    prompt = escaped.replace("{" + context + "}", "{message}")
    end_string = data.get("end_string") if _is_value(data.get("end_string")) else settings.get("end_string")
    stops = (str(end_string),) if _is_value(end_string) else ()
    return ChatTemplate("salm", prompt, add_bos=bool(settings.get("add_bos", False)), stop_tokens=stops)


def perception_section(model_config: Any, state_dict: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
    """The perception config and its weights (NeMo names without ``perception.``) from a whole SALM checkpoint or
    from NeMo's exported perception folder."""
    if "perception" in model_config:
        prefix = "perception."
        weights = {name[len(prefix):]: value for name, value in state_dict.items() if name.startswith(prefix)}
        return model_config["perception"], weights
    if "encoder" in model_config and "modality_adapter" in model_config:
        return model_config, dict(state_dict)
    raise ValueError("not a SALM checkpoint: its model_config.yaml has no 'perception' section (and is not NeMo's "
                     "exported perception folder with encoder and modality_adapter); check visual_checkpoint_path")


def features_per_second(perception: AudioPerception) -> int:
    """The feature count of one second of audio."""
    rate = perception.sample_rate
    device = next(perception.parameters()).device
    with torch.inference_mode():
        _, lengths = perception(torch.zeros(1, rate, device=device), torch.tensor([rate], device=device))
    return int(lengths[0])


def _container(section: Any) -> dict:
    """A config section as plain data, resolved where its interpolations resolve."""
    if not isinstance(section, DictConfig):
        return dict(section)
    try:
        return OmegaConf.to_container(section, resolve=True)
    except OmegaConfBaseException:  # an interpolation pointing outside the saved config: keep it as written
        return OmegaConf.to_container(section, resolve=False)


def _plain(model_config: Any) -> dict:
    if isinstance(model_config, DictConfig):
        return OmegaConf.to_container(model_config, resolve=False)
    return dict(model_config or {})


def _is_value(value: Any) -> bool:
    """Set, and not an interpolation (a saved config's ``${model...}`` cannot resolve)."""
    return value is not None and value != "" and not (isinstance(value, str) and value.startswith("${"))


MODEL_TYPES = (SalmModel(),)
