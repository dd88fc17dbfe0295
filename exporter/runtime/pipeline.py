"""Requests from text + media to text, each request succeeding or failing on its own.

Preprocessing, the perception encoder and the prompt layout run per batch of requests; the LLM part of every
request (beam searches too) goes to the in-flight :class:`Scheduler`, so requests from concurrent callers share
decode steps.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..engine import Engine, EngineLimits
from ..llm.generate import SamplingParams
from ..llm.model import Decoder
from ..llm.sampling import host_to_device
from ..llm.tokenizer import Tokenizer
from ..models import PromptLayout
from .feature_cache import FeatureCache, media_key
from .kv_cache import KVCacheOptions
from .scheduler import Handle, Scheduler

# the host phases ``Pipeline.on_phase`` reports, in the order a request meets them
PHASES = ("media decode", "media hash", "encoder cache wait", "preprocess", "encoder", "encoder cache hit", "tokenize",
          "embed", "submit")

# Streamed pieces a second over all of a process's streams, at most (about). Every piece costs Python work in this
# process (the detokenization, the server's serialization and send), under the GIL the scheduler's step loop needs
# too: one piece a token for 32 streams slowed the H100's decode steps down to half their speed. So each stream
# spaces its pieces by (streams running) / STREAM_PIECES_PER_S seconds: a lone stream still gets a piece a token,
# a busy server sends fewer pieces of several tokens each.
STREAM_PIECES_PER_S = 400.0


@dataclass
class Request:
    """One prompt: ``media`` is one item or a list (path, PIL image, uint8 array or encoded bytes); ``system``
    replaces the chat template's system prompt; ``lora_uid`` names the LoRA adapter it is answered with."""

    text: str
    media: Any = None
    params: SamplingParams = field(default_factory=SamplingParams)
    apply_chat_template: bool = True
    system: str | None = None
    lora_uid: str | None = None


@dataclass
class Completion:
    """One request's answer: text and token ids per beam (best first) and the prompt's length in positions."""

    texts: list[str]
    token_ids: list[list[int]]
    prompt_tokens: int


@dataclass
class _Prepared:
    """A request turned into LLM input: embeddings, the ids behind them, its parameters with the template's stops,
    and what each position holds (for prefix reuse)."""

    embeds: torch.Tensor
    layout: PromptLayout
    params: SamplingParams
    prefix: list
    lora_uid: str | None


def serving_scheduler(decoder: Decoder, limits: EngineLimits, *, eos_id: int | None = None,
                      tokenizer: Tokenizer | None = None, kv_cache: KVCacheOptions | None = None,
                      max_num_tokens: int | None = None, compile_kernels_ahead: bool = True) -> Scheduler:
    """The scheduler a :class:`Pipeline` serves an engine of ``limits`` with (its rows, longest request and beam
    width from them); the export-time kernel warm-up (`kernel_warmup`) builds the same one, so that the kernels it
    compiles and times are those a start meets."""
    return Scheduler(decoder, max_slots=limits.max_batch_size, max_seq_len=limits.max_input_len + limits.max_output_len,
                     eos_id=eos_id, tokenizer=tokenizer, max_beam_width=limits.max_beam_width, kv_cache=kv_cache,
                     max_num_tokens=max_num_tokens, compile_kernels_ahead=compile_kernels_ahead)


