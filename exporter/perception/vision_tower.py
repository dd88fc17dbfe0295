"""Vision towers (CLIP / SigLIP, built as `vit.VisionTransformer`) resolved from a NeMo config, never downloaded.

Resolution order:
(a) tower weights stored in the checkpoint (unfrozen tower); the architecture then comes from a local
    folder (`mm_cfg.vision_encoder.from_pretrained` or `vision_tower_path`), else from
    `mm_cfg.vision_encoder` fields;
(b) `from_pretrained` when it is a local folder (or a copy in the local Hugging Face cache);
(c) `vision_tower_path`.
A folder may hold a full CLIPModel/SiglipModel or a vision-only model.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .vit import VisionTransformer

TOWER_PREFIX = "embedding.word_embeddings.vision_encoder."
TOWER_TYPES = ("clip", "siglip")
_HF_PREFIX = "vision_model."
_LAYER_KEY = re.compile(r"^encoder\.layers\.(\d+)\.")


class VisionTowerError(ValueError):
    """The vision tower cannot be built from what the checkpoint and the options give."""


@dataclass
class TowerSource:
    """What instantiating a tower needs: type, HF vision config, weights (names without `vision_model.`)."""

    tower_type: str
    hf_config: dict[str, Any]
    weights: dict[str, torch.Tensor]
    preprocessor_config: dict[str, Any] | None
    origin: str

    @property
    def image_size(self) -> int:
        return int(self.hf_config["image_size"])

    @property
    def patch_size(self) -> int:
        return int(self.hf_config["patch_size"])

    @property
    def num_layers(self) -> int:
        return int(self.hf_config["num_hidden_layers"])


def strip_hf_prefix(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weight names without a leading `vision_model.` (transformers 4.x writes it, 5.x does not)."""
    return {k.removeprefix(_HF_PREFIX): v for k, v in weights.items()}


