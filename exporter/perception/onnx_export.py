"""ONNX export of a `VisionEncoder` (the artifact a TensorRT engine build consumes): input `input` [B,3,S,S],
output `output` [B,N,H], dynamic batch axis, opset 17 (as NeMo's visual engine build)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from .vision_encoder import VisionEncoder


def export_vision_onnx(encoder: VisionEncoder, path: str | os.PathLike, opset: int = 17) -> Path:
    """Writes `encoder` as ONNX to `path` and returns the path.

    Uses the TorchScript exporter (`dynamo=False`): the dynamo exporter needs `onnxscript`, which this
    project does not depend on. The graph keeps the encoder's dtype.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    size = encoder.image_size
    dummy = torch.zeros(2, 3, size, size, dtype=encoder.dtype)
    with torch.no_grad(), warnings.catch_warnings():
        # the image size is fixed per engine, so shape values the tracer freezes to constants are intended
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message="Constant folding")
        torch.onnx.export(
            encoder.eval(),
            (dummy,),
            str(path),
            input_names=["input"],
            output_names=["output"],
            dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
            opset_version=opset,
            do_constant_folding=True,
            dynamo=False,
        )
    return path
