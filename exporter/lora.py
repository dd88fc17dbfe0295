"""Merge NeMo LoRA adapters (``adapter_layer.lora_*`` weights) into the decoder weights they adapt.

NeMo's LoRA adds ``(alpha / dim) · linear_out(linear_in(x))`` to a projection's output, so merging is
``W += (alpha / dim) · B @ A`` with ``A`` = ``linear_in.weight`` ``[dim, in]`` and ``B`` = ``linear_out.weight``
``[out, dim]``; ``dim`` and ``alpha`` come from the config's ``peft.lora_tuning`` (``alpha`` defaults to ``dim``,
a scale of 1). The output rows of the fused QKV and ``[gate; up]`` adapters are in the fused tensors' own order, so
they add to the canonical tensors as they are. NeMo's own merge script leaves out the ``alpha / dim`` scale
(docs/fidelity.md).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

LORA_MARKER = "adapter_layer.lora"
#: NeMo's LoRA adapter (relative to a layer) -> the canonical projection weight it adapts.
LORA_TARGETS = {
    "self_attention.adapter_layer.lora_kqv_adapter": "self_attention.linear_qkv.weight",
    "self_attention.adapter_layer.lora_dense_attention_adapter": "self_attention.linear_proj.weight",
    "mlp.adapter_layer.lora_hto4h_adapter": "mlp.linear_fc1.weight",
    "mlp.adapter_layer.lora_4htoh_adapter": "mlp.linear_fc2.weight",
}
_LORA_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+\.adapter_layer\.lora_\w+)\.(linear_in|linear_out)\.weight$")


class LoraMergeError(ValueError):
    """LoRA weights that cannot be merged (the message names the key or config field)."""


def merge_lora(weights: dict[str, torch.Tensor], model_config: Any) -> dict[str, torch.Tensor]:
    """Fold every LoRA adapter of canonical ``weights`` into its projection (in place) and drop the adapter keys.

    Each sum is computed in float32 and stored in the projection's own dtype. A checkpoint without LoRA keys is
    returned unchanged.
    """
    adapters: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name in [k for k in weights if LORA_MARKER in k]:
        match = _LORA_KEY.match(name)
        if match is None or match[2] not in LORA_TARGETS:
            raise LoraMergeError(
                f"LoRA weight {name!r} is not one this exporter merges (linear_in/linear_out weights of "
                f"{', '.join(a.rsplit('.', 1)[1] for a in LORA_TARGETS)}); merge it into the checkpoint with NeMo"
            )
        adapters.setdefault((int(match[1]), match[2]), {})[match[3]] = weights.pop(name)
    if not adapters:
        return weights
    alpha, dim = lora_alpha_and_dim(model_config)
    for (layer, adapter), pair in sorted(adapters.items()):
        where = f"decoder.layers.{layer}.{adapter}"
        if set(pair) != {"linear_in", "linear_out"}:
            raise LoraMergeError(f"{where} lacks its {({'linear_in', 'linear_out'} - set(pair)).pop()}.weight")
        a, b = pair["linear_in"].float(), pair["linear_out"].float()
        rank = a.shape[0]
        if dim is not None and rank != dim:
            raise LoraMergeError(f"{where}.linear_in.weight has rank {rank}, but peft.lora_tuning.adapter_dim is {dim}")
        target = f"decoder.layers.{layer}.{LORA_TARGETS[adapter]}"
        if target not in weights:
            raise LoraMergeError(f"{where} adapts {target}, which the checkpoint does not hold")
        base = weights[target]
        if b.shape[1] != rank or (b.shape[0], a.shape[1]) != tuple(base.shape):
            raise LoraMergeError(f"{where}: linear_out {list(b.shape)} @ linear_in {list(a.shape)} does not fit "
                                 f"{target} {list(base.shape)} (tensor-parallel LoRA shards are not supported)")
        scale = (alpha if alpha is not None else rank) / rank
        weights[target] = (base.float() + scale * (b @ a)).to(base.dtype)
    return weights


def lora_alpha_and_dim(model_config: Any) -> tuple[float | None, int | None]:
    """``(alpha, adapter_dim)`` from ``peft.lora_tuning`` (None where not set; alpha None means alpha = dim).

    The example configs write ``alpha: ${model.peft.lora_tuning.adapter_dim}``, an interpolation that cannot
    resolve in a saved model config; it is read as what it names.
    """
    peft = _plain(model_config).get("peft") or {}
    if peft.get("weight_tying"):
        raise LoraMergeError("peft.weight_tying LoRA is not supported; merge the adapters with NeMo first")
    lora = peft.get("lora_tuning") or {}
    if lora.get("weight_tying"):
        raise LoraMergeError("peft.lora_tuning.weight_tying LoRA is not supported; merge the adapters with NeMo first")
    dim, alpha = lora.get("adapter_dim"), lora.get("alpha")
    if isinstance(alpha, str) and alpha.startswith("${"):
        if not alpha.rstrip("}").endswith("adapter_dim"):
            raise LoraMergeError(f"peft.lora_tuning.alpha is the interpolation {alpha!r}; set it to a number")
        alpha = None
    try:
        return (None if alpha is None else float(alpha)), (None if dim is None else int(dim))
    except (TypeError, ValueError):
        raise LoraMergeError(f"peft.lora_tuning adapter_dim={dim!r} / alpha={alpha!r} must be numbers") from None


def _plain(model_config: Any) -> dict:
    """The config as plain containers, interpolations left as their ``${...}`` text."""
    if isinstance(model_config, DictConfig):
        return OmegaConf.to_container(model_config, resolve=False)
    return dict(model_config or {})