class Pipeline:
    """Preprocess → perception encoder → prompt layout → splice → LLM → text.

    ``run`` returns, per request, its :class:`Completion` or the exception that request alone raised; a bad request
    never fails the others. ``stream`` yields one request's text as it is generated. Media already encoded are
    taken from ``feature_cache``. ``kv_cache``, ``max_num_tokens`` and ``compile_kernels_ahead`` configure the
    scheduler's KV cache, chunked prefill and first compiles (see :class:`Scheduler`); a prompt that starts like an
    earlier one (same token ids, same media by content) reuses its cached blocks. Each function in ``submitted`` is
    called with every request's scheduler handle as it is submitted (the server's metrics time requests by them).
    ``on_phase``, when set, is called with each host phase of a batch's preparation and its seconds (one of
    ``PHASES``; the benches' TTFT breakdown).
    """

    def __init__(self, engine: Engine, feature_cache: FeatureCache | None = None,
                 kv_cache: KVCacheOptions | None = None, max_num_tokens: int | None = None,
                 compile_kernels_ahead: bool = True):
        self.engine = engine
        self.feature_cache = feature_cache if feature_cache is not None else FeatureCache()
        limits = engine.limits
        tokenizer = engine.tokenizer
        stops = {tokenizer.token_to_id(token) for token in engine.template.stop_tokens}
        self.stop_token_ids = tuple(sorted(i for i in stops if i is not None))
        started = time.perf_counter()
        self.scheduler = serving_scheduler(engine.decoder, limits, eos_id=tokenizer.eos_id, tokenizer=tokenizer,
                                           kv_cache=kv_cache, max_num_tokens=max_num_tokens,
                                           compile_kernels_ahead=compile_kernels_ahead)
        self.build_s = time.perf_counter() - started  # the scheduler's KV pool, step buffers and graphs' setup
        if engine.decoder.device.type == "cuda":
            self.scheduler.warm_up(rest_in_background=True)  # what a first request runs now, the rest when idle
        self.scheduler.start()
        self._encoder_lock = threading.Lock()  # the encoder (and its CUDA graphs) serve one batch at a time
        self.submitted: list[Callable[[Handle], None]] = []  # observers of each request's handle (server metrics)
        self.on_phase: Callable[[str, float], None] | None = None
        self._streams = 0  # streams running now (``stream``), under ``_streams_lock``
        self._streams_lock = threading.Lock()

    def close(self) -> None:
        """Stop the scheduler's thread."""
        self.scheduler.stop()

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """Report the seconds the block takes to ``on_phase`` as phase ``name``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.on_phase is not None:
                self.on_phase(name, time.perf_counter() - start)

    def run(self, requests: list[Request]) -> list[Completion | Exception]:
        prepared = self._prepare(requests)
        results: list[Completion | Exception] = [p if isinstance(p, Exception) else None for p in prepared]
        handles: dict[int, Handle] = {}
        for i, p in enumerate(prepared):
            if isinstance(p, _Prepared):
                try:
                    with self._phase("submit"):
                        handles[i] = self._submit(p)
                except Exception as error:  # noqa: BLE001 - reported per request
                    results[i] = error
        for i, handle in handles.items():
            try:
                results[i] = self._completion(handle.results(), prepared[i].layout)
            except Exception as error:  # noqa: BLE001 - reported per request
                results[i] = error
        return results

    def stream(self, request: Request) -> Generator[str, None, Completion]:
        """Yield the text of one request's answer piece by piece as tokens are generated; return its Completion.

        A piece holds every token generated since the previous piece. Pieces of one stream are at least
        (streams running) / ``STREAM_PIECES_PER_S`` seconds apart: alone, a stream gets a piece a token; with many
        streams each piece holds several tokens, so their handling does not slow the decode steps down."""
        (prepared,) = self._prepare([request])
        if isinstance(prepared, Exception):
            raise prepared
        if prepared.params.num_beams != 1:
            raise ValueError("streaming returns one answer; use num_beams=1")
        tokens: queue.Queue[int | None] = queue.Queue()
        handle = self._submit(prepared, on_token=tokens.put)
        handle.on_finish = lambda: tokens.put(None)  # the end mark after the last token (twice at most: harmless)
        if handle.done:  # finished before the callback was set
            tokens.put(None)
        generated: list[int] = []
        sent = ""
        with self._streams_lock:
            self._streams += 1
        try:
            finished, next_piece_at = False, 0.0
            while not finished and (token := tokens.get()) is not None:
                generated.append(token)
                finished = _take_queued(tokens, generated, until=next_piece_at)  # those meanwhile join this piece
                text = self.engine.tokenizer.decode(generated).lstrip()
                if len(text) > len(sent) and not text.endswith("\ufffd"):  # hold back half a character
                    next_piece_at = time.monotonic() + self._streams / STREAM_PIECES_PER_S
                    yield text[len(sent):]
                    sent = text
            handle.result()  # raises the request's error, if any
            text = self.engine.tokenizer.decode(generated).strip()
            if text.startswith(sent) and len(text) > len(sent):
                yield text[len(sent):]
            return self._completion([generated], prepared.layout)
        finally:
            with self._streams_lock:
                self._streams -= 1
            handle.cancel()  # a consumer that stops early frees the slot

    def _prepare(self, requests: list[Request]) -> list[_Prepared | Exception]:
        """Media → features → prompt layout → embeddings for each request, or the error it raised."""
        results: list[_Prepared | Exception | None] = [None] * len(requests)
        media_items: dict[int, list[_MediaItem]] = {}
        try:
            for i, request in enumerate(requests):
                try:
                    self.engine.limits.check_request(0, 0, request.params.max_output_len, request.params.num_beams)
                    media_items[i] = self._load_media(request.media)
                except Exception as error:  # noqa: BLE001 - reported per request
                    results[i] = error
            features = self._encode(media_items)
        finally:  # the media this thread claimed in the feature cache and did not encode
            self.feature_cache.release([item.key for items in media_items.values() for item in items])
        for i, items in features.items():
            request = requests[i]
            try:
                with self._phase("tokenize"):
                    template = self.engine.template if request.system is None else replace(self.engine.template,
                                                                                          system=request.system)
                    layout = self.engine.perception.layout(request.text, items, self.engine.tokenizer, template,
                                                           request.apply_chat_template)
                    media_len = sum(int(block.shape[0]) for block in items)
                    self.engine.limits.check_request(layout.length, media_len, request.params.max_output_len)
                params = replace(request.params,
                                 stop_token_ids=tuple({*request.params.stop_token_ids, *self.stop_token_ids}))
                keys = [item.key for item in media_items[i]]
                with self._phase("embed"):
                    embeds = self._embed(layout)
                results[i] = _Prepared(embeds, layout, params, prompt_prefix(layout, keys), request.lora_uid)
            except Exception as error:  # noqa: BLE001 - reported per request
                results[i] = error
        return results  # type: ignore[return-value]

    def _submit(self, prepared: _Prepared, on_token=None) -> Handle:
        handle = self.scheduler.submit(prepared.embeds, prepared.layout.token_ids(), prepared.params, on_token,
                                       prepared.lora_uid, prefix=prepared.prefix)
        for observe in self.submitted:
            observe(handle)
        return handle

    def _load_media(self, media: Any) -> list[_MediaItem]:
        """Each media item's cache key and cached block, and its encoder input unless every item was cached."""
        perception = self.engine.perception
        with self._phase("media decode"):
            raw = perception.media_items(media)
        with self._phase("media hash"):
            keys = [media_key(item) for item in raw] if raw is not None else []
        try:
            with self._phase("encoder cache wait"):  # another request encoding the same media: its features
                cached = [self.feature_cache.get_or_claim(key) for key in keys]
            if raw is not None and all(block is not None for block in cached):
                return [_MediaItem(key, block, None) for key, block in zip(keys, cached)]
            with self._phase("preprocess"):
                inputs = perception.load_media(media)
        except BaseException:
            self.feature_cache.release(keys)
            raise
        if raw is None:
            return [_MediaItem(None, None, item) for item in inputs]
        return [_MediaItem(key, block, item) for key, block, item in zip(keys, cached, inputs, strict=True)]

    def _encode(self, media_items: dict[int, list[_MediaItem]]) -> dict[int, list[torch.Tensor]]:
        """Encode the items not cached (each distinct one once) in shared encoder batches, cache their blocks, and
        hand each request back its own blocks."""
        pending: dict[Any, torch.Tensor] = {}
        for i in sorted(media_items):
            for n, item in enumerate(media_items[i]):
                if item.block is None:
                    pending.setdefault(item.key or (i, n), item.inputs)
        with self._encoder_lock, self._phase("encoder" if pending else "encoder cache hit"):
            blocks = self.engine.perception.encode(list(pending.values())) if pending else []
        encoded = dict(zip(pending, blocks))
        for slot, block in encoded.items():
            if isinstance(slot, str):
                self.feature_cache.put(slot, block)
        return {i: [item.block if item.block is not None else encoded[item.key or (i, n)]
                    for n, item in enumerate(media_items[i])]
                for i in sorted(media_items)}

    def _embed(self, layout: PromptLayout) -> torch.Tensor:
        """The prompt's embeddings on the decoder's device, queued without waiting for the device (the encoder's
        work may still be running: the prefill queues behind it): every token piece's ids uploaded and looked up
        together, then spliced with the feature blocks."""
        decoder = self.engine.decoder
        ids = [token for piece in layout.pieces if isinstance(piece, list) for token in piece]
        tokens = decoder.embed(host_to_device(ids, torch.long, decoder.device)) if ids else None
        parts, taken = [], 0
        for piece in layout.pieces:
            if not isinstance(piece, list):
                parts.append(piece.to(device=decoder.device, dtype=decoder.dtype))
            elif piece:
                parts.append(tokens[taken:taken + len(piece)])
                taken += len(piece)
        return torch.cat(parts)

    def _completion(self, token_lists: list[list[int]], layout: PromptLayout) -> Completion:
        texts = [self.engine.tokenizer.decode(tokens).strip() for tokens in token_lists]
        return Completion(texts, token_lists, layout.length)


