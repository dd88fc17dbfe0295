"""ONNX export of the VisionEncoder, run with ONNX Runtime against the PyTorch module."""

import numpy as np
import pytest
import torch

from exporter.perception import build_vision_encoder, export_vision_onnx
from support.vision_towers import model_config, pixels_for, projector_state, tiny_tower, tower_state

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")


@pytest.mark.parametrize(
    "tower_type, adapter, image_size", [("clip", "mlp2x_gelu", 32), ("siglip", "mlp_downsample", 40)]
)
def test_onnx_matches_pytorch(tmp_path, tower_type, adapter, image_size):
    cfg = model_config(
        adapter,
        model_type=tower_type,
        crop_size=[image_size, image_size],
        vision_select_feature="cls_patch" if tower_type == "siglip" else "patch",
    )
    encoder = build_vision_encoder(
        cfg, {**tower_state(tiny_tower(tower_type, image_size)), **projector_state(adapter)}
    )
    path = export_vision_onnx(encoder, tmp_path / "visual_encoder.onnx")
    model = onnx.load(str(path))
    assert [i.name for i in model.graph.input] == ["input"] and [o.name for o in model.graph.output] == [
        "output"
    ]
    assert model.opset_import[0].version == 17

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in (1, 3):
        pixels = pixels_for(image_size, batch=batch, seed=batch)
        (got,) = session.run(["output"], {"input": pixels.numpy()})
        with torch.no_grad():
            expected = encoder(pixels).numpy()
        assert got.shape == (batch, encoder.tokens_per_image, encoder.llm_hidden_size)
        assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 1e-4