def checkpoint_tower_weights(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tower weights stored in a canonical NeMo state dict (present when the tower was trained), else `{}`."""
    return strip_hf_prefix(
        {k[len(TOWER_PREFIX) :]: state_dict[k] for k in state_dict if k.startswith(TOWER_PREFIX)}
    )


def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    if cfg is None:
        return default
    value = cfg.get(key, default)
    return default if value is None else value


def _tower_type_name(model_type: str | None) -> str | None:
    if not model_type:
        return None
    name = str(model_type).lower().removesuffix("_vision_model")
    if name not in TOWER_TYPES:
        raise VisionTowerError(
            f"unsupported vision tower model_type {model_type!r}; supported: {TOWER_TYPES}"
        )
    return name


def local_model_folder(name_or_path: str | os.PathLike | None) -> Path | None:
    """A local folder with `config.json` for a path, or for a hub name cached locally (no network)."""
    if not name_or_path:
        return None
    path = Path(os.path.expanduser(str(name_or_path)))
    if (path / "config.json").is_file():
        return path
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(str(name_or_path), "config.json")
    except (ImportError, ValueError):  # no hub client, or not a valid repo id: not cached
        return None
    return Path(cached).parent if isinstance(cached, str) else None


def _read_weight_files(folder: Path, wanted) -> dict[str, torch.Tensor]:
    """Tensors whose names pass `wanted` from the safetensors / PyTorch files of a HF model folder."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if files:
        weights = {}
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                names = [k for k in handle.keys() if wanted(k)]  # noqa: SIM118 (safe_open is not a Mapping)
                weights.update({k: handle.get_tensor(k) for k in names})
        return weights
    files = sorted(folder.glob("pytorch_model*.bin"))
    if not files:
        raise VisionTowerError(
            f"no model.safetensors or pytorch_model.bin weights in vision tower folder {folder}"
        )
    weights = {}
    for file in files:
        weights.update(
            {k: v for k, v in torch.load(file, map_location="cpu", weights_only=True).items() if wanted(k)}
        )
    return weights


def read_tower_folder(
    folder: Path, load_weights: bool = True, fallback_type: str | None = None
) -> TowerSource:
    """Type, vision config and (optionally) weights of a local CLIP/SigLIP folder, full or vision-only."""
    config = json.loads((folder / "config.json").read_text())
    full_model = "vision_config" in config
    vision_config = dict(config["vision_config"]) if full_model else dict(config)
    tower_type = _tower_type_name(config.get("model_type")) or fallback_type
    if tower_type is None:
        raise VisionTowerError(
            f"{folder / 'config.json'} has no model_type: set mm_cfg.vision_encoder.model_type "
            "(clip or siglip)"
        )
    vision_config.pop("model_type", None)
    weights: dict[str, torch.Tensor] = {}
    if load_weights:
        wanted = (lambda k: k.startswith(_HF_PREFIX)) if full_model else (lambda k: True)
        weights = strip_hf_prefix(_read_weight_files(folder, wanted))
    processor_file = folder / "preprocessor_config.json"
    processor = json.loads(processor_file.read_text()) if processor_file.is_file() else None
    return TowerSource(tower_type, vision_config, weights, processor, str(folder))


def _layer_count(weights: Mapping[str, torch.Tensor]) -> int:
    indices = {int(m.group(1)) for k in weights if (m := _LAYER_KEY.match(k))}
    return max(indices) + 1 if indices else 0


def _config_from_mm_cfg(
    tower_type: str, vision_cfg: Any, weights: Mapping[str, torch.Tensor]
) -> dict[str, Any]:
    """An HF vision config from `mm_cfg.vision_encoder` fields, with missing sizes read off the weights."""
    heads = _cfg_get(vision_cfg, "num_attention_heads")
    if heads is None:
        raise VisionTowerError(
            "the checkpoint holds the vision tower weights but no tower config: set "
            "mm_cfg.vision_encoder.num_attention_heads (or pass vision_tower_path, a local folder with "
            "config.json)"
        )
    try:
        patch_weight = weights["embeddings.patch_embedding.weight"]
        positions = weights["embeddings.position_embedding.weight"].shape[0]
    except KeyError as missing:
        raise VisionTowerError(f"vision tower weights in the checkpoint lack {missing}") from None
    patch = int(_cfg_get(vision_cfg, "patch_dim", patch_weight.shape[-1]))
    grid = round((positions - (1 if tower_type == "clip" else 0)) ** 0.5)
    crop = _cfg_get(vision_cfg, "crop_size")
    image_size = _cfg_get(vision_cfg, "image_size", grid * patch if crop is None else int(crop[0]))
    fc1 = weights.get("encoder.layers.0.mlp.fc1.weight")
    hidden = int(patch_weight.shape[0])
    if int(_cfg_get(vision_cfg, "hidden_size", hidden)) != hidden:
        raise VisionTowerError(
            f"mm_cfg.vision_encoder.hidden_size is {vision_cfg.get('hidden_size')} but the vision tower "
            f"weights in the checkpoint have hidden size {hidden}"
        )
    config = {
        "hidden_size": hidden,
        "num_hidden_layers": int(_cfg_get(vision_cfg, "num_layers", _layer_count(weights))),
        "num_attention_heads": int(heads),
        "intermediate_size": int(
            _cfg_get(vision_cfg, "ffn_hidden_size", fc1.shape[0] if fc1 is not None else 0)
        ),
        "patch_size": patch,
        "image_size": int(image_size),
        "layer_norm_eps": float(
            _cfg_get(vision_cfg, "layernorm_epsilon", 1e-5 if tower_type == "clip" else 1e-6)
        ),
        "num_channels": int(patch_weight.shape[1]),
    }
    if _cfg_get(vision_cfg, "hidden_act"):
        config["hidden_act"] = str(vision_cfg.get("hidden_act"))
    if tower_type == "siglip":
        config["vision_use_head"] = any(k.startswith("head.") for k in weights)
    return config


def resolve_tower_source(
    mm_cfg: Any, state_dict: Mapping[str, torch.Tensor], vision_tower_path: str | os.PathLike | None = None
) -> TowerSource:
    """Finds the tower's type, config and weights following the module's resolution order."""
    vision_cfg = _cfg_get(mm_cfg, "vision_encoder")
    if vision_cfg is None:
        raise VisionTowerError("the model config has no mm_cfg.vision_encoder section")
    if _cfg_get(vision_cfg, "from_hf", True) is False:
        raise VisionTowerError(
            "mm_cfg.vision_encoder.from_hf is False (a NeMo CLIP .nemo tower); only transformers CLIP/SigLIP "
            "towers are supported"
        )
    from_pretrained = _cfg_get(vision_cfg, "from_pretrained")
    if vision_tower_path is not None and local_model_folder(vision_tower_path) is None:
        raise VisionTowerError(
            f"vision_tower_path {vision_tower_path!r} is not a local folder with config.json"
        )
    folder = local_model_folder(from_pretrained) or local_model_folder(vision_tower_path)
    stored = checkpoint_tower_weights(state_dict)
    configured_type = _tower_type_name(_cfg_get(vision_cfg, "model_type"))
    names = f"{from_pretrained or ''} {vision_tower_path or ''}".lower()
    named_type = "siglip" if "siglip" in names else None

    if folder is not None:
        source = read_tower_folder(
            folder, load_weights=not stored, fallback_type=configured_type or named_type
        )
        if stored:
            source.weights, source.origin = stored, f"checkpoint weights, architecture from {folder}"
        if configured_type and configured_type != source.tower_type:
            raise VisionTowerError(
                f"mm_cfg.vision_encoder.model_type is {configured_type!r} but {folder} holds a "
                f"{source.tower_type!r} model; fix the config or pass the right vision_tower_path"
            )
        return source
    if stored:
        tower_type = configured_type or named_type or "clip"
        config = _config_from_mm_cfg(tower_type, vision_cfg, stored)
        return TowerSource(tower_type, config, stored, None, "checkpoint weights, architecture from mm_cfg")
    raise VisionTowerError(
        f"the checkpoint has no vision tower weights and mm_cfg.vision_encoder.from_pretrained "
        f"({from_pretrained!r}) is not a local folder; nothing is downloaded: pass "
        "vision_tower_path=<local folder of the HF CLIP/SigLIP model> (vision_tower_path option)"
    )


# The architecture fields the tower reads, where a config leaves them out (transformers' CLIPVisionConfig and
# SiglipVisionConfig defaults)
_DEFAULTS = {
    "clip": dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
                 num_channels=3, image_size=224, patch_size=32, hidden_act="quick_gelu", layer_norm_eps=1e-5),
    "siglip": dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
                   num_channels=3, image_size=224, patch_size=16, hidden_act="gelu_pytorch_tanh",
                   layer_norm_eps=1e-6),
}


