"""A tiny transformers Llama with random weights and the NeMo-1 config of the same shape (the decoder parity and
video tests compare the decoder with it)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

HIDDEN, LAYERS, VOCAB, FFN = 64, 2, 300, 96


def small_noise_(model: torch.nn.Module, seed: int, std: float = 0.1) -> torch.nn.Module:
    """Random values for every parameter, norms included (so γ, β and layernorm1p's +1 matter)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * std)
    return model.eval()


def llama_nemo_config(heads: int, groups: int, vocab: int = VOCAB, **extra) -> dict:
    """The NeMo-1 config of `tiny_llama(heads, groups)` (`extra` fields added)."""
    return {
        "num_layers": LAYERS,
        "hidden_size": HIDDEN,
        "ffn_hidden_size": FFN,
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "normalization": "rmsnorm",
        "activation": "fast-swiglu",
        "bias": False,
        "position_embedding_type": "rope",
        "share_embeddings_and_output_weights": False,
        "layernorm_epsilon": 1e-5,
        "max_position_embeddings": 128,
        **extra,
    }


def tiny_llama(
    heads: int,
    groups: int,
    vocab: int = VOCAB,
    rope_theta: float = 10000.0,
    scaling: float | None = None,
    seed: int = 0,
) -> LlamaForCausalLM:
    """transformers' Llama of this shape with `small_noise_` weights (linear RoPE scaling by `scaling`)."""
    rope = {"rope_type": "default", "rope_theta": rope_theta}
    if scaling is not None:
        rope = {"rope_type": "linear", "factor": scaling, "rope_theta": rope_theta}
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=heads,
        num_key_value_heads=groups,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_parameters=rope,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return small_noise_(LlamaForCausalLM(config), seed)
