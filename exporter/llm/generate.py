"""Generation for a batch of requests given as embedding sequences, each with its own sampling parameters.

Semantics follow NeMo's exporter (TensorRT-LLM): greedy when `top_k == 1`, when `temperature == 0`, or when
`top_k == 0` and `top_p == 0`; `top_k == 0` disables top-k and `top_p == 0` (or 1) disables top-p. The order
is repetition penalty -> temperature -> top-k -> top-p -> sample. Beam search (`num_beams > 1`) is
deterministic: it uses the repetition penalty and ignores temperature/top-k/top-p; it ranks hypotheses by
their summed token log-probabilities divided by the number of generated tokens (EOS counted), i.e. length
penalty 1.0, and stops like transformers' beam search (`early_stopping=False`).

Returned token ids never include the EOS token; a stop string's tokens are included (callers cut the text).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .model import Decoder, KVCache
from .tokenizer import Tokenizer


def _check_int(name: str, value: object, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_float(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high
    if not ok or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be a number in {bracket}{low}, {high}], got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded (defaults are NeMo's `TensorRTMMExporter.forward` defaults: greedy)."""

    max_output_len: int = 30
    top_k: int = 1
    top_p: float = 0.0
    temperature: float = 1.0
    repetition_penalty: float = 1.0
    num_beams: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    end_id: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        _check_int("max_output_len", self.max_output_len, 1)
        _check_int("top_k", self.top_k, 0)
        _check_float("top_p", self.top_p, 0.0, 1.0)
        _check_float("temperature", self.temperature, 0.0, float("inf"))
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, float("inf"), low_open=True)
        _check_int("num_beams", self.num_beams, 1)
        _check_int("seed", self.seed, 0, allow_none=True)
        _check_int("end_id", self.end_id, 0, allow_none=True)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.top_k == 1 or self.temperature == 0.0 or (self.top_k == 0 and self.top_p == 0.0)


@torch.inference_mode()
def generate(
    model: Decoder,
    prompts: Sequence[Tensor],
    prompt_ids: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    eos_id: int | None = None,
    tokenizer: Tokenizer | None = None,
) -> list[list[list[int]]]:
    """Generate for each prompt; returns `[request][beam] -> token ids` (best beam first).

    prompts: per request the input embeddings `[T_i, H]` (token embeddings, media features spliced in).
    prompt_ids: per request the T_i token ids behind the embeddings (-1 where a media feature sits); used
        only for the repetition penalty.
    params: per request; `end_id` overrides `eos_id`. Stop strings need `tokenizer`.

    Every request owns `num_beams` consecutive rows of one batch and one preallocated KV cache; all rows step
    together, rows of finished requests idle until the whole batch is done.
    """
    check_requests(model, prompts, prompt_ids, params, tokenizer)
    if not prompts:
        return []
    vocab = model.config.vocab_size
    requests = [
        _make_request(p, [t for t in ids if 0 <= t < vocab], eos_id, tokenizer, model.device)
        for p, ids in zip(params, prompt_ids)
    ]
    spans, start = [], 0
    for request in requests:
        spans.append(slice(start, start + request.width))
        start += request.width

    logits, cache, next_position = _prefill(model, prompts, spans, params)
    for _ in range(max(p.max_output_len for p in params)):
        tokens, source_rows = _step_requests(requests, spans, logits)
        if all(r.done for r in requests):
            break
        if not torch.equal(source_rows, torch.arange(len(tokens), device=model.device)):
            cache.reorder_(source_rows)
        positions = torch.tensor(next_position, device=model.device)[:, None]
        step_logits = model(model.embed(tokens)[:, None], positions, cache, kv_len=max(next_position) + 1)
        logits = step_logits[:, 0].float()
        for request, span in zip(requests, spans):
            if not request.done:
                next_position[span] = [p + 1 for p in next_position[span]]
    return [r.results() for r in requests]


def _step_requests(requests: list[_Request], spans: list[slice], logits: Tensor) -> tuple[Tensor, Tensor]:
    """Let each unfinished request pick its rows' next tokens; returns the tokens `[rows]` and, per row, the
    row whose cache it continues (beam search reorders its rows)."""
    tokens = torch.zeros(len(logits), dtype=torch.long, device=logits.device)
    source_rows = torch.arange(len(logits), device=logits.device)
    for request, span in zip(requests, spans):
        if not request.done:
            tokens[span], parents = request.step(logits[span])
            if parents is not None:
                source_rows[span] = parents + span.start
    return tokens, source_rows


