"""Tensor parallelism of the decoder: the slice of each weight a rank holds (Megatron's split), and the
collectives a rank runs (torch.distributed: NCCL on GPUs, gloo on the CPU).

A rank holds its query groups' rows of the fused QKV (whole groups: ``num_query_groups`` must divide by the size;
KV heads are never replicated), its ``[gate_r; up_r]`` rows of a gated fc1 (its rows of a plain one), its columns
of proj and fc2, and its rows of the output head (the vocabulary padded up to a multiple of the size). The
row-parallel biases (proj, fc2) are held by rank 0 and are zeros elsewhere, so the all-reduce of the partial sums
adds them once. Norms and position embeddings are replicated. The input embedding stays whole on rank 0, which
embeds every prompt and decode token (the scheduler's steps broadcast the embeddings); the other ranks hold none.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..checkpoint.names import LAYER_KEY, holds_gate_and_up, tp_split_dim
from .config import DecoderConfig

#: Keep NVLink multicast (NVLS) off: set in this process before any group starts, and inherited by its children.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
EMBEDDING = "embedding.word_embeddings.weight"
HEAD = "output_layer.weight"
LOGGER = logging.getLogger(__name__)
_ROW_PARALLEL_BIASES = ("self_attention.linear_proj.bias", "mlp.linear_fc2.bias")
#: torch's one-shot all-reduce takes whole 4-byte words only; other sizes go through NCCL.
_PEER_ALIGNMENT = 4


def disable_multicast() -> None:
    """Set `MULTICAST_OFF` in this process's environment (child processes inherit it)."""
    os.environ.update(MULTICAST_OFF)


@dataclass(frozen=True)
class Shard:
    """Which slice of the decoder a rank holds: rank ``rank`` of ``size`` (``Shard()``: the whole model)."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in [0, {self.size})")

    @property
    def leader(self) -> bool:
        """Rank 0: the rank that embeds, chooses tokens and drives the others."""
        return self.rank == 0

    def part(self, total: int) -> int:
        """This rank's share of ``total`` heads, groups or MLP channels (``check_tensor_parallel`` made it exact)."""
        return total // self.size

    def vocab_part(self, vocab: int) -> int:
        """Output-head rows per rank: the vocabulary padded up to a multiple of the size."""
        return -(-vocab // self.size)


def check_tensor_parallel(config: DecoderConfig, size: int) -> None:
    """A ValueError naming what keeps ``config`` from being split over ``size`` ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    if size == 1:
        return
    for field in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        if getattr(config, field) % size:
            raise ValueError(f"tensor_parallel_size={size} must divide the model's {field} "
                             f"({getattr(config, field)}); choose a size that does")
    unsupported = [name for name, used in (("mixture of experts", config.num_moe_experts > 0),
                                           ("quantized weights", config.quantization is not None)) if used]
    if unsupported:
        raise ValueError(f"tensor_parallel_size > 1 does not support {' or '.join(unsupported)}; use 1")


def split_tensor(name: str, tensor: Tensor, config: DecoderConfig, shard: Shard) -> Tensor | None:
    """Rank ``shard.rank``'s part of the whole canonical decoder tensor ``name`` (None: the rank holds none)."""
    if shard.size == 1:
        return tensor
    if name == EMBEDDING:
        return tensor if shard.leader else None
    if name == HEAD:
        return _head_rows(tensor, config, shard)
    if _is_row_parallel_bias(name):
        return tensor if shard.leader else torch.zeros_like(tensor)
    dim = tp_split_dim(name)
    if dim is None:
        return tensor
    if config.gated and holds_gate_and_up(name):
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate.chunk(shard.size)[shard.rank], up.chunk(shard.size)[shard.rank]])
    return tensor.chunk(shard.size, dim=dim)[shard.rank]


def split_weights(weights: Mapping[str, Tensor], config: DecoderConfig, shard: Shard) -> Iterator[tuple[str, Tensor]]:
    """Rank ``shard.rank``'s tensors of a whole canonical decoder state dict, one at a time; with tied weights its
    head rows come from the embedding."""
    for name, tensor in weights.items():
        part = split_tensor(name, tensor, config, shard)
        if part is not None:
            yield name, part
    if shard.size > 1 and config.share_embeddings_and_output_weights:
        yield HEAD, _head_rows(weights[EMBEDDING], config, shard)


def adopt_nemo_shard(weights: Mapping[str, Tensor], embedding: Tensor, config: DecoderConfig,
                     shard: Shard) -> Iterator[tuple[str, Tensor]]:
    """Rank ``shard.rank``'s tensors from the same rank's file of a NeMo checkpoint sharded at the same size (its
    tensors are already Megatron's per-rank slices), and the whole ``embedding`` (merged once, for rank 0)."""
    vocab_rows = shard.vocab_part(config.vocab_size)
    for name, tensor in weights.items():
        if name == EMBEDDING:
            if shard.leader:
                yield name, embedding
            if config.share_embeddings_and_output_weights:
                yield HEAD, _checked_head(tensor, vocab_rows)
        elif name == HEAD:
            yield name, _checked_head(tensor, vocab_rows)
        elif _is_row_parallel_bias(name) and not shard.leader:
            yield name, torch.zeros_like(tensor)
        else:
            yield name, tensor


