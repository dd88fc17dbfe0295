"""Serve-time LoRA: every row of a batch adds its own adapter's low-rank update to a projection's output.

NeMo's LoRA adds ``(alpha / dim) · B (A x)`` to the output of the projection it adapts (``A = linear_in [dim, in]``,
``B = linear_out [out, dim]``), before anything else reads that output: the fused, per-group interleaved QKV output,
fc1's fused ``[gate; up]`` before the gating. The adapters a decoder serves sit in one :class:`LoraBank`; each
adapted projection holds a :class:`LoraSlots`: ``a [slots + 1, r, in]`` and ``b [slots + 1, r, out]`` (B transposed,
the scale folded in), zero-padded to the bank's rank ``r`` (``max_lora_rank``), slot 0 all zeros (no adapter). A
row names its slot (``adapters [B]``, a device tensor), so rows with different adapters and rows with none share one
step, and a captured CUDA graph replays for any mix: ``y + (x a[i]^T) b[i]`` as two batched products over the
gathered slots (``torch.bmm``; the CPU, float32 and reference path), or, on CUDA in float16/bfloat16, two Triton
kernels (`exporter.llm.lora_kernels`) that read each slot once per block of rows, up to the slot's own rank, and add
into the projection's output in place.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .config import DecoderConfig
from .lora_kernels import add_lora_, triton

if TYPE_CHECKING:
    from .model import Decoder

#: The projections LoRA adapts, by TensorRT-LLM's `lora_target_modules` name -> path inside a decoder layer.
LORA_MODULES: dict[str, str] = {
    "attn_qkv": "self_attention.linear_qkv",
    "attn_dense": "self_attention.linear_proj",
    "mlp_h_to_4h": "mlp.linear_fc1",
    "mlp_4h_to_h": "mlp.linear_fc2",
}
# The CUDA products in float16/bfloat16: "triton" (`lora_kernels`, in place) or "bmm" (the gathered batched
# products, which the benchmark measures beside them).
CUDA_KERNEL = "triton"


def lora_shape(config: DecoderConfig, module: str) -> tuple[int, int]:
    """``(out, in)`` of the projection a LoRA ``module`` adapts (its B rows, its A columns)."""
    qkv = (config.num_attention_heads + 2 * config.num_query_groups) * config.head_dim
    attention = config.num_attention_heads * config.head_dim
    fc1 = (2 if config.gated else 1) * config.ffn_hidden_size
    return {"attn_qkv": (qkv, config.hidden_size), "attn_dense": (config.hidden_size, attention),
            "mlp_h_to_4h": (fc1, config.hidden_size), "mlp_4h_to_h": (config.hidden_size, config.ffn_hidden_size),
            }[module]


def check_lora_adapter(config: DecoderConfig, modules: Sequence[str], max_rank: int, uid: str, rank: int,
                       weights: Mapping[tuple[int, str], tuple[Tensor, Tensor]]) -> None:
    """A ValueError saying why adapter ``uid`` cannot be served on ``modules`` with ranks up to ``max_rank`` by
    the decoder of ``config``: its rank, a module outside ``modules``, or the first (layer, module) whose
    ``A [rank, in]`` / ``B [out, rank]`` do not fit."""
    if not 1 <= rank <= max_rank:
        raise ValueError(f"LoRA adapter {uid!r} has rank {rank}, over max_lora_rank={max_rank}; raise max_lora_rank "
                         f"to at least {rank}")
    outside = [m for m in LORA_MODULES if m not in modules and any(module == m for _, module in weights)]
    if outside:
        raise ValueError(f"LoRA adapter {uid!r} adapts {', '.join(outside)}, not in lora_target_modules "
                         f"({', '.join(modules) or 'none'}); add them to lora_target_modules")
    for (layer, module), (a, b) in sorted(weights.items()):
        if not 0 <= layer < config.num_layers:
            raise ValueError(f"LoRA adapter {uid!r} adapts layer {layer}, but the model has {config.num_layers}")
        out_features, in_features = lora_shape(config, module)
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise ValueError(f"LoRA adapter {uid!r}: layer {layer} {module} has A {list(a.shape)} and B "
                             f"{list(b.shape)}, the model needs {[rank, in_features]} and {[out_features, rank]}")


class LoraSlots:
    """One projection's adapters: ``a [slots + 1, rank, in]``, ``b [slots + 1, rank, out]`` (scale folded in) and
    each slot's own rank (``ranks``, slot 0 has none). The tensors never move: loading writes in place."""

    def __init__(self, slots: int, rank: int, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device):
        self.a = torch.zeros(slots + 1, rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(slots + 1, rank, out_features, dtype=dtype, device=device)
        self.ranks = torch.zeros(slots + 1, dtype=torch.int32, device=device)

    def write(self, slot: int, a: Tensor | None = None, b: Tensor | None = None, scale: float = 1.0) -> None:
        """Put an adapter's ``A [r, in]`` and ``B [out, r]`` (times ``scale``) in ``slot``; without them, clear it."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        rank = 0 if a is None else a.shape[0]
        if a is not None and b is not None:
            self.a[slot, :rank].copy_(a)
            self.b[slot, :rank].copy_((b.float() * scale).T)
        self.ranks[slot] = rank

    def __call__(self, y: Tensor, x: Tensor, adapters: Tensor) -> Tensor:
        """``y [B, T, out]`` plus each row's update of ``x [B, T, in]``; ``adapters [B]``: each row's slot. On
        CUDA in float16/bfloat16 the update is added into ``y`` in place (`lora_kernels`)."""
        if (CUDA_KERNEL == "triton" and triton is not None and x.is_cuda and x.dtype == y.dtype == self.a.dtype
                and x.dtype in (torch.float16, torch.bfloat16) and y.is_contiguous() and x.is_contiguous()):
            return self.kernels(y, x, adapters)
        return self.batched(y, x, adapters)

    def batched(self, y: Tensor, x: Tensor, adapters: Tensor) -> Tensor:
        """The update as two batched products over each row's gathered slot (any device, any T), out of place."""
        down = torch.bmm(x, self.a.index_select(0, adapters).transpose(1, 2))  # [B, T, rank], the model dtype
        return torch.baddbmm(y, down, self.b.index_select(0, adapters))

    def kernels(self, y: Tensor, x: Tensor, adapters: Tensor) -> Tensor:
        """The update by the Triton kernels, added into ``y`` in place: each block of rows reads the slots its
        rows use, up to each slot's rank; rows without an adapter are not touched."""
        return add_lora_(y, x, adapters, self.a, self.b, self.ranks)


class LoraBank:
    """The LoRA adapters one decoder serves at once: ``capacity`` slots, each adapter of rank up to ``max_rank``
    on ``modules`` (names of ``LORA_MODULES``), in the decoder's dtype (on a quantized decoder too).

    Building it attaches a :class:`LoraSlots` to each adapted projection and sets ``decoder.lora``. ``add`` writes
    an adapter into a free slot and names it by its uid; ``acquire`` gives a request its adapter's slot (an unknown
    uid is a ValueError naming the known ones) and holds the slot until ``release``: a removed adapter's slot is
    taken by a new one only once no request uses it. Thread-safe.
    """

    def __init__(self, decoder: Decoder, modules: Sequence[str], max_rank: int, capacity: int):
        unknown = sorted(set(modules) - set(LORA_MODULES))
        if unknown:
            raise ValueError(f"LoRA modules {unknown} are not served; these are: {', '.join(LORA_MODULES)}")
        if max_rank < 1 or capacity < 1:
            raise ValueError(f"max_lora_rank ({max_rank}) and the number of LoRA slots ({capacity}) must be >= 1")
        config = decoder.config
        if config.num_moe_experts and any(LORA_MODULES[m].startswith("mlp.") for m in modules):
            raise ValueError("LoRA on a mixture-of-experts MLP is not supported; adapt the attention only "
                             "(lora_target_modules attn_qkv, attn_dense)")
        self.modules = tuple(m for m in LORA_MODULES if m in modules)
        self.max_rank = max_rank
        self.capacity = capacity
        self.slots: dict[tuple[int, str], LoraSlots] = {}
        for index, layer in enumerate(decoder.decoder.layers):
            for module in self.modules:
                out_features, in_features = lora_shape(config, module)
                slots = LoraSlots(capacity, max_rank, in_features, out_features, decoder.dtype, decoder.device)
                layer.get_submodule(LORA_MODULES[module]).lora = slots
                self.slots[index, module] = slots
        self.config = config
        self._uids: dict[str, int] = {}
        self._writing: dict[str, int] = {}  # adapters being written into their slots
        self._users = [0] * (capacity + 1)
        self._lock = threading.Lock()
        decoder.lora = self

    @property
    def uids(self) -> list[str]:
        """The adapters served, in the order they were added."""
        with self._lock:
            return list(self._uids)

    def add(self, uid: str, rank: int, scale: float, weights: Mapping[tuple[int, str], tuple[Tensor, Tensor]]
            ) -> None:
        """Serve adapter ``uid``: ``weights[(layer, module)] = (A [rank, in], B [out, rank])``, scaled by ``scale``
        (alpha / rank). Modules it leaves out are not adapted for it."""
        check_lora_adapter(self.config, self.modules, self.max_rank, uid, rank, weights)
        with self._lock:
            if uid in self._uids or uid in self._writing:
                raise ValueError(f"a LoRA adapter named {uid!r} is served already; remove it first")
            busy = {*self._uids.values(), *self._writing.values()}
            free = [s for s in range(1, self.capacity + 1) if s not in busy and not self._users[s]]
            if not free:
                raise ValueError(f"all {self.capacity} LoRA slots are in use; remove an adapter or raise max_loras")
            slot = self._writing[uid] = free[0]
        try:
            for key, slots in self.slots.items():
                slots.write(slot, *weights.get(key, ()), scale=scale)
            with self._lock:
                self._uids[uid] = slot
        finally:
            with self._lock:
                del self._writing[uid]

    def remove(self, uid: str) -> None:
        """Stop serving ``uid``; requests already using it finish with it."""
        with self._lock:
            if self._uids.pop(uid, None) is None:
                raise ValueError(self._unknown(uid))

    def acquire(self, uid: str) -> int:
        """The slot of adapter ``uid``, held for one request until ``release``."""
        with self._lock:
            slot = self._uids.get(uid)
            if slot is None:
                raise ValueError(self._unknown(uid))
            self._users[slot] += 1
            return slot

    def release(self, slot: int) -> None:
        """A request that held ``slot`` is done with it."""
        with self._lock:
            self._users[slot] -= 1

    def _unknown(self, uid: str) -> str:
        known = ", ".join(repr(u) for u in self._uids) or "none"
        return f"unknown LoRA adapter {uid!r}; served adapters: {known}"