def prompt_prefix(layout: PromptLayout, media_keys: list[str | None]) -> list:
    """What each prompt position holds: its token id, or for the j-th feature block (a function of the request's
    media, which the keys name by content) the media's number (``MEDIA_NUMBERS``), j and the offset packed into one
    negative int (so that ``prefix_keys`` hashes the prompt's bytes at once); None after media without a key."""
    prefix: list = []
    known = bool(media_keys) and all(key is not None for key in media_keys)
    number = MEDIA_NUMBERS.number(tuple(media_keys)) if known else 0
    blocks = 0
    for piece in layout.pieces:
        if isinstance(piece, list):
            prefix.extend(piece)
        else:
            length = int(piece.shape[0])
            if not known:
                prefix.extend([None] * length)
            elif blocks < 1 << _BLOCK_BITS and length <= 1 << _OFFSET_BITS:
                first = -1 - ((number << _BLOCK_BITS | blocks) << _OFFSET_BITS)  # offsets count down from it
                prefix.extend(range(first, first - length, -1))
            else:  # past the packed ints' fields: the keys themselves
                prefix.extend((tuple(media_keys), blocks, offset) for offset in range(length))
            blocks += 1
    return prefix


# a packed media position's fields: its feature block and its offset in it (past 2**27 media numbers the items
# outgrow 64 bits and `prefix_keys` hashes them as their repr: slower, still exact)
_BLOCK_BITS, _OFFSET_BITS = 12, 24


