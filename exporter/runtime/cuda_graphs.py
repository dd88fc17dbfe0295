"""Decode steps, prefills and encoder calls at fixed shapes, replayed as CUDA graphs on the GPU (eager elsewhere).

A CUDA graph replays a whole captured call with one launch, removing the per-kernel launch cost (and the Python
that issues each kernel) that dominates small-batch decoding and the prefill of one prompt. Shapes must be static,
so inputs are copied into preallocated buffers and a call runs at the smallest captured size ("bucket") that holds
it: batch sizes for the decoder step and the encoder, padded lengths for a prefill. Padding rows and positions
compute on filler and are dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..llm.model import Decoder, KVCache

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
KV_ALIGNMENT = 64  # cache lengths, attended spans and padded prompts are multiples of this
SHORTEST_KV_BUCKET = 128


def bucket_sizes(limit: int) -> list[int]:
    """The captured batch sizes up to ``limit`` (``limit`` itself always included)."""
    return sorted({b for b in BUCKETS if b < limit} | {limit})


def kv_bucket_sizes(cache_len: int) -> list[int]:
    """The attended cache spans a decode step is captured for: powers of two from 128 below ``cache_len``, and
    ``cache_len``; a step attends only to the shortest span holding every row's position."""
    spans, span = {cache_len}, SHORTEST_KV_BUCKET
    while span < cache_len:
        spans.add(span)
        span *= 2
    return sorted(spans)


