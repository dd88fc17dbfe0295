"""An independent Neva reference answer, from transformers and plain torch only (nothing of ``exporter``).

Features: the image processor given (transformers' CLIP/SigLIP processors), the transformers tower's
``hidden_states[select_layer]`` (CLIP's class token dropped for ``patch``), the projector by hand
(`support.projectors`). Prompt: literal text, each text part tokenized alone with SentencePiece, token ids and
feature blocks spliced as embeddings. Answer: transformers' own ``generate`` on ``inputs_embeds`` (greedy or beam
search), cut at EOS; or, for the checkpoints of `support.vlm`, greedy steps on the literal prompt of their
template (``reference_tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence

import sentencepiece
import torch
from PIL import Image
from transformers import CLIPImageProcessor, SiglipImageProcessor

from support.projectors import project
from support.vlm import IMAGE, PROMPTS, TinyVlm

Part = str | int | torch.Tensor  # text (tokenized alone), one token id, or a feature block [n, H]


def pad_to_square(image: Image.Image, mean: Sequence[float]) -> Image.Image:
    """NeMo's ``expand2square``: the image centred on a square filled with ``int(255 * mean)``."""
    width, height = image.size
    side = max(width, height)
    square = Image.new("RGB", (side, side), tuple(int(255 * m) for m in mean))
    square.paste(image, ((side - width) // 2, (side - height) // 2))
    return square


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
    return project(projector_type, _below_projector(projector), hidden[1:] if drop_class_token else hidden)


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


def _below_projector(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Projector weights named below ``mm_projector`` with or without the leading dot, without it."""
    return {name.removeprefix("."): value for name, value in weights.items()}


# --- the checkpoints of support.vlm -----------------------------------------------------------------------------


def reference_features(vlm: TinyVlm, image: Image.Image) -> torch.Tensor:
    """Features ``[N, HIDDEN]`` of one image, by transformers' processor and tower and hand-written projectors."""
    image = image.convert("RGB")
    if vlm.tower_type == "clip":
        processor = CLIPImageProcessor(size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE})
    else:
        processor = SiglipImageProcessor(size={"height": IMAGE, "width": IMAGE})
    if vlm.aspect == "pad":
        image = pad_to_square(image, processor.image_mean)
    elif vlm.aspect == "resize":  # VILA: a plain resize to the crop size first
        image = image.resize((IMAGE, IMAGE), Image.Resampling.BICUBIC)
    pixels = processor(images=image, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        hidden = vlm.tower(pixel_values=pixels, output_hidden_states=True).hidden_states[-2][0]
    if vlm.tower_type == "clip":
        hidden = hidden[1:]  # vision_select_feature "patch": the class token is dropped
    return project(vlm.projector_type, _below_projector(vlm.projector), hidden)


def reference_tokens(vlm: TinyVlm, question: str, images: Image.Image | list[Image.Image], steps: int,
                     prompt: tuple[str, bool] | None = None) -> list[int]:
    """Greedy ids of the reference: literal prompt (the template's, or ``prompt`` = (text, BOS)), the pieces
    around each ``<image>`` tokenized apart, each image's features spliced there as embeddings."""
    sp = sentencepiece.SentencePieceProcessor(model_file=str(vlm.sp_path))
    text, add_bos = prompt or PROMPTS[vlm.template]
    images = images if isinstance(images, list) else [images]
    pieces = text.format(q=question).split("<image>")
    assert len(pieces) == len(images) + 1
    embed = vlm.llm.get_input_embeddings()
    with torch.no_grad():
        parts = [embed(torch.tensor(([sp.bos_id()] if add_bos else []) + sp.encode(pieces[0]), dtype=torch.long))]
        for image, piece in zip(images, pieces[1:]):
            parts += [reference_features(vlm, image), embed(torch.tensor(sp.encode(piece), dtype=torch.long))]
        sequence = torch.cat(parts)
        generated: list[int] = []
        for _ in range(steps):
            token = int(vlm.llm(inputs_embeds=sequence[None]).logits[0, -1].argmax())
            if token == sp.eos_id():
                break
            generated.append(token)
            sequence = torch.cat([sequence, embed(torch.tensor([token]))])
    return generated
