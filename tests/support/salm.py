"""A tiny SALM checkpoint in NeMo's layouts, audio clips written with soundfile, and an independent reference.

The checkpoint: a `.nemo` with `perception.*` weights (NeMo's AudioPerceptionModule names), `model.*` Llama weights
and LoRA adapters on QKV, dense, fc1 and fc2 (`adapter_layer.lora_*`), a `model_config.yaml` with a `perception`
section as NeMo writes it, `peft.lora_tuning` and the `data` prompt settings, and a SentencePiece tokenizer; or
NeMo's split export layout (perception folder + LLM `.nemo` with the LoRA merged).

The reference merges the LoRA in transformers' own (unfused) q/k/v/o/gate/up/down weights, feeds
`LlamaForCausalLM` the clip's features from `AudioPerception` followed by the literal prompt's SentencePiece ids
(no BOS), and decodes greedily.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sentencepiece
import soundfile
import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

from exporter.perception.audio import AudioPerception
from support.tokenizer_files import tokenizer_file
from support.vlm import FFN, GROUPS, HEADS, HIDDEN, LAYERS
from tools.nemo_writer import fuse_qkv, hf_llama_to_nemo, write_nemo

RATE = 16000
N_MELS = 32
LORA_DIM, LORA_ALPHA = 4, 8.0  # scale alpha / dim = 2
HEAD_DIM = HIDDEN // HEADS
TRAINED_PROMPT = "Q: {q}\nA:"  # data.train_ds.prompt_template "Q: {context}\nA: {answer}", answer cut, stripped
DEFAULT_QUESTION = "what's the transcription of the audio?"

_CONFORMER = {
    "_target_": "nemo.collections.asr.modules.ConformerEncoder", "feat_out": -1, "subsampling": "dw_striding",
    "causal_downsampling": False, "reduction": None, "reduction_position": None, "reduction_factor": 1,
    "ff_expansion_factor": 2, "self_attention_model": "rel_pos", "n_heads": 2, "att_context_size": [-1, -1],
    "att_context_style": "regular", "xscaling": True, "untie_biases": True, "pos_emb_max_len": 5000,
    "conv_kernel_size": 9, "conv_norm_type": "batch_norm", "conv_context_size": None, "dropout": 0.1,
    "dropout_pre_encoder": 0.1, "dropout_emb": 0.0, "dropout_att": 0.1, "stochastic_depth_drop_prob": 0.0,
    "stochastic_depth_mode": "linear", "stochastic_depth_start_layer": 1,
}
PERCEPTION_CONFIG = {
    "use_multi_layer_feat": False,
    "preprocessor": {
        "_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor", "sample_rate": RATE,
        "normalize": "per_feature", "window_size": 0.025, "window_stride": 0.01, "window": "hann",
        "features": N_MELS, "n_fft": 512, "log": True, "frame_splicing": 1, "dither": 1.0e-05, "pad_to": 0,
        "pad_value": 0.0,
    },
    "encoder": {**_CONFORMER, "feat_in": N_MELS, "n_layers": 2, "d_model": 32, "subsampling_factor": 4,
                "subsampling_conv_channels": 16},
    "modality_adapter": {**_CONFORMER, "feat_in": 32, "n_layers": 1, "d_model": 32, "subsampling_factor": 2,
                         "subsampling_conv_channels": 16},
    "spec_augment": {"_target_": "nemo.collections.asr.modules.SpectrogramAugmentation", "freq_masks": 2,
                     "time_masks": 10, "freq_width": 27, "time_width": 0.05},
    "output_dim": HIDDEN,
}
LLM_CONFIG = {
    "mcore_gpt": True, "num_layers": LAYERS, "hidden_size": HIDDEN, "ffn_hidden_size": FFN,
    "num_attention_heads": HEADS, "num_query_groups": GROUPS, "kv_channels": None, "normalization": "rmsnorm",
    "layernorm_epsilon": 1e-5, "activation": "fast-swiglu", "bias": False, "position_embedding_type": "rope",
    "rotary_percentage": 1.0, "rotary_base": 10000, "share_embeddings_and_output_weights": False,
    "make_vocab_size_divisible_by": 128, "max_position_embeddings": 512, "encoder_seq_length": 512,
    "precision": 32,
}
PEFT_CONFIG = {"peft_scheme": "lora", "restore_from_path": None, "lora_tuning": {
    "target_modules": ["attention_qkv", "attention_dense", "mlp_fc1", "mlp_fc2"], "adapter_dim": LORA_DIM,
    "alpha": LORA_ALPHA, "adapter_dropout": 0.0, "column_init_method": "xavier", "row_init_method": "zero",
    "layer_selection": None, "weight_tying": False, "position_embedding_strategy": None}}
DATA_CONFIG = {"end_string": "[EOG]", "train_ds": {
    "context_key": "context", "answer_key": "answer", "add_eos": True, "end_string": "${model.data.end_string}",
    "add_sep": False, "add_bos": False, "separate_prompt_and_response_with_newline": False,
    "prompt_template": "Q: {context}\nA: {answer}", "sample_rate": RATE}}


@dataclass
class TinySalm:
    """A built checkpoint and what its reference needs."""

    nemo: Path
    llm: LlamaForCausalLM  # LoRA merged
    unmerged_llm: LlamaForCausalLM
    perception: AudioPerception
    sp_path: Path


def build_salm(folder: Path, seed: int = 0, llm_family=None) -> TinySalm:
    """Write a tiny SALM `.nemo` (NeMo-1 layout, float32) into `folder`; `llm_family` (a `support.llm_families.Family`
    of hidden size 64, vocab 384) replaces the Llama and its LoRA."""
    folder.mkdir(parents=True, exist_ok=True)
    sp_path = tokenizer_file(folder)
    torch.manual_seed(seed)
    llm = LlamaForCausalLM(LlamaConfig(vocab_size=384, hidden_size=HIDDEN, intermediate_size=FFN,
                                       num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                       num_key_value_heads=GROUPS, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                       max_position_embeddings=512)).eval()
    perception = _random_perception(seed)
    hf_deltas, nemo_lora = _lora(seed)
    merged = copy.deepcopy(llm)
    with torch.no_grad():
        for name, delta in hf_deltas.items():
            merged.get_parameter(name).add_(delta)
    weights = hf_llama_to_nemo(llm.state_dict(), HEADS, GROUPS)
    weights.update(nemo_lora)
    peft = {"peft": PEFT_CONFIG}
    if llm_family is not None:
        llm = merged = llm_family.hf
        weights, peft = dict(llm_family.weights), {}
    weights.update({f"perception.{name}": value for name, value in perception.state_dict().items()})
    config = {**LLM_CONFIG, **(llm_family.config if llm_family is not None else {}),
              "tokenizer": _tokenizer_config(sp_path), "perception": PERCEPTION_CONFIG, **peft, "data": DATA_CONFIG,
              "freeze_llm": True, "freeze_audio_encoder": False}
    nemo = write_nemo(folder / "salm.nemo", config, weights, artifacts={"tokenizer.model": sp_path})
    return TinySalm(nemo, merged, llm, perception, sp_path)


def write_split_layout(salm: TinySalm, folder: Path) -> tuple[Path, Path]:
    """NeMo's export layout: `<folder>/salm_perception/` (model_config.yaml = the perception section,
    model_weights.ckpt without the `perception.` prefix) and `<folder>/salm_llm.nemo` with the LoRA merged."""
    perception_dir = folder / "salm_perception"
    perception_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(PERCEPTION_CONFIG), perception_dir / "model_config.yaml")
    torch.save(dict(salm.perception.state_dict()), perception_dir / "model_weights.ckpt")
    llm_nemo = write_nemo(folder / "salm_llm.nemo", {**LLM_CONFIG, "tokenizer": _tokenizer_config(salm.sp_path)},
                          hf_llama_to_nemo(salm.llm.state_dict(), HEADS, GROUPS),
                          artifacts={"tokenizer.model": salm.sp_path})
    return perception_dir, llm_nemo


def _tokenizer_config(sp_path: Path) -> dict:
    return {"library": "sentencepiece", "type": None, "model": str(sp_path), "sentencepiece_legacy": True}


def _random_perception(seed: int) -> AudioPerception:
    """The perception module with every weight and norm statistic drawn at random (the mel filters kept)."""
    perception = AudioPerception.from_config(OmegaConf.create(PERCEPTION_CONFIG))
    generator = torch.Generator().manual_seed(seed + 10)
    state = perception.state_dict()
    for name, tensor in state.items():
        if not tensor.is_floating_point() or name.startswith("preprocessor."):
            continue
        noise = torch.randn(tensor.shape, generator=generator)
        if name.endswith("running_var"):
            state[name] = 0.5 + noise.abs()
        elif "norm" in name and name.endswith(".weight"):
            state[name] = 1 + 0.2 * noise
        else:
            state[name] = 0.3 * noise
    perception.load_state_dict(state)
    return perception.eval()


def _lora(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """LoRA adapters as (merged deltas in transformers' names, NeMo adapter weights in canonical names)."""
    generator = torch.Generator().manual_seed(seed + 20)
    scale = LORA_ALPHA / LORA_DIM

    def rand(*shape):
        return 0.3 * torch.randn(*shape, generator=generator)

    deltas, nemo = {}, {}
    for i in range(LAYERS):
        hf, layer = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = rand(LORA_DIM, HIDDEN)
        b = {p: rand(rows, LORA_DIM) for p, rows in (("q", HIDDEN), ("k", GROUPS * HEAD_DIM), ("v", GROUPS * HEAD_DIM))}
        deltas.update({f"{hf}self_attn.{p}_proj.weight": scale * b[p] @ a for p in "qkv"})
        nemo[f"{layer}self_attention.adapter_layer.lora_kqv_adapter.linear_in.weight"] = a
        nemo[f"{layer}self_attention.adapter_layer.lora_kqv_adapter.linear_out.weight"] = fuse_qkv(
            b["q"], b["k"], b["v"], GROUPS, HEAD_DIM)
        a, b_o = rand(LORA_DIM, HIDDEN), rand(HIDDEN, LORA_DIM)
        deltas[f"{hf}self_attn.o_proj.weight"] = scale * b_o @ a
        nemo[f"{layer}self_attention.adapter_layer.lora_dense_attention_adapter.linear_in.weight"] = a
        nemo[f"{layer}self_attention.adapter_layer.lora_dense_attention_adapter.linear_out.weight"] = b_o
        a, b_gate, b_up = rand(LORA_DIM, HIDDEN), rand(FFN, LORA_DIM), rand(FFN, LORA_DIM)
        deltas[f"{hf}mlp.gate_proj.weight"] = scale * b_gate @ a
        deltas[f"{hf}mlp.up_proj.weight"] = scale * b_up @ a
        nemo[f"{layer}mlp.adapter_layer.lora_hto4h_adapter.linear_in.weight"] = a
        nemo[f"{layer}mlp.adapter_layer.lora_hto4h_adapter.linear_out.weight"] = torch.cat([b_gate, b_up])
        a, b_down = rand(LORA_DIM, FFN), rand(HIDDEN, LORA_DIM)
        deltas[f"{hf}mlp.down_proj.weight"] = scale * b_down @ a
        nemo[f"{layer}mlp.adapter_layer.lora_4htoh_adapter.linear_in.weight"] = a
        nemo[f"{layer}mlp.adapter_layer.lora_4htoh_adapter.linear_out.weight"] = b_down
    return deltas, nemo


# --- audio clips --------------------------------------------------------------------------------------------------


def tone(seed: int, seconds: float, rate: int = RATE) -> np.ndarray:
    """A band-limited test signal (a few enveloped partials under 4 kHz), a function of time: the same sound
    sampled at any rate."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(round(seconds * rate))) / rate
    signal = np.zeros_like(t)
    for _ in range(5):
        freq, phase, amp = rng.uniform(120, 3500), rng.uniform(0, 2 * np.pi), rng.uniform(0.05, 0.15)
        envelope = 0.6 + 0.4 * np.sin(2 * np.pi * rng.uniform(1, 4) * t + rng.uniform(0, 2 * np.pi))
        signal += amp * envelope * np.sin(2 * np.pi * freq * t + phase)
    return signal.astype(np.float32)


@dataclass
class Clips:
    """Clip files: `wav` (1.0 s float WAV), `flac` (1.6 s), `stereo` (0.8 s, 44.1 kHz, two channels), `ogg`,
    `mp3`, and the 16 kHz mono signals the first three hold."""

    wav: Path
    flac: Path
    stereo: Path
    ogg: Path
    mp3: Path
    wav_signal: np.ndarray
    flac_signal: np.ndarray
    stereo_mono_16k: np.ndarray


def write_clips(folder: Path) -> Clips:
    folder.mkdir(parents=True, exist_ok=True)
    wav_signal, flac_signal = tone(1, 1.0), tone(2, 1.6)
    soundfile.write(folder / "clip.wav", wav_signal, RATE, subtype="FLOAT")
    soundfile.write(folder / "clip.flac", flac_signal, RATE, subtype="PCM_16")
    flac_decoded, _ = soundfile.read(folder / "clip.flac", dtype="float32")
    left = tone(3, 0.8, 44100)
    soundfile.write(folder / "stereo.wav", np.stack([left, 0.5 * left], axis=1), 44100, subtype="FLOAT")
    soundfile.write(folder / "clip.ogg", tone(4, 1.2), RATE, format="OGG", subtype="VORBIS")
    soundfile.write(folder / "clip.mp3", tone(5, 1.2), RATE, format="MP3", subtype="MPEG_LAYER_III")
    return Clips(folder / "clip.wav", folder / "clip.flac", folder / "stereo.wav", folder / "clip.ogg",
                 folder / "clip.mp3", wav_signal, flac_decoded, 0.75 * tone(3, 0.8))


# --- the independent reference ------------------------------------------------------------------------------------


def reference_tokens(salm: TinySalm, signal: np.ndarray, prompt: str, steps: int, merged: bool = True) -> list[int]:
    """Greedy ids of `LlamaForCausalLM` given `[clip features ; ids of prompt]` (no BOS)."""
    sp = sentencepiece.SentencePieceProcessor(model_file=str(salm.sp_path))
    llm = salm.llm if merged else salm.unmerged_llm
    embed = llm.get_input_embeddings()
    with torch.no_grad():
        encoded, lengths = salm.perception(torch.from_numpy(signal)[None], torch.tensor([signal.shape[0]]))
        audio = encoded[0, : int(lengths[0])]
        sequence = torch.cat([audio, embed(torch.tensor(sp.encode(prompt), dtype=torch.long))])
        generated: list[int] = []
        for _ in range(steps):
            token = int(llm(inputs_embeds=sequence[None]).logits[0, -1].argmax())
            if token == sp.eos_id():
                break
            generated.append(token)
            sequence = torch.cat([sequence, embed(torch.tensor([token]))])
    return generated
