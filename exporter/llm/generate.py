"""What decoding a request means, on the host: its parameters, its end conditions, beam search's bookkeeping.

Semantics follow NeMo's exporter (TensorRT-LLM): greedy when `top_k == 1`, when `temperature == 0`, or when
`top_k == 0` and `top_p == 0`; `top_k == 0` disables top-k and `top_p == 0` (or 1) disables top-p. The order
is repetition penalty -> temperature -> top-k -> top-p -> sample. Beam search (`num_beams > 1`) is
deterministic: it uses the repetition penalty and ignores temperature/top-k/top-p; it ranks hypotheses by
their summed token log-probabilities divided by the number of generated tokens (EOS counted), i.e. length
penalty 1.0, and stops like transformers' beam search (`early_stopping=False`).

The tokens themselves are chosen on the device for all rows at once (`exporter.llm.sampling`); the in-flight
scheduler (`exporter.runtime.scheduler`, which also has `generate`) hands each request its tokens here.
Returned token ids never include the EOS token; a stop string's tokens are included (callers cut the text).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from .model import Decoder
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


class StopStrings:
    """Finds a request's stop strings in the text each new token adds, decoding only a short tail of its tokens.

    A tail keeps the fewest last tokens whose text has more characters (partial ones not counted) than the longest
    stop string: enough for a match that ends in the next token's text to start inside it.
    """

    def __init__(self, stops: Sequence[str], tokenizer: Tokenizer):
        self.stops = tuple(stops)
        self.tokenizer = tokenizer
        self.keep = max(len(stop) for stop in self.stops) + 1  # a tail's first character may be dropped (a space)

    def extend(self, tail: tuple[int, ...], token: int) -> tuple[tuple[int, ...], bool]:
        """The tail with ``token`` appended, and whether a stop string now ends in the text."""
        tail = (*tail, token)
        text = self.tokenizer.decode(list(tail), skip_special=False)
        if any(stop in text for stop in self.stops):
            return tail, True
        while len(tail) > 1 and self._characters(tail[1:]) >= self.keep:
            tail = tail[1:]
        return tail, False

    def _characters(self, ids: tuple[int, ...]) -> int:
        return len(self.tokenizer.decode(list(ids), skip_special=False).replace("\ufffd", ""))


class _Request:
    """What one sequence and a beam search share: the parameters and the end conditions."""

    def __init__(self, params: SamplingParams, eos_id: int | None, tokenizer: Tokenizer | None):
        self.params = params
        self.eos_id = params.end_id if params.end_id is not None else eos_id
        self.end_ids = {self.eos_id, *params.stop_token_ids} - {None}  # tokens that end the answer, not kept
        self.stops = StopStrings(params.stop, tokenizer) if params.stop else None
        self.done = False


class Answer(_Request):
    """One greedy or sampled sequence: the tokens kept so far and whether it has ended."""

    def __init__(self, params: SamplingParams, eos_id: int | None, tokenizer: Tokenizer | None):
        super().__init__(params, eos_id, tokenizer)
        self.tokens: list[int] = []
        self._tail: tuple[int, ...] = ()

    def accept(self, token: int) -> None:
        """Record ``token``; the answer is done at an end token, at max_output_len or at a stop string."""
        if token in self.end_ids:
            self.done = True
            return
        self.tokens.append(token)
        hit = False
        if self.stops is not None:
            self._tail, hit = self.stops.extend(self._tail, token)
        self.done = hit or len(self.tokens) == self.params.max_output_len

    def results(self) -> list[list[int]]:
        return [self.tokens]


class BeamSearch(_Request):
    """Beam search over `num_beams` beams; finished hypotheses scored by mean token log-probability.

    Each step the device offers the best `2 × num_beams` continuations of all beams and continues the first
    `num_beams` that are no end token; ``advance`` keeps the same ones unless a stop string ends one of them.
    """

    def __init__(self, params: SamplingParams, eos_id: int | None, tokenizer: Tokenizer | None):
        super().__init__(params, eos_id, tokenizer)
        self.width = params.num_beams
        self.beams: list[list[int]] = [[] for _ in range(self.width)]
        self.scores = [0.0] + [float("-inf")] * (self.width - 1)  # summed log-probs; rows start identical
        self.finished: list[tuple[float, list[int]]] = []
        self._tails: list[tuple[int, ...]] = [()] * self.width

    def advance(self, values: Sequence[float], ids: Sequence[int], vocab_size: int) -> bool:
        """Take a step's candidates (best first: summed log-probability and `beam * vocab_size + token`); returns
        whether the beams continued are the ones the device continued."""
        width = self.width
        candidates = [(value, *divmod(index, vocab_size)) for value, index in zip(values[: 2 * width],
                                                                                 ids[: 2 * width])]
        device = [(parent, token) for value, parent, token in candidates
                  if value != float("-inf") and token not in self.end_ids][:width]
        live: list[tuple[float, int, list[int], tuple[int, ...]]] = []
        for rank, (value, parent, token) in enumerate(candidates):
            if value == float("-inf") or len(live) == width:
                break
            tokens = self.beams[parent] + [token]
            if token in self.end_ids:
                if rank < width:  # only candidates that would have been kept may end a hypothesis
                    self._finish(value, tokens[:-1], len(tokens))
                continue
            tail, hit = self.stops.extend(self._tails[parent], token) if self.stops is not None else ((), False)
            if hit:
                if rank < width:
                    self._finish(value, tokens, len(tokens))
                continue
            live.append((value, parent, tokens, tail))
        kept = [(parent, tokens[-1]) for _, parent, tokens, _ in live]
        live += [(float("-inf"), 0, [0], ())] * (width - len(live))  # dead rows when too few candidates survive

        self.scores = [value for value, _, _, _ in live]
        self.beams = [tokens for _, _, tokens, _ in live]
        self._tails = [tail for _, _, _, tail in live]
        length = len(self.beams[0])
        best_live = max(self.scores) / length
        if length == self.params.max_output_len or best_live == float("-inf"):
            for score, tokens in zip(self.scores, self.beams):
                self._finish(score, tokens, length)
            self.done = True
        elif len(self.finished) == width and self.finished[-1][0] >= best_live:
            self.done = True
        return kept == device

    def _finish(self, summed_log_prob: float, tokens: list[int], length: int) -> None:
        if summed_log_prob == float("-inf"):
            return
        self.finished.append((summed_log_prob / max(length, 1), tokens))
        self.finished.sort(key=lambda hypothesis: hypothesis[0], reverse=True)
        del self.finished[self.width :]

    def results(self) -> list[list[int]]:
        return [tokens for _, tokens in self.finished]
