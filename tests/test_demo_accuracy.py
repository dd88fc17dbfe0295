"""The exported demo model answers both demo questions on freshly drawn images (issue: Neva end to end)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import load_demo_builder
from exporter import TensorRTMMExporter

DEMO_NEMO = Path(__file__).resolve().parents[1] / "demo" / "neva_demo.nemo"
FRESH_SEED = 20261122  # not the training seed
IMAGES = 200
BATCH = 8


@pytest.fixture(scope="module")
def demo_exporter(tmp_path_factory) -> TensorRTMMExporter:
    exporter = TensorRTMMExporter(tmp_path_factory.mktemp("demo_engine"), device="cpu")
    exporter.export(DEMO_NEMO, model_type="neva", dtype="float32", max_batch_size=BATCH, max_input_len=512,
                    max_output_len=8, max_multimodal_len=BATCH * 64)
    return exporter


@pytest.mark.parametrize("question", ["What shape is this?", "What color is the shape?"])
def test_demo_answers_fresh_images(demo_exporter: TensorRTMMExporter, question: str) -> None:
    builder = load_demo_builder()
    examples = builder.sample_examples(np.random.default_rng(FRESH_SEED), IMAGES)
    correct = 0
    for start in range(0, IMAGES, BATCH):
        chunk = examples[start:start + BATCH]
        answers = demo_exporter.forward([question] * len(chunk), [image for image, _, _ in chunk], max_output_len=4)
        correct += sum(answer[0] == builder.answer_for(question, shape, color)
                       for answer, (_, shape, color) in zip(answers, chunk))
    assert correct / IMAGES >= 0.95, f"{question!r}: {correct}/{IMAGES} correct"
