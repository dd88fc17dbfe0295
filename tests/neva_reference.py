"""An independent Neva reference answer, from transformers and plain torch only (nothing of ``exporter``).

Features: the image processor given (transformers' CLIP/SigLIP processors), the transformers tower's
``hidden_states[select_layer]`` (CLIP's class token dropped for ``patch``), the projector in plain torch ops with
the 2x2 merge of ``mlp_downsample`` written as an explicit loop over windows. Prompt: literal text, each text
part tokenized alone with SentencePiece, token ids and feature blocks spliced as embeddings. Answer: transformers'
own ``generate`` on ``inputs_embeds`` (greedy or beam search), cut at EOS.
"""

from __future__ import annotations

from collections.abc import Sequence

import sentencepiece
import torch
from PIL import Image

Part = str | int | torch.Tensor  # text (tokenized alone), one token id, or a feature block [n, H]


def pad_to_square(image: Image.Image, mean: Sequence[float]) -> Image.Image:
    """NeMo's ``expand2square``: the image centred on a square filled with ``int(255 * mean)``."""
    width, height = image.size
    side = max(width, height)
    square = Image.new("RGB", (side, side), tuple(int(255 * m) for m in mean))
    square.paste(image, ((side - width) // 2, (side - height) // 2))
    return square


def merge_2x2(tokens: torch.Tensor) -> torch.Tensor:
    """NeMo's DownSampleBlock on one image ``[s*s, D]`` (row-major grid), one window at a time.

    An odd grid gets a zero row and column at the end. Output token ``i * h + j`` (``i`` = column pair, ``j`` =
    row pair, ``h`` = half the side) holds cells (2j, 2i), (2j, 2i+1), (2j+1, 2i), (2j+1, 2i+1) in that order.
    """
    side = round(tokens.shape[0] ** 0.5)
    grid = tokens.reshape(side, side, -1)
    if side % 2:
        grid = torch.cat([grid, torch.zeros(1, side, grid.shape[2])], dim=0)
        grid = torch.cat([grid, torch.zeros(side + 1, 1, grid.shape[2])], dim=1)
        side += 1
    half = side // 2
    merged = []
    for i in range(half):
        for j in range(half):
            cells = [grid[2 * j, 2 * i], grid[2 * j, 2 * i + 1], grid[2 * j + 1, 2 * i], grid[2 * j + 1, 2 * i + 1]]
            merged.append(torch.cat(cells))
    return torch.stack(merged)


def project(kind: str, weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The projector ``kind`` from its raw NeMo weights (names below ``mm_projector``, e.g. ``.0.weight``)."""
    w = weights
    if kind == "linear":
        return x @ w[".weight"].T + w[".bias"]
    if kind == "mlp2x_gelu":
        hidden = torch.nn.functional.gelu(x @ w[".0.weight"].T + w[".0.bias"])
        return hidden @ w[".2.weight"].T + w[".2.bias"]
    if kind == "mlp_downsample":
        merged = merge_2x2(x)
        mean = merged.mean(dim=-1, keepdim=True)
        var = merged.var(dim=-1, unbiased=False, keepdim=True)
        normed = (merged - mean) / torch.sqrt(var + 1e-5) * w[".1.weight"] + w[".1.bias"]
        hidden = torch.nn.functional.gelu(normed @ w[".2.weight"].T + w[".2.bias"])
        return hidden @ w[".4.weight"].T + w[".4.bias"]
    raise ValueError(f"no reference for projector {kind!r}")


@torch.no_grad()
def image_features(image: Image.Image, *, tower: torch.nn.Module, processor, projector_type: str,
                   projector: dict[str, torch.Tensor], pad: bool = False, select_layer: int = -2,
                   drop_class_token: bool = True) -> torch.Tensor:
    """``[N, H_llm]`` features of one image; ``processor`` is a transformers image processor."""
    image = image.convert("RGB")
    if pad:
        image = pad_to_square(image, processor.image_mean)
    pixels = processor(images=image, return_tensors="pt")["pixel_values"]
    hidden = tower(pixel_values=pixels, output_hidden_states=True).hidden_states[select_layer][0]
    return project(projector_type, projector, hidden[1:] if drop_class_token else hidden)


def prompt_embeddings(llm, sp_path, parts: Sequence[Part], add_bos: bool) -> torch.Tensor:
    """``[T, H]``: BOS (when asked), then each part: text tokenized alone, a token id, or a feature block."""
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_path))
    embed = llm.get_input_embeddings()
    ids: list[int] = [sp.bos_id()] if add_bos else []
    blocks: list[torch.Tensor] = []
    for part in parts:
        if isinstance(part, torch.Tensor):
            blocks += [embed(torch.tensor(ids, dtype=torch.long)), part]
            ids = []
        else:
            ids += sp.encode(part) if isinstance(part, str) else [part]
    with torch.no_grad():
        return torch.cat([*blocks, embed(torch.tensor(ids, dtype=torch.long))])


@torch.no_grad()
def answer_ids(llm, embeddings: torch.Tensor, steps: int, eos_id: int, num_beams: int = 1) -> list[list[int]]:
    """transformers' greedy / beam search on ``inputs_embeds``: the new ids of each beam (best first), cut at EOS."""
    output = llm.generate(
        inputs_embeds=embeddings[None],
        attention_mask=torch.ones(1, embeddings.shape[0], dtype=torch.long),
        max_new_tokens=steps,
        do_sample=False,
        num_beams=num_beams,
        num_return_sequences=num_beams,
        length_penalty=1.0,
        eos_token_id=eos_id,
        pad_token_id=0,
    )
    beams = output.tolist()
    return [beam[: beam.index(eos_id)] if eos_id in beam else beam for beam in beams]
