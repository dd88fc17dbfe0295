"""The decoder's architecture: read from a NeMo-1 model config; saved to and loaded from the engine config."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# NeMo activation name -> the name the decoder uses. `fast-*` and plain gated names differ only in how NeMo
# stores the weights; the canonical state dict always holds one fused `[gate; up]` linear_fc1.
ACTIVATIONS = {
    "fast-swiglu": "swiglu",
    "swiglu": "swiglu",
    "fast-geglu": "geglu",
    "geglu": "geglu",
    "fast-reglu": "reglu",
    "reglu": "reglu",
    "gelu": "gelu",
    "openai-gelu": "openai-gelu",
    "squared-relu": "squared-relu",
}
GATED_ACTIVATIONS = ("swiglu", "geglu", "reglu")
NORMALIZATIONS = ("layernorm", "layernorm1p", "rmsnorm")
POSITION_EMBEDDINGS = ("rope", "learned_absolute")
GELU_APPROXIMATIONS = ("none", "tanh")
ROUTER_SCORE_FUNCTIONS = ("softmax", "sigmoid")
#: `name` of NeMo-1 Falcon configs: NeMo builds its Falcon layer (parallel attention + MLP) only for this name.
FALCON_SPEC_NAME = "megatron_falcon_gpt"
# How the decoder layers' linear weights may be stored (exporter/llm/quant): int8 per output channel, int4 in
# groups along the input (plain or activation-aware), FP8 e4m3 per output channel.
QUANT_METHODS = ("int8_wo", "int4_wo", "int4_awq", "fp8")
INT4_GROUP_SIZES = (128, 64, 32)


def _supported(field: str, value: Any, allowed: tuple[str, ...] | list[str]) -> None:
    if value not in allowed:
        raise ValueError(
            f"model config {field}={value!r} is not supported; supported values: {', '.join(allowed)}"
        )


@dataclass(frozen=True)
class QuantConfig:
    """How the decoder layers' QKV, proj, fc1 and fc2 weights are stored; embedding, head and norms keep the
    model dtype. `group_size` (int4 methods only, default 128) is the preferred group along the input; a layer
    whose input width it does not divide uses the largest of 128/64/32 that does, else 32 with zero padding."""

    method: str
    group_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in QUANT_METHODS:
            raise ValueError(f"quantization {self.method!r} is not supported; supported values: "
                             f"{', '.join(QUANT_METHODS)}")
        if self.method.startswith("int4"):
            if self.group_size is None:
                object.__setattr__(self, "group_size", INT4_GROUP_SIZES[0])
            if self.group_size not in INT4_GROUP_SIZES:
                raise ValueError(f"quantization group_size {self.group_size!r} is not supported; supported values: "
                                 f"{', '.join(map(str, INT4_GROUP_SIZES))}")
        elif self.group_size is not None:
            raise ValueError(f"quantization {self.method} takes no group_size (got {self.group_size})")


@dataclass(frozen=True)
class DecoderConfig:
    """Everything that defines a GPT-style decoder's shape and numerics.

    `normalization` is `layernorm` or `rmsnorm`; `zero_centered_gamma` means the stored norm weight is γ-1
    (NeMo's `layernorm1p`). `activation` is one of the values of `ACTIVATIONS`; the gated ones compute
    `act(x·W_gate) * (x·W_up)` from one `[gate; up]` weight; `gelu_approximation` "tanh" makes GELU the tanh
    form. `vocab_size` is the padded vocabulary.

    Family fields: `apply_embedding_scaling` multiplies the input embeddings by sqrt(hidden) (Gemma).
    `parallel_attention_mlp`: attention and MLP both read the layer input and their outputs are added to it
    together (Falcon); `shared_input_norm`: such a block has one norm, `input_layernorm`, feeding both (else the
    MLP has its own `pre_mlp_layernorm`). `attention_window`: a token attends to keys at most this many positions
    back (Megatron's `window_size[0]`; None: all). `num_moe_experts` > 0 makes every MLP a mixture of experts:
    a router picks `moe_router_topk` experts per token (`moe_router_pre_softmax`: softmax over all experts, then
    top-k; else top-k logits, then their softmax; `moe_router_score_function` "sigmoid": top-k sigmoids,
    normalised), weights scaled by `moe_router_topk_scaling_factor`; each expert's MLP has
    `moe_ffn_hidden_size` (default `ffn_hidden_size`).
    `quantization`: how the layers' linear weights are stored (None: in the model dtype).
    """

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    normalization: str = "rmsnorm"
    zero_centered_gamma: bool = False
    norm_epsilon: float = 1e-5
    activation: str = "swiglu"
    bias: bool = False
    position_embedding_type: str = "rope"
    rotary_percentage: float = 1.0
    rotary_base: float = 10000.0
    seq_len_interpolation_factor: float | None = None
    max_position_embeddings: int = 4096
    share_embeddings_and_output_weights: bool = False
    gelu_approximation: str = "none"
    apply_embedding_scaling: bool = False
    parallel_attention_mlp: bool = False
    shared_input_norm: bool = False
    attention_window: int | None = None
    num_moe_experts: int = 0
    moe_router_topk: int = 2
    moe_router_pre_softmax: bool = False
    moe_router_score_function: str = "softmax"
    moe_router_topk_scaling_factor: float | None = None
    moe_ffn_hidden_size: int | None = None
    quantization: QuantConfig | None = None

    def __post_init__(self) -> None:
        if self.quantization is not None and not isinstance(self.quantization, QuantConfig):
            raise ValueError(f"quantization must be a QuantConfig or None, got {self.quantization!r}")
        _supported("normalization", self.normalization, ("layernorm", "rmsnorm"))
        _supported("activation", self.activation, sorted(set(ACTIVATIONS.values())))
        _supported("position_embedding_type", self.position_embedding_type, POSITION_EMBEDDINGS)
        _supported("gelu_approximation", self.gelu_approximation, GELU_APPROXIMATIONS)
        _supported("moe_router_score_function", self.moe_router_score_function, ROUTER_SCORE_FUNCTIONS)
        for name in (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "head_dim",
            "vocab_size",
            "max_position_embeddings",
        ):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(
                    f"model config {name} must be a positive integer, got {getattr(self, name)!r}"
                )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.num_query_groups})"
            )
        if not 0.0 < self.rotary_percentage <= 1.0:
            raise ValueError(f"rotary_percentage must be in (0, 1], got {self.rotary_percentage}")
        if self.position_embedding_type == "rope" and self.rotary_dim % 2:
            raise ValueError(
                f"rotary_percentage {self.rotary_percentage} x head_dim {self.head_dim} gives an odd "
                f"number of rotary dims ({self.rotary_dim}); it must be even"
            )
        if self.shared_input_norm and not self.parallel_attention_mlp:
            raise ValueError("shared_input_norm needs parallel_attention_mlp: a sequential layer has two norms")
        if self.attention_window is not None and self.attention_window < 0:
            raise ValueError(f"attention_window must be None or >= 0, got {self.attention_window}")
        if self.num_moe_experts < 0 or (self.num_moe_experts and not 1 <= self.moe_router_topk <= self.num_moe_experts):
            raise ValueError(
                f"moe_router_topk must be between 1 and num_moe_experts ({self.num_moe_experts}), "
                f"got {self.moe_router_topk}"
            )
        if self.num_moe_experts and self.bias:
            raise ValueError("mixture-of-experts layers with linear biases (bias=True) are not supported")

    @property
    def gated(self) -> bool:
        return self.activation in GATED_ACTIVATIONS

    @property
    def expert_ffn_hidden_size(self) -> int:
        """The FFN size of each expert of a mixture-of-experts MLP."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def rotary_dim(self) -> int:
        """Leading head dims that RoPE rotates (Megatron: `int(head_dim * rotary_percentage)`)."""
        return int(self.head_dim * self.rotary_percentage)

    @classmethod
    def from_nemo(cls, cfg: Mapping[str, Any], vocab_size: int) -> DecoderConfig:
        """Build from a NeMo-1 model config (NeMo's defaults for missing fields).

        `vocab_size` is the number of rows of `embedding.word_embeddings.weight` (the padded vocabulary),
        which the config does not record. Values this decoder cannot run raise ValueError naming the field.
        """
        for field in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads"):
            if cfg.get(field) is None:
                raise ValueError(f"model config has no {field}; it is needed to build the decoder")
        _reject_unsupported_knobs(cfg)

        normalization = str(cfg.get("normalization", "layernorm")).lower()
        _supported("normalization", normalization, NORMALIZATIONS)
        activation = str(cfg.get("activation", "gelu")).lower()
        _supported("activation", activation, list(ACTIVATIONS))
        position_embedding_type = str(cfg.get("position_embedding_type", "learned_absolute")).lower()
        _supported("position_embedding_type", position_embedding_type, POSITION_EMBEDDINGS)

        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        bias = bool(cfg.get("bias", True))
        max_positions = cfg.get("max_position_embeddings") or cfg.get("encoder_seq_length") or 4096
        interpolation = cfg.get("seq_len_interpolation_factor")
        activation, gelu_approximation = _activation(cfg, activation, bias)
        parallel, shared_input_norm = _falcon_block(cfg, bias)
        return cls(
            num_layers=int(cfg["num_layers"]),
            hidden_size=hidden,
            ffn_hidden_size=int(cfg["ffn_hidden_size"]),
            num_attention_heads=heads,
            num_query_groups=int(cfg.get("num_query_groups") or heads),
            head_dim=int(cfg.get("kv_channels") or hidden // heads),
            vocab_size=int(vocab_size),
            normalization="layernorm" if normalization == "layernorm1p" else normalization,
            zero_centered_gamma=normalization == "layernorm1p"
            or bool(cfg.get("layernorm_zero_centered_gamma")),
            norm_epsilon=float(cfg.get("layernorm_epsilon", 1e-5)),
            activation=activation,
            bias=bias,
            position_embedding_type=position_embedding_type,
            rotary_percentage=float(cfg.get("rotary_percentage", 1.0)),
            rotary_base=float(cfg.get("rotary_base", 10000)),
            seq_len_interpolation_factor=None if interpolation is None else float(interpolation),
            max_position_embeddings=int(max_positions),
            share_embeddings_and_output_weights=bool(cfg.get("share_embeddings_and_output_weights", True)),
            gelu_approximation=gelu_approximation,
            apply_embedding_scaling=bool(cfg.get("apply_embedding_scaling", False)),
            parallel_attention_mlp=parallel,
            shared_input_norm=shared_input_norm,
            attention_window=_attention_window(cfg.get("window_size")),
            **_moe_fields(cfg),
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> DecoderConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown decoder config fields {unknown}; known fields: {sorted(known)}")
        quantization = values.get("quantization")
        if quantization is not None:
            values = {**values, "quantization": QuantConfig(**quantization)}
        return cls(**values)


def _activation(cfg: Mapping[str, Any], name: str, bias: bool) -> tuple[str, str]:
    """(activation, gelu_approximation) as Megatron runs them.

    `openai_gelu` replaces the activation function by the tanh GELU, keeping the gating (NeMo's
    `activation_to_func`). GELU with `bias_activation_fusion` (NeMo's default) runs Megatron's fused bias-GELU
    kernels, which compute the tanh approximation; the exact erf form runs only without fusion.
    """
    activation = ACTIVATIONS[name]
    gated = activation in GATED_ACTIVATIONS
    if cfg.get("openai_gelu") or activation == "openai-gelu":
        return ("geglu" if gated else "gelu"), "tanh"
    fused = bool(cfg.get("bias_activation_fusion", True)) and (gated or bias)
    return activation, "tanh" if fused and activation in ("gelu", "geglu") else "none"


def _falcon_block(cfg: Mapping[str, Any], bias: bool) -> tuple[bool, bool]:
    """(parallel attention + MLP, one shared input norm) of NeMo's Falcon layer, from its customization config.

    Falcon-7B: parallel, one `input_layernorm`. Falcon-40B (`new_decoder_architecture`): parallel, the MLP has
    its own `pre_mlp_layernorm`. Otherwise (Falcon-RW) sequential, its `post_self_attn_layernorm` acting as
    the pre-MLP norm. Other configs build Megatron's standard layer.
    """
    if cfg.get("name") != FALCON_SPEC_NAME:
        return False, False
    custom = cfg.get("mcore_customization_config") or {}
    new_architecture = bool(custom.get("new_decoder_architecture"))
    parallel = new_architecture or bool(custom.get("parallel_attention"))
    if parallel and bias:
        raise ValueError(
            "model config: a Falcon layer with parallel attention and bias=True is not supported (NeMo's Falcon "
            "layer leaves the attention and MLP output biases out of a parallel block)"
        )
    return parallel, parallel and not new_architecture


def _attention_window(window: Any) -> int | None:
    """Megatron's `window_size` `[left, right]` -> how far back a token attends (None: everything)."""
    if window is None:
        return None
    left, right = (list(window) + [0, 0])[:2]
    if right not in (0, None):
        raise ValueError(f"model config window_size={list(window)} looks ahead; only [left, 0] is supported")
    return None if left is None or left < 0 else int(left)


def _moe_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The DecoderConfig fields of a Megatron mixture-of-experts MLP (none for a dense model)."""
    experts = int(cfg.get("num_moe_experts") or 0)
    if not experts:
        return {}
    scaling = cfg.get("moe_router_topk_scaling_factor")
    ffn = cfg.get("moe_ffn_hidden_size")
    return {
        "num_moe_experts": experts,
        "moe_router_topk": int(cfg.get("moe_router_topk") or 2),
        "moe_router_pre_softmax": bool(cfg.get("moe_router_pre_softmax", False)),
        "moe_router_score_function": str(cfg.get("moe_router_score_function") or "softmax"),
        "moe_router_topk_scaling_factor": None if scaling is None else float(scaling),
        "moe_ffn_hidden_size": None if ffn is None else int(ffn),
    }


#: MoE options that change the maths and that the decoder does not run: (field, value that is harmless).
_UNSUPPORTED_MOE_FIELDS = (
    ("moe_shared_expert_intermediate_size", None), ("moe_router_enable_expert_bias", False),
    ("moe_router_group_topk", None), ("moe_router_num_groups", None), ("moe_apply_probs_on_input", False),
)


def _reject_unsupported_knobs(cfg: Mapping[str, Any]) -> None:
    """Legacy/rare NeMo options that change the maths: refused rather than silently computed differently."""
    if cfg.get("num_moe_experts"):
        for field, harmless in _UNSUPPORTED_MOE_FIELDS:
            if cfg.get(field, harmless) not in (harmless, 0):
                raise ValueError(f"model config {field}={cfg.get(field)!r} is not supported for mixture of experts")
        frequency = cfg.get("moe_layer_freq", 1)
        if frequency != 1 and (isinstance(frequency, (int, str)) or any(f != 1 for f in frequency)):
            raise ValueError(f"model config moe_layer_freq={frequency!r} is not supported; every layer must be MoE")
    custom = cfg.get("mcore_customization_config") or {}
    for field in ("final_logit_softcapping", "attn_logit_softcapping", "query_pre_attn_scalar"):
        if cfg.get(field) or custom.get(field):
            raise ValueError(f"model config {field} is set (Gemma 2): it is not supported")
    for field in ("qk_layernorm", "scale_positional_embedding"):
        if cfg.get(field):
            raise ValueError(f"model config {field}=True is not supported; supported values: False")
    block = cfg.get("transformer_block_type", "pre_ln")
    _supported("transformer_block_type", block, ("pre_ln",))
    if cfg.get("rotary_interleaved"):
        raise ValueError("model config rotary_interleaved=True is not supported; supported values: False")
    if cfg.get("normalize_attention_scores", True) is False:
        raise ValueError(
            "model config normalize_attention_scores=False is not supported; supported values: True"
        )
    if cfg.get("headscale"):
        raise ValueError("model config headscale=True is not supported; supported values: False")
