"""The exported demo model answers both demo questions on freshly drawn images (issue: Neva end to end)."""

from __future__ import annotations

import numpy as np
import pytest

from exporter import TensorRTMMExporter
from support.demo import FRESH_IMAGES, FRESH_SEED, load_demo_builder

BATCH = 8


@pytest.mark.parametrize("question", ["What shape is this?", "What color is the shape?"])
def test_demo_answers_fresh_images(demo_exporter: TensorRTMMExporter, question: str) -> None:
    builder = load_demo_builder()
    examples = builder.sample_examples(np.random.default_rng(FRESH_SEED), FRESH_IMAGES)
    correct = 0
    for start in range(0, FRESH_IMAGES, BATCH):
        chunk = examples[start:start + BATCH]
        answers = demo_exporter.forward([question] * len(chunk), [image for image, _, _ in chunk], max_output_len=4)
        correct += sum(answer[0] == builder.answer_for(question, shape, color)
                       for answer, (_, shape, color) in zip(answers, chunk))
    assert correct / FRESH_IMAGES >= 0.95, f"{question!r}: {correct}/{FRESH_IMAGES} correct"