class MediaNumbers:
    """Numbers naming the media of prompts by content (their keys), for ``prompt_prefix``: a set of keys gets the
    next number the first time it is seen and keeps it while among the ``size`` last seen. A number is never given
    twice (one forgotten and seen again gets a new number: its old blocks are only not reused), so two prompts'
    positions get the same item only for the same media."""

    def __init__(self, size: int = 4096):
        self.size = size
        self._numbers: OrderedDict[tuple[str, ...], int] = OrderedDict()
        self._next = 1
        self._lock = threading.Lock()

    def number(self, keys: tuple[str, ...]) -> int:
        """The number of the media named by ``keys``."""
        with self._lock:
            number = self._numbers.get(keys)
            if number is not None:
                self._numbers.move_to_end(keys)
                return number
            number, self._next = self._next, self._next + 1
            self._numbers[keys] = number
            if len(self._numbers) > self.size:
                self._numbers.popitem(last=False)
            return number


MEDIA_NUMBERS = MediaNumbers()  # one per process: a number names the same media in every Pipeline


@dataclass
class _MediaItem:
    """One media item of a request: its feature-cache key, its cached feature block, or its encoder input."""

    key: str | None
    block: torch.Tensor | None
    inputs: torch.Tensor | None


def _take_queued(tokens: queue.Queue[int | None], generated: list[int], until: float = 0.0) -> bool:
    """Move the tokens already waiting in ``tokens``, and those arriving until ``time.monotonic()`` reaches
    ``until``, onto ``generated``; whether the end mark (None) was among them (it ends the wait at once: the last
    piece is never held back)."""
    while True:
        try:
            remaining = until - time.monotonic()
            token = tokens.get(timeout=remaining) if remaining > 0 else tokens.get_nowait()
        except queue.Empty:
            return False
        if token is None:
            return True
        generated.append(token)