def check_requests(
    model: Decoder,
    prompts: Sequence[Tensor],
    prompt_ids: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    tokenizer: Tokenizer | None,
) -> None:
    """Raise ValueError naming the request and what to change if any request cannot be generated for."""
    if not len(prompts) == len(prompt_ids) == len(params):
        raise ValueError(
            f"got {len(prompts)} prompts, {len(prompt_ids)} id lists and {len(params)} SamplingParams; "
            "they must be one per request"
        )
    hidden, config = model.config.hidden_size, model.config
    for i, (embeds, ids, p) in enumerate(zip(prompts, prompt_ids, params)):
        if embeds.ndim != 2 or embeds.shape[0] == 0 or embeds.shape[1] != hidden:
            raise ValueError(
                f"prompt {i} must be a non-empty [T, {hidden}] embedding tensor, got {tuple(embeds.shape)}"
            )
        if len(ids) != embeds.shape[0]:
            raise ValueError(f"prompt {i} has {embeds.shape[0]} embeddings but {len(ids)} token ids")
        if p.stop and tokenizer is None:
            raise ValueError(f"request {i} has stop strings but no tokenizer was given to decode the output")
        if (
            config.position_embedding_type == "learned_absolute"
            and len(ids) + p.max_output_len > config.max_position_embeddings
        ):
            raise ValueError(
                f"request {i}: prompt ({len(ids)}) + max_output_len ({p.max_output_len}) exceeds the "
                f"model's {config.max_position_embeddings} learned position embeddings; shorten the "
                "prompt or max_output_len"
            )


def _prefill(
    model: Decoder, prompts: Sequence[Tensor], spans: list[slice], params: Sequence[SamplingParams]
) -> tuple[Tensor, KVCache, list[int]]:
    """Run the right-padded prompts (repeated over each request's rows) at positions 0..T_i-1.

    Returns the float32 logits after each row's last prompt token `[rows, V]`, the cache, and per row the
    position its next token goes to.
    """
    rows = spans[-1].stop
    lengths = [len(embeds) for embeds, span in zip(prompts, spans) for _ in range(span.start, span.stop)]
    max_seq = max(len(embeds) + p.max_output_len for embeds, p in zip(prompts, params))
    padded = torch.zeros(rows, max(lengths), model.config.hidden_size, dtype=model.dtype, device=model.device)
    for embeds, span in zip(prompts, spans):
        padded[span, : len(embeds)] = embeds.to(padded)
    cache = model.new_kv_cache(rows, max_seq)
    last = torch.tensor(lengths, device=model.device) - 1
    logits = model(padded, kv_cache=cache, output_index=last)[:, 0].float()
    return logits, cache, lengths


class _Request:
    """What greedy/sampling and beam search share: penalties, end conditions."""

    width = 1

    def __init__(
        self, params: SamplingParams, prompt_ids: list[int], eos_id: int | None, tokenizer: Tokenizer | None
    ):
        self.params = params
        self.prompt_ids = prompt_ids
        self.eos_id = params.end_id if params.end_id is not None else eos_id
        self.end_ids = {self.eos_id, *params.stop_token_ids} - {None}  # tokens that end the answer, not kept
        self.tokenizer = tokenizer
        self.done = False

    def penalized(self, logits: Tensor, generated: list[int]) -> Tensor:
        return apply_repetition_penalty(
            logits, [*self.prompt_ids, *generated], self.params.repetition_penalty
        )

    def hits_stop(self, generated: list[int]) -> bool:
        if not self.params.stop:
            return False
        text = self.tokenizer.decode(generated, skip_special=False)
        return any(s in text for s in self.params.stop)


