"""Tiny transformers models of the LLM families NeMo's deploy script names, in NeMo's layout.

Each builder returns a `Family`: the transformers model (random weights, norms included), the NeMo-1 model config
NeMo's HF->NeMo converter writes for it, and its weights under canonical names, converted as that converter does
(per-group interleaved QKV, `[gate; up]` fc1, the family's norm names and norm conventions). Nothing here calls
the decoder: the tests compare it against the transformers model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import (
    FalconConfig,
    FalconForCausalLM,
    GemmaConfig,
    GemmaForCausalLM,
    GPTBigCodeConfig,
    GPTBigCodeForCausalLM,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Starcoder2Config,
    Starcoder2ForCausalLM,
)

from tools.nemo_writer import hf_llama_to_nemo

HIDDEN, HEADS, LAYERS, FFN, EXPERTS, MAX_POSITIONS = 64, 4, 2, 96, 4, 512
TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


@dataclass
class Family:
    """A transformers model and the NeMo checkpoint contents (config fields, canonical weights) made from it."""

    hf: torch.nn.Module
    config: dict
    weights: dict[str, torch.Tensor]


def randomize_(model: torch.nn.Module, seed: int, norm_center: float = 1.0) -> torch.nn.Module:
    """Random values at realistic scales, so every convention shows in the logits: norm weights
    `norm_center + 0.2 N(0,1)` (0 where transformers stores them zero-centred), biases `0.2 N(0,1)`, matrices
    `N(0,1)/sqrt(fan_in)` (activations of order one, where GELU's erf and tanh forms differ)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.dim() > 1:
                param.copy_(noise / param.shape[-1] ** 0.5)
            elif "norm" in name or ".ln_" in name:
                param.copy_(norm_center + 0.2 * noise)
            else:
                param.copy_(0.2 * noise)
    return model.eval()


def _base_config(hf: torch.nn.Module, **fields) -> dict:
    return {"num_layers": LAYERS, "hidden_size": HIDDEN, "num_attention_heads": HEADS,
            "max_position_embeddings": MAX_POSITIONS, "layernorm_epsilon": 1e-5, "position_embedding_type": "rope",
            "rotary_base": hf.config.rope_parameters["rope_theta"], "share_embeddings_and_output_weights": False,
            **fields}


def _renamed(state_dict: dict[str, torch.Tensor], names: dict[str, str]) -> dict[str, torch.Tensor]:
    """`state_dict` with every `old` part of each key replaced by its `new` (in `names`' order)."""
    out = {}
    for key, value in state_dict.items():
        for old, new in names.items():
            key = key.replace(old, new)
        out[key] = value
    return out


def _moe_weights(sd: dict, prefix: str, layers: int) -> dict[str, torch.Tensor]:
    """Router and stacked experts of transformers' fused MoE parameters (`gate_up_proj` is `[gate; up]`)."""
    out = {}
    for i in range(layers):
        src, dst = f"{prefix}{i}.mlp.", f"decoder.layers.{i}.mlp."
        out[f"{dst}router.weight"] = sd[f"{src}gate.weight"]
        out[f"{dst}experts.linear_fc1.weight"] = sd[f"{src}experts.gate_up_proj"]
        out[f"{dst}experts.linear_fc2.weight"] = sd[f"{src}experts.down_proj"]
    return out


def mixtral(vocab: int = 384, seed: int = 0, groups: int = 2, topk: int = 2) -> Family:
    """Mixtral with `moe_router_pre_softmax: False`: top-k logits, then their softmax, which is transformers'
    softmax, top-k, renormalise."""
    hf = randomize_(MixtralForCausalLM(MixtralConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=groups, num_local_experts=EXPERTS,
        num_experts_per_tok=topk, rms_norm_eps=1e-5, max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False, **TOKENS)), seed)
    sd = hf.state_dict()
    weights = hf_llama_to_nemo({k: v for k, v in sd.items() if ".mlp." not in k}, HEADS, groups)
    weights.update(_moe_weights(sd, "model.layers.", LAYERS))
    config = _base_config(hf, ffn_hidden_size=FFN, num_query_groups=groups, normalization="rmsnorm",
                          activation="fast-swiglu", bias=False, num_moe_experts=EXPERTS, moe_router_topk=topk,
                          moe_router_pre_softmax=False)
    return Family(hf, config, weights)


def mixtral_pre_softmax(vocab: int = 384, seed: int = 0) -> Family:
    """`moe_router_pre_softmax: True` (what NeMo's Mixtral converters set): softmax over all experts, the top-k
    probabilities used as they are. Its transformers reference is Qwen2-MoE with `norm_topk_prob=False`, no QKV
    bias and its shared expert zeroed: the same computation."""
    hf = randomize_(Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FFN, moe_intermediate_size=FFN,
        shared_expert_intermediate_size=16, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=2, num_experts=EXPERTS, num_experts_per_tok=2, norm_topk_prob=False, qkv_bias=False,
        rms_norm_eps=1e-5, max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False, **TOKENS)), seed)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.shared_expert.down_proj.weight.zero_()
    sd = hf.state_dict()
    weights = hf_llama_to_nemo({k: v for k, v in sd.items() if ".mlp." not in k}, HEADS, 2)
    weights.update(_moe_weights(sd, "model.layers.", LAYERS))
    config = _base_config(hf, ffn_hidden_size=FFN, num_query_groups=2, normalization="rmsnorm",
                          activation="fast-swiglu", bias=False, num_moe_experts=EXPERTS, moe_router_topk=2,
                          moe_router_pre_softmax=True)
    return Family(hf, config, weights)


