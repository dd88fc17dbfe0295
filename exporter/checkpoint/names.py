"""Canonical weight names (docs/architecture.md): stored NeMo key -> canonical name, and TP split dimensions."""

from __future__ import annotations

import re

LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
#: Stored key prefixes, longest first: NeMo-1 `model.` (amp O2: `model.module.`), NeMo 2 `module.`.
STORED_PREFIXES = ("model.module.", "model.", "module.")
#: Stored entries that are not model weights (a buffer, legacy PP's tied copy of the embedding).
DROPPED_SUFFIXES = ("rotary_pos_emb.inv_freq", "word_embeddings_for_head.weight")

#: Activations whose `linear_fc1` holds `[gate; up]` (per TP rank in sharded files).
GATED_ACTIVATIONS = frozenset({"fast-swiglu", "swiglu", "fast-geglu", "geglu", "fast-reglu", "reglu"})
#: Legacy (non-mcore) activations whose up half is a separate `dense_h_to_4h_2`.
SEPARATE_UP_ACTIVATIONS = frozenset({"swiglu", "geglu", "reglu"})
#: Internal name of such a separate up half until it is appended to `linear_fc1`.
FC1_UP = "mlp.linear_fc1_up."
#: (canonical, TransformerEngine) name prefixes of a layer's norms, relative to `decoder.layers.<i>.`.
TE_NORM_NAMES = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
                 ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))
#: (canonical, legacy non-mcore) name prefixes of a layer's parameters.
LEGACY_LAYER_NAMES = (
    ("self_attention.linear_qkv.", "self_attention.query_key_value."),
    ("self_attention.linear_proj.", "self_attention.dense."), ("mlp.linear_fc1.", "mlp.dense_h_to_4h."),
    (FC1_UP, "mlp.dense_h_to_4h_2."), ("mlp.linear_fc2.", "mlp.dense_4h_to_h."),
    ("pre_mlp_layernorm.", "post_attention_layernorm."),
)
COLUMN_PARALLEL_LAYER_PARAMS = frozenset(
    module + kind for module in ("self_attention.linear_qkv.", "mlp.linear_fc1.", FC1_UP)
    for kind in ("weight", "bias")
)
#: (canonical, NeMo Falcon) name prefix: a sequential Falcon layer's norm before its MLP.
FALCON_NORM_NAMES = (("pre_mlp_layernorm.", "post_self_attn_layernorm."),)
#: (canonical, stored) prefix of stacked expert weights: dist checkpoints add an `experts.` level.
DIST_EXPERT_NAMES = (("mlp.experts.", "mlp.experts.experts."),)
#: One expert's linear layer (Megatron's SequentialMLP): its tensors are stacked into `mlp.experts.linear_fcX`.
EXPERT_KEY = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12]\.\w+)$")
#: TransformerEngine's grouped experts name expert e's weight `linear_fcX.weight<e>`.
_TE_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")
#: A NeMo LoRA adapter's weights (relative to a layer): (adapter, linear_in | linear_out).
_LORA_WEIGHT = re.compile(r"^(?:self_attention|mlp)\.adapter_layer\.(lora_\w+)\.(linear_in|linear_out)\.weight$")
#: NeMo's LoRA adapters whose input is TP-split (on RowParallel projections): their `linear_in` is a RowParallel
#: layer split along its input (dim 1). Every other `linear_in` (ColumnParallel, gathered) and every `linear_out`
#: (ColumnParallel) is split along its output rows (dim 0).
_LORA_ROW_PARALLEL = frozenset({"lora_dense_attention_adapter", "lora_4htoh_adapter"})
#: The LoRA adapter tensor whose rows are fc1's `[gate; up]` (per TP rank `[gate_r; up_r]`).
_LORA_FC1_OUT = "mlp.adapter_layer.lora_hto4h_adapter.linear_out.weight"
#: Layer tensors that hold the split dim of each expert's matrices: (canonical pattern, TP split dim).
_EXPERT_SPLIT_DIMS = (
    (re.compile(r"^mlp\.experts\.local_experts\.\d+\.linear_fc1\.(weight|bias)$"), 0),
    (re.compile(r"^mlp\.experts\.local_experts\.\d+\.linear_fc2\.weight$"), 1),
    (re.compile(r"^mlp\.experts\.linear_fc1\.weight$"), 1),
    (re.compile(r"^mlp\.experts\.linear_fc2\.weight$"), 2),
)


def swap_prefix(name: str, pairs: tuple[tuple[str, str], ...], reverse: bool = False) -> str:
    """Replace the first matching prefix of `name` by its partner in `pairs` (left->right, or right->left)."""
    for left, right in pairs:
        old, new = (right, left) if reverse else (left, right)
        if name.startswith(old):
            return new + name[len(old):]
    return name


def tp_split_dim(name: str) -> int | None:
    """Dimension along which NeMo splits canonical tensor `name` over TP ranks; None when replicated."""
    match = LAYER_KEY.match(name)
    if not match:
        return 0 if name in ("embedding.word_embeddings.weight", "output_layer.weight") else None
    if match[2] in COLUMN_PARALLEL_LAYER_PARAMS:
        return 0
    if match[2] in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
        return 1
    if lora := _LORA_WEIGHT.match(match[2]):
        return 1 if lora[2] == "linear_in" and lora[1] in _LORA_ROW_PARALLEL else 0
    return next((dim for pattern, dim in _EXPERT_SPLIT_DIMS if pattern.match(match[2])), None)


def holds_gate_and_up(name: str) -> bool:
    """Whether canonical tensor `name` is an fc1 (dense or expert), or fc1's LoRA `linear_out`, whose rows are
    `[gate; up]` when gated."""
    return name.rsplit(".", 1)[0].endswith("linear_fc1") or name.endswith(_LORA_FC1_OUT)


def expert_slot(name: str) -> tuple[str, int] | None:
    """(stacked canonical name, expert index) of one expert's tensor, else None."""
    match = EXPERT_KEY.match(name)
    return (f"{match[1]}{match[3]}", int(match[2])) if match else None


def canonical_name(key: str) -> str | None:
    """Canonical name of a stored NeMo key (any prefix; legacy or TE names); None for dropped entries."""
    if "_extra_state" in key or key.endswith(DROPPED_SUFFIXES):
        return None
    prefix = next((p for p in STORED_PREFIXES if key.startswith(p)), "")
    key = key[len(prefix):]
    if key.startswith("language_model."):  # legacy NeMo-1, or a NeMo 2 VLM's language model
        key = key[len("language_model."):]
        key = "decoder." + key[len("encoder."):] if key.startswith("encoder.") else key
    match = LAYER_KEY.match(key)
    if match:
        rest = swap_prefix(match[2], LEGACY_LAYER_NAMES, reverse=True)
        rest = swap_prefix(rest, TE_NORM_NAMES + FALCON_NORM_NAMES + DIST_EXPERT_NAMES, reverse=True)
        grouped = _TE_GROUPED_EXPERT.match(rest)
        rest = f"mlp.experts.local_experts.{grouped[2]}.{grouped[1]}.weight" if grouped else rest
        key = f"decoder.layers.{match[1]}.{rest}"
    return key
