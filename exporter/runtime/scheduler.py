"""In-flight batching: requests join and leave a running decode batch between steps.

The KV cache has a fixed number of slots (rows). Each iteration (``step``) admits waiting requests into free
slots and prefills them together, runs one decode step for every occupied slot together, and lets each request
pick its token (its own sampling parameters), stream it and finish, freeing its slot at once. Slots are handed
out lowest first and a decode step covers rows ``[0, bucket)``, the smallest captured batch size that holds every
occupied slot, so on CUDA each step replays a CUDA graph (see ``cuda_graphs``); a lone newcomer's prefill is a
graph too. While every running request decodes greedily and no one waits, the next step is queued on the device
before the host reads the current one's tokens, so the device does not wait for the host's bookkeeping.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..llm.generate import SamplingParams, TokenSampler, check_requests
from ..llm.model import Decoder
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
    tokens: list[int] = field(default_factory=list)
    error: BaseException | None = None
    cancelled: bool = False
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
        """The generated ids (EOS excluded); raises the request's error, or RequestCancelled."""
        if not self._finished.wait(timeout):
            raise TimeoutError("the request did not finish in time")
        if self.error is not None:
            raise self.error
        if self.cancelled:
            raise RequestCancelled(f"cancelled after {len(self.tokens)} tokens")
        return self.tokens

    def _finish(self, error: BaseException | None = None) -> None:
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


@dataclass
class _Slot:
    handle: Handle
    sampler: TokenSampler
    position: int  # where the next token's key goes
    next_token: int = 0


