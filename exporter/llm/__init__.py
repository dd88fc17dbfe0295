"""The language model of a NeMo checkpoint, run in PyTorch: `load_llm(path) -> LLM`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .config import DecoderConfig
from .generate import SamplingParams
from .model import Decoder, KVCache, select_llm_weights
from .tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from exporter.checkpoint import NemoCheckpoint

__all__ = [
    "LLM",
    "load_llm",
    "Decoder",
    "DecoderConfig",
    "KVCache",
    "SamplingParams",
    "Tokenizer",
    "load_tokenizer",
    "parse_dtype",
]

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"dtype {dtype!r} is not supported; supported values: bfloat16, float16, float32")


class LLM:
    """A decoder and its tokenizer: logits, text generation, and generation from spliced embeddings."""

    def __init__(self, model: Decoder, tokenizer: Tokenizer):
        self.model = model
        self.tokenizer = tokenizer

    @property
    def config(self) -> DecoderConfig:
        return self.model.config

    @torch.inference_mode()
    def logits(self, input_ids: Tensor | Sequence[Sequence[int]]) -> Tensor:
        """Float32 logits `[B,T,V]` for equal-length rows of token ids (no KV cache)."""
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.model.device)
        if ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {tuple(ids.shape)}")
        return self.model(self.model.embed(ids)).float()

    def generate(
        self,
        prompts: Sequence[str],
        max_output_len: int = 30,
        top_k: int = 1,
        top_p: float = 0.0,
        temperature: float = 1.0,
        repetition_penalty: float = 1.0,
        num_beams: int = 1,
        stop: Sequence[str] | None = None,
        seed: int | None = None,
        add_bos: bool = True,
    ) -> list[str]:
        """Text continuation of each prompt (best beam), cut before the first stop string."""
        params = SamplingParams(
            max_output_len=max_output_len,
            top_k=top_k,
            top_p=top_p,
            temperature=temperature,
            repetition_penalty=repetition_penalty,
            num_beams=num_beams,
            stop=tuple(stop or ()),
            seed=seed,
        )
        ids = [self.tokenizer.encode(text, add_bos=add_bos) for text in prompts]
        with torch.inference_mode():
            embeddings = [
                self.model.embed(torch.tensor(row, dtype=torch.long, device=self.model.device)) for row in ids
            ]
        outputs = self.generate_from_embeddings(embeddings, ids, params)
        return [self.decode(beams[0], params.stop) for beams in outputs]

    def generate_from_embeddings(
        self,
        embeddings: Sequence[Tensor],
        token_ids: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
    ) -> list[list[list[int]]]:
        """Token ids `[request][beam]` generated after each `[T_i, H]` embedding sequence.

        token_ids: the ids behind each sequence (-1 at media positions), for the repetition penalty.
        params: one for all requests or one per request. EOS is `params.end_id` or the tokenizer's EOS.
        """
        from ..runtime.scheduler import generate  # the one decode engine; exporter.runtime imports this package

        per_request = [params] * len(embeddings) if isinstance(params, SamplingParams) else list(params)
        return generate(
            self.model,
            embeddings,
            token_ids,
            per_request,
            eos_id=self.tokenizer.eos_id,
            tokenizer=self.tokenizer,
        )

    def decode(self, ids: Sequence[int], stop: Sequence[str] = ()) -> str:
        """Text of generated ids (special tokens skipped), cut before the earliest stop string."""
        text = self.tokenizer.decode(ids)
        cuts = [text.find(s) for s in stop if s in text]
        return text[: min(cuts)] if cuts else text


def load_llm(
    path_or_checkpoint: str | Path | NemoCheckpoint,
    dtype: str | torch.dtype = "bfloat16",
    device: str | torch.device = "cpu",
    tokenizer_path: str | Path | None = None,
) -> LLM:
    """Load the LLM of a `.nemo` archive/folder (or an opened `NemoCheckpoint`) with its tokenizer."""
    from exporter.checkpoint import NemoCheckpoint

    checkpoint = (
        path_or_checkpoint
        if isinstance(path_or_checkpoint, NemoCheckpoint)
        else NemoCheckpoint(path_or_checkpoint)
    )
    weights = select_llm_weights(checkpoint.state_dict())
    embedding = weights.get("embedding.word_embeddings.weight")
    if embedding is None:
        raise ValueError("the checkpoint has no embedding.word_embeddings.weight; it holds no GPT decoder")
    config = DecoderConfig.from_nemo(checkpoint.config, vocab_size=embedding.shape[0])
    torch_dtype = parse_dtype(dtype)
    for name, tensor in weights.items():  # one tensor at a time, so the source copy is freed as we go
        weights[name] = tensor.to(device=device, dtype=torch_dtype)
    model = Decoder.from_state_dict(config, weights)
    return LLM(model, checkpoint.tokenizer(tokenizer_path=tokenizer_path))
