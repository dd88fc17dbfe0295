"""Tiny transformers vision towers (CLIP, SigLIP) with projector weights and the Neva model config under NeMo's
names, for the perception tests."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf
from transformers import CLIPVisionConfig, CLIPVisionModel, SiglipVisionConfig, SiglipVisionModel

from exporter.perception.projector import PROJECTOR_PREFIX
from exporter.perception.vision_tower import TOWER_PREFIX
from support.projectors import project

VISION_HIDDEN, LLM_HIDDEN, HEADS = 32, 48, 4


def tiny_tower(tower_type: str, image_size: int = 32, layers: int = 3, seed: int = 0):
    """A randomly initialised transformers vision model (the reference)."""
    torch.manual_seed(seed)
    sizes = {
        "hidden_size": VISION_HIDDEN,
        "intermediate_size": 64,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "patch_size": 8,
        "image_size": image_size,
    }
    if tower_type == "clip":
        model = CLIPVisionModel(CLIPVisionConfig(**sizes))
    else:
        model = SiglipVisionModel(SiglipVisionConfig(**sizes))
    for param in model.parameters():  # non-trivial norms / biases
        param.data.add_(0.05 * torch.randn_like(param))
    return model.eval()


def tower_state(model, with_hf_prefix: bool = True) -> dict:
    """Tower weights as NeMo stores an unfrozen tower (transformers 4.x names carry `vision_model.`)."""
    prefix = TOWER_PREFIX + ("vision_model." if with_hf_prefix else "")
    return {prefix + k.removeprefix("vision_model."): v.clone() for k, v in model.state_dict().items()}


def projector_state(adapter: str, seed: int = 1) -> dict:
    """Random projector weights under NeMo's key names for `adapter`."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "linear": {"weight": (LLM_HIDDEN, VISION_HIDDEN), "bias": (LLM_HIDDEN,)},
        "mlp2x_gelu": {
            "0.weight": (LLM_HIDDEN, VISION_HIDDEN),
            "0.bias": (LLM_HIDDEN,),
            "2.weight": (LLM_HIDDEN, LLM_HIDDEN),
            "2.bias": (LLM_HIDDEN,),
        },
        "mlp3x_gelu": {
            "0.weight": (LLM_HIDDEN, VISION_HIDDEN),
            "0.bias": (LLM_HIDDEN,),
            "2.weight": (LLM_HIDDEN, LLM_HIDDEN),
            "2.bias": (LLM_HIDDEN,),
            "4.weight": (LLM_HIDDEN, LLM_HIDDEN),
            "4.bias": (LLM_HIDDEN,),
        },
        "mlp_downsample": {
            "1.weight": (4 * VISION_HIDDEN,),
            "1.bias": (4 * VISION_HIDDEN,),
            "2.weight": (LLM_HIDDEN, 4 * VISION_HIDDEN),
            "2.bias": (LLM_HIDDEN,),
            "4.weight": (LLM_HIDDEN, LLM_HIDDEN),
            "4.bias": (LLM_HIDDEN,),
        },
        "identity": {},
    }[adapter]
    return {PROJECTOR_PREFIX + k: 0.2 * torch.randn(s, generator=gen) for k, s in shapes.items()}


def model_config(adapter: str = "linear", llm_hidden: int = LLM_HIDDEN, **vision_fields):
    """A Neva model config (pad aspect) with a tiny CLIP tower and projector `adapter`."""
    vision = {
        "from_pretrained": "openai/clip-vit-large-patch14-336",
        "from_hf": True,
        "hidden_size": VISION_HIDDEN,
        "vision_select_layer": -2,
        "vision_select_feature": "patch",
        "class_token_length": 1,
        "patch_dim": 8,
        "crop_size": [32, 32],
        "num_attention_heads": HEADS,
        "freeze": True,
    }
    vision.update(vision_fields)
    return OmegaConf.create(
        {
            "hidden_size": llm_hidden,
            "data": {"image_aspect_ratio": "pad"},
            "mm_cfg": {"mm_mlp_adapter_type": adapter, "vision_encoder": vision},
        }
    )


def project_by_hand(adapter: str, x: torch.Tensor, state: dict) -> torch.Tensor:
    """`support.projectors.project` with the weights of `state` (named as `projector_state` names them)."""
    return project(adapter, {name.removeprefix(PROJECTOR_PREFIX): value for name, value in state.items()}, x)


def pixels_for(size, batch=2, seed=3) -> torch.Tensor:
    """`batch` random pixel arrays `[3, size, size]`."""
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))