class Scheduler:
    """Shares decode steps among concurrent requests over ``max_slots`` KV-cache slots of ``max_seq_len``.

    Drive it with ``step()`` from one thread, or ``start()`` a background loop and ``submit`` from any thread.
    Callbacks run on the stepping thread; a callback that raises ends its own request with that error.
    """

    def __init__(self, model: Decoder, *, max_slots: int, max_seq_len: int, eos_id: int | None,
                 tokenizer: Tokenizer | None = None, use_cuda_graphs: bool | None = None):
        if max_slots < 1 or max_seq_len < 2:
            raise ValueError(f"max_slots ({max_slots}) must be >= 1 and max_seq_len ({max_seq_len}) >= 2")
        self.model = model
        self.max_seq_len = max_seq_len
        self.eos_id = eos_id
        self.tokenizer = tokenizer
        # two positions of slack: a step queued ahead runs one position past a request's last one
        self.cache = model.new_kv_cache(max_slots, aligned_cache_len(max_seq_len + 2))
        self.slots: list[_Slot | None] = [None] * max_slots
        self.waiting: deque[Handle] = deque()
        self.prefill = PrefillStep(model, self.cache, use_cuda_graphs)
        self.decode = DecodeStep(model, self.cache, use_cuda_graphs)
        self._wake = threading.Condition()
        self._ahead: tuple[LaunchedStep, list[_Slot | None]] | None = None  # queued, tokens not yet read
        self._thread: threading.Thread | None = None
        self._stopping = False

    # --- submission -------------------------------------------------------------------------------------------

    def submit(self, prompt: Tensor, prompt_ids: list[int], params: SamplingParams,
               on_token: TokenCallback | None = None) -> Handle:
        """Queue one request: ``prompt [T, H]`` embeddings and the ids behind them (-1 at media features).

        ``on_token(id)`` is called with each kept token in order (never EOS).
        """
        check_requests(self.model, [prompt], [prompt_ids], [params], self.tokenizer)
        if params.num_beams != 1:
            raise ValueError("the in-flight scheduler decodes one beam per request; use generate() for beams")
        if len(prompt) + params.max_output_len > self.max_seq_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_output_len ({params.max_output_len}) exceeds the "
                             f"scheduler's max_seq_len={self.max_seq_len}; shorten them or raise max_seq_len")
        handle = Handle(prompt, list(prompt_ids), params, on_token)
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
                while not self._stopping and not self.waiting and not any(self.slots):
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as error:  # noqa: BLE001 - a failed step fails the requests in it, not the loop
                self._fail_all(error)

    def _fail_all(self, error: BaseException) -> None:
        self._ahead = None
        with self._wake:
            handles = [*self.waiting, *(slot.handle for slot in self.slots if slot is not None)]
            self.waiting.clear()
            self.slots = [None] * len(self.slots)
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
        """Admit, decode once, pick tokens, free finished slots; returns whether any work is left.

        When nothing can change the next step (no one waiting, no slot freed, every request greedy without a
        penalty), it is queued on the device, continuing from this step's greedy tokens, before this step's tokens
        are read: the device never waits for the host's bookkeeping. A request that ends meanwhile has one extra
        step computed and dropped.
        """
        launched, self._ahead = self._ahead, None
        if launched is not None and not any(s is not None and s is self.slots[i] for i, s in enumerate(launched[1])):
            launched = None  # every request in the queued step has ended: nothing to read from it
        if launched is None:
            self._admit()
        occupied = [i for i, slot in enumerate(self.slots) if slot is not None]
        if not occupied:
            return bool(self.waiting)
        if launched is None:
            launched = self._launch_from_host(occupied)
        step, slots = launched
        if not self.waiting and slots == self.slots[: len(slots)] and all(
                self.slots[i].sampler.plain_greedy for i in occupied):
            furthest = max(self.slots[i].position for i in occupied) + 2
            self._ahead = (self.decode.launch(len(slots), furthest), slots)
        self._pick(step, slots)
        return bool(self.waiting) or any(self.slots)

    def _launch_from_host(self, occupied: list[int]) -> tuple[LaunchedStep, list[_Slot | None]]:
        rows = max(occupied) + 1
        tokens, positions = [0] * rows, [0] * rows  # free rows below the last occupied one idle at slot 0
        for i in occupied:
            tokens[i], positions[i] = self.slots[i].next_token, self.slots[i].position
        return self.decode.launch(rows, max(positions) + 1, tokens, positions), self.slots[:rows]

    def _admit(self) -> None:
        """Move waiting requests into the lowest run of free slots and prefill them in one forward pass."""
        newcomers: list[Handle] = []
        with self._wake:
            first = next((i for i, slot in enumerate(self.slots) if slot is None), len(self.slots))
            end = first
            while end < len(self.slots) and self.slots[end] is None:
                end += 1
            while self.waiting and len(newcomers) < end - first:
                handle = self.waiting.popleft()
                if handle.cancelled:
                    handle._finish()
                else:
                    newcomers.append(handle)
        if not newcomers:
            return
        try:
            logits = self.prefill([handle.prompt for handle in newcomers], first)
        except Exception as error:  # noqa: BLE001 - the failure belongs to these requests only
            for handle in newcomers:
                handle._finish(error)
            return
        vocab = self.model.config.vocab_size
        for row, handle in enumerate(newcomers):
            sampler = TokenSampler(handle.params, [t for t in handle.prompt_ids if 0 <= t < vocab], self.eos_id,
                                   self.tokenizer, device=self.model.device)
            handle.tokens = sampler.tokens  # the sampler appends each kept token
            slot = _Slot(handle, sampler, position=len(handle.prompt))
            self.slots[first + row] = slot
            self._advance(first + row, slot, sampler.choose(logits[row]))

    def _pick(self, step: LaunchedStep, slots: list[_Slot | None]) -> None:
        """Give each request that was in ``step`` and is still running its token."""
        greedy = step.greedy()
        for i, slot in enumerate(slots):
            if slot is None or self.slots[i] is not slot:  # a free row, or its request ended before this step
                continue
            if slot.handle.cancelled:
                self._release(i)
                continue
            token = greedy[i] if slot.sampler.plain_greedy else slot.sampler.choose(step.logits[i].float())
            slot.position += 1
            self._advance(i, slot, token)

    def _advance(self, index: int, slot: _Slot, token: int) -> None:
        if slot.handle.first_token_at is None:
            slot.handle.first_token_at = time.monotonic()
        kept = len(slot.sampler.tokens)
        slot.sampler.accept(token)
        if len(slot.sampler.tokens) > kept and slot.handle.on_token is not None:
            try:
                slot.handle.on_token(token)
            except Exception as error:  # noqa: BLE001 - a failing consumer ends its own request
                slot.handle.cancelled = True
                slot.handle.error = error
        if slot.sampler.done or slot.handle.cancelled:
            self._release(index)
        else:
            slot.next_token = token

    def _release(self, index: int) -> None:
        handle = self.slots[index].handle
        self.slots[index] = None
        handle._finish()


def _stop_if_alive(scheduler: weakref.ref[Scheduler]) -> None:
    if (alive := scheduler()) is not None:
        alive.stop()
