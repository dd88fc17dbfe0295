"""ONNX export of the audio perception's encoder + modality adapter + proj (NeMo's `perception_encoder.onnx`).

Inputs `processed_signal` float32 [B, n_mels, T] and `processed_signal_length` int32 [B]; outputs `encoded`
[B, T', H] and `encoded_length` int32 [B] (NeMo's names and length dtype); batch and time axes dynamic, any mel
count. The mel front end stays in PyTorch (NeMo exported it as TorchScript: the complex STFT does not export to ONNX).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from .perception import AudioPerception

_TRACE_FRAMES = 203  # odd, not a multiple of the subsampling factor, so no length is special-cased while tracing


class _EncodeGraph(nn.Module):
    def __init__(self, perception: AudioPerception):
        super().__init__()
        self.perception = perception

    def forward(self, mel: Tensor, mel_lengths: Tensor) -> tuple[Tensor, Tensor]:
        encoded, lengths = self.perception.encode(mel, mel_lengths.to(torch.int64))
        return encoded, lengths.to(torch.int32)


def export_audio_onnx(perception: AudioPerception, path: str | os.PathLike, opset: int = 17) -> Path:
    """Writes `perception.encode` as ONNX to `path` (TorchScript exporter, opset 17 as NeMo) and returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    dtype = next(perception.encoder.parameters()).dtype
    mel = torch.zeros(2, perception.n_mels, _TRACE_FRAMES, dtype=dtype)
    lengths = torch.tensor([_TRACE_FRAMES, _TRACE_FRAMES - 40], dtype=torch.int32)
    with torch.no_grad(), warnings.catch_warnings():
        # shapes flow through size() ops; the tracer's warnings about Python values are expected here
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message="Constant folding")
        torch.onnx.export(
            _EncodeGraph(perception).eval(),
            (mel, lengths),
            str(path),
            input_names=["processed_signal", "processed_signal_length"],
            output_names=["encoded", "encoded_length"],
            dynamic_axes={
                "processed_signal": {0: "batch", 2: "frames"},
                "processed_signal_length": {0: "batch"},
                "encoded": {0: "batch", 1: "tokens"},
                "encoded_length": {0: "batch"},
            },
            opset_version=opset,
            do_constant_folding=True,
            dynamo=False,
        )
    return path
