"""Tiny random GPT-style decoders (NeMo-1 configs, canonical weights) for the generation and runtime tests."""

from __future__ import annotations

import torch

from exporter.llm.config import DecoderConfig
from exporter.llm.model import Decoder, select_llm_weights


def make_tiny_gpt_weights(config: dict, vocab: int = 64, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random canonical weights (docs/architecture.md) for a NeMo-1 style GPT `config`."""
    generator = torch.Generator().manual_seed(seed)
    hidden, ffn = config["hidden_size"], config["ffn_hidden_size"]
    heads = config["num_attention_heads"]
    groups = config.get("num_query_groups") or heads
    head_dim = config.get("kv_channels") or hidden // heads
    fc1_rows = 2 * ffn if config["activation"] in ("fast-swiglu", "swiglu", "fast-geglu", "geglu") else ffn

    def rand(*shape):
        return torch.randn(*shape, generator=generator)

    weights = {
        "embedding.word_embeddings.weight": rand(vocab, hidden),
        "decoder.final_layernorm.weight": rand(hidden),
        "output_layer.weight": rand(vocab, hidden),
        "embedding.word_embeddings.adapter_layer.mm_projector_adapter.mm_projector.0.weight": rand(hidden, 8),
        "embedding.word_embeddings.adapter_layer.mm_projector_adapter.mm_projector.0.bias": rand(hidden),
    }
    for i in range(config["num_layers"]):
        layer = f"decoder.layers.{i}."
        weights.update(
            {
                layer + "input_layernorm.weight": rand(hidden),
                layer + "self_attention.linear_qkv.weight": rand((heads + 2 * groups) * head_dim, hidden),
                layer + "self_attention.linear_qkv.bias": rand((heads + 2 * groups) * head_dim),
                layer + "self_attention.linear_proj.weight": rand(hidden, heads * head_dim),
                layer + "self_attention.linear_proj.bias": rand(hidden),
                layer + "pre_mlp_layernorm.weight": rand(hidden),
                layer + "mlp.linear_fc1.weight": rand(fc1_rows, hidden),
                layer + "mlp.linear_fc1.bias": rand(fc1_rows),
                layer + "mlp.linear_fc2.weight": rand(hidden, ffn),
                layer + "mlp.linear_fc2.bias": rand(hidden),
            }
        )
    return weights


# The scheduler tests' model (2 layers, GQA, no biases); LONG_CONFIG is it with room for long prompts.
SCHEDULER_CONFIG = {
    "num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 48, "num_attention_heads": 4, "num_query_groups": 2,
    "kv_channels": 8, "activation": "fast-swiglu", "normalization": "rmsnorm", "bias": False,
    "position_embedding_type": "rope", "rotary_percentage": 1.0, "rotary_base": 10000,
    "share_embeddings_and_output_weights": False, "layernorm_epsilon": 1e-5, "max_position_embeddings": 256,
}
SCHEDULER_VOCAB = 64
LONG_CONFIG = {**SCHEDULER_CONFIG, "max_position_embeddings": 32768}


def scheduler_decoder() -> Decoder:
    """The scheduler tests' tiny decoder: `SCHEDULER_CONFIG` without biases, random weights of seed 0."""
    torch.manual_seed(0)
    weights = make_tiny_gpt_weights({**SCHEDULER_CONFIG, "bias": False}, vocab=SCHEDULER_VOCAB)
    weights = {k: v for k, v in weights.items() if not k.endswith(".bias")}
    return Decoder.from_state_dict(DecoderConfig.from_nemo(SCHEDULER_CONFIG, vocab_size=SCHEDULER_VOCAB),
                                   select_llm_weights(weights))


def random_ids(seed: int, length: int, vocab: int = SCHEDULER_VOCAB) -> list[int]:
    """`length` random token ids in `[3, vocab)` (no special ids)."""
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def unit_scale_decoder(device: str = "cpu", dtype: torch.dtype = torch.float32) -> Decoder:
    """The tiny decoder with its matrices scaled by 1/sqrt(fan-in): activations of unit scale, as trained models
    keep them (the float8 comparisons need realistic ranges)."""
    weights = make_tiny_gpt_weights(LONG_CONFIG, vocab=SCHEDULER_VOCAB, seed=4)
    weights = {k: v / v.shape[-1] ** 0.5 if v.ndim == 2 and "embedding" not in k else v
               for k, v in weights.items() if not k.endswith(".bias")}
    return Decoder.from_state_dict(DecoderConfig.from_nemo(LONG_CONFIG, vocab_size=SCHEDULER_VOCAB),
                                   select_llm_weights(weights), dtype=dtype, device=device)


# The GPU parity tests' model: 3 layers, GQA, weights scaled by 0.3 (no near-ties on greedy paths).
PARITY_VOCAB = 128
PARITY_CONFIG = {
    "num_layers": 3, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4, "num_query_groups": 2,
    "activation": "fast-swiglu", "normalization": "rmsnorm", "bias": False, "position_embedding_type": "rope",
    "share_embeddings_and_output_weights": False, "layernorm_epsilon": 1e-5, "max_position_embeddings": 256,
}


def parity_decoder(device: str, dtype: torch.dtype) -> Decoder:
    """The GPU parity model on `device` in `dtype`."""
    weights = {k: v for k, v in make_tiny_gpt_weights(PARITY_CONFIG, vocab=PARITY_VOCAB, seed=3).items()
               if not k.endswith(".bias")}
    weights = {k: v * 0.3 for k, v in select_llm_weights(weights).items()}
    return Decoder.from_state_dict(DecoderConfig.from_nemo(PARITY_CONFIG, vocab_size=PARITY_VOCAB), weights,
                                   dtype=dtype, device=device)


# The checkpoint memory tests' model: ~580 MB of float32 with vocab 8192 (10 layers of ~51 MB, largest tensor fc1,
# 23 MB, plus two 33 MB vocabulary matrices). Above ~430 MB a loader holding two copies of the weights (2 W) exceeds
# their limit: the tests can catch one.
BIG_CONFIG = {
    "num_layers": 10,
    "hidden_size": 1024,
    "ffn_hidden_size": 2816,
    "num_attention_heads": 16,
    "num_query_groups": 16,
    "kv_channels": 64,
    "activation": "fast-swiglu",
    "normalization": "rmsnorm",
    "bias": True,
}