def gemma(vocab: int = 384, seed: int = 0, zero_centered: bool = False) -> Family:
    """Gemma (MQA, head_dim 32 != hidden/heads, tanh GeGLU, embeddings x sqrt(hidden), tied head).

    NeMo-1's converter stores the RMSNorm weights plus one; NeMo 2.0 stores them as transformers does, with
    `layernorm_zero_centered_gamma` (`zero_centered`)."""
    hf = randomize_(GemmaForCausalLM(GemmaConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=1, head_dim=32, hidden_act="gelu_pytorch_tanh",
        rms_norm_eps=1e-6, max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True, **TOKENS)), seed,
        norm_center=0.0)
    sd = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    if not zero_centered:
        sd = {k: v + 1.0 if k.endswith("norm.weight") else v for k, v in sd.items()}
    config = _base_config(hf, ffn_hidden_size=FFN, num_query_groups=1, kv_channels=32, normalization="rmsnorm",
                          layernorm_zero_centered_gamma=zero_centered, activation="geglu", openai_gelu=True,
                          bias_activation_fusion=False, bias=False, apply_embedding_scaling=True,
                          share_embeddings_and_output_weights=True, layernorm_epsilon=1e-6)
    return Family(hf, config, hf_llama_to_nemo(sd, HEADS, 1, head_dim=32))


FALCON_KINDS = {  # transformers FalconConfig fields of each kind
    "7b": dict(new_decoder_architecture=False, parallel_attn=True, multi_query=True, bias=False),
    "40b": dict(new_decoder_architecture=True, parallel_attn=True, num_kv_heads=2, bias=False),
    "rw": dict(new_decoder_architecture=False, parallel_attn=False, multi_query=False, bias=True,
               activation="gelu_pytorch_tanh"),  # NeMo fuses bias-GELU for biased Falcons: the tanh form
}


def falcon(kind: str = "7b", vocab: int = 384, seed: int = 0) -> Family:
    """Falcon-7B (parallel block, one norm, MQA), -40B (new decoder architecture: two norms, GQA) or -RW
    (sequential, `post_self_attn_layernorm`, MHA, biases; NeMo runs it with RoPE instead of ALiBi)."""
    options = FALCON_KINDS[kind]
    hf = randomize_(FalconForCausalLM(FalconConfig(
        vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, alibi=False,
        max_position_embeddings=MAX_POSITIONS, layer_norm_epsilon=1e-5, tie_word_embeddings=False, **TOKENS,
        **options)), seed)
    groups = HEADS if not options.get("multi_query", True) else 1
    groups = hf.config.num_kv_heads if options["new_decoder_architecture"] else groups
    names = {"word_embeddings.": "embedding.word_embeddings.", "ln_f.": "decoder.final_layernorm.",
             "ln_attn.": "input_layernorm.", "ln_mlp.": "pre_mlp_layernorm.",
             "post_attention_layernorm.": "pre_mlp_layernorm.",  # canonical name of post_self_attn_layernorm
             "self_attention.query_key_value.": "self_attention.linear_qkv.",  # already NeMo's per-group order
             "self_attention.dense.": "self_attention.linear_proj.", "mlp.dense_h_to_4h.": "mlp.linear_fc1.",
             "mlp.dense_4h_to_h.": "mlp.linear_fc2."}
    weights = _renamed(hf.state_dict(), {"lm_head.": "output_layer.", "transformer.h.": "decoder.layers.",
                                         "transformer.": "", **names})
    config = _base_config(
        hf, name="megatron_falcon_gpt", ffn_hidden_size=4 * HIDDEN, num_query_groups=groups,
        normalization="layernorm", activation="gelu", bias=options["bias"],
        bias_activation_fusion=options["bias"],
        mcore_customization_config={"new_decoder_architecture": options["new_decoder_architecture"],
                                    "parallel_attention": options["parallel_attn"]})
    return Family(hf, config, weights)