def aligned_cache_len(max_seq_len: int) -> int:
    """``max_seq_len`` rounded up to a multiple of ``KV_ALIGNMENT``."""
    return -(-max_seq_len // KV_ALIGNMENT) * KV_ALIGNMENT


def capture(fn: Callable[[], Any], pool: tuple) -> tuple[torch.cuda.CUDAGraph, Any]:
    """A CUDA graph of ``fn()`` (which reads only static buffers) and its static output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up runs compile, pick kernels and allocate workspaces outside the graph
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = fn()
    return graph, output


class GraphedCall:
    """``fn(batch_input)`` for inputs of shape ``[n, *item_shape]``, captured once per bucket on CUDA.

    ``fn`` must only read its input and return a tensor whose first dimension is the batch. The returned rows are
    a view of the graph's output buffer: read them before the next call. Inputs beyond the largest bucket run
    eagerly. Graphs given the same ``pool`` share their workspace memory (never run them concurrently).
    """

    def __init__(self, fn: Callable[[Tensor], Tensor], item_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, max_batch: int, enabled: bool = True, pool: tuple | None = None):
        self.fn = fn
        self.enabled = enabled and torch.device(device).type == "cuda"
        self.buckets = bucket_sizes(max_batch)
        self.inputs = torch.zeros(max_batch, *item_shape, dtype=dtype, device=device) if self.enabled else None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.pool = (pool or torch.cuda.graph_pool_handle()) if self.enabled else None

    def __call__(self, batch: Tensor) -> Tensor:
        rows = batch.shape[0]
        if not self.enabled or rows > self.buckets[-1]:
            return self.fn(batch)
        bucket = next(b for b in self.buckets if b >= rows)
        self.inputs[:rows].copy_(batch, non_blocking=True)
        if rows < bucket:
            self.inputs[rows:bucket].zero_()
        if bucket not in self.graphs:
            self.capture(bucket)
        graph, output = self.graphs[bucket]
        graph.replay()
        return output[:rows]

    def capture(self, bucket: int) -> None:
        """Capture ``fn`` at batch size ``bucket`` (done on first use; call ahead to keep it off the first request)."""
        static_input = self.inputs[:bucket]
        self.graphs[bucket] = capture(lambda: self.fn(static_input), self.pool)


@dataclass
class LaunchedStep:
    """A decode step queued on the device: its logits ``[n, V]`` (valid until the next launch) and its rows' greedy
    next tokens, read back without blocking the device."""

    logits: Tensor
    greedy_ids: Tensor
    done: torch.cuda.Event | None

    def greedy(self) -> list[int]:
        """Each row's argmax token (waits for this step only)."""
        if self.done is not None:
            self.done.synchronize()
        return self.greedy_ids.tolist()


class DecodeStep:
    """One decode step for cache rows ``[0, n)``.

    A step reads each row's token and position from a device buffer and leaves there the row's greedy next token
    and the next position: ``launch`` with tokens and positions sets them from the host; without, the step
    continues every row greedily, so it can be queued before the host has read the previous step's tokens. Rows
    are masked past their own position. On CUDA a step is a graph captured per (row bucket, attended span: the
    shortest ``kv_bucket_sizes`` span holding ``furthest``); elsewhere it runs eagerly.
    """

    def __init__(self, model: Decoder, cache: KVCache, use_cuda_graphs: bool | None = None):
        self.model = model
        self.cache = cache
        device = model.device
        self.enabled = device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs and device.type == "cuda"
        slots = cache.stop - cache.start
        self.buckets = bucket_sizes(slots)
        self.spans = kv_bucket_sizes(cache.max_seq_len)
        self.inputs = torch.zeros(slots, 2, dtype=torch.long, device=device)  # per row: token, position
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[Tensor, Tensor]]] = {}
        if self.enabled:
            self.pool = torch.cuda.graph_pool_handle()
            self.staging = torch.zeros(slots, 2, dtype=torch.long).pin_memory()
            self.read_back = [torch.zeros(slots, dtype=torch.long).pin_memory() for _ in range(2)]
            self.launches = 0

    def launch(self, rows: int, furthest: int, tokens: Sequence[int] | None = None,
               positions: Sequence[int] | None = None) -> LaunchedStep:
        """Queue a step for rows ``[0, rows)`` whose positions are all below ``furthest``; ``tokens`` and
        ``positions`` (one per row) replace what the previous step left."""
        span = next(s for s in self.spans if s >= furthest)
        if not self.enabled:
            if tokens is not None:
                self.inputs[:rows] = torch.tensor([list(tokens), list(positions)]).T
            logits, greedy = self._compute(rows, span)
            return LaunchedStep(logits, greedy, None)
        bucket = next(b for b in self.buckets if b >= rows)
        if tokens is not None:
            self.staging[:rows] = torch.tensor([list(tokens), list(positions)]).T
            self.inputs[:rows].copy_(self.staging[:rows], non_blocking=True)
            self.inputs[rows:bucket].zero_()
        if (bucket, span) not in self.graphs:
            self._capture(bucket, span)
        graph, (logits, greedy) = self.graphs[(bucket, span)]
        graph.replay()
        host = self.read_back[self.launches % 2][:rows]  # two steps can be in flight: alternate buffers
        self.launches += 1
        host.copy_(greedy[:rows], non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return LaunchedStep(logits[:rows], host, done)

    def capture_all(self) -> None:
        """Capture every (row bucket, span) graph now, so no request waits for one later (before any request:
        the captures run steps on the rows)."""
        for bucket in self.buckets if self.enabled else ():
            for span in self.spans:
                if (bucket, span) not in self.graphs:
                    self._capture(bucket, span)

    @property
    def graph_count(self) -> int:
        return len(self.graphs)

    def _capture(self, bucket: int, span: int) -> None:
        # Capturing runs the step from the current inputs (writing each row's cache at its own position, as the
        # step will, and past it, where the next steps write): keep the inputs as they were.
        saved = self.inputs.clone()
        self.graphs[(bucket, span)] = capture(lambda: self._compute(bucket, span), self.pool)
        self.inputs.copy_(saved)

    def _compute(self, rows: int, span: int) -> tuple[Tensor, Tensor]:
        tokens, positions = self.inputs[:rows, 0], self.inputs[:rows, 1:]
        view = self.cache.rows(0, rows)
        logits = self.model(self.model.embed(tokens)[:, None], positions, view, kv_len=span)[:, 0]
        greedy = logits.argmax(-1)
        self.inputs[:rows, 0] = greedy
        self.inputs[:rows, 1] += 1
        return logits, greedy


def prefill_bucket(length: int) -> int:
    """The padded length a prompt of ``length`` positions is prefilled at on CUDA (multiples of 64 up to 1024,
    then of 256)."""
    step = KV_ALIGNMENT if length <= 1024 else 256
    return -(-length // step) * step


class PrefillStep:
    """Fresh prompts into consecutive cache rows; returns the float32 logits after each prompt's last position.

    On CUDA, a lone prompt runs as a graph captured per padded length (``prefill_bucket``) into a one-row scratch
    cache whose filled positions are then copied into its row: no Python issues the prefill's kernels one by one.
    Several prompts at once run eagerly, right-padded, as one batch, straight into their rows.
    """

    def __init__(self, model: Decoder, cache: KVCache, use_cuda_graphs: bool | None = None):
        self.model = model
        self.cache = cache
        device = model.device
        self.enabled = device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs and device.type == "cuda"
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        if self.enabled:
            longest = cache.max_seq_len
            self.scratch = model.new_kv_cache(1, longest)
            self.embeds = torch.zeros(1, longest, model.config.hidden_size, dtype=model.dtype, device=device)
            self.last = torch.zeros(1, dtype=torch.long, device=device)
            self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, prompts: Sequence[Tensor], first_row: int) -> Tensor:
        if self.enabled and len(prompts) == 1 and prefill_bucket(len(prompts[0])) <= self.cache.max_seq_len:
            return self._graphed(prompts[0], first_row)
        return self._batched(prompts, first_row)

    def capture_all(self) -> None:
        """Capture the graph of every padded length now."""
        length = KV_ALIGNMENT
        while self.enabled and length <= self.cache.max_seq_len:
            if length not in self.graphs:
                self._capture(length)
            length = prefill_bucket(length + 1)

    def _graphed(self, prompt: Tensor, row: int) -> Tensor:
        length = len(prompt)
        bucket = prefill_bucket(length)
        self.embeds[0, :length].copy_(prompt, non_blocking=True)
        self.last.fill_(length - 1)
        if bucket not in self.graphs:
            self._capture(bucket)
        graph, logits = self.graphs[bucket]
        graph.replay()
        target = self.cache.data[:, :, self.cache.start + row, :length]
        target.copy_(self.scratch.data[:, :, 0, :length])
        return logits[:, 0].float()

    def _capture(self, bucket: int) -> None:
        embeds = self.embeds[:, :bucket]
        self.graphs[bucket] = capture(lambda: self.model(embeds, kv_cache=self.scratch, output_index=self.last),
                                      self.pool)

    def _batched(self, prompts: Sequence[Tensor], first_row: int) -> Tensor:
        model = self.model
        lengths = [len(prompt) for prompt in prompts]
        padded = torch.zeros(len(prompts), max(lengths), model.config.hidden_size, dtype=model.dtype,
                             device=model.device)
        for row, prompt in enumerate(prompts):
            padded[row, : lengths[row]] = prompt.to(padded)
        rows = self.cache.rows(first_row, first_row + len(prompts))
        last = torch.tensor(lengths, device=model.device) - 1
        return model(padded, kv_cache=rows, output_index=last)[:, 0].float()
