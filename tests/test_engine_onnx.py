"""export_onnx=True writes visual_engine/encoder.onnx, which ONNX Runtime runs to the PyTorch encoder's output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime
import torch

from exporter import TensorRTMMExporter
from support.demo import DEMO_NEMO


def test_exported_onnx_encoder_matches_pytorch(tmp_path: Path) -> None:
    exporter = TensorRTMMExporter(tmp_path / "engine", device="cpu")
    exporter.export(DEMO_NEMO, model_type="neva", dtype="float32", max_batch_size=4, max_input_len=512,
                    max_output_len=8, max_multimodal_len=256, export_onnx=True)
    onnx_path = tmp_path / "engine" / "visual_engine" / "encoder.onnx"
    assert onnx_path.is_file()

    session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    encoder = exporter.engine.perception.encoder
    for batch in (1, 3):
        pixels = torch.randn(batch, 3, encoder.image_size, encoder.image_size, generator=torch.Generator().manual_seed(batch))
        expected = encoder(pixels).numpy()
        (got,) = session.run(["output"], {"input": pixels.numpy()})
        assert got.shape == expected.shape == (batch, encoder.tokens_per_image, encoder.llm_hidden_size)
        assert np.abs(got - expected).max() / np.abs(expected).max() < 1e-4
