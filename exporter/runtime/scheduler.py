"""In-flight batching: requests join and leave a running decode batch between steps.

A request takes one row of the decode batch (a beam search of ``num_beams`` beams as many consecutive rows; at
most ``max_slots`` rows run) and the KV-cache blocks its prompt and ``max_output_len`` new tokens need, reserved at
admission (``kv_cache``: no request is ever preempted or runs out of cache). Requests are admitted first come
first served while rows and blocks are free; the others wait. A prompt whose leading blocks another request
already computed (same token ids and media, see ``prefix``) takes those blocks instead of computing them.

Each iteration (``step``) admits waiting requests, queues one forward that holds a decode token for every
decoding row and a chunk of the admitted prompts (at most ``max_num_tokens`` prompt positions, and fewer while rows
decode, ``chunk_budget``, so a long prompt is prefilled over several steps while the others keep decoding),
chooses the first tokens of the prompts that chunk completed, and then reads back what the iteration before
queued: each request takes its token (a beam search its candidates), streams it and finishes, releasing its rows
and blocks at once. The decode rows of a step are ``[0, bucket)``, the smallest captured batch size that holds
every decoding row, so on CUDA each step replays a CUDA graph (see ``cuda_graphs``).

Every row's next token is chosen on the device (``exporter.llm.sampling``: greedy, sampled and beam rows alike), so
the next step is always queued before the host reads the current one and the device does not wait for the host's
bookkeeping. A request that ends meanwhile (an end token, a stop) has one extra step computed and dropped; one whose
last token (``max_output_len``) is queued takes no further step, so the device is free for the next request. The
device cannot read text: when a stop string ends a beam that the device continued, the host rebuilds that search's
rows (each beam's tokens computed again after the prompt) and the search skips the step queued meanwhile.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import secrets
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..engine.progress import LOGGER
from ..llm.gemv import release_timing_buffers
from ..llm.generate import Answer, BeamSearch, SamplingParams, check_requests
from ..llm.model import Decoder
from ..llm.sampling import RowSetup, TokenChooser, host_to_device
from ..llm.tokenizer import Tokenizer
from .chunk_pacing import ChunkPacer, attention_key_equivalent, plan_counts
from .cuda_graphs import MAX_PIECES, ForwardStep, LaunchedStep, Piece, activation_bytes, compile_ahead
from .kv_cache import BlockPool, BlockTables, KVCacheOptions, allocate_cache, prefix_keys

TokenCallback = Callable[[int], None]


class RequestCancelled(RuntimeError):
    """The request was cancelled (or the scheduler stopped) before it finished."""


@dataclass
class Handle:
    """A submitted request: ``result()`` waits for its token ids; ``cancel()`` ends it at the next step."""

    prompt: Tensor
    prompt_ids: list[int]
    params: SamplingParams
    on_token: TokenCallback | None = None
    tokens: list[int] = field(default_factory=list)  # the answer so far; a beam search's best beam at the end
    beams: list[list[int]] = field(default_factory=list)  # a beam search's hypotheses, best first
    error: BaseException | None = None
    cancelled: bool = False
    adapter: int = 0  # the LoRA slot its rows decode with (0: none)
    release_adapter: Callable[[], None] | None = None  # gives the LoRA slot back when the request ends
    submitted_at: float = field(default_factory=time.monotonic)  # time.monotonic() of each milestone
    taken_up_at: float | None = None  # the scheduler's loop first tried to admit it (woken, or done with a step)
    admitted_at: float | None = None  # given its rows and blocks
    prefill_started_at: float | None = None  # the host began launching the step with its prompt's first chunk
    prefill_launched_at: float | None = None  # the host finished launching the step with its prompt's last chunk
    prompt_queued_at: float | None = None  # its prompt's last chunk and first token choice queued on the device
    first_token_at: float | None = None
    finished_at: float | None = None
    block_keys: list[bytes] = field(default_factory=list)  # prefix keys of the prompt's full blocks (for reuse)
    on_finish: Callable[[], None] | None = None  # called once it has finished (on the thread that finished it)
    _finished: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request has finished (done, failed or cancelled); False if ``timeout`` ran out first."""
        return self._finished.wait(timeout)

    def result(self, timeout: float | None = None) -> list[int]:
        """The generated ids (EOS excluded; a beam search's best beam); raises the request's error, or
        RequestCancelled."""
        if not self._finished.wait(timeout):
            raise TimeoutError("the request did not finish in time")
        if self.error is not None:
            raise self.error
        if self.cancelled:
            raise RequestCancelled(f"cancelled after {len(self.tokens)} tokens")
        return self.tokens

    def results(self, timeout: float | None = None) -> list[list[int]]:
        """Every beam's ids, best first (one list without beam search); raises as ``result`` does."""
        tokens = self.result(timeout)
        return self.beams if self.params.num_beams > 1 else [tokens]

    def _finish(self, error: BaseException | None = None) -> None:
        if self.release_adapter is not None:
            self.release_adapter()
            self.release_adapter = None
        self.error = self.error or error
        self.finished_at = time.monotonic()
        self._finished.set()
        if self.on_finish is not None:
            self.on_finish()


