"""In-flight batching: requests join and leave a running decode batch between steps.

The KV cache has a fixed number of rows. A request takes one row, a beam search of ``num_beams`` beams as many
consecutive rows; rows are handed out lowest first, and a request waits until rows for it are free. Each iteration
(``step``) admits waiting requests (their prompts prefilled together, a beam search's once, and their first tokens
chosen), queues one decode step for every occupied row, and then reads back what was queued before it: each request
takes its token (a beam search its candidates), streams it and finishes, freeing its rows at once. A step covers
rows ``[0, bucket)``, the smallest captured batch size that holds every occupied row, so on CUDA each step replays a
CUDA graph (see ``cuda_graphs``).

Every row's next token is chosen on the device (``exporter.llm.sampling``: greedy, sampled and beam rows alike), so
the next step is always queued before the host reads the current one and the device does not wait for the host's
bookkeeping. A request that ends meanwhile has one extra step computed and dropped. The device cannot read text:
when a stop string ends a beam that the device continued, the host rebuilds that search's rows (their cache from
the prompt and each beam) and the search skips the step queued meanwhile.
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..llm.generate import Answer, BeamSearch, SamplingParams, check_requests
from ..llm.model import Decoder
from ..llm.sampling import RowSetup, TokenChooser, host_to_device
from ..llm.tokenizer import Tokenizer
from .cuda_graphs import DecodeStep, LaunchedStep, PrefillStep, aligned_cache_len

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
    first_token_at: float | None = None
    finished_at: float | None = None
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


@dataclass(frozen=True)
class SchedulerStats:
    """Requests waiting for admission, rows decoding, the row cap, and the share of the KV cache in use."""

    waiting: int
    running_rows: int
    max_rows: int
    kv_used_fraction: float


@dataclass(eq=False)
class _Running:
    """A request in its rows: how it decodes, and the position of its input token in the next step launched."""

    handle: Handle
    first_row: int
    search: Answer | BeamSearch
    seed: int
    position: int
    skip_through: int = -1  # launches up to this number ran on state the host has since replaced: not read

    @property
    def width(self) -> int:
        return self.handle.params.num_beams

    @property
    def rows(self) -> range:
        return range(self.first_row, self.first_row + self.width)

    @property
    def plain(self) -> bool:
        """Greedy without a penalty or beams: an argmax is its whole choice."""
        params = self.handle.params
        return params.num_beams == 1 and params.greedy and params.repetition_penalty == 1.0


@dataclass
class _Launched:
    """Token choices queued on the device (a decode step, or newcomers' first tokens) for these requests."""

    number: int
    step: LaunchedStep
    requests: list[_Running]
    decode: bool


class Scheduler:
    """Shares decode steps among concurrent requests over ``max_slots`` KV-cache rows of ``max_seq_len``.

    Drive it with ``step()`` from one thread, or ``start()`` a background loop and ``submit`` from any thread.
    Callbacks run on the stepping thread; a callback that raises ends its own request with that error.
    ``max_beam_width`` is the widest beam search served (at most ``max_slots``). ``decode_steps`` counts the decode
    steps launched and ``steps_queued_ahead`` those launched while the step before was still unread.
    """

    def __init__(self, model: Decoder, *, max_slots: int, max_seq_len: int, eos_id: int | None,
                 tokenizer: Tokenizer | None = None, use_cuda_graphs: bool | None = None, max_beam_width: int = 1):
        if max_slots < 1 or max_seq_len < 2:
            raise ValueError(f"max_slots ({max_slots}) must be >= 1 and max_seq_len ({max_seq_len}) >= 2")
        if not 1 <= max_beam_width <= max_slots:
            raise ValueError(f"max_beam_width ({max_beam_width}) must be between 1 and max_slots ({max_slots}): "
                             "each beam takes a row")
        self.model = model
        self.max_seq_len = max_seq_len
        self.max_beam_width = max_beam_width
        self.eos_id = eos_id
        self.tokenizer = tokenizer
        # a position of slack: capturing a step graph (on first use) runs the step twice, once past every row's position
        self.cache = model.new_kv_cache(max_slots, aligned_cache_len(max_seq_len + 1))
        self.slots: list[_Running | None] = [None] * max_slots
        self.waiting: deque[Handle] = deque()
        self.chooser = TokenChooser(max_slots, model.config.vocab_size, model.device, max_beam_width)
        self.prefill = PrefillStep(model, self.cache, use_cuda_graphs)
        self.decode = DecodeStep(model, self.cache, use_cuda_graphs, self.chooser)
        self.decode_steps = 0
        self.steps_queued_ahead = 0
        self._wake = threading.Condition()
        self._inflight: deque[_Launched] = deque()  # queued on the device, not yet read, oldest first
        self._launches = 0
        self._beam_rows: tuple[tuple[int, ...], Tensor] | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    # --- submission -------------------------------------------------------------------------------------------

    def submit(self, prompt: Tensor, prompt_ids: list[int], params: SamplingParams,
               on_token: TokenCallback | None = None, lora_uid: str | None = None) -> Handle:
        """Queue one request: ``prompt [T, H]`` embeddings and the ids behind them (-1 at media features).

        ``on_token(id)`` is called with each kept token in order (never EOS; one sequence only). ``lora_uid``: the
        LoRA adapter of the model's bank it decodes with (an unknown one is a ValueError).
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
        handle = Handle(prompt, list(prompt_ids), params, on_token)
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

    def warm_up(self) -> None:
        """Compile and capture every decode step and lone-prompt prefill now (CUDA), so that no request waits for
        it (seconds; the graphs share one memory pool each)."""
        with torch.inference_mode():
            self.prefill.capture_all()
            self.decode.capture_all()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self.waiting and not self._inflight and not any(self.slots):
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as error:  # noqa: BLE001 - a failed step fails the requests in it, not the loop
                self._fail_all(error)

    def _fail_all(self, error: BaseException) -> None:
        self._inflight.clear()
        with self._wake:
            handles = [*self.waiting, *(request.handle for request in self._requests())]
            self.waiting.clear()
            self.slots = [None] * len(self.slots)
        with contextlib.suppress(Exception):  # a broken device fails the next step again
            self.chooser.release(0, len(self.slots))
        for handle in handles:
            handle._finish(error)

    def stats(self) -> SchedulerStats:
        """A snapshot of the queue and the KV cache, for metrics."""
        with self._wake:
            running = sum(slot is not None for slot in self.slots)
            return SchedulerStats(waiting=len(self.waiting), running_rows=running, max_rows=len(self.slots),
                                  kv_used_fraction=running / len(self.slots))

    # --- one iteration ----------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> bool:
        """Admit, queue one decode step, read back what was queued before it; returns whether work is left."""
        self._admit()
        running = self._requests()
        if running:
            self._launch(running)
        while len(self._inflight) > (1 if running else 0):
            self._pick(self._inflight.popleft())
        return bool(self.waiting or self._inflight or any(self.slots))

    def _requests(self) -> list[_Running]:
        """The running requests in row order."""
        return [slot for row, slot in enumerate(self.slots) if slot is not None and slot.first_row == row]

    def _launch(self, running: list[_Running]) -> None:
        last = running[-1]
        searches = [request for request in running if request.width > 1]
        beam_rows = [row for request in searches for row in request.rows]
        step = self.decode.launch(last.first_row + last.width, max(r.position for r in running) + 1,
                                  full=not all(r.plain for r in running),
                                  beam_rows=self._beam_rows_tensor(beam_rows) if beam_rows else None,
                                  beams_from=min((len(r.handle.prompt) for r in searches), default=0),
                                  lora=any(r.handle.adapter for r in running))
        self.decode_steps += 1
        self.steps_queued_ahead += any(launched.decode for launched in self._inflight)
        for request in running:
            request.position += 1
        self._inflight.append(_Launched(self._count_launch(), step, running, decode=True))

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
        """Place waiting requests in order into one run of free rows; prefill them and choose their first tokens."""
        placed = self._place_waiting()
        if not placed:
            return
        try:
            first = placed[0].first_row
            self._set_up(placed)
            logits = self._prefill_prompts(placed)
            rows = [i for i, request in enumerate(placed) for _ in request.rows]
            per_row = logits[host_to_device(rows, torch.long, logits.device)]
            full = not all(request.plain for request in placed)
            self.chooser.choose(per_row, first, full)
            beams = full and any(request.width > 1 for request in placed)
            step = LaunchedStep.read_back(self.chooser, first, per_row, beams)
        except Exception as error:  # noqa: BLE001 - the failure belongs to these requests only
            for request in placed:
                self._release(request, error)
            return
        self._inflight.append(_Launched(self._count_launch(), step, placed, decode=False))

    def _place_waiting(self) -> list[_Running]:
        """Take waiting requests, first come first served, into consecutive free rows: the first into the lowest
        run wide enough for it, the next ones after it while they fit."""
        placed: list[_Running] = []
        with self._wake:
            row: int | None = None
            while self.waiting:
                handle = self.waiting[0]
                if handle.cancelled:
                    self.waiting.popleft()._finish()
                    continue
                width = handle.params.num_beams
                if row is None:
                    row = self._free_run(width)
                if row is None or row + width > len(self.slots) or any(self.slots[row:row + width]):
                    break
                self.waiting.popleft()
                request = self._running(handle, row)
                self.slots[row:row + width] = [request] * width
                placed.append(request)
                row += width
        return placed

    def _free_run(self, width: int) -> int | None:
        run = 0
        for row, slot in enumerate(self.slots):
            run = run + 1 if slot is None else 0
            if run == width:
                return row - width + 1
        return None

    def _running(self, handle: Handle, row: int) -> _Running:
        params = handle.params
        search = (BeamSearch if params.num_beams > 1 else Answer)(params, self.eos_id, self.tokenizer)
        if isinstance(search, Answer):
            handle.tokens = search.tokens  # the answer appends each kept token
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        return _Running(handle, row, search, seed, position=len(handle.prompt))

    def _set_up(self, placed: list[_Running]) -> None:
        """Write each newcomer's rows: parameters, the prompt's ids as seen, a beam leader's end ids."""
        first = placed[0].first_row
        setups, seen, ends = [], [], []
        for request in placed:
            width = request.width
            scores = [0.0] + [float("-inf")] * (width - 1)
            setups += self._row_setups(request, len(request.handle.prompt) - 1, scores, [0] * width)
            seen += [self._prompt_ids(request)] * width
            ends += [sorted(request.search.end_ids) if width > 1 else []] + [[]] * (width - 1)
        self.chooser.set_rows(first, setups)
        if self.model.lora is not None:
            self.decode.set_adapters(first, [request.handle.adapter for request in placed for _ in request.rows])
        self.chooser.set_ids(self.chooser.seen, first, seen)
        if any(ends):
            self.chooser.set_ids(self.chooser.ends, first, ends)

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

    def _prefill_prompts(self, placed: list[_Running]) -> Tensor:
        """Prefill each prompt once, into its first row, and copy it to a beam search's other rows; returns the
        logits after each prompt ``[n, V]``."""
        first = placed[0].first_row
        logits = self.prefill([request.handle.prompt for request in placed], first,
                              [request.handle.adapter for request in placed])
        longest = max(len(request.handle.prompt) for request in placed)
        # prefilled side by side, then each moved to its first row (a beam search's other rows lie in between)
        self._copy_rows([(request.first_row, first + i) for i, request in enumerate(placed)], longest)
        self._copy_rows([(row, request.first_row) for request in placed for row in request.rows[1:]], longest)
        return logits

    def _copy_rows(self, pairs: list[tuple[int, int]], length: int) -> None:
        """Each (target, source) row pair: the target gets the source's cache slots ``[0, length)``."""
        pairs = [(target, source) for target, source in pairs if target != source]
        if pairs:
            targets, sources = (host_to_device(rows, torch.long, self.model.device) for rows in zip(*pairs))
            self.cache.copy_rows_(targets, sources, 0, length)

    # --- reading back -----------------------------------------------------------------------------------------

    def _pick(self, launched: _Launched) -> None:
        """Give each request that took part in ``launched`` and is still running its token or candidates."""
        tokens, values, ids = launched.step.read()
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
        row's cache from the prompt and its beam, its state as the host has it) and skip the steps queued meanwhile.
        A dead beam's row copies the best beam's."""
        search = request.search
        assert isinstance(search, BeamSearch)
        sequences = [beam if score > float("-inf") else search.beams[0]
                     for beam, score in zip(search.beams, search.scores)]
        prompt = request.handle.prompt
        device = self.model.device
        self.prefill([torch.cat([prompt, self.model.embed(host_to_device(beam[:-1], torch.long, device))])
                      for beam in sequences], request.first_row, [request.handle.adapter] * len(sequences))
        position = len(prompt) + len(sequences[0]) - 1
        self.chooser.set_rows(request.first_row, self._row_setups(request, position, search.scores,
                                                                  [beam[-1] for beam in sequences]))
        prompt_ids = self._prompt_ids(request)
        self.chooser.set_ids(self.chooser.seen, request.first_row, [prompt_ids + beam for beam in sequences])
        request.position = position
        request.skip_through = self._launches

    def _release(self, request: _Running, error: BaseException | None = None) -> None:
        for row in request.rows:
            self.slots[row] = None
        self.chooser.release(request.first_row, request.width)
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
