"""Model steps and encoder calls at fixed shapes, replayed as CUDA graphs on the GPU (eager elsewhere).

A CUDA graph replays a whole captured call with one launch, removing the per-kernel launch cost (and the Python
that issues each kernel) that dominates small-batch decoding and the prefill of one prompt. Shapes must be static,
so inputs are copied into preallocated buffers and a call runs at the smallest captured size ("bucket") that holds
it: batch sizes for the decode rows and the encoder, padded token counts for a chunk of prompt pieces. Padding rows
and positions compute on filler (writing to the KV cache's null block) and are dropped.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from ..llm.gemv import timings
from ..llm.model import Decoder
from ..llm.paged_attention import Chunk, PagedBatch, PagedKVCache
from ..llm.paged_triton import CHUNK_TILE, split_count
from ..llm.parallel_compile import compiles_only
from ..llm.sampling import PARENT, POSITION, TOKEN, TokenChooser, host_to_device

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SHORTEST_CHUNK = 32  # the smallest padded chunk of prompt tokens
MAX_PIECES = 16  # prompt pieces one captured step prefills at most (more run eagerly)
MAX_SPLITS = 16
# runs of a step before its capture, outside the graph: the first compiles or loads its kernels, restores or chooses
# their configurations and makes the workspaces and weight copies they use. A second one runs only where the first
# timed kernels to choose them (no kernel cache): a start whose kernel cache holds every choice runs each step once.
MAX_WARM_UP_RUNS = 2


def bucket_sizes(limit: int) -> list[int]:
    """The captured batch sizes up to ``limit`` (``limit`` itself always included)."""
    return sorted({b for b in BUCKETS if b < limit} | {limit})


def chunk_bucket_sizes(limit: int) -> list[int]:
    """The padded chunk sizes a step is captured for, up to ``limit`` (always included): powers of two from 32 to
    256, then every 128 up to 1024 and every 256 beyond, so that a lone prompt's chunk (an image prompt of ~600
    positions: 640) computes little padding."""
    sizes, size = {limit}, SHORTEST_CHUNK
    while size < limit:
        sizes.add(size)
        size = size * 2 if size < 256 else size + (128 if size < 1024 else 256)
    return sorted(sizes)


def decode_splits(rows: int, heads: int, device: torch.device) -> int:
    """Parts the attention kernel cuts the keys of each of its ``rows x heads`` programs into (decode: rows and KV
    heads; a chunk: query tiles and heads): enough programs for two per SM."""
    if device.type != "cuda":
        return 1
    return split_count(rows * heads, 2 * torch.cuda.get_device_properties(device).multi_processor_count, MAX_SPLITS)


def _always() -> bool:
    return True


def capture(fn: Callable[[], Any], pool: tuple, proceed: Callable[[], bool] = _always,
            seconds: dict[str, float] | None = None) -> tuple[torch.cuda.CUDAGraph, Any] | None:
    """A CUDA graph of ``fn()`` (which reads only static buffers) and its static output; None (nothing captured)
    where ``proceed()``, asked before each of its slices (one warm-up run, a second where the first timed kernels
    (``MAX_WARM_UP_RUNS``), then the capture), says stop.
    ``seconds["runs"]`` and ``seconds["capture"]`` are added the warm-up runs' time (to the end of their device
    work) and the capture's."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    started = time.perf_counter()
    try:
        for _ in range(MAX_WARM_UP_RUNS):
            if not proceed():
                return None
            timed = timings()
            with torch.cuda.stream(side):
                fn()
            if timings() == timed:  # it chose no kernel: nothing is left for another run
                break
    finally:
        torch.cuda.current_stream().wait_stream(side)
    if seconds is not None:
        side.synchronize()  # costs nothing: entering torch.cuda.graph synchronizes the device anyway
        seconds["runs"] = seconds.get("runs", 0.0) + time.perf_counter() - started
    if not proceed():
        return None
    ran = time.perf_counter()
    graph = torch.cuda.CUDAGraph()
    # thread_local: another thread (an encoder beside a background capture) may use the device meanwhile
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        output = fn()
    if seconds is not None:
        seconds["capture"] = seconds.get("capture", 0.0) + time.perf_counter() - ran
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


