"""Tiny Neva/VILA checkpoints in NeMo's layout (transformers' Llama and CLIP/SigLIP towers with random weights),
the prompts their templates render, and a tiny Neva exported for the CPU. Their reference answer is
`support.neva_reference`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf
from transformers import (
    CLIPVisionConfig,
    CLIPVisionModel,
    LlamaConfig,
    LlamaForCausalLM,
    SiglipVisionConfig,
    SiglipVisionModel,
)

from exporter import TensorRTMMExporter
from support.tokenizer_files import tokenizer_file
from tools.nemo_writer import hf_llama_to_nemo, write_nemo

HIDDEN, HEADS, GROUPS, FFN, LAYERS = 64, 4, 2, 128, 2
TOWER_HIDDEN, IMAGE, PATCH = 32, 32, 8
PROJECTOR_PREFIX = "embedding.word_embeddings.adapter_layer.mm_projector_adapter.mm_projector"
TOWER_PREFIX = "embedding.word_embeddings.vision_encoder."
CHAT = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
        "detailed, and polite answers to the user's questions.")
VISION_SYSTEM = ("You are a helpful language and vision assistant. You are able to understand the visual content "
                 "that the user provides, and assist the user with a variety of tasks using natural language.")
LABELS = "quality:4,toxicity:0,humor:0,creativity:0,helpfulness:4,correctness:4,coherence:4,complexity:4,verbosity:4"
# The prompts training rendered, written out literally: (text with <image>, BOS in front).
PROMPTS = {
    "v1": (CHAT + " USER: <image>\n{q} ASSISTANT:", True),
    "nvgpt": ("<extra_id_0>System\n" + CHAT + "\n\n<extra_id_1>User\n<image>\n{q}\n<extra_id_1>Assistant\n"
              "<extra_id_2>" + LABELS + "\n", False),
    "llama_2": ("[INST] <<SYS>>\n" + VISION_SYSTEM + "\n<</SYS>>\n\n<image>\n{q} [/INST]", True),
    "mistral": ("[INST] <image>\n{q} [/INST]", True),
}

_LITA = {"use_lita": True, "lita": {"visual_token_format": "im_vid_start_end",
                                    "lita_video_arch": "temporal_all_resolution", "sample_frames": 2}}
# build_vlm's arguments for a tiny checkpoint of each video model type
VIDEO_TYPES = {
    "video-neva": dict(template="nvgpt", config_overrides={"data": {"media_type": "video", "num_frames": 3}}),
    "lita": dict(template="v1", config_overrides={"mm_cfg": _LITA, "data": {"media_type": "video", "num_frames": 6}}),
    "vita": dict(template="llama_3", tower_type="siglip", projector_type="mlp_downsample", aspect="pad",
                 config_overrides={"mm_cfg": {**_LITA, "llm": {"model_type": "vita"}},
                                   "data": {"media_type": "video", "num_frames": 6}}),
}


@dataclass
class TinyVlm:
    """A built checkpoint and the transformers modules and files its reference needs."""

    nemo: Path
    llm: LlamaForCausalLM
    tower: torch.nn.Module
    tower_type: str
    projector_type: str
    projector: dict[str, torch.Tensor]
    sp_path: Path
    template: str
    aspect: str
    export_kwargs: dict = field(default_factory=dict)


def build_vlm(folder: Path, sp_path: Path, *, tower_type="clip", projector_type="mlp2x_gelu", layout="legacy",
              tp_size=1, mcore=True, tower_at="checkpoint", template="v1", aspect="square", seed=0,
              config_overrides: dict | None = None, llm_family=None) -> TinyVlm:
    """Write a tiny Neva-style ``.nemo``; ``tower_at`` is checkpoint | from_pretrained | vision_tower_path;
    ``config_overrides`` are merged into model_config.yaml (e.g. the video types' ``data`` and ``mm_cfg.lita``);
    ``llm_family`` (a ``support.llm_families.Family`` of hidden size 64, vocab 384) replaces the Llama."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    vocab = 384  # the 300-piece SentencePiece vocab padded to a multiple of 128, as NeMo pads it
    llm = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FFN,
                                       num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                       num_key_value_heads=GROUPS, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                       max_position_embeddings=512)).eval()
    tower = _tower(tower_type)
    projector = _projector(projector_type, seed)
    weights = hf_llama_to_nemo(llm.state_dict(), HEADS, GROUPS)
    if llm_family is not None:
        llm, weights = llm_family.hf, dict(llm_family.weights)
    weights.update({f"{PROJECTOR_PREFIX}{name}": value for name, value in projector.items()})
    vision = {"from_pretrained": "example-org/tiny-tower-not-downloaded", "from_hf": True,
              "hidden_size": TOWER_HIDDEN, "patch_dim": PATCH, "crop_size": [IMAGE, IMAGE],
              "vision_select_layer": -2, "vision_select_feature": "patch", "class_token_length": 1, "freeze": True}
    export_kwargs: dict = {}
    if tower_at == "checkpoint":
        weights.update({TOWER_PREFIX + name: value for name, value in tower.state_dict().items()})
        vision.update(freeze=False, model_type=tower_type, num_layers=2, num_attention_heads=4, ffn_hidden_size=64,
                      image_size=IMAGE, layernorm_epsilon=tower.config.layer_norm_eps,
                      hidden_act=tower.config.hidden_act)
    else:
        tower.save_pretrained(folder / "tower")
        if tower_at == "from_pretrained":
            vision["from_pretrained"] = str(folder / "tower")
        else:
            export_kwargs["vision_tower_path"] = str(folder / "tower")
    config = {
        "mcore_gpt": mcore, "num_layers": LAYERS, "hidden_size": HIDDEN, "ffn_hidden_size": FFN,
        "num_attention_heads": HEADS, "num_query_groups": GROUPS, "kv_channels": None,
        "normalization": "rmsnorm", "layernorm_epsilon": 1e-5, "activation": "fast-swiglu", "bias": False,
        "position_embedding_type": "rope", "rotary_percentage": 1.0, "rotary_base": 10000,
        "share_embeddings_and_output_weights": False, "make_vocab_size_divisible_by": 128,
        "max_position_embeddings": 512, "encoder_seq_length": 512, "precision": 32,
        "tokenizer": {"library": "sentencepiece", "type": None, "model": str(sp_path), "sentencepiece_legacy": True},
        "mm_cfg": {"llm": {"freeze": True, "model_type": template}, "vision_encoder": vision,
                   "mm_mlp_adapter_type": projector_type, "use_im_start_end": False},
        "data": {"media_type": "image", "image_aspect_ratio": aspect, "conv_template": template},
        **(llm_family.config if llm_family is not None else {}),
    }
    if config_overrides:
        config = OmegaConf.to_container(OmegaConf.merge(config, config_overrides))
    nemo = write_nemo(folder / "model.nemo", config, weights, layout=layout, tp_size=tp_size, mcore=mcore,
                      artifacts={"tokenizer.model": sp_path})
    return TinyVlm(nemo, llm, tower.eval(), tower_type, projector_type, projector, sp_path, template, aspect,
                   export_kwargs)


