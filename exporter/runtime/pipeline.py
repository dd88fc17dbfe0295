"""One batch of requests from text + media to text, each request succeeding or failing on its own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine import Engine
from ..llm.generate import SamplingParams, generate
from ..models import PromptLayout


@dataclass
class Request:
    """One prompt: ``media`` is one item or a list (path, PIL image, uint8 array or encoded bytes)."""

    text: str
    media: Any = None
    params: SamplingParams = field(default_factory=SamplingParams)
    apply_chat_template: bool = True


@dataclass
class Completion:
    """One request's answer: text and token ids per beam (best first) and the prompt's length in positions."""

    texts: list[str]
    token_ids: list[list[int]]
    prompt_tokens: int


class Pipeline:
    """Preprocess → perception encoder → prompt layout → splice → LLM → text, for a batch of requests.

    ``run`` returns, per request, its :class:`Completion` or the exception that request alone raised; a bad request
    never fails the others.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.stop_token_ids = self._stop_token_ids()

    def _stop_token_ids(self) -> set[int]:
        tokenizer = self.engine.tokenizer
        ids = {tokenizer.token_to_id(token) for token in self.engine.template.stop_tokens}
        return {i for i in ids if i is not None}

    def run(self, requests: list[Request]) -> list[Completion | Exception]:
        limit = self.engine.limits.max_batch_size
        results: list[Completion | Exception] = []
        for start in range(0, len(requests), limit):
            results.extend(self._run_batch(requests[start:start + limit]))
        return results

    def _run_batch(self, requests: list[Request]) -> list[Completion | Exception]:
        results: list[Completion | Exception | None] = [None] * len(requests)
        media_items: dict[int, list[torch.Tensor]] = {}
        for i, request in enumerate(requests):
            try:
                self.engine.limits.check_request(0, 0, request.params.max_output_len)
                media_items[i] = self.engine.perception.load_media(request.media)
            except Exception as error:  # noqa: BLE001 - reported per request
                results[i] = error

        features = self._encode(media_items)
        layouts: dict[int, PromptLayout] = {}
        for i, items in features.items():
            request = requests[i]
            try:
                layout = self.engine.perception.layout(request.text, items, self.engine.tokenizer,
                                                       self.engine.template, request.apply_chat_template)
                media_len = sum(int(block.shape[0]) for block in items)
                self.engine.limits.check_request(layout.length, media_len, request.params.max_output_len)
                layouts[i] = layout
            except Exception as error:  # noqa: BLE001 - reported per request
                results[i] = error

        order = sorted(layouts)
        outputs = generate(
            self.engine.decoder,
            [self._embed(layouts[i]) for i in order],
            [layouts[i].token_ids() for i in order],
            [requests[i].params for i in order],
            eos_id=self.engine.tokenizer.eos_id,
            tokenizer=self.engine.tokenizer,
        ) if order else []
        for i, beams in zip(order, outputs):
            kept = [self._until_stop_token(tokens) for tokens in beams]
            texts = [self.engine.tokenizer.decode(tokens).strip() for tokens in kept]
            results[i] = Completion(texts, kept, layouts[i].length)
        return results  # type: ignore[return-value]

    def _encode(self, media_items: dict[int, list[torch.Tensor]]) -> dict[int, list[torch.Tensor]]:
        """Encode every request's media in shared encoder batches; hand each request back its own blocks."""
        flat = [item for i in sorted(media_items) for item in media_items[i]]
        blocks = iter(self.engine.perception.encode(flat) if flat else [])
        return {i: [next(blocks) for _ in media_items[i]] for i in sorted(media_items)}

    def _embed(self, layout: PromptLayout) -> torch.Tensor:
        decoder = self.engine.decoder
        parts = []
        for piece in layout.pieces:
            if isinstance(piece, list):
                parts.append(decoder.embed(torch.tensor(piece, dtype=torch.long, device=decoder.device)))
            else:
                parts.append(piece.to(device=decoder.device, dtype=decoder.dtype))
        return torch.cat(parts)

    def _until_stop_token(self, tokens: list[int]) -> list[int]:
        for index, token in enumerate(tokens):
            if token in self.stop_token_ids:
                return tokens[:index]
        return tokens