class PeerAllReduce:
    """The all-reduce of small tensors (a decode step's activations) through symmetric memory: each rank stages its
    partial sums in a buffer the other ranks map, then reads theirs over NVLink in one kernel (torch's one-shot
    all-reduce; no multicast). On the H200 pair it took 6.4 µs inside a CUDA graph against NCCL's 18 µs
    (docs/performance.md), and a decode step has two a layer. Two buffers take turns, so a rank that runs ahead
    never overwrites a buffer a slower rank still reads (every all-reduce waits for all ranks to arrive)."""

    def __init__(self, group: Any, device: torch.device, dtype: torch.dtype, capacity_bytes: int):
        from torch.distributed import _symmetric_memory as symmetric

        self._reduce = torch.ops.symm_mem.one_shot_all_reduce_out  # missing in an older torch: an error here
        self.dtype = dtype
        self.capacity = capacity_bytes // dtype.itemsize
        self.group_name = group.group_name
        self.buffers = []
        for _ in range(2):
            buffer = symmetric.empty(self.capacity, dtype=dtype, device=device)
            symmetric.rendezvous(buffer, self.group_name)
            self.buffers.append(buffer)
        self._turn = 0

    def fits(self, tensor: Tensor) -> bool:
        return (tensor.dtype == self.dtype and tensor.numel() <= self.capacity and tensor.is_contiguous()
                and tensor.numel() * tensor.element_size() % _PEER_ALIGNMENT == 0)

    def __call__(self, partial: Tensor) -> Tensor:
        """The sum over the ranks of ``partial``, written into it."""
        staged = self.buffers[self._turn][:partial.numel()].view(partial.shape)
        self._turn ^= 1
        staged.copy_(partial)
        return self._reduce(staged, "sum", self.group_name, partial)


class TensorParallel:
    """A rank's collectives in its group: ``group`` carries tensors (NCCL on GPUs, gloo on the CPU); ``control``
    (gloo) carries rank 0's step messages to the others, so that a waiting rank holds no GPU stream. ``peer``
    (GPUs, where symmetric memory works) takes the all-reduces that fit it."""

    def __init__(self, shard: Shard, group: Any, control: Any, peer: PeerAllReduce | None = None):
        self.shard = shard
        self.group = group
        self.control = control
        self.peer = peer

    @property
    def leader(self) -> bool:
        return self.shard.leader

    def reduce(self, partial: Tensor) -> Tensor:
        """The sum over the ranks of each rank's ``partial`` (in place)."""
        if self.peer is not None and self.peer.fits(partial):
            return self.peer(partial)
        dist.all_reduce(partial, group=self.group)
        return partial

    def gather_vocab(self, logits: Tensor, vocab: int) -> Tensor:
        """Every rank's logits of its vocabulary rows ``[..., V_r]`` side by side ``[..., vocab]``."""
        parts = [torch.empty_like(logits) for _ in range(self.shard.size)]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[..., :vocab]

    def share(self, *tensors: Tensor) -> None:
        """Rank 0's values of ``tensors`` (contiguous, of equal shapes on every rank) copied into every rank's."""
        for tensor in tensors:
            dist.broadcast(tensor, src=0, group=self.group)

    @contextlib.contextmanager
    def in_step(self) -> Iterator[None]:
        """Rank 0's part of a step the other ranks run too: a failure inside it leaves them waiting in a collective
        that never comes, so the process ends (logged; the other ranks end with it)."""
        try:
            yield
        except BaseException as error:  # noqa: BLE001 - the group cannot go on
            LOGGER.critical("a tensor-parallel step failed on rank 0 (%r); the ranks are out of step: exiting", error)
            logging.shutdown()
            os._exit(1)

    def send(self, message: Any) -> None:
        """Rank 0: hand ``message`` (picklable) to every other rank's ``receive``."""
        dist.broadcast_object_list([message], src=0, group=self.control)

    def receive(self) -> Any:
        """The other ranks: rank 0's next message (waits for it)."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]


def _head_rows(tensor: Tensor, config: DecoderConfig, shard: Shard) -> Tensor:
    rows = shard.vocab_part(config.vocab_size)
    part = tensor[shard.rank * rows: (shard.rank + 1) * rows]
    if len(part) == rows:
        return part
    return torch.cat([part, part.new_zeros(rows - len(part), *part.shape[1:])])  # padding rows, sliced off later


def _checked_head(tensor: Tensor, rows: int) -> Tensor:
    if len(tensor) != rows:
        raise ValueError(f"a rank's output rows ({len(tensor)}) differ from vocab / tensor_parallel_size ({rows})")
    return tensor


def _is_row_parallel_bias(name: str) -> bool:
    match = LAYER_KEY.match(name)
    return bool(match) and match[2] in _ROW_PARALLEL_BIASES