def _tower(tower_type: str) -> torch.nn.Module:
    sizes = {"hidden_size": TOWER_HIDDEN, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "image_size": IMAGE, "patch_size": PATCH}
    if tower_type == "clip":
        return CLIPVisionModel(CLIPVisionConfig(**sizes))
    return SiglipVisionModel(SiglipVisionConfig(**sizes))


def _projector(projector_type: str, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed + 1)

    def rand(*shape):
        return torch.randn(*shape, generator=generator)

    if projector_type == "linear":
        return {".weight": rand(HIDDEN, TOWER_HIDDEN), ".bias": rand(HIDDEN)}
    if projector_type == "mlp2x_gelu":
        return {".0.weight": rand(HIDDEN, TOWER_HIDDEN), ".0.bias": rand(HIDDEN),
                ".2.weight": rand(HIDDEN, HIDDEN), ".2.bias": rand(HIDDEN)}
    return {".1.weight": 1 + rand(4 * TOWER_HIDDEN), ".1.bias": rand(4 * TOWER_HIDDEN),
            ".2.weight": rand(HIDDEN, 4 * TOWER_HIDDEN), ".2.bias": rand(HIDDEN),
            ".4.weight": rand(HIDDEN, HIDDEN), ".4.bias": rand(HIDDEN)}


def tiny_neva(folder: Path, max_output_len: int, max_batch_size: int = 2) -> TensorRTMMExporter:
    """A tiny random Neva (16 features per image, prompts up to 200 tokens) exported in-process for the CPU."""
    vlm = build_vlm(folder / "ckpt", tokenizer_file(folder))
    exporter = TensorRTMMExporter(folder / "engine", device="cpu")
    exporter.export(vlm.nemo, model_type="neva", dtype="float32", max_batch_size=max_batch_size, max_input_len=200,
                    max_output_len=max_output_len, max_multimodal_len=max_batch_size * 16)
    return exporter