@dataclass(frozen=True)
class SchedulerStats:
    """Requests waiting for admission, rows in use, the row cap, and the KV cache's blocks: the share in use
    (``kv_used_fraction``), blocks held by requests, blocks kept only for prefix reuse, and the pool's size."""

    waiting: int
    running_rows: int
    max_rows: int
    kv_used_fraction: float
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    kv_blocks_total: int = 0


@dataclass
class _Blocks:
    """A request's blocks: each row's block table, the blocks it holds a reference to, the shared prompt blocks
    each beam row other than the first copies before writing (copy-on-write), and its prompt's prefix keys."""

    tables: list[list[int]]
    held: list[int]
    copies: list[tuple[int, int]]  # (target, source)
    keys: list[bytes]
    reused: int  # leading prompt blocks taken from the prefix index


@dataclass(eq=False)
class _Running:
    """A request in its rows: how it decodes, its blocks, how much of its prompt is computed, and the position of
    its input token in the next decode step launched."""

    handle: Handle
    first_row: int
    search: Answer | BeamSearch
    seed: int
    blocks: _Blocks
    prefilled: int  # prompt positions whose keys and values are in the cache (reused or computed)
    registered: int  # leading full prompt blocks indexed for reuse
    position: int = 0
    decoding: bool = False
    skip_through: int = -1  # launches up to this number ran on state the host has since replaced: not read

    @property
    def width(self) -> int:
        return self.handle.params.num_beams

    @property
    def rows(self) -> range:
        return range(self.first_row, self.first_row + self.width)

    @property
    def tokens_left(self) -> bool:
        """Whether a decode step still has a token to compute for it: the prompt's launch chose the first token,
        each decode step launched since one more; at ``max_output_len`` it waits only to be read."""
        return self.position - len(self.handle.prompt) + 1 < self.handle.params.max_output_len

    @property
    def plain(self) -> bool:
        """Greedy without a penalty or beams: an argmax is its whole choice."""
        params = self.handle.params
        return params.num_beams == 1 and params.greedy and params.repetition_penalty == 1.0


@dataclass
class _Launched:
    """Token choices queued on the device (a decode step, or a prompt's first tokens) for these requests, by the
    iteration ``iteration``."""

    number: int
    step: LaunchedStep
    requests: list[_Running]
    decode: bool
    iteration: int
    rows: int = 0  # a decode step's rows
    cost: float = 0.0  # the ``chunk_cost`` of the prompt chunk queued with it


@dataclass
class _Chunk:
    """The prompt pieces one step prefills, and the ``chunk_cost`` they spend of the step's budget."""

    pieces: list[tuple[_Running, Piece]]
    cost: float = 0.0


DEFAULT_MAX_NUM_TOKENS = 2048  # a lone prompt's chunk: 600-position image prompts in one step, 16k in ~13
# The largest prompt chunk beside decoding rows (the step graphs are captured up to it), its budget until step times
# are measured (``ChunkPacer``: then what keeps a mixed step within ``MIXED_STEP_LIMIT`` times the rows' own).
# Its matrix products are compute-bound (a 7B model: ~14 GFLOP a position, ~9 ms for 384 positions on an H100 at
# ~600 TFLOP/s; a 16-row decode step takes 7.7 ms, its weight read 4.5 of them, shared).
DECODE_CHUNK_TOKENS = 384
# Once the server is READY (``capture_in_background``) and has answered a request, a background capture starts when
# the scheduler has had nothing to do this long (requests sent one after another meet no capture); with no request
# since READY, after this long idle (the first request, likely soon after READY, meets no capture). A request
# arriving during a capture puts it off at the capture's next slice (`cuda_graphs.capture`): it waits for one
# slice at most, not for the whole capture.
CAPTURE_AFTER_IDLE_S = 2.0
CAPTURE_AFTER_READY_S = 30.0


