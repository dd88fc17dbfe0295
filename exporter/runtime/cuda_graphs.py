"""Decode steps and encoder calls at fixed batch sizes, replayed as CUDA graphs on the GPU (eager elsewhere).

A CUDA graph replays a whole captured step with one launch, removing the per-kernel launch cost that dominates
small-batch decoding. Shapes must be static, so inputs are copied into preallocated buffers and a call runs at
the smallest captured batch size ("bucket") that holds it; the extra rows compute on padding and are dropped.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..llm.model import Decoder, KVCache

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bucket_sizes(limit: int) -> list[int]:
    """The captured batch sizes up to ``limit`` (``limit`` itself always included)."""
    return sorted({b for b in BUCKETS if b < limit} | {limit})


class GraphedCall:
    """``fn(batch_input)`` for inputs of shape ``[n, *item_shape]``, captured once per bucket on CUDA.

    ``fn`` must only read its input and return a tensor whose first dimension is the batch.
    """

    def __init__(self, fn: Callable[[Tensor], Tensor], item_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, max_batch: int, enabled: bool):
        self.fn = fn
        self.enabled = enabled and device.type == "cuda"
        self.buckets = bucket_sizes(max_batch)
        self.inputs = torch.zeros(max_batch, *item_shape, dtype=dtype, device=device) if self.enabled else None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.enabled else None

    def __call__(self, batch: Tensor) -> Tensor:
        rows = batch.shape[0]
        if not self.enabled or rows > self.buckets[-1]:
            return self.fn(batch)
        bucket = next(b for b in self.buckets if b >= rows)
        self.inputs[:rows].copy_(batch, non_blocking=True)
        if rows < bucket:
            self.inputs[rows:bucket].zero_()
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket)
        graph, output = self.graphs[bucket]
        graph.replay()
        return output[:rows]

    def _capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        static_input = self.inputs[:bucket]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up runs pick kernels and allocate workspaces outside the graph
                self.fn(static_input)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = self.fn(static_input)
        return graph, output


class DecodeStep:
    """One decode step for cache rows ``[0, n)``: token ids and positions ``[n]`` in, logits ``[n, V]`` out.

    On CUDA the step attends over the whole static cache (masked past each row's position) so that it can be
    captured; on the CPU it attends only up to the furthest position, eagerly.
    """

    def __init__(self, model: Decoder, cache: KVCache, use_cuda_graphs: bool | None = None):
        self.model = model
        self.cache = cache
        device = model.device
        enabled = device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        slots = cache.keys.shape[1]
        # tokens and positions travel as one [n, 2] tensor so one buffer copy feeds the graph
        self.graphed = GraphedCall(self._step, (2,), torch.long, device, slots, enabled)

    def __call__(self, tokens: Tensor, positions: Tensor) -> Tensor:
        packed = torch.stack([tokens, positions], dim=1).to(self.model.device, non_blocking=True)
        if self.graphed.enabled:
            return self.graphed(packed)
        return self._step(packed, kv_len=int(positions.max()) + 1)

    def _step(self, packed: Tensor, kv_len: int | None = None) -> Tensor:
        rows = packed.shape[0]
        view = KVCache(self.cache.keys[:, :rows], self.cache.values[:, :rows])
        tokens, positions = packed[:, 0], packed[:, 1:]
        return self.model(self.model.embed(tokens)[:, None], positions, view, kv_len=kv_len)[:, 0]