class TokenSampler(_Request):
    """Greedy or sampled decoding of one sequence."""

    def __init__(self, *args, device: torch.device):
        super().__init__(*args)
        self.tokens: list[int] = []
        self.generator = None
        if not self.params.greedy:
            self.generator = torch.Generator(device)
            if self.params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(self.params.seed)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no penalty: the token is the row's argmax, so a batch can pick it for every row at once."""
        return self.generator is None and self.params.repetition_penalty == 1.0

    def step(self, logits: Tensor) -> tuple[Tensor, None]:
        token = self.choose(logits[0])
        self.accept(token)
        return torch.tensor([token], device=logits.device), None

    def choose(self, logits: Tensor) -> int:
        """The next token for the row's `logits [V]` (penalised, then argmax or sampled)."""
        scores = self.penalized(logits, self.tokens)
        return int(scores.argmax()) if self.generator is None else self._sample(scores)

    def accept(self, token: int) -> None:
        """Record `token`; the request is done at EOS, at max_output_len or at a stop string."""
        if token in self.end_ids:
            self.done = True
        else:
            self.tokens.append(token)
            self.done = len(self.tokens) == self.params.max_output_len or self.hits_stop(self.tokens)

    def _sample(self, scores: Tensor) -> int:
        p = self.params
        scores = scores / p.temperature
        if p.top_k > 0:
            kth_best = scores.topk(min(p.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth_best, float("-inf"))
        probs = F.softmax(scores, dim=-1)
        if 0.0 < p.top_p < 1.0:
            probs = top_p_filter(probs, p.top_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def results(self) -> list[list[int]]:
        return [self.tokens]


def apply_repetition_penalty(logits: Tensor, seen_ids: Sequence[int], penalty: float) -> Tensor:
    """`logits [V]` with each seen token's logit divided by `penalty` if positive, multiplied if not."""
    if penalty == 1.0 or not seen_ids:
        return logits
    index = torch.tensor(sorted(set(seen_ids)), device=logits.device)
    picked = logits[index]
    return logits.index_put((index,), torch.where(picked > 0, picked / penalty, picked * penalty))


def top_p_filter(probs: Tensor, top_p: float) -> Tensor:
    """Zero all but the smallest set of most likely tokens whose probabilities sum to at least `top_p`."""
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


class _BeamSearch(_Request):
    """Beam search over `num_beams` rows; finished hypotheses scored by mean token log-probability."""

    def __init__(self, *args):
        super().__init__(*args)
        self.width = self.params.num_beams
        self.beams: list[list[int]] = [[] for _ in range(self.width)]
        self.scores = [0.0] + [float("-inf")] * (self.width - 1)  # summed log-probs; rows start identical
        self.finished: list[tuple[float, list[int]]] = []

    def step(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        width, vocab = logits.shape
        log_probs = torch.stack(
            [F.log_softmax(self.penalized(logits[b], self.beams[b]), dim=-1) for b in range(width)]
        )
        totals = log_probs + torch.tensor(self.scores, device=logits.device)[:, None]
        values, indices = totals.flatten().topk(2 * width)
        live: list[tuple[float, int, list[int]]] = []
        for rank, (value, index) in enumerate(zip(values.tolist(), indices.tolist())):
            if value == float("-inf") or len(live) == width:
                break
            parent, token = divmod(index, vocab)
            tokens = self.beams[parent] + [token]
            if token in self.end_ids or self.hits_stop(tokens):
                if rank < width:  # only candidates that would have been kept may end a hypothesis
                    self._finish(value, tokens[:-1] if token in self.end_ids else tokens, len(tokens))
                continue
            live.append((value, parent, tokens))
        live += [(float("-inf"), 0, [0])] * (width - len(live))  # dead rows when too few candidates survive

        self.scores = [value for value, _, _ in live]
        self.beams = [tokens for _, _, tokens in live]
        length = len(self.beams[0])
        best_live = max(self.scores) / length
        if length == self.params.max_output_len or best_live == float("-inf"):
            for score, tokens in zip(self.scores, self.beams):
                self._finish(score, tokens, length)
            self.done = True
        elif len(self.finished) == width and self.finished[-1][0] >= best_live:
            self.done = True
        parents = torch.tensor([parent for _, parent, _ in live], device=logits.device)
        return torch.tensor([tokens[-1] for tokens in self.beams], device=logits.device), parents

    def _finish(self, summed_log_prob: float, tokens: list[int], length: int) -> None:
        if summed_log_prob == float("-inf"):
            return
        self.finished.append((summed_log_prob / max(length, 1), tokens))
        self.finished.sort(key=lambda hypothesis: hypothesis[0], reverse=True)
        del self.finished[self.width :]

    def results(self) -> list[list[int]]:
        return [tokens for _, tokens in self.finished]


def _make_request(
    params: SamplingParams,
    prompt_ids: list[int],
    eos_id: int | None,
    tokenizer: Tokenizer | None,
    device: torch.device,
) -> _Request:
    if params.num_beams > 1:
        return _BeamSearch(params, prompt_ids, eos_id, tokenizer)
    return TokenSampler(params, prompt_ids, eos_id, tokenizer, device=device)
