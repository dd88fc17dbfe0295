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
    `act(x·W_gate) * (x·W_up)` from one `[gate; up]` weight. `vocab_size` is the padded vocabulary.
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
    quantization: QuantConfig | None = None

    def __post_init__(self) -> None:
        if self.quantization is not None and not isinstance(self.quantization, QuantConfig):
            raise ValueError(f"quantization must be a QuantConfig or None, got {self.quantization!r}")
        _supported("normalization", self.normalization, ("layernorm", "rmsnorm"))
        _supported("activation", self.activation, sorted(set(ACTIVATIONS.values())))
        _supported("position_embedding_type", self.position_embedding_type, POSITION_EMBEDDINGS)
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

    @property
    def gated(self) -> bool:
        return self.activation in GATED_ACTIVATIONS

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
        max_positions = cfg.get("max_position_embeddings") or cfg.get("encoder_seq_length") or 4096
        interpolation = cfg.get("seq_len_interpolation_factor")
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
            activation=ACTIVATIONS[activation],
            bias=bool(cfg.get("bias", True)),
            position_embedding_type=position_embedding_type,
            rotary_percentage=float(cfg.get("rotary_percentage", 1.0)),
            rotary_base=float(cfg.get("rotary_base", 10000)),
            seq_len_interpolation_factor=None if interpolation is None else float(interpolation),
            max_position_embeddings=int(max_positions),
            share_embeddings_and_output_weights=bool(cfg.get("share_embeddings_and_output_weights", True)),
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


def _reject_unsupported_knobs(cfg: Mapping[str, Any]) -> None:
    """Legacy/rare NeMo options that change the maths: refused rather than silently computed differently."""
    if cfg.get("num_moe_experts"):
        raise ValueError("model config num_moe_experts is set: mixture-of-experts decoders are not supported")
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