@dataclass
class Piece:
    """A run of one prompt's positions to prefill: embeddings ``[n, H]`` at positions ``[start, start + n)`` of a
    row whose block table is ``blocks`` (covering them), computed with LoRA slot ``adapter`` (0: none)."""

    embeds: Tensor
    start: int
    blocks: Sequence[int]
    adapter: int = 0


class ForwardStep:
    """One forward over decode rows ``[0, rows)`` and a chunk of prompt pieces, with the rows' next tokens chosen
    on the device; returns the decode rows' launched choice and the logits after each piece's last position.

    A decode row's input token and position are the ``TokenChooser``'s state: the step reads them and leaves there
    the row's next token and position (``TokenChooser.choose``), so steps can be queued back to back before the host
    has read any of them. ``launch`` with tokens and positions sets them from the host instead. Row ``r`` reads and
    writes the blocks of ``tables[r]`` (an idle row's: the null block). Beam rows given to ``launch`` first copy
    their parent rows' blocks. With a LoRA bank on the model, each decode row runs with its adapter slot
    (``set_adapters``, a static device tensor) and each piece with its own; a step without adapters skips the LoRA
    products. On CUDA a step is a graph captured per (row bucket, chunk bucket, full or argmax-only choice, LoRA or
    not) with the block tables, the chooser's state and the chunk's buffers as its inputs; a chunk of more than
    ``MAX_PIECES`` pieces or ``max_chunk`` tokens, and every step elsewhere, runs eagerly. A graph not captured
    ahead (``capture_all``, ``capture_next``) is captured by the first step that needs it, or with
    ``capture_on_demand`` off (a server, whose requests must not wait for a capture) that step runs the graph of
    a bigger bucket already captured (padded), else eagerly.

    Tensor parallel (the model's ``tp`` set): rank 0's step tells the other ranks' twins (``follower``) what it
    does (a message, then ``_share_inputs``: the chooser's state, the tables and the chunk's metadata), and every
    rank runs the same step, the collectives inside its graph; rank 0 embeds (the embeddings are broadcast inside
    the step) and chooses the tokens. Copies between KV-cache blocks go through ``copy_blocks`` for the same reason.
    """

    _ids = itertools.count()

    def __init__(self, model: Decoder, cache: PagedKVCache, tables: Tensor, chooser: TokenChooser, *,
                 max_chunk: int, use_cuda_graphs: bool | None = None, step_id: int | None = None):
        self.model = model
        self.cache = cache
        self.tables = tables
        self.chooser = chooser
        self.tp = model.tp
        self.id = next(self._ids) if step_id is None else step_id
        device = model.device
        self.enabled = device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs and device.type == "cuda"
        self.buckets = bucket_sizes(tables.shape[0])
        self.chunk_buckets = chunk_bucket_sizes(max_chunk)
        self.splits = {rows: decode_splits(rows, model.kv_heads, device) for rows in self.buckets}
        self.graphs: dict[tuple[int, int, bool, bool], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.capture_on_demand = True  # a step whose graph is missing captures it (else it runs eagerly)
        self.chunk_beside_rows: int | None = None  # the largest chunk a step with decode rows takes (None: any)
        self.eager_steps = 0  # steps of a captured shape that ran eagerly, their graph not captured yet
        self.padded_steps = 0  # steps that ran a bigger bucket's graph, their own not captured yet
        self.capture_seconds: dict[str, float] = {}  # the step graphs' warm-up runs and captures so far (`capture`)
        self.adapters = None if model.lora is None else torch.zeros(tables.shape[0], dtype=torch.long, device=device)
        if self.enabled:
            self.allocate_static_inputs()
        if self.tp is not None and self.tp.leader:
            self.tp.send(("new", self.id, dict(blocks=cache.num_blocks, block_size=cache.block_size,
                                               rows=tables.shape[0], width=tables.shape[1], max_chunk=max_chunk,
                                               beams=chooser.max_beam_width, graphs=self.enabled)))

    def allocate_static_inputs(self) -> None:
        """The graphs' memory pool and the static chunk buffers they read (done when graphs are enabled)."""
        device, longest = self.model.device, self.chunk_buckets[-1]
        self.pool = torch.cuda.graph_pool_handle()
        self.embeds = torch.zeros(longest, self.model.config.hidden_size, dtype=self.model.dtype, device=device)
        self.longs = torch.zeros(_LONG_FIELDS * longest + MAX_PIECES, dtype=torch.long, device=device)
        self.ints = torch.zeros(4 * _tile_capacity(longest) + MAX_PIECES * self.tables.shape[1],
                                dtype=torch.int32, device=device)

    @classmethod
    def follower(cls, model: Decoder, step_id: int, facts: dict) -> ForwardStep:
        """A tensor-parallel rank's twin of rank 0's step ``step_id`` (its ``"new"`` message's ``facts``), over
        this rank's own KV-cache blocks."""
        device = model.device
        cache = model.new_paged_kv_cache(facts["blocks"], facts["block_size"])
        tables = torch.zeros(facts["rows"], facts["width"], dtype=torch.int32, device=device)
        chooser = TokenChooser(facts["rows"], model.config.vocab_size, device, facts["beams"])
        return cls(model, cache, tables, chooser, max_chunk=facts["max_chunk"], use_cuda_graphs=facts["graphs"],
                   step_id=step_id)

    def follow(self, message: tuple) -> None:
        """Do what rank 0's step told (a tensor-parallel rank other than 0)."""
        kind, _, *facts = message
        if kind == "copy":
            targets, sources = (torch.empty(facts[0], dtype=torch.long, device=self.model.device) for _ in "ts")
            self.tp.share(targets, sources)
            self.cache.copy_blocks_(targets, sources)
        elif kind == "capture":
            self._capture(*facts[0], filler=True)
        elif kind == "launch":
            self._follow_launch(**facts[0])

    def close(self) -> None:
        """Tensor parallel: the other ranks drop their twins of this step (their cache and graphs)."""
        if self.tp is not None and self.tp.leader:
            self.tp.send(("close", self.id))

    def copy_blocks(self, targets: Tensor, sources: Tensor) -> None:
        """KV-cache block ``targets[i]`` gets the contents of block ``sources[i]`` (on every rank)."""
        if self.tp is not None:
            self.tp.send(("copy", self.id, len(targets)))
            self.tp.share(targets.contiguous(), sources.contiguous())
        self.cache.copy_blocks_(targets, sources)

    def set_adapters(self, first: int, slots: Sequence[int]) -> None:
        """Rows ``[first, first + len(slots))`` decode with these LoRA slots (the model has a LoRA bank)."""
        self.adapters[first:first + len(slots)].copy_(host_to_device(slots, torch.long, self.adapters.device))

    def launch(self, rows: int, furthest: int, pieces: Sequence[Piece] = (), tokens: Sequence[int] | None = None,
               positions: Sequence[int] | None = None, *, full: bool = False, beam_rows: Tensor | None = None,
               beams_from: int = 0, lora: bool = True) -> tuple[LaunchedStep | None, Tensor | None]:
        """Queue a step for decode rows ``[0, rows)``, whose positions are all below ``furthest``, and ``pieces``.

        ``tokens`` and ``positions`` (one per row) replace the chooser's; ``full`` runs penalties, sampling and beam
        search (else an argmax); ``beam_rows`` (a device tensor) are the rows that first copy their parent's blocks
        from position ``beams_from`` on (where beams of one prompt start to differ); ``lora``: some row or piece has
        a LoRA adapter (else the step skips the LoRA products). Returns the decode rows' launched choice (None
        without rows) and the logits after each piece's last position ``[len(pieces), V]`` (None without pieces;
        valid until the next launch).
        """
        if tokens is not None:
            self.chooser.place(tokens, positions)
        tokens_in_chunk = sum(len(piece.embeds) for piece in pieces)
        full = full and rows > 0
        lora = lora and self.adapters is not None
        key = self._graph_key(rows, pieces, tokens_in_chunk, full, lora)
        if key is not None and key not in self.graphs and not self.capture_on_demand:
            key = self._captured_above(key)
            self.padded_steps += key is not None
            self.eager_steps += key is None
        if key is None:
            chunk = self._chunk(pieces, tokens_in_chunk) if pieces else None
            key, decoded = None, rows
            layout = None if chunk is None else ("eager", tokens_in_chunk, len(pieces), _tile_count(pieces),
                                                 chunk.chunk.sequences)
        else:
            decoded, padded = key[:2]
            if pieces:
                self._fill(pieces, padded)
            chunk, layout = None, ("static", padded) if pieces else None
        if self.tp is None:
            logits = self._run(rows, furthest, chunk, key, full, lora, beam_rows, beams_from)
        else:
            self.tp.send(("launch", self.id, dict(rows=rows, furthest=furthest, full=full, lora=lora, key=key,
                                                  layout=layout, beams_from=beams_from,
                                                  beam_rows=None if beam_rows is None else len(beam_rows))))
            with self.tp.in_step():
                self._share_inputs(beam_rows, layout, chunk)
                logits = self._run(rows, furthest, chunk, key, full, lora, beam_rows, beams_from)
        launched = (LaunchedStep.read_back(self.chooser, 0, logits[:rows], full and beam_rows is not None)
                    if rows else None)
        return launched, logits[decoded: decoded + len(pieces)] if pieces else None

    def _graph_key(self, rows: int, pieces: Sequence[Piece], tokens_in_chunk: int, full: bool,
                   lora: bool) -> tuple[int, int, bool, bool] | None:
        """The graph a step of this shape replays, or None where steps of its shape always run eagerly."""
        if not self.enabled or len(pieces) > MAX_PIECES or tokens_in_chunk > self.chunk_buckets[-1]:
            return None
        decoded = next(b for b in self.buckets if b >= rows) if rows else 0
        padded = next(c for c in self.chunk_buckets if c >= tokens_in_chunk) if pieces else 0
        return decoded, padded, full, lora

    def _captured_above(self, key: tuple[int, int, bool, bool]) -> tuple[int, int, bool, bool] | None:
        """The captured graph that runs a step of ``key``'s shape padded at the least cost (the smallest chunk
        bucket, then row bucket, at least ``key``'s, with the same choice and LoRA; decode rows only where ``key``
        has some, a chunk likewise), or None."""
        rows, padded, full, lora = key
        fits = [(other_padded, other_rows) for other_rows, other_padded, *rest in self.graphs
                if tuple(rest) == (full, lora) and (other_rows >= rows if rows else other_rows == 0)
                and (other_padded >= padded if padded else other_padded == 0)]
        if not fits:
            return None
        padded, rows = min(fits)
        return rows, padded, full, lora

    def _run(self, rows: int, furthest: int, chunk: _ChunkInputs | None, key: tuple | None, full: bool, lora: bool,
             beam_rows: Tensor | None, beams_from: int) -> Tensor:
        """The step's beam copies, then its forward: eager (``key`` None) or the graph of ``key``."""
        if beam_rows is not None:
            self._copy_beam_blocks(beam_rows, beams_from, furthest)
        if key is None:
            return self._compute(rows, chunk, full, furthest, lora)
        if key not in self.graphs:  # captured on demand, from this step's inputs
            self._capture(*key)
        graph, logits = self.graphs[key]
        graph.replay()
        return logits

    def _share_inputs(self, beam_rows: Tensor | None, layout: tuple | None, chunk: _ChunkInputs | None) -> None:
        """Rank 0's step inputs into every rank's: the chooser's state, the tables, the beam rows, and the chunk's
        metadata (an eager chunk's own buffers, or the static buffers' part that ``layout``'s bucket uses)."""
        self.tp.share(self.chooser.ints, self.tables)
        if beam_rows is not None:
            self.tp.share(beam_rows)
        if layout is not None:
            self.tp.share(*(chunk.buffers if chunk is not None else self._static_buffers(layout[1])))

    def _follow_launch(self, rows: int, furthest: int, full: bool, lora: bool, key: tuple | None,
                       layout: tuple | None, beams_from: int, beam_rows: int | None) -> None:
        device = self.model.device
        beams = None if beam_rows is None else torch.empty(beam_rows, dtype=torch.long, device=device)
        chunk = None
        if layout is not None and layout[0] == "eager":
            _, tokens, sequences, tiles, described = layout
            width = self.tables.shape[1]
            chunk = _views(torch.zeros(_LONG_FIELDS * tokens + sequences, dtype=torch.long, device=device),
                           torch.zeros(4 * tiles + sequences * width, dtype=torch.int32, device=device),
                           torch.empty(tokens, self.model.config.hidden_size, dtype=self.model.dtype, device=device),
                           tokens, sequences, tiles, width, tuple(map(tuple, described)))
        self._share_inputs(beams, layout, chunk)
        self._run(rows, furthest, chunk, key, full, lora, beams, beams_from)

    def graph_keys(self) -> list[tuple[int, int, bool, bool]]:
        """Every (row bucket, chunk bucket, full choice, LoRA) a step can take, those a first request uses first
        (``first_keys``), then decode on every row (which a decode step of fewer rows runs padded until its own
        graph is captured), then by rows and chunk size, smallest first. Beside decode rows only the chunk buckets
        up to the one holding ``chunk_beside_rows`` (the scheduler's chunks there)."""
        beside = self.chunk_buckets[-1] if self.chunk_beside_rows is None else \
            next((c for c in self.chunk_buckets if c >= self.chunk_beside_rows), self.chunk_buckets[-1])
        first = self.first_keys() + [(self.buckets[-1], 0, full, False) for full in (False, True)]
        others = [(rows, padded, full, lora) for rows in [0, *self.buckets] for padded in [0, *self.chunk_buckets]
                  if (rows or padded) and (not rows or padded <= beside)
                  for full in ((False, True) if rows else (False,))
                  for lora in ((False, True) if self.adapters is not None else (False,))]
        return first + [key for key in others if key not in first]

    def first_keys(self) -> list[tuple[int, int, bool, bool]]:
        """The graphs a first request runs: its prompt's chunks alone (every chunk bucket), then its decode steps
        on one row (argmax and full choice); no LoRA."""
        return [(0, padded, False, False) for padded in self.chunk_buckets] + [(1, 0, False, False),
                                                                                (1, 0, True, False)]

    def uncaptured(self) -> int:
        """How many of ``graph_keys``' graphs are not captured yet (0 where graphs are off)."""
        return sum(key not in self.graphs for key in self.graph_keys()) if self.enabled else 0

    def capture_all(self, first_only: bool = False) -> int:
        """Capture every step graph not captured yet (or only ``first_keys``'), so that no step runs eagerly later;
        returns how many were captured. Run only while no request is admitted: the captures run steps on the
        rows (an idle row writes the null block)."""
        if not self.enabled:
            return 0
        keys = self.first_keys() if first_only else self.graph_keys()
        return sum(self.capture_next(key) for key in keys)

    def capture_next(self, key: tuple[int, int, bool, bool] | None = None,
                     proceed: Callable[[], bool] = _always) -> bool:
        """Capture ``key``'s graph, or the first of ``graph_keys`` not captured yet; False if there was none.
        Under the same rule as ``capture_all``. ``proceed``: asked between the capture's slices, it may put the
        capture off (nothing captured; under tensor parallelism, whose ranks capture together, it is not asked)."""
        if key is None and self.enabled:
            key = next((key for key in self.graph_keys() if key not in self.graphs), None)
        if key is None or key in self.graphs:
            return False
        if self.tp is not None:
            self.tp.send(("capture", self.id, key))
            proceed = _always
        self._capture(*key, filler=True, proceed=proceed)
        return True

    @property
    def graph_count(self) -> int:
        return len(self.graphs)

    def _copy_beam_blocks(self, beam_rows: Tensor, beams_from: int, furthest: int) -> None:
        size = self.cache.block_size
        first, stop = beams_from // size, min(-(-furthest // size), self.tables.shape[1])
        if stop > first:
            parents = self.chooser.ints[PARENT, beam_rows]
            self.cache.copy_blocks_(self.tables[beam_rows, first:stop].flatten().long(),
                                    self.tables[parents, first:stop].flatten().long())

    def _capture(self, rows: int, padded: int, full: bool, lora: bool, filler: bool = False,
                 proceed: Callable[[], bool] = _always) -> None:
        # Capturing runs the step from the current state (writing each row's cache at its own position, as the
        # step will, and past it, where the next steps write): keep the state as it was. Outside a step
        # (``filler``) the chunk is filler (the null block), not the last step's (whose blocks may be cached now).
        saved = self.chooser.snapshot()
        if padded and filler:
            self.longs.zero_()
            self.ints.zero_()
        try:
            captured = capture(lambda: self.compute(rows, padded, full, lora), self.pool, proceed,
                               self.capture_seconds)
        finally:
            self.chooser.restore(saved)
        if captured is not None:
            self.graphs[(rows, padded, full, lora)] = captured

    def compute(self, rows: int, padded: int, full: bool, lora: bool) -> Tensor:
        """The computation of graph ``(rows, padded, full, lora)``, run eagerly as its capture runs it (a chunk
        bucket's static buffers as they are); its logits."""
        return self._compute(rows, self._static_chunk(padded) if padded else None, full, 0, lora)

    def _compute(self, rows: int, chunk: _ChunkInputs | None, full: bool, span: int, lora: bool = False) -> Tensor:
        """Logits of the decode rows ``[rows, V]`` then of each piece's last position, the rows' tokens chosen.
        The batch's tokens go through the model one per row (``[N, 1, H]``), so each has its own LoRA slot.
        Tensor parallel: rank 0's embeddings are broadcast, and only rank 0 chooses tokens."""
        state = self.chooser.ints
        embeds, positions, adapters = [], [], []
        if rows:
            embeds.append(state[TOKEN, :rows])
            positions.append(state[POSITION, :rows])
            adapters.append(self.adapters[:rows] if lora else None)
        output_index = None
        if chunk is not None:
            embeds.append(chunk.embeds)
            positions.append(chunk.positions)
            adapters.append(chunk.adapters)
            output_index = torch.cat([torch.arange(rows, device=chunk.outputs.device), rows + chunk.outputs])
        prompt = None
        if chunk is not None:  # its kernel's splits: as many as its tokens in whole query tiles need
            tiles = -(-len(chunk.positions) // CHUNK_TILE)
            prompt = replace(chunk.chunk, splits=decode_splits(tiles, self.model.config.num_attention_heads,
                                                               self.model.device))
        batch = PagedBatch(self.cache, rows, self.tables, state[POSITION, :rows], span,
                           self.splits.get(rows, 1), prompt)
        logits = self.model(self._embeddings(embeds)[:, None], torch.cat(positions)[:, None], batch,
                            output_index=output_index, adapters=torch.cat(adapters) if lora else None)[:, 0]
        if rows and (self.tp is None or self.tp.leader):
            self.chooser.choose(logits[:rows], 0, full)
        return logits

    def _embeddings(self, parts: list[Tensor]) -> Tensor:
        """The step's input embeddings ``[N, H]``: the decode rows' tokens (the first part, ids, when there are
        rows) embedded, then the chunk's; tensor parallel: rank 0's, broadcast to the others."""
        leader = self.tp is None or self.tp.leader
        if parts[0].dtype == torch.long:
            parts[0] = self.model.embed(parts[0]) if leader else parts[0]
        if leader:
            embeds = torch.cat(parts)
        else:
            embeds = torch.empty(sum(len(part) for part in parts), self.model.config.hidden_size,
                                 dtype=self.model.dtype, device=self.model.device)
        if self.tp is not None:
            self.tp.share(embeds)
        return embeds

    def _chunk(self, pieces: Sequence[Piece], tokens: int) -> _ChunkInputs:
        """The chunk's inputs on the device at exactly its size (eager steps)."""
        device = self.model.device
        tiles = _tile_count(pieces)
        longs, ints, described = _describe(pieces, tokens, len(pieces), tiles, self.tables.shape[1],
                                           self.cache.block_size)
        embeds = torch.cat([piece.embeds for piece in pieces]).to(self.model.dtype)
        return _views(longs.to(device), ints.to(device), embeds, tokens, len(pieces), tiles, self.tables.shape[1],
                      described)

    def _fill(self, pieces: Sequence[Piece], padded: int) -> None:
        """Copy the pieces and their metadata into the static buffers, laid out for chunk bucket ``padded``."""
        longs, ints, _ = _describe(pieces, padded, MAX_PIECES, _tile_capacity(padded), self.tables.shape[1],
                                   self.cache.block_size)
        self.longs[: len(longs)].copy_(longs.pin_memory(), non_blocking=True)
        self.ints[: len(ints)].copy_(ints.pin_memory(), non_blocking=True)
        start = 0
        for piece in pieces:
            self.embeds[start: start + len(piece.embeds)].copy_(piece.embeds, non_blocking=True)
            start += len(piece.embeds)

    def _static_buffers(self, padded: int) -> tuple[Tensor, Tensor]:
        """The parts of the static metadata buffers that chunk bucket ``padded`` lays out."""
        return (self.longs[: _LONG_FIELDS * padded + MAX_PIECES],
                self.ints[: 4 * _tile_capacity(padded) + MAX_PIECES * self.tables.shape[1]])

    def _static_chunk(self, padded: int) -> _ChunkInputs:
        """Views of the static buffers as chunk bucket ``padded`` lays them out (what its graph reads)."""
        return _views(self.longs, self.ints, self.embeds[:padded], padded, MAX_PIECES, _tile_capacity(padded),
                      self.tables.shape[1], ())


@dataclass
class _ChunkInputs:
    """A chunk's attention metadata and its per-token inputs: embeddings, positions, LoRA slots, and the index of
    each piece's last token."""

    chunk: Chunk
    embeds: Tensor
    positions: Tensor
    adapters: Tensor
    outputs: Tensor
    buffers: tuple[Tensor, Tensor]  # the int64 and int32 metadata buffers the views above read


_LONG_FIELDS = 4  # per-token int64 fields of a chunk's metadata: positions, blocks, offsets, LoRA slots


def _views(longs: Tensor, ints: Tensor, embeds: Tensor, tokens: int, sequences: int, tiles: int, width: int,
           described: tuple[tuple[int, int, int], ...]) -> _ChunkInputs:
    """The chunk's inputs from buffers laid out as ``_describe`` does."""
    positions, blocks, offsets, adapters = (longs[field * tokens: (field + 1) * tokens] for field in range(4))
    chunk = Chunk(tables=ints[4 * tiles: 4 * tiles + sequences * width].view(sequences, width), blocks=blocks,
                  offsets=offsets, tiles=ints[: 4 * tiles].view(tiles, 4), sequences=described)
    end = _LONG_FIELDS * tokens
    return _ChunkInputs(chunk, embeds, positions, adapters, longs[end: end + sequences], (longs, ints))


def _tile_count(pieces: Sequence[Piece]) -> int:
    return sum(-(-len(piece.embeds) // CHUNK_TILE) for piece in pieces)


def _tile_capacity(tokens: int) -> int:
    """Tiles enough for any ``MAX_PIECES`` pieces of ``tokens`` tokens in all."""
    return -(-tokens // CHUNK_TILE) + MAX_PIECES


def _describe(pieces: Sequence[Piece], tokens: int, sequences: int, tiles: int, width: int,
              block_size: int) -> tuple[Tensor, Tensor, tuple[tuple[int, int, int], ...]]:
    """The chunk's metadata on the host, padded to ``tokens`` tokens, ``sequences`` pieces and ``tiles`` tiles:
    int64 ``[positions | blocks | offsets | LoRA slots (tokens each) | last token of each piece (sequences)]`` and
    int32 ``[tiles x (piece or -1, first, count, start) | block tables (sequences x width)]``; and per piece
    ``(first, count, start)``."""
    positions = torch.zeros(tokens, dtype=torch.long)
    blocks = torch.zeros(tokens, dtype=torch.long)
    adapters = torch.zeros(tokens, dtype=torch.long)
    outputs = torch.zeros(sequences, dtype=torch.long)
    tile_rows = torch.full((tiles, 4), -1, dtype=torch.int32)
    tables = torch.zeros(sequences, width, dtype=torch.int32)
    described = []
    first = tile = 0
    for index, piece in enumerate(pieces):
        count = len(piece.embeds)
        table = torch.tensor(piece.blocks, dtype=torch.long)
        span = torch.arange(piece.start, piece.start + count)
        positions[first: first + count] = span
        blocks[first: first + count] = table[span // block_size]
        adapters[first: first + count] = piece.adapter
        outputs[index] = first + count - 1
        tables[index, : len(table)] = table.to(torch.int32)
        for offset in range(0, count, CHUNK_TILE):
            tile_rows[tile] = torch.tensor([index, first + offset, min(CHUNK_TILE, count - offset),
                                            piece.start + offset], dtype=torch.int32)
            tile += 1
        described.append((first, count, piece.start))
        first += count
    longs = torch.cat([positions, blocks, positions % block_size, adapters, outputs])
    return longs, torch.cat([tile_rows.flatten(), tables.flatten()]), tuple(described)


def activation_bytes(model: Decoder, rows: int, chunk_tokens: int, max_beam_width: int) -> int:
    """The memory one eager step of ``rows`` decode rows and a ``chunk_tokens`` prompt chunk allocates at its peak,
    the full token choice included (CUDA; measured on a two-block cache, before the real one is sized)."""
    device = model.device
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    _activation_step(model, rows, chunk_tokens, max_beam_width)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def _activation_step(model: Decoder, rows: int, chunk_tokens: int, max_beam_width: int) -> None:
    """The step ``activation_bytes`` measures, on a throwaway two-block cache (queued, not waited for)."""
    device = model.device
    cache = model.new_paged_kv_cache(2, SHORTEST_CHUNK)
    pages = -(-chunk_tokens // SHORTEST_CHUNK)
    tables = torch.ones(rows, pages, dtype=torch.int32, device=device)
    chooser = TokenChooser(rows, model.config.vocab_size, device, max_beam_width)
    step = ForwardStep(model, cache, tables, chooser, max_chunk=chunk_tokens, use_cuda_graphs=False)
    embeds = torch.zeros(chunk_tokens, model.config.hidden_size, dtype=model.dtype, device=device)
    step.launch(rows, 1, [Piece(embeds, 0, [1] * pages)], full=True)
    step.close()


def compile_ahead(model: Decoder, *, rows: int, width: int, block_size: int, chunk_tokens: int,
                  max_beam_width: int, fp8: bool, graphs: bool) -> None:
    """Compile the Triton kernels of a first start's eager steps in one parallel batch
    (``parallel_compile.compiles_only``): ``activation_bytes``' step, and with ``graphs`` the computation of each
    of ``ForwardStep.first_keys``' graphs on a step shaped as the scheduler's (``rows`` x ``width`` block tables
    over ``block_size``-token blocks, in float8 with ``fp8``), on a throwaway two-block cache. Nothing is launched
    or timed: the steps after it find their kernels compiled and time them. Not under tensor parallelism (its
    steps talk to the other ranks); a kernel it misses compiles at its first call, as without it."""
    if model.tp is not None:
        return
    with torch.inference_mode(), compiles_only():
        _activation_step(model, rows, chunk_tokens, max_beam_width)
        if graphs:
            tables = torch.zeros(rows, width, dtype=torch.int32, device=model.device)
            chooser = TokenChooser(rows, model.config.vocab_size, model.device, max_beam_width)
            scales = torch.ones(model.config.num_layers, 2, model.kv_heads) if fp8 else None  # only their type counts
            step = ForwardStep(model, model.new_paged_kv_cache(2, block_size, scales), tables, chooser,
                               max_chunk=chunk_tokens, use_cuda_graphs=True)
            for key in step.first_keys():
                step.compute(*key)
