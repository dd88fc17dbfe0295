"""Merge NeMo LoRA adapters into the decoder weights they adapt: ``W += (alpha / dim) · B @ A``.

This follows NeMo's forward (``exporter.lora.adapters``): B's rows are in the fused tensors' own order (the
per-group interleaved QKV, fc1's ``[gate; up]``), so each update adds to the canonical tensor as it is. NeMo's own
merge script leaves out the ``alpha / dim`` scale and joins TP-sharded fc1 adapters end to end, wrong for gated
MLPs (docs/fidelity.md). Used for adapters stored inside a checkpoint (SALM) and for ``merge_lora=True`` exports.
"""

from __future__ import annotations

from typing import Any

import torch

from ..llm.lora_layers import LORA_MODULES
from .adapters import LoraAdapter, LoraError, take_adapter_weights


def merge_lora(weights: dict[str, torch.Tensor], model_config: Any) -> dict[str, torch.Tensor]:
    """Fold every LoRA adapter of canonical ``weights`` into its projection (in place) and drop the adapter keys;
    a checkpoint without LoRA keys is returned unchanged."""
    taken = take_adapter_weights(weights, model_config, "the checkpoint")
    if taken is not None:
        adapters, rank, alpha = taken
        merge_adapter(weights, LoraAdapter("checkpoint", rank, alpha, adapters))
    return weights


def merge_adapter(weights: dict[str, torch.Tensor], adapter: LoraAdapter) -> None:
    """Add ``adapter``'s update to the canonical ``weights`` it adapts (in place): each sum computed in float32 and
    stored in the projection's own dtype."""
    for (layer, module), (a, b) in sorted(adapter.weights.items()):
        target = f"decoder.layers.{layer}.{LORA_MODULES[module]}.weight"
        base = weights.get(target)
        if base is None:
            raise LoraError(f"LoRA adapter {adapter.uid!r} adapts {target}, which the model does not hold")
        if (b.shape[0], a.shape[1]) != tuple(base.shape):
            raise LoraError(f"LoRA adapter {adapter.uid!r}: linear_out {list(b.shape)} @ linear_in {list(a.shape)} "
                            f"does not fit {target} {list(base.shape)}")
        weights[target] = (base.float() + adapter.scale * (b.float() @ a.float())).to(base.dtype)


def merge_extra(weights: dict[str, torch.Tensor], adapter: LoraAdapter) -> None:
    """Take the other fine-tuned tensors an adapter checkpoint carries (a projector, say) in place of the base's,
    as NeMo's exporter reads them from the LoRA folder; each must be a tensor the base has, of the same shape."""
    for name, tensor in adapter.extra.items():
        if name not in weights or tuple(weights[name].shape) != tuple(tensor.shape):
            raise LoraError(f"LoRA adapter {adapter.uid!r} carries {name} {list(tensor.shape)}, which the base "
                            "checkpoint does not hold in that shape")
        weights[name] = tensor