class Scheduler:
    """Shares decode steps among concurrent requests over at most ``max_slots`` rows, each request's prompt plus
    new tokens at most ``max_seq_len`` positions, in a paged KV cache sized and used as ``kv_cache`` says.

    Drive it with ``step()`` from one thread, or ``start()`` a background loop and ``submit`` from any thread.
    Callbacks run on the stepping thread; a callback that raises ends its own request with that error.
    ``max_beam_width`` is the widest beam search served (at most ``max_slots``). ``max_num_tokens`` caps the prompt
    positions one step prefills (weighted by the keys they attend to, see ``chunk_cost``; beside decoding rows at
    most ``decode_chunk_tokens``, ``DECODE_CHUNK_TOKENS`` unless changed, and on CUDA what keeps their step within
    ``MIXED_STEP_LIMIT`` times its time alone, measured, see ``chunk_budget``). ``kv_cache_scales``
    ``[layers, 2, kv_heads]`` sets a float8 cache's scales (default: calibrated on token embeddings).
    ``compile_kernels_ahead`` (CUDA): compile the first steps' Triton kernels in one parallel batch before they run
    (``cuda_graphs.compile_ahead``); a start whose kernels are all in Triton's disk cache gains nothing from it.
    ``decode_steps`` counts the decode steps launched and ``steps_queued_ahead`` those launched while the step
    before was still unread; ``prefilled_positions`` the prompt positions computed and ``reused_positions`` those
    taken from other requests' blocks.
    """

    def __init__(self, model: Decoder, *, max_slots: int, max_seq_len: int, eos_id: int | None,
                 tokenizer: Tokenizer | None = None, use_cuda_graphs: bool | None = None, max_beam_width: int = 1,
                 kv_cache: KVCacheOptions | None = None, max_num_tokens: int | None = None,
                 kv_cache_scales: Tensor | None = None, compile_kernels_ahead: bool = True):
        if max_slots < 1 or max_seq_len < 2:
            raise ValueError(f"max_slots ({max_slots}) must be >= 1 and max_seq_len ({max_seq_len}) >= 2")
        if not 1 <= max_beam_width <= max_slots:
            raise ValueError(f"max_beam_width ({max_beam_width}) must be between 1 and max_slots ({max_slots}): "
                             "each beam takes a row")
        max_num_tokens = DEFAULT_MAX_NUM_TOKENS if max_num_tokens is None else max_num_tokens
        if max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be at least 1, got {max_num_tokens}")
        options = kv_cache or KVCacheOptions()
        device = model.device
        self.model = model
        self.max_seq_len = max_seq_len
        self.max_beam_width = max_beam_width
        self.max_num_tokens = max_num_tokens
        self.decode_chunk_tokens = DECODE_CHUNK_TOKENS
        # the chunk budget beside decoding rows from step times (on CUDA: on the CPU a step's time is its launch)
        self.pacer = ChunkPacer() if device.type == "cuda" else None
        self.eos_id = eos_id
        self.tokenizer = tokenizer
        self.reuse = options.enable_reuse
        self.block_size = options.block_size
        # the tables cover the longest request, and a null column: positions past it (a capture runs two steps
        # past every row's position) write to the null block
        width = -(-max_seq_len // self.block_size) + 1
        reserve = 0
        if device.type == "cuda":
            if compile_kernels_ahead:  # the Triton kernels of the steps below and of warm_up, in one parallel batch
                compile_ahead(model, rows=max_slots, width=width, block_size=self.block_size,
                              chunk_tokens=max_num_tokens, max_beam_width=max_beam_width, fp8=options.dtype == "fp8",
                              graphs=use_cuda_graphs is None or bool(use_cuda_graphs))
            reserve = 2 * activation_bytes(model, max_slots, max_num_tokens, max_beam_width)
        started = time.perf_counter()
        self.cache = allocate_cache(model, options, rows=max_slots, blocks_per_row=width - 1, reserve_bytes=reserve,
                                    scales=kv_cache_scales)
        self.kv_pool_s = time.perf_counter() - started  # sizing and zeroing the KV pool (a start-up phase's detail)
        self.pool = BlockPool(self.cache.num_blocks)
        self.tables = BlockTables(max_slots, width, device)
        self.slots: list[_Running | None] = [None] * max_slots
        self.waiting: deque[Handle] = deque()
        self.prefilling: list[_Running] = []  # admitted, prompt not complete, in admission order
        self.chooser = TokenChooser(max_slots, model.config.vocab_size, device, max_beam_width)
        self.forward = ForwardStep(model, self.cache, self.tables.tensor, self.chooser, max_chunk=max_num_tokens,
                                   use_cuda_graphs=use_cuda_graphs)
        self.key_equivalent = attention_key_equivalent(model.config)
        # the chunk sizes the step graphs compute a chunk for (the next one up): beside decoding rows, the padding
        # counts in a chunk's cost (``plan_counts``)
        self.padded_chunk_sizes: Sequence[int] = self.forward.chunk_buckets if self.forward.enabled else ()
        self.decode_steps = 0
        self.steps_queued_ahead = 0
        self.prefilled_positions = 0
        self.reused_positions = 0
        self._wake = threading.Condition()
        self._inflight: deque[_Launched] = deque()  # queued on the device, not yet read, oldest first
        self._launches = 0
        self._iteration = 0
        self._beam_rows: tuple[tuple[int, ...], Tensor] | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.capture_stats: dict[str, float] = {}  # warm_up's graphs and seconds, before READY and after
        self.on_captured: Callable[[], None] | None = None  # called once the background captures are done
        self.capture_after_idle_s = CAPTURE_AFTER_IDLE_S
        self.capture_after_ready_s = CAPTURE_AFTER_READY_S
        self._capture_later = False
        self._capture_from: float | None = None  # when background captures were allowed (None: not yet)

    # --- submission -------------------------------------------------------------------------------------------

    def submit(self, prompt: Tensor, prompt_ids: list[int], params: SamplingParams,
               on_token: TokenCallback | None = None, lora_uid: str | None = None,
               prefix: Sequence[Hashable | None] | None = None) -> Handle:
        """Queue one request: ``prompt [T, H]`` embeddings and the ids behind them (-1 at media features).

        ``on_token(id)`` is called with each kept token in order (never EOS; one sequence only). ``lora_uid``: the
        LoRA adapter of the model's bank it decodes with (an unknown one is a ValueError). ``prefix`` names what
        each prompt position holds (a token id, or a media item's key and the feature's offset; None where unknown)
        so that blocks of an identical prefix (and adapter) are shared with other requests; None shares nothing.
        """
        check_requests(self.model, [prompt], [prompt_ids], [params], self.tokenizer)
        if params.num_beams > self.max_beam_width:
            raise ValueError(f"num_beams={params.num_beams} is over max_beam_width={self.max_beam_width}; ask for "
                             "fewer beams")
        if params.num_beams > 1 and on_token is not None:
            raise ValueError("on_token streams one sequence; a beam search (num_beams > 1) returns its beams when "
                             "it finishes")
        if len(prompt) + params.max_output_len > self.max_seq_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_output_len ({params.max_output_len}) exceeds the "
                             f"scheduler's max_seq_len={self.max_seq_len}; shorten them or raise max_seq_len")
        if prefix is not None and len(prefix) != len(prompt):
            raise ValueError(f"prefix names {len(prefix)} positions, the prompt has {len(prompt)}")
        needed = self._blocks_needed(len(prompt), params, reused=0)
        if needed > self.pool.capacity:
            raise ValueError(f"the request needs {needed} KV-cache blocks of {self.block_size} positions (prompt "
                             f"{len(prompt)} + max_output_len {params.max_output_len}, {params.num_beams} beam(s)) "
                             f"and the whole cache has {self.pool.capacity}; raise kv_cache_free_gpu_mem_fraction "
                             "(or kv_cache_bytes), or ask for fewer tokens")
        keys = prefix_keys(prefix, self.block_size, salt=lora_uid or "") if prefix is not None and self.reuse else []
        handle = Handle(prompt, list(prompt_ids), params, on_token, block_keys=keys)
        if lora_uid is not None:
            bank = self.model.lora
            if bank is None:
                raise ValueError(f"LoRA adapter {lora_uid!r} asked for, but this model serves no LoRA adapters")
            handle.adapter = bank.acquire(lora_uid)
            handle.release_adapter = functools.partial(bank.release, handle.adapter)
        with self._wake:
            self.waiting.append(handle)
            self._wake.notify()
        return handle

    def start(self) -> None:
        """Run ``step`` in a background thread whenever there is work."""
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
            self._thread.start()
            # A daemon thread still inside a torch call when the interpreter exits aborts the process: stop first.
            atexit.register(_stop_if_alive, weakref.ref(self))

    def stop(self) -> None:
        """Stop the background loop; unfinished requests end with RequestCancelled."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._fail_all(RequestCancelled("the scheduler stopped"))

    def warm_up(self, rest_in_background: bool = False) -> None:
        """Capture the step graphs now (CUDA), so that no request waits for one (seconds; the graphs share one
        memory pool): all of them, or with ``rest_in_background`` those a first request runs
        (``ForwardStep.first_keys``), the others then captured one at a time by the scheduler's thread, once
        ``capture_in_background`` was called, whenever it has been idle for ``capture_after_idle_s`` since a
        request (``capture_after_ready_s`` while none came since then). A step meanwhile runs a bigger bucket's
        graph, else eagerly; a request arriving during a capture puts it off at its next slice (taken up again at
        the next idle time). Once the last graph is captured (or the captures stop), the buffer the kernels' timing
        reads is freed (``gemv.release_timing_buffers``)."""
        started = time.perf_counter()
        self.forward.chunk_beside_rows = self.chunk_budget(decoding=True)
        self.forward.capture_on_demand = not rest_in_background
        with torch.inference_mode():
            captured = self.forward.capture_all(first_only=rest_in_background)
        seconds = self.forward.capture_seconds
        self.capture_stats.update(before=captured, before_s=time.perf_counter() - started,
                                  before_runs_s=seconds.get("runs", 0.0), before_capture_s=seconds.get("capture", 0.0),
                                  left=self.forward.uncaptured())
        self._capture_later = rest_in_background and self.capture_stats["left"] > 0
        if not self._capture_later:
            release_timing_buffers()  # the kernels' timing is over (a shape first met later times again)

    def capture_in_background(self) -> None:
        """Let the scheduler's thread capture the step graphs ``warm_up`` left for later (call it once the server
        is READY, or the first requests are answered), counting the idle time from now."""
        with self._wake:
            if self._capture_from is None:
                self._capture_from = time.monotonic()
                self._wake.notify()

    def _loop(self) -> None:
        busy_until, served = time.monotonic(), False  # served: a step ran since capture_in_background
        while True:
            with self._wake:
                while not self._stopping and not self.waiting and not self._inflight and not any(self.slots):
                    wait = None
                    if self._capture_later and self._capture_from is not None:
                        idle_s = self.capture_after_idle_s if served else self.capture_after_ready_s
                        wait = max(busy_until, self._capture_from) + idle_s - time.monotonic()
                    if wait is not None and wait <= 0:
                        break
                    self._wake.wait(wait)
                if self._stopping:
                    return
                idle = not self.waiting and not self._inflight and not any(self.slots)
            if idle:
                self._capture_one()
                continue
            try:
                self.step()
            except Exception as error:  # noqa: BLE001 - a failed step fails the requests in it, not the loop
                self._fail_all(error)
            busy_until, served = time.monotonic(), served or self._capture_from is not None

    def _capture_one(self) -> None:
        """Capture the next step graph ``warm_up`` left for later (the scheduler idle; put off if a request comes
        meanwhile); the last one logged and ``on_captured`` called."""
        started, graphs = time.perf_counter(), self.forward.graph_count
        try:
            with torch.inference_mode():
                self._capture_later = self.forward.capture_next(proceed=lambda: not self.waiting)
        except Exception as error:  # noqa: BLE001 - the steps left run eagerly: slower, still right
            LOGGER.warning("background capture of the step graphs stopped: %s: %s", type(error).__name__, error)
            self._capture_later = False
        stats = self.capture_stats
        if self._capture_later:
            done = self.forward.graph_count > graphs
            stats["after" if done else "put_off"] = stats.get("after" if done else "put_off", 0) + 1
            stats["after_s"] = stats.get("after_s", 0.0) + time.perf_counter() - started
            return
        LOGGER.info("phase capture the other step graphs (in the background, after READY): %.2f s (%d graphs, "
                    "%d put off for a request)", stats.get("after_s", 0.0), stats.get("after", 0),
                    stats.get("put_off", 0))
        release_timing_buffers()
        if self.on_captured is not None:
            self.on_captured()

    def _fail_all(self, error: BaseException) -> None:
        self._inflight.clear()
        with self._wake:
            handles = list(self.waiting)
            self.waiting.clear()
        for request in self._requests():
            self._release(request, error, device=False)
        self.pool.forget()  # a failed step may have left indexed blocks half written
        with contextlib.suppress(Exception):  # a broken device fails the next step again
            self.chooser.release(0, len(self.slots))
            self.tables.clear(0, len(self.slots))
        for handle in handles:
            handle._finish(error)

    def stats(self) -> SchedulerStats:
        """A snapshot of the queue, the rows and the KV cache, for metrics."""
        with self._wake:
            running = sum(slot is not None for slot in self.slots)
            pool = self.pool
            return SchedulerStats(waiting=len(self.waiting), running_rows=running, max_rows=len(self.slots),
                                  kv_used_fraction=pool.used / pool.capacity, kv_blocks_used=pool.used,
                                  kv_blocks_cached=len(pool.cached), kv_blocks_total=pool.capacity)

    # --- one iteration ----------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> bool:
        """Admit, queue one step (decode rows and a prompt chunk), read back what the iteration before queued;
        returns whether work is left."""
        self._iteration += 1
        self._admit()
        decoding = [request for request in self._requests() if request.decoding and request.tokens_left]
        rows = decoding[-1].first_row + decoding[-1].width if decoding else 0
        chunk = self._plan_chunk(self.chunk_budget(bool(decoding), rows), bool(decoding))
        if decoding or chunk.pieces:
            self._launch(decoding, chunk)
        while self._inflight and (self._inflight[0].iteration < self._iteration or not (decoding or chunk.pieces)):
            self._pick(self._inflight.popleft())
        return bool(self.waiting or self._inflight or any(self.slots))

    def _requests(self) -> list[_Running]:
        """The admitted requests in row order."""
        return [slot for row, slot in enumerate(self.slots) if slot is not None and slot.first_row == row]

    def _launch(self, decoding: list[_Running], chunk: _Chunk) -> None:
        pieces = chunk.pieces
        rows = furthest = 0
        full = False
        beam_rows = None
        beams_from = 0
        if decoding:
            last = decoding[-1]
            rows = last.first_row + last.width
            furthest = max(request.position for request in decoding) + 1
            full = not all(request.plain for request in decoding)
            searches = [request for request in decoding if request.width > 1]
            rows_of_beams = [row for request in searches for row in request.rows]
            beam_rows = self._beam_rows_tensor(rows_of_beams) if rows_of_beams else None
            beams_from = min((len(request.handle.prompt) for request in searches), default=0)
        lora = any(request.handle.adapter for request in decoding) or any(piece.adapter for _, piece in pieces)
        started = time.monotonic()
        decode, piece_logits = self.forward.launch(rows, furthest, [piece for _, piece in pieces], full=full,
                                                   beam_rows=beam_rows, beams_from=beams_from, lora=lora)
        if decode is not None:
            self.decode_steps += 1
            self.steps_queued_ahead += any(launched.decode for launched in self._inflight)
            for request in decoding:
                request.position += 1
            self._inflight.append(_Launched(self._count_launch(), decode, decoding, True, self._iteration, rows,
                                            chunk.cost))
        launched_at = time.monotonic()
        for index, (request, piece) in enumerate(pieces):
            handle = request.handle
            handle.prefill_started_at = handle.prefill_started_at or started
            handle.prefill_launched_at = launched_at
            self._prefilled(request, len(piece.embeds))
            if request.prefilled == len(request.handle.prompt):
                self._start_decoding(request, piece_logits[index])

    def _count_launch(self) -> int:
        self._launches += 1
        return self._launches

    def _beam_rows_tensor(self, rows: list[int]) -> Tensor:
        """The beam rows on the device (uploaded again only when they change)."""
        if self._beam_rows is None or self._beam_rows[0] != tuple(rows):
            self._beam_rows = (tuple(rows), host_to_device(rows, torch.long, self.model.device))
        return self._beam_rows[1]

    # --- admission --------------------------------------------------------------------------------------------

    def _admit(self) -> None:
        """Take waiting requests, first come first served, while rows and KV-cache blocks are free for them: each
        into the lowest run of free rows wide enough, with its blocks (reused prefix blocks, new ones for the rest
        of its prompt and for its new tokens). A request whose next prompt block is one that an admitted prompt is
        about to compute waits until that block is indexed, and the requests behind it go ahead: a burst of
        questions about one image prefills the image once."""
        now = time.monotonic()
        with self._wake:
            pending = self._pending_keys() if self.waiting else set()
            deferred: list[Handle] = []
            while self.waiting:
                handle = self.waiting[0]
                handle.taken_up_at = handle.taken_up_at or now
                if handle.cancelled:
                    self.waiting.popleft()._finish()
                    continue
                keys = handle.block_keys
                hits = self.pool.lookup(keys)
                if len(hits) < len(keys) and keys[len(hits)] in pending:
                    deferred.append(self.waiting.popleft())
                    continue
                row = self._free_run(handle.params.num_beams)
                if row is None or not self.pool.can_allocate(
                        self._blocks_needed(len(handle.prompt), handle.params, len(hits)), hits):
                    break
                self.waiting.popleft()
                request = self._running(handle, row, self._take_blocks(handle, keys, hits))
                handle.admitted_at = time.monotonic()
                self.slots[row:row + request.width] = [request] * request.width
                self.prefilling.append(request)
                pending.update(keys[len(hits):])
            self.waiting.extendleft(reversed(deferred))

    def _pending_keys(self) -> set[bytes]:
        """The prefix keys of the prompt blocks that admitted requests have yet to compute."""
        return {key for request in self.prefilling for key in request.blocks.keys[request.registered:]}

    def _free_run(self, width: int) -> int | None:
        run = 0
        for row, slot in enumerate(self.slots):
            run = run + 1 if slot is None else 0
            if run == width:
                return row - width + 1
        return None

    def _blocks_needed(self, length: int, params: SamplingParams, reused: int) -> int:
        """New blocks a request takes when its first ``reused`` prompt blocks come from the prefix index."""
        size, width = self.block_size, params.num_beams
        prompt_blocks = -(-length // size)
        generated = -(-(length + params.max_output_len) // size) - prompt_blocks
        whole_prompt_reused = reused * size == length
        shared_partial = length % size != 0
        return (prompt_blocks - reused + whole_prompt_reused + width * generated
                + (width - 1) * shared_partial)

    def _take_blocks(self, handle: Handle, keys: list[bytes], hits: list[int]) -> _Blocks:
        """Allocate a request's blocks (see ``_blocks_needed``) and lay out its rows' tables. A prompt reused whole
        recomputes its last position into a copy of its last block; beam rows other than the first get a copy of
        a partly filled last prompt block (the copies are made once the prompt is computed)."""
        size, width = self.block_size, handle.params.num_beams
        length = len(handle.prompt)
        prompt_blocks = -(-length // size)
        generated = -(-(length + handle.params.max_output_len) // size) - prompt_blocks
        copies: list[tuple[int, int]] = []
        self.pool.share(hits)
        prompt = list(hits)
        if len(hits) * size == length:  # the whole prompt is cached: copy-on-write its last block
            (copy,) = self.pool.allocate(1)
            copies.append((copy, prompt[-1]))
            self.pool.release([prompt[-1]])
            prompt[-1] = copy
            held = list(prompt)
        else:
            held = prompt + self.pool.allocate(prompt_blocks - len(hits))
            prompt = list(held)
        tables = []
        for beam in range(width):
            table = list(prompt)
            if beam and length % size:
                (table[-1],) = self.pool.allocate(1)
                held.append(table[-1])
            own = self.pool.allocate(generated)
            held += own
            tables.append(table + own)
        return _Blocks(tables, held, copies, keys, reused=len(hits))

    def _running(self, handle: Handle, row: int, blocks: _Blocks) -> _Running:
        params = handle.params
        search = (BeamSearch if params.num_beams > 1 else Answer)(params, self.eos_id, self.tokenizer)
        if isinstance(search, Answer):
            handle.tokens = search.tokens  # the answer appends each kept token
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        length = len(handle.prompt)
        reused = min(blocks.reused * self.block_size, length - 1)
        self.reused_positions += reused
        if blocks.copies:  # the last block of a prompt reused whole: copy it before the last position is written
            targets, sources = zip(*blocks.copies)
            self.forward.copy_blocks(*(host_to_device(list(ids), torch.long, self.model.device)
                                       for ids in (targets, sources)))
        return _Running(handle, row, search, seed, blocks, prefilled=reused, registered=blocks.reused)

    def chunk_budget(self, decoding: bool, rows: int = 0) -> int:
        """The prompt positions (``chunk_cost`` units) one step prefills: ``max_num_tokens`` when no row is decoding
        (a lone prompt takes the biggest chunks, the fastest prefill), at most ``decode_chunk_tokens`` beside
        decoding rows (the step graphs' largest chunk there), and with ``rows`` (the decode step's rows) and step
        times measured, what keeps their step within ``MIXED_STEP_LIMIT`` times its time alone (so that their time
        per token grows by a bounded share; ``ChunkPacer``). ``max_num_tokens`` is a hard cap either way."""
        if not decoding:
            return self.max_num_tokens
        most = min(self.max_num_tokens, self.decode_chunk_tokens)
        return self.pacer.budget(rows, most) if self.pacer is not None and rows else most

    def _plan_chunk(self, budget: int, decoding: bool) -> _Chunk:
        """The next pieces of the admitted prompts, in admission order, within ``budget`` and ``MAX_PIECES``
        (``plan_counts``; beside ``decoding`` rows a step graph's padding counted in), with the cost they spend
        (the pacer's measure of the chunk)."""
        for request in [request for request in self.prefilling if request.handle.cancelled]:
            self.prefilling.remove(request)
            self._release(request)
        requests = self.prefilling[:MAX_PIECES]
        counts, cost = plan_counts([(request.prefilled, len(request.handle.prompt) - request.prefilled)
                                    for request in requests], budget, self.key_equivalent,
                                   self.padded_chunk_sizes if decoding else ())
        pieces = []
        for request, count in zip(requests, counts):
            start = request.prefilled
            pieces.append((request, Piece(request.handle.prompt[start:start + count], start,
                                          request.blocks.tables[0], request.handle.adapter)))
        return _Chunk(pieces, cost)

    def _prefilled(self, request: _Running, count: int) -> None:
        """``count`` more prompt positions are queued: index the prompt blocks they complete."""
        request.prefilled += count
        self.prefilled_positions += count
        blocks = request.blocks
        while (request.registered < len(blocks.keys)
               and (request.registered + 1) * self.block_size <= request.prefilled):
            self.pool.register(blocks.tables[0][request.registered], blocks.keys[request.registered])
            request.registered += 1

    def _start_decoding(self, request: _Running, logits: Tensor) -> None:
        """The prompt is computed: give beam rows their copies of a shared last block, install the rows' block
        tables and decoding state, and choose the first tokens from the prompt's last ``logits [V]``."""
        self.prefilling.remove(request)
        first, width = request.first_row, request.width
        tables = request.blocks.tables
        if width > 1 and len(request.handle.prompt) % self.block_size:
            last = len(request.handle.prompt) // self.block_size
            device = self.model.device
            self.forward.copy_blocks(host_to_device([table[last] for table in tables[1:]], torch.long, device),
                                     host_to_device([tables[0][last]] * (width - 1), torch.long, device))
        self.tables.set(first, tables)
        if self.model.lora is not None:
            self.forward.set_adapters(first, [request.handle.adapter] * width)
        scores = [0.0] + [float("-inf")] * (width - 1)
        self.chooser.set_rows(first, self._row_setups(request, len(request.handle.prompt) - 1, scores, [0] * width))
        self.chooser.set_ids(self.chooser.seen, first, [self._prompt_ids(request)] * width)
        if width > 1:
            self.chooser.set_ids(self.chooser.ends, first, [sorted(request.search.end_ids)] + [[]] * (width - 1))
        per_row = logits[None].expand(width, -1)
        self.chooser.choose(per_row, first, not request.plain)
        step = LaunchedStep.read_back(self.chooser, first, per_row, width > 1)
        request.position = len(request.handle.prompt)
        request.decoding = True
        request.handle.prompt_queued_at = time.monotonic()
        self._inflight.append(_Launched(self._count_launch(), step, [request], False, self._iteration))

    def _row_setups(self, request: _Running, position: int, scores: Sequence[float],
                    tokens: Sequence[int]) -> list[RowSetup]:
        params = request.handle.params
        return [RowSetup(greedy=params.greedy, temperature=params.temperature, top_k=params.top_k,
                         top_p=params.top_p, repetition_penalty=params.repetition_penalty, seed=request.seed,
                         position=position, width=request.width, offset=offset, score=score, token=token)
                for offset, (score, token) in enumerate(zip(scores, tokens))]

    def _prompt_ids(self, request: _Running) -> list[int]:
        vocab = self.model.config.vocab_size
        return [t for t in request.handle.prompt_ids if 0 <= t < vocab]

    # --- reading back -----------------------------------------------------------------------------------------

    def _pick(self, launched: _Launched) -> None:
        """Give each request that took part in ``launched`` and is still running its token or candidates."""
        waited_from = time.monotonic()
        tokens, values, ids = launched.step.read()
        if launched.decode and self.pacer is not None:
            self.pacer.read_back(launched.rows, launched.cost, waited_from, time.monotonic(),
                                 any(later.decode for later in self._inflight))
        first = launched.step.first
        for request in launched.requests:
            if self.slots[request.first_row] is not request or request.skip_through >= launched.number:
                continue  # ended before this step, or rebuilt after it was queued
            handle = request.handle
            if handle.cancelled:
                self._release(request)
                continue
            if handle.first_token_at is None:
                handle.first_token_at = time.monotonic()
            row = request.first_row - first
            if isinstance(request.search, Answer):
                self._accept(request, request.search, tokens[row])
            elif not request.search.advance(values[row], ids[row], self.model.config.vocab_size):
                self._rebuild(request)
            if request.search.done or handle.cancelled:
                self._release(request)

    def _accept(self, request: _Running, answer: Answer, token: int) -> None:
        kept = len(answer.tokens)
        answer.accept(token)
        if len(answer.tokens) > kept and request.handle.on_token is not None:
            try:
                request.handle.on_token(token)
            except Exception as error:  # noqa: BLE001 - a failing consumer ends its own request
                request.handle.cancelled = True
                request.handle.error = error

    def _rebuild(self, request: _Running) -> None:
        """A stop string ended a beam the device continued: rebuild the search's rows from the host's beams (each
        row's beam tokens computed again after the prompt, its state as the host has it) and skip the steps queued
        meanwhile. A dead beam's row copies the best beam's."""
        search = request.search
        assert isinstance(search, BeamSearch)
        sequences = [beam if score > float("-inf") else search.beams[0]
                     for beam, score in zip(search.beams, search.scores)]
        length = len(request.handle.prompt)
        device = self.model.device
        pieces = [Piece(self.model.embed(host_to_device(beam[:-1], torch.long, device)), length, table,
                        request.handle.adapter)
                  for beam, table in zip(sequences, request.blocks.tables) if len(beam) > 1]
        if pieces:
            self.forward.launch(0, 0, pieces, lora=bool(request.handle.adapter))
        position = length + len(sequences[0]) - 1
        self.chooser.set_rows(request.first_row, self._row_setups(request, position, search.scores,
                                                                  [beam[-1] for beam in sequences]))
        prompt_ids = self._prompt_ids(request)
        self.chooser.set_ids(self.chooser.seen, request.first_row, [prompt_ids + beam for beam in sequences])
        request.position = position
        request.skip_through = self._launches

    def _release(self, request: _Running, error: BaseException | None = None, device: bool = True) -> None:
        """Free the request's rows and blocks and finish its handle (``device``: also reset its rows' state)."""
        for row in request.rows:
            self.slots[row] = None
        if device:
            self.chooser.release(request.first_row, request.width)
            self.tables.clear(request.first_row, request.width)
        self.pool.release(request.blocks.held)
        request.blocks.held = []
        if request in self.prefilling:
            self.prefilling.remove(request)
        handle = request.handle
        if isinstance(request.search, BeamSearch):
            handle.beams = request.search.results()
            handle.tokens = handle.beams[0] if handle.beams else []
        handle._finish(error)


@torch.inference_mode()
def generate(
    model: Decoder,
    prompts: Sequence[Tensor],
    prompt_ids: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    eos_id: int | None = None,
    tokenizer: Tokenizer | None = None,
) -> list[list[list[int]]]:
    """Generate for each prompt, all together on a private scheduler (eager); returns `[request][beam] -> token
    ids`, best beam first.

    prompts: per request the input embeddings `[T_i, H]` (token embeddings, media features spliced in).
    prompt_ids: per request the T_i token ids behind the embeddings (-1 where a media feature sits); used
        only for the repetition penalty.
    params: per request; `end_id` overrides `eos_id`. Stop strings need `tokenizer`.
    """
    check_requests(model, prompts, prompt_ids, params, tokenizer)
    if not prompts:
        return []
    scheduler = Scheduler(model, max_slots=sum(p.num_beams for p in params),
                          max_seq_len=max(len(embeds) + p.max_output_len for embeds, p in zip(prompts, params)),
                          eos_id=eos_id, tokenizer=tokenizer, use_cuda_graphs=False,
                          max_beam_width=max(p.num_beams for p in params))
    handles = [scheduler.submit(embeds, list(ids), p) for embeds, ids, p in zip(prompts, prompt_ids, params)]
    while scheduler.step():
        pass
    return [handle.results() for handle in handles]


def _stop_if_alive(scheduler: weakref.ref[Scheduler]) -> None:
    if (alive := scheduler()) is not None:
        alive.stop()
