"""In-flight batching: requests join and leave a running decode batch between steps.

The KV cache has a fixed number of slots (rows). Each loop iteration (``step``) does three things:
admit waiting requests into free slots (prefill each newcomer into its slot), run one decode step for every
occupied slot together, and let each request pick its token, stream it and finish (freeing its slot at once).
Slots are handed out lowest first and a decode step covers rows ``[0, bucket)``, the smallest captured batch size
that holds every occupied slot, so on CUDA each step replays a CUDA graph (see ``cuda_graphs``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..llm.generate import SamplingParams, TokenSampler
from ..llm.model import Decoder
from ..llm.tokenizer import Tokenizer
from .cuda_graphs import DecodeStep

TokenCallback = Callable[[int], None]


class RequestCancelled(RuntimeError):
    """The request was cancelled before it finished."""


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
    _finished: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def done(self) -> bool:
        return self._finished.is_set()

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
        self.error = error
        self._finished.set()


@dataclass
class _Slot:
    handle: Handle
    sampler: TokenSampler
    position: int  # where the next token's key goes
    next_token: int


class Scheduler:
    """Shares decode steps among concurrent requests over ``max_slots`` KV-cache slots of ``max_seq_len``."""

    def __init__(self, model: Decoder, *, max_slots: int, max_seq_len: int, eos_id: int | None,
                 tokenizer: Tokenizer | None = None, use_cuda_graphs: bool | None = None):
        self.model = model
        self.max_seq_len = max_seq_len
        self.eos_id = eos_id
        self.tokenizer = tokenizer
        self.cache = model.new_kv_cache(max_slots, max_seq_len)
        self.slots: list[_Slot | None] = [None] * max_slots
        self.waiting: deque[Handle] = deque()
        self.decode = DecodeStep(model, self.cache, use_cuda_graphs)
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # --- submission -------------------------------------------------------------------------------------------

    def submit(self, prompt: Tensor, prompt_ids: list[int], params: SamplingParams,
               on_token: TokenCallback | None = None) -> Handle:
        """Queue one request: ``prompt [T, H]`` embeddings, the ids behind them (-1 at media features)."""
        if params.num_beams != 1:
            raise ValueError("the in-flight scheduler decodes one beam per request; use generate() for beams")
        if len(prompt) + params.max_output_len > self.max_seq_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_output_len ({params.max_output_len}) exceeds the "
                             f"scheduler's max_seq_len={self.max_seq_len}")
        handle = Handle(prompt, prompt_ids, params, on_token)
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

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self.waiting and not any(self.slots):
                    self._wake.wait()
                if self._stopping:
                    return
            self.step()

    # --- one iteration ----------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> bool:
        """Admit, decode once, pick tokens, free finished slots; returns whether any work is left."""
        self._admit()
        occupied = [i for i, slot in enumerate(self.slots) if slot is not None]
        if occupied:
            rows = max(occupied) + 1
            tokens = torch.zeros(rows, dtype=torch.long)
            positions = torch.zeros(rows, dtype=torch.long)
            for i in occupied:
                tokens[i], positions[i] = self.slots[i].next_token, self.slots[i].position
            logits = self.decode(tokens, positions)
            self._pick(occupied, logits)
        return bool(self.waiting) or any(self.slots)

    def _admit(self) -> None:
        """Move waiting requests into free slots and prefill all newcomers in one batched forward pass."""
        newcomers: list[tuple[int, Handle]] = []
        with self._wake:
            free = [i for i, slot in enumerate(self.slots) if slot is None]
            while free and self.waiting:
                handle = self.waiting.popleft()
                if handle.cancelled:
                    handle._finish()
                else:
                    newcomers.append((free.pop(0), handle))
        if newcomers:
            try:
                self._prefill(newcomers)
            except Exception as error:  # noqa: BLE001 - the failure belongs to these requests only
                for _, handle in newcomers:
                    handle._finish(error)

    def _prefill(self, newcomers: list[tuple[int, Handle]]) -> None:
        """Run the newcomers' prompts right-padded in a scratch cache, copy each row into its slot, pick the first
        token of each."""
        device, vocab = self.model.device, self.model.config.vocab_size
        lengths = [len(handle.prompt) for _, handle in newcomers]
        longest = max(lengths)
        padded = torch.zeros(len(newcomers), longest, self.model.config.hidden_size, dtype=self.model.dtype,
                             device=device)
        for row, (_, handle) in enumerate(newcomers):
            padded[row, : len(handle.prompt)] = handle.prompt.to(padded)
        scratch = self.model.new_kv_cache(len(newcomers), longest)
        positions = torch.arange(longest, device=device).expand(len(newcomers), -1)
        last = torch.tensor(lengths, device=device) - 1
        logits = self.model(padded, positions, scratch, kv_len=longest, output_index=last)[:, 0].float()
        for row, ((index, handle), length) in enumerate(zip(newcomers, lengths)):
            self.cache.keys[:, index, :, :length] = scratch.keys[:, row, :, :length]
            self.cache.values[:, index, :, :length] = scratch.values[:, row, :, :length]
            sampler = TokenSampler(handle.params, [t for t in handle.prompt_ids if 0 <= t < vocab], self.eos_id,
                                   self.tokenizer, device=device)
            handle.tokens = sampler.tokens  # the sampler appends each kept token
            slot = _Slot(handle, sampler, length, 0)
            self.slots[index] = slot
            self._advance(index, slot, sampler.choose(logits[row]))

    def _pick(self, occupied: list[int], logits: Tensor) -> None:
        greedy = logits.argmax(-1).tolist()
        for i in occupied:
            slot = self.slots[i]
            if slot.handle.cancelled:
                self._release(i)
                continue
            token = greedy[i] if slot.sampler.plain_greedy else slot.sampler.choose(logits[i].float())
            slot.position += 1
            self._advance(i, slot, token)

    def _advance(self, index: int, slot: _Slot, token: int) -> None:
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
        handle._finish(handle.error)
