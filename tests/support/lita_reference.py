"""An independent LITA/VITA reference written from NeMo's training code, never from ``exporter``.

- Frames: ``TarOrFolderVideoLoader.flatten_frames`` (``neva_dataset.py``): ``linspace(0, len-1, min(len, num_frames),
  dtype=int)``, then the last frame repeated until there are ``data.num_frames``. Files are decoded here with PyAV.
- Per-frame features: ``support.neva_reference.reference_features`` (transformers' processor and tower, projector by hand).
- ``add_lita_layer`` (``LitaWordEmbeddingMixin``) over all ``num_frames`` frames, the 2×2 pooling as window means.
- The placeholder span as ``preprocess_multimodal`` writes it (``<extra_id_3>`` patches between start/end tokens),
  embedded, then overwritten as ``replace_media_embeddings`` does, including its final position check.
"""

from __future__ import annotations

import io
from pathlib import Path

import av
import numpy as np
import sentencepiece
import torch
from PIL import Image

from support.neva_reference import reference_features
from support.vlm import TinyVlm

PATCH, IM_START, IM_END, VID_START, VID_END = (f"<extra_id_{i}>" for i in (3, 4, 5, 8, 9))


def decoded_frames(source: np.ndarray | bytes | str | Path) -> np.ndarray:
    """Every frame of a video file (PyAV, RGB) or the uint8 array itself."""
    if isinstance(source, np.ndarray):
        return source
    with av.open(io.BytesIO(source) if isinstance(source, bytes) else str(source)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def training_frames(frames: np.ndarray, num_frames: int) -> list[np.ndarray]:
    """``flatten_frames``: evenly spaced frames (truncated), the last repeated up to ``num_frames``."""
    indices = np.linspace(0, len(frames) - 1, min(len(frames), num_frames), dtype=int)
    chosen = [frames[i] for i in indices]
    while len(chosen) < num_frames:
        chosen.append(chosen[-1])
    return chosen


def pool_2x2(tokens: torch.Tensor) -> torch.Tensor:
    """``avg_pool2d(kernel 2)`` on one frame's ``[side*side, H]`` tokens (row-major grid), window by window."""
    side = round(tokens.shape[0] ** 0.5)
    grid = tokens.reshape(side, side, -1)
    return torch.stack([grid[2 * i:2 * i + 2, 2 * j:2 * j + 2].reshape(4, -1).mean(dim=0)
                        for i in range(side // 2) for j in range(side // 2)])


def add_lita_layer(features: torch.Tensor, arch: str, sample_frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t_tokens, s_tokens)`` of one video's features ``[T, S, H]``; for ``temporal_all_resolution``
    ``(im_features [F, S, H], vid_tokens [T, H])``, as NeMo returns them."""
    count = features.shape[0]
    temporal = features.mean(dim=1)
    if arch == "temporal_spatial_pool":
        selected = np.round(np.linspace(0, count - 1, 4)).astype(int)
        return temporal, torch.cat([pool_2x2(features[i]) for i in selected])
    if arch == "temporal_spatial":
        return temporal, features.mean(dim=0)
    if arch == "temporal_all_resolution":
        index = np.round(np.linspace(0, count - 1, sample_frames)).astype(int)
        return features[index], temporal
    raise ValueError(f"no reference for {arch!r}")


def span_tokens(token_format: str, arch: str, tokens_per_frame: int, num_frames: int, sample_frames: int) -> list[str]:
    """The tokens ``preprocess_multimodal`` puts in place of ``<video>`` (``use_im_start_end`` False)."""
    if token_format == "im_vid_start_end":
        frames = min(sample_frames, num_frames)
        span = [IM_START, IM_START] + [PATCH] * (tokens_per_frame - 1) + [IM_END]
        span += ([IM_START] + [PATCH] * tokens_per_frame + [IM_END]) * (frames - 1)
        span += [VID_START] + [PATCH] * (num_frames - 1) + [VID_END]
        return span + [IM_END]
    assert arch != "temporal_all_resolution"
    return [IM_START] + [PATCH] * (num_frames + tokens_per_frame - 2) + [IM_END]


def replace_media_embeddings(ids: list[int], embeds: torch.Tensor, t_tokens: torch.Tensor, s_tokens: torch.Tensor,
                             token_format: str, start_id: int, end_id: int) -> torch.Tensor:
    """NeMo's replacement on one sequence (``use_media_start_end`` False)."""
    embeds = embeds.clone()
    positions = torch.tensor(ids)
    start = int(torch.where(positions == start_id)[0][0])
    end = int(torch.where(positions == end_id)[0][-1])
    if token_format == "v1":
        count, spatial = t_tokens.shape[0], s_tokens.shape[0]
        assert start + count + spatial == end + 1, "Token replacement error"
        embeds[start:start + count] = t_tokens
        embeds[start + count:start + count + spatial] = s_tokens
        return embeds
    embeds[start] = embeds[start + 1]
    embeds[end] = embeds[end - 1]
    im_features, vid_features = t_tokens, s_tokens
    position = start + 1
    for frame in im_features:
        embeds[position:position + frame.shape[0]] = frame
        position += frame.shape[0] + 2
    embeds[position:position + vid_features.shape[0]] = vid_features
    assert position + vid_features.shape[0] == end
    return embeds


def export_runtime_frames(frames: np.ndarray, num_frames: int, sample_frames: int,
                          token_format: str) -> list[np.ndarray]:
    """NeMo's export runtime (``get_num_sample_frames``, then ``round(linspace)`` indices), for the opt-in."""
    count = len(frames)
    if token_format != "im_vid_start_end":
        keep = sample_frames
    elif count <= num_frames:
        keep = count
    else:
        keep = int(np.round(count / np.ceil(count / num_frames)))
    return [frames[i] for i in np.round(np.linspace(0, count - 1, keep)).astype(int)]


@torch.no_grad()
def video_span(vlm: TinyVlm, frames: list[np.ndarray], *, token_format: str, arch: str,
               sample_frames: int) -> torch.Tensor:
    """The embeddings training puts where the prompt has ``<video>``, for the sampled ``frames`` (``T`` of them)."""
    features = torch.stack([reference_features(vlm, Image.fromarray(frame)) for frame in frames])
    spatial_frames = min(sample_frames, len(frames))
    t_tokens, s_tokens = add_lita_layer(features, arch, spatial_frames)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(vlm.sp_path))
    ids = [sp.piece_to_id(token) for token in span_tokens(token_format, arch, features.shape[1], len(frames),
                                                          spatial_frames)]
    embeds = vlm.llm.get_input_embeddings()(torch.tensor(ids))
    start_id, end_id = sp.piece_to_id(IM_START), sp.piece_to_id(IM_END)
    return replace_media_embeddings(ids, embeds, t_tokens, s_tokens, token_format, start_id, end_id)


@torch.no_grad()
def prompt_embeddings(vlm: TinyVlm, prompt: str, add_bos: bool, span: torch.Tensor) -> torch.Tensor:
    """``[T, H]``: the literal prompt's text around ``<video>`` tokenized apart, ``span`` in between."""
    sp = sentencepiece.SentencePieceProcessor(model_file=str(vlm.sp_path))
    before, after = prompt.split("<video>")
    embed = vlm.llm.get_input_embeddings()
    head = embed(torch.tensor(([sp.bos_id()] if add_bos else []) + sp.encode(before), dtype=torch.long))
    return torch.cat([head, span, embed(torch.tensor(sp.encode(after), dtype=torch.long))])


@torch.no_grad()
def greedy_ids(vlm: TinyVlm, embeddings: torch.Tensor, steps: int) -> list[int]:
    """Greedy ids from transformers' Llama, stopping at EOS."""
    eos = sentencepiece.SentencePieceProcessor(model_file=str(vlm.sp_path)).eos_id()
    embed = vlm.llm.get_input_embeddings()
    sequence, generated = embeddings, []
    for _ in range(steps):
        token = int(vlm.llm(inputs_embeds=sequence[None]).logits[0, -1].argmax())
        if token == eos:
            break
        generated.append(token)
        sequence = torch.cat([sequence, embed(torch.tensor([token]))])
    return generated
