"""Per-expert weights (Megatron's SequentialMLP `local_experts.<e>`) read straight into one stacked tensor.

The canonical state dict holds each MoE layer's experts stacked, `mlp.experts.linear_fc1.weight [E, R, H]`.
Files that store the experts one by one are read into slots of that stack: `ExpertStacks.empty` hands out
`stack[e]` as expert e's target, and `stack_experts` then replaces the per-expert entries by the stack itself, so
the weights are never held twice.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .archive import NemoCheckpointError
from .names import expert_slot


class ExpertStacks:
    """Allocates the target tensors of one set of canonical names; an expert's tensor is a slot of its stack."""

    def __init__(self, names: Iterable[str]):
        self._sizes: dict[str, int] = {}
        for slot in filter(None, map(expert_slot, names)):
            self._sizes[slot[0]] = max(self._sizes.get(slot[0], 0), slot[1] + 1)
        self._stacks: dict[str, torch.Tensor] = {}

    def empty(self, name: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor for canonical tensor `name` (a view of its stack for an expert's tensor)."""
        slot = expert_slot(name)
        if slot is None:
            return torch.empty(shape, dtype=dtype)
        stacked, expert = slot
        if stacked not in self._stacks:
            self._stacks[stacked] = torch.empty([self._sizes[stacked], *shape], dtype=dtype)
        stack = self._stacks[stacked]
        if list(stack.shape[1:]) != list(shape) or stack.dtype != dtype:
            raise NemoCheckpointError(f"{name}: shape {list(shape)} {dtype} differs from the other experts' "
                                      f"{list(stack.shape[1:])} {stack.dtype}")
        return stack[expert]


def stack_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` with every set of per-expert tensors replaced by their stacked tensor (the stack they were read
    into, or a new one when they were not), checking that no expert is missing."""
    groups: dict[str, dict[int, str]] = {}
    for name in weights:
        if (slot := expert_slot(name)) is not None:
            groups.setdefault(slot[0], {})[slot[1]] = name
    for stacked, names in groups.items():
        if sorted(names) != list(range(len(names))):
            missing = sorted(set(range(max(names) + 1)) - set(names))
            raise NemoCheckpointError(f"{stacked}: the checkpoint lacks the weights of experts {missing}")
        parts = [weights.pop(names[e]) for e in range(len(names))]
        base = parts[0]._base
        in_place = base is not None and base.shape[0] == len(parts) and all(
            part._base is base and part.data_ptr() == base[e].data_ptr() for e, part in enumerate(parts))
        weights[stacked] = base if in_place else torch.stack(parts)
    return weights