def starcoder(vocab: int = 384, seed: int = 0) -> Family:
    """StarCoder (GPTBigCode): MQA, learned absolute positions, LayerNorm, biases, fused bias-GELU (tanh)."""
    hf = randomize_(GPTBigCodeForCausalLM(GPTBigCodeConfig(
        vocab_size=vocab, n_positions=MAX_POSITIONS, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=FFN,
        activation_function="gelu_pytorch_tanh", multi_query=True, layer_norm_epsilon=1e-5,
        tie_word_embeddings=False, **TOKENS)), seed)
    names = {"transformer.wte.": "embedding.word_embeddings.", "transformer.wpe.": "embedding.position_embeddings.",
             "transformer.ln_f.": "decoder.final_layernorm.", "lm_head.": "output_layer.",
             "transformer.h.": "decoder.layers.", ".ln_1.": ".input_layernorm.", ".ln_2.": ".pre_mlp_layernorm.",
             ".attn.c_attn.": ".self_attention.linear_qkv.",  # [Q | K | V]: MQA's one group, NeMo's order
             ".attn.c_proj.": ".self_attention.linear_proj.", ".mlp.c_fc.": ".mlp.linear_fc1.",
             ".mlp.c_proj.": ".mlp.linear_fc2."}
    weights = _renamed(hf.state_dict(), names)
    config = {"num_layers": LAYERS, "hidden_size": HIDDEN, "ffn_hidden_size": FFN, "num_attention_heads": HEADS,
              "num_query_groups": 1, "normalization": "layernorm", "activation": "gelu", "bias": True,
              "position_embedding_type": "learned_absolute", "max_position_embeddings": MAX_POSITIONS,
              "layernorm_epsilon": 1e-5, "share_embeddings_and_output_weights": False,
              "apply_query_key_layer_scaling": True}
    return Family(hf, config, weights)


def starcoder2(vocab: int = 384, seed: int = 0, window: int | None = None) -> Family:
    """StarCoder2: GQA, RoPE, LayerNorm, biases, fused bias-GELU (tanh); NeMo's `window_size: [w, 0]` attends
    to w + 1 keys, transformers' `sliding_window` to that many, so the reference gets w + 1."""
    hf = randomize_(Starcoder2ForCausalLM(Starcoder2Config(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, hidden_act="gelu_pytorch_tanh", norm_epsilon=1e-5,
        max_position_embeddings=MAX_POSITIONS, sliding_window=None if window is None else window + 1, use_bias=True,
        tie_word_embeddings=False, **TOKENS)), seed)
    sd = hf.state_dict()
    canonical = hf_llama_to_nemo(_renamed(sd, {"mlp.c_proj.": "mlp.down_proj."}), HEADS, 2)
    for i in range(LAYERS):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        canonical[f"{dst}mlp.linear_fc1.weight"] = sd[f"{src}mlp.c_fc.weight"]
        canonical[f"{dst}mlp.linear_fc1.bias"] = sd[f"{src}mlp.c_fc.bias"]
        canonical[f"{dst}input_layernorm.bias"] = sd[f"{src}input_layernorm.bias"]
        canonical[f"{dst}pre_mlp_layernorm.bias"] = sd[f"{src}post_attention_layernorm.bias"]
    canonical["decoder.final_layernorm.bias"] = sd["model.norm.bias"]
    config = _base_config(hf, ffn_hidden_size=FFN, num_query_groups=2, normalization="layernorm",
                          activation="gelu", bias=True, window_size=None if window is None else [window, 0])
    return Family(hf, config, canonical)


def gpt_next(vocab: int = 384, seed: int = 0) -> Family:
    """NeMo GPT-Next style: layernorm1p, RoPE on half of each head (`rotary_percentage` 0.5), biases, unfused
    exact GELU; the reference is GPT-NeoX with sequential residuals (its LayerNorm γ = NeMo's stored γ-1 plus 1)."""
    hf = randomize_(GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, hidden_act="gelu", use_parallel_residual=False, layer_norm_eps=1e-5,
        max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False, **TOKENS,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})), seed)
    names = {"gpt_neox.embed_in.": "embedding.word_embeddings.",
             "gpt_neox.final_layer_norm.": "decoder.final_layernorm.",
             "embed_out.": "output_layer.", "lm_head.": "output_layer.", "gpt_neox.layers.": "decoder.layers.",
             ".post_attention_layernorm.": ".pre_mlp_layernorm.",
             ".attention.query_key_value.": ".self_attention.linear_qkv.",  # per head [q, k, v]: NeMo's MHA order
             ".attention.dense.": ".self_attention.linear_proj.", ".mlp.dense_h_to_4h.": ".mlp.linear_fc1.",
             ".mlp.dense_4h_to_h.": ".mlp.linear_fc2."}
    weights = {k: v - 1.0 if "layernorm.weight" in k else v for k, v in _renamed(hf.state_dict(), names).items()}
    config = _base_config(hf, ffn_hidden_size=FFN, num_query_groups=None, normalization="layernorm1p",
                          activation="gelu", bias=True, bias_activation_fusion=False, rotary_percentage=0.5)
    return Family(hf, config, weights)


FAMILIES: dict[str, Callable[..., Family]] = {
    "mixtral": mixtral, "mixtral-pre-softmax": mixtral_pre_softmax, "gemma": gemma,
    "gemma-zero-centered": lambda **kw: gemma(zero_centered=True, **kw),
    "falcon-7b": lambda **kw: falcon("7b", **kw), "falcon-40b": lambda **kw: falcon("40b", **kw),
    "falcon-rw": lambda **kw: falcon("rw", **kw), "starcoder": starcoder, "starcoder2": starcoder2,
    "gpt-next": gpt_next,
}
