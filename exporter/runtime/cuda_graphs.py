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
from ..llm.sampling import PARENT, POSITION, TOKEN, TokenChooser, host_to_device

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
    """Token choices queued on the device for rows ``[first, first + n)``: the logits they came from ``[n, V]``
    (valid until the next launch), and host copies of each row's next token and, when beam rows took part, of each
    beam leader's candidates, read back without blocking the device."""

    first: int
    logits: Tensor
    next_tokens: Tensor
    candidate_values: Tensor | None
    candidate_ids: Tensor | None
    done: torch.cuda.Event | None

    @classmethod
    def read_back(cls, chooser: TokenChooser, first: int, logits: Tensor, candidates: bool) -> LaunchedStep:
        """Queue the copies of what ``chooser.choose`` left for rows ``[first, first + len(logits))``."""
        window = slice(first, first + len(logits))
        outputs = [chooser.ints[TOKEN, window]]
        if candidates:
            outputs += [chooser.candidate_values[window], chooser.candidate_ids[window]]
        if chooser.device.type != "cuda":
            copies = [output.clone() for output in outputs]
            done = None
        else:
            copies = [torch.empty(output.shape, dtype=output.dtype, pin_memory=True) for output in outputs]
            for copy, output in zip(copies, outputs):
                copy.copy_(output, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        values, ids = copies[1:] if candidates else (None, None)
        return cls(first, logits, copies[0], values, ids, done)

    def read(self) -> tuple[list[int], list[list[float]] | None, list[list[int]] | None]:
        """Per row its next token, and per row (meaningful at beam leaders) its candidates' summed log-probabilities
        and ``parent_offset * V + token`` ids, best first (None without beam rows). Waits for this launch only."""
        if self.done is not None:
            self.done.synchronize()
        if self.candidate_values is None:
            return self.next_tokens.tolist(), None, None
        return self.next_tokens.tolist(), self.candidate_values.tolist(), self.candidate_ids.tolist()


class DecodeStep:
    """One decode step for cache rows ``[0, n)`` with every row's next token chosen on the device.

    Each row's input token and position are the ``TokenChooser``'s state: a step reads them and leaves there the
    row's next token and position (``TokenChooser.choose``), so steps can be queued back to back before the host has
    read any of them. ``launch`` with tokens and positions sets them from the host instead (rows ``[0, n)`` active).
    Beam rows given to ``launch`` first copy their parent rows' cache. Rows are masked past their own position. With
    a LoRA bank on the model, each row decodes with its adapter slot (``set_adapters``, a static device tensor), and
    a step without adapter rows skips the LoRA products. On CUDA a step is a graph captured per (row bucket,
    attended span: the shortest ``kv_bucket_sizes`` span holding ``furthest``, full or argmax-only choice, LoRA or
    not); elsewhere it runs eagerly.
    """

    def __init__(self, model: Decoder, cache: KVCache, use_cuda_graphs: bool | None = None,
                 chooser: TokenChooser | None = None):
        self.model = model
        self.cache = cache
        device = model.device
        self.enabled = device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs and device.type == "cuda"
        slots = cache.stop - cache.start
        self.chooser = chooser or TokenChooser(slots, model.config.vocab_size, device)
        self.buckets = bucket_sizes(slots)
        self.spans = kv_bucket_sizes(cache.max_seq_len)
        self.graphs: dict[tuple[int, int, bool, bool], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.adapters = None if model.lora is None else torch.zeros(slots, dtype=torch.long, device=device)
        if self.enabled:
            self.pool = torch.cuda.graph_pool_handle()

    def set_adapters(self, first: int, slots: Sequence[int]) -> None:
        """Rows ``[first, first + len(slots))`` decode with these LoRA slots (the model has a LoRA bank)."""
        self.adapters[first:first + len(slots)].copy_(host_to_device(slots, torch.long, self.adapters.device))

    def launch(self, rows: int, furthest: int, tokens: Sequence[int] | None = None,
               positions: Sequence[int] | None = None, *, full: bool = False,
               beam_rows: Tensor | None = None, beams_from: int = 0, lora: bool = True) -> LaunchedStep:
        """Queue a step for rows ``[0, rows)`` whose positions are all below ``furthest``.

        ``tokens`` and ``positions`` (one per row) replace the chooser's; ``full`` runs penalties, sampling and beam
        search (else an argmax); ``beam_rows`` (a device tensor) are the rows that first copy their parent's cache
        from position ``beams_from`` on (where beams of one prompt start to differ); ``lora``: some row has a LoRA
        adapter (else the step skips the LoRA products).
        """
        span = next(s for s in self.spans if s >= furthest)
        if tokens is not None:
            self.chooser.place(tokens, positions)
        if beam_rows is not None:
            self.cache.copy_rows_(beam_rows, self.chooser.ints[PARENT, beam_rows], beams_from, furthest)
        lora = lora and self.adapters is not None
        if not self.enabled:
            logits = self._compute(rows, span, full, lora)
        else:
            bucket = next(b for b in self.buckets if b >= rows)
            if (bucket, span, full, lora) not in self.graphs:
                self._capture(bucket, span, full, lora)
            graph, logits = self.graphs[(bucket, span, full, lora)]
            graph.replay()
            logits = logits[:rows]
        return LaunchedStep.read_back(self.chooser, 0, logits, full and beam_rows is not None)

    def capture_all(self) -> None:
        """Capture every (row bucket, span, choice, LoRA) graph now, so no request waits for one later (before any
        request: the captures run steps on the rows)."""
        for bucket in self.buckets if self.enabled else ():
            for span in self.spans:
                for full in (False, True):
                    for lora in (False, True) if self.adapters is not None else (False,):
                        if (bucket, span, full, lora) not in self.graphs:
                            self._capture(bucket, span, full, lora)

    @property
    def graph_count(self) -> int:
        return len(self.graphs)

    def _capture(self, bucket: int, span: int, full: bool, lora: bool) -> None:
        # Capturing runs the step from the current state (writing each row's cache at its own position, as the
        # step will, and past it, where the next steps write): keep the state as it was.
        saved = self.chooser.snapshot()
        self.graphs[(bucket, span, full, lora)] = capture(lambda: self._compute(bucket, span, full, lora), self.pool)
        self.chooser.restore(saved)

    def _compute(self, rows: int, span: int, full: bool, lora: bool = False) -> Tensor:
        state = self.chooser.ints
        tokens, positions = state[TOKEN, :rows], state[POSITION, :rows, None]
        view = self.cache.rows(0, rows)
        adapters = self.adapters[:rows] if lora else None
        logits = self.model(self.model.embed(tokens)[:, None], positions, view, kv_len=span, adapters=adapters)[:, 0]
        self.chooser.choose(logits, 0, full)
        return logits


def prefill_bucket(length: int) -> int:
    """The padded length a prompt of ``length`` positions is prefilled at on CUDA (multiples of 64 up to 1024,
    then of 256)."""
    step = KV_ALIGNMENT if length <= 1024 else 256
    return -(-length // step) * step


class PrefillStep:
    """Fresh prompts into consecutive cache rows; returns the float32 logits after each prompt's last position.

    On CUDA, a lone prompt runs as a graph captured per padded length (``prefill_bucket``) into a one-row scratch
    cache whose filled positions are then copied into its row: no Python issues the prefill's kernels one by one.
    Several prompts at once run eagerly, right-padded, as one batch, straight into their rows. With a LoRA bank on
    the model, each prompt runs with its adapter slot.
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
            self.adapter = None if model.lora is None else torch.zeros(1, dtype=torch.long, device=device)
            self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, prompts: Sequence[Tensor], first_row: int, adapters: Sequence[int] | None = None) -> Tensor:
        """The prompts into rows ``first_row, ...``; ``adapters``: each prompt's LoRA slot (default none)."""
        adapters = list(adapters) if adapters is not None else [0] * len(prompts)
        if self.enabled and len(prompts) == 1 and prefill_bucket(len(prompts[0])) <= self.cache.max_seq_len:
            return self._graphed(prompts[0], first_row, adapters[0])
        return self._batched(prompts, first_row, adapters)

    def capture_all(self) -> None:
        """Capture the graph of every padded length now."""
        length = KV_ALIGNMENT
        while self.enabled and length <= self.cache.max_seq_len:
            if length not in self.graphs:
                self._capture(length)
            length = prefill_bucket(length + 1)

    def _graphed(self, prompt: Tensor, row: int, adapter: int) -> Tensor:
        length = len(prompt)
        bucket = prefill_bucket(length)
        self.embeds[0, :length].copy_(prompt, non_blocking=True)
        self.last.fill_(length - 1)
        if self.adapter is not None:
            self.adapter.fill_(adapter)
        if bucket not in self.graphs:
            self._capture(bucket)
        graph, logits = self.graphs[bucket]
        graph.replay()
        target = self.cache.data[:, :, self.cache.start + row, :length]
        target.copy_(self.scratch.data[:, :, 0, :length])
        return logits[:, 0].float()

    def _capture(self, bucket: int) -> None:
        embeds = self.embeds[:, :bucket]
        self.graphs[bucket] = capture(lambda: self.model(embeds, kv_cache=self.scratch, output_index=self.last,
                                                         adapters=self.adapter), self.pool)

    def _batched(self, prompts: Sequence[Tensor], first_row: int, adapters: Sequence[int]) -> Tensor:
        model = self.model
        lengths = [len(prompt) for prompt in prompts]
        padded = torch.zeros(len(prompts), max(lengths), model.config.hidden_size, dtype=model.dtype,
                             device=model.device)
        for row, prompt in enumerate(prompts):
            padded[row, : lengths[row]] = prompt.to(padded)
        rows = self.cache.rows(first_row, first_row + len(prompts))
        last = host_to_device(lengths, torch.long, model.device) - 1
        slots = host_to_device(adapters, torch.long, model.device) if any(adapters) else None
        return model(padded, kv_cache=rows, output_index=last, adapters=slots)[:, 0].float()