def tower_config(tower_type: str, hf_config: Mapping[str, Any], keep_layers: int | None = None) -> dict[str, Any]:
    """The vision config with the defaults of the fields the tower reads filled in, JSON-safe; ``keep_layers``
    trims it to its first layers (and drops SigLIP's pooling head)."""
    config = json.loads(json.dumps({**_DEFAULTS[tower_type], **dict(hf_config)}))
    if keep_layers is not None:
        config["num_hidden_layers"] = keep_layers
        if tower_type == "siglip":
            config["vision_use_head"] = False
    return config


def instantiate_tower(
    tower_type: str,
    hf_config: Mapping[str, Any],
    weights: Mapping[str, torch.Tensor],
    *,
    keep_layers: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> VisionTransformer:
    """The project's CLIP / SigLIP tower (`vit.VisionTransformer`) holding `weights`.

    `keep_layers` trims the encoder to its first layers (features are read after them) and drops SigLIP's
    pooling head; the weights of dropped parts are ignored, any other missing or extra weight is an error.
    """
    config = tower_config(tower_type, hf_config, keep_layers)
    layers = int(config["num_hidden_layers"])
    given = strip_hf_prefix(weights)
    kept = {key: tensor for key, tensor in given.items()
            if not ((match := _LAYER_KEY.match(key)) is not None and int(match.group(1)) >= layers)}
    present = {int(match.group(1)) for key in kept if (match := _LAYER_KEY.match(key))}
    if present != set(range(layers)):
        absent = sorted(set(range(layers)) - present)
        raise VisionTowerError(f"vision tower weights do not match the {tower_type} config: encoder layers "
                               f"{absent[:8]} missing")
    try:
        return VisionTransformer.from_weights(tower_type, config, kept, dtype)
    except ValueError as error:
        raise VisionTowerError(str(error)) from None


@dataclass
class VisionTower:
    """A built tower and the facts the encoder and the preprocessing need."""

    module: nn.Module
    tower_type: str
    image_size: int
    patch_size: int
    hf_config: dict[str, Any]
    preprocessor_config: dict[str, Any] | None


def feature_layer_index(select_layer: int, num_layers: int) -> int:
    """`hidden_states[select_layer]` as a count of encoder layers (0 = embeddings output)."""
    index = select_layer + num_layers + 1 if select_layer < 0 else select_layer
    if not 0 <= index <= num_layers:
        raise VisionTowerError(
            f"mm_cfg.vision_encoder.vision_select_layer {select_layer} is out of range for a tower with "
            f"{num_layers} layers (valid: {-num_layers - 1}..{num_layers})"
        )
    return index


def build_vision_tower(
    mm_cfg: Any,
    state_dict: Mapping[str, torch.Tensor],
    vision_tower_path: str | os.PathLike | None = None,
    *,
    select_layer: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> VisionTower:
    """Resolves (see module docstring) and instantiates the tower of a NeMo multimodal config.

    With `select_layer` the tower keeps only the layers up to `hidden_states[select_layer]`, so the output of
    its last layer is that feature.
    """
    source = resolve_tower_source(mm_cfg, state_dict, vision_tower_path)
    keep = None if select_layer is None else feature_layer_index(select_layer, source.num_layers)
    module = instantiate_tower(
        source.tower_type,
        source.hf_config,
        source.weights,
        keep_layers=keep,
        dtype=dtype,
    )
    return VisionTower(
        module,
        source.tower_type,
        source.image_size,
        source.patch_size,
        tower_config(source.tower_type, source.hf_config, keep),
        source.preprocessor_config,
    )
