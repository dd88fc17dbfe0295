"""Light checks of the demo builder (tools/make_demo_checkpoint.py) and of the demo checkpoint it ships.

The accuracy of the exported demo model is tested elsewhere; here: the generated images show what their labels
say, answers follow the question, training sequences match the v1 prompt, and demo/ holds a real .nemo.
"""

from __future__ import annotations

import tarfile
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from exporter.models.templates import IMAGE_PLACEHOLDER, get_template
from support.demo import DEMO_NEMO, load_demo_builder

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_NAMES = ("red_circle", "blue_triangle", "green_square", "yellow_circle")
# Fill ratio of a shape inside its bounding box: square 1, circle pi/4, triangle 1/2.
FILL_RATIO = {"square": (0.93, 1.01), "circle": (0.70, 0.86), "triangle": (0.42, 0.62)}


builder = load_demo_builder()


def _shape_mask(image: Image.Image) -> np.ndarray:
    """Pixels that are clearly not the light background (some channel far below 215)."""
    pixels = np.asarray(image, dtype=np.int16)
    return pixels.min(axis=2) < 150


@pytest.mark.parametrize("shape", builder.SHAPES)
@pytest.mark.parametrize("color", list(builder.COLORS))
def test_image_shows_its_label(shape, color):
    rng = np.random.default_rng(123)
    for _ in range(5):
        image = builder.draw_shape(rng, shape, color)
        assert image.mode == "RGB" and image.size == (64, 64)
        pixels = np.asarray(image, dtype=np.float64)
        mask = _shape_mask(image)
        rows, cols = np.nonzero(mask)
        height, width = np.ptp(rows) + 1, np.ptp(cols) + 1
        assert 16 <= max(height, width) <= 40, "shape size outside the 16-40 px range"
        fill = mask.sum() / (height * width)
        low, high = FILL_RATIO[shape]
        assert low <= fill <= high, f"{shape} fills {fill:.2f} of its box"
        mean = pixels[mask].mean(axis=0)
        assert np.abs(mean - builder.COLORS[color]).max() < 40, f"{color} drawn as {mean}"
        assert np.median(pixels[~mask]) >= 205, "background is not light"


def test_draw_shape_rejects_unknown_labels():
    with pytest.raises(ValueError, match="unknown shape"):
        builder.draw_shape(np.random.default_rng(0), "hexagon", "red")


def test_answers_follow_the_question():
    shape_q, color_q = list(builder.QUESTIONS)
    assert builder.answer_for(shape_q, "triangle", "blue") == "triangle"
    assert builder.answer_for(color_q, "triangle", "blue") == "blue"
    with pytest.raises(ValueError, match="unknown question"):
        builder.answer_for("How big is it?", "triangle", "blue")


def test_samples_are_deterministic_and_cover_all_labels():
    first = builder.sample_examples(np.random.default_rng(7), 60)
    second = builder.sample_examples(np.random.default_rng(7), 60)
    assert all(np.array_equal(np.asarray(a[0]), np.asarray(b[0])) for a, b in zip(first, second, strict=True))
    assert {s for _, s, _ in first} == set(builder.SHAPES)
    assert {c for _, _, c in first} == set(builder.COLORS)


def test_training_sequence_matches_v1_prompt(tmp_path):
    sp = builder.train_tokenizer(tmp_path / "tokenizer.model")
    assert (sp.bos_id(), sp.eos_id(), sp.unk_id(), sp.pad_id()) == (1, 2, 0, -1)
    examples = builder.sample_examples(np.random.default_rng(0), 2)
    questions = list(builder.QUESTIONS)
    before, after, targets = builder.training_batch(sp, examples, questions)
    for row, ((_, shape, color), question) in enumerate(zip(examples, questions, strict=True)):
        piece0, piece1 = get_template("v1").render(question).split(IMAGE_PLACEHOLDER)
        assert before == [1] + sp.encode(piece0)
        answer = sp.encode(builder.answer_for(question, shape, color))
        expected = sp.encode(piece1) + answer + [2]
        assert after[row, : len(expected)].tolist() == expected
        scored = targets[row][targets[row] != -100].tolist()
        assert scored == answer + [2]
        assert sp.decode(answer) == builder.answer_for(question, shape, color)


def test_shipped_checkpoint_is_a_nemo_tar():
    assert DEMO_NEMO.is_file(), "run python -m tools.make_demo_checkpoint to build demo/neva_demo.nemo"
    with tarfile.open(DEMO_NEMO) as tar:
        names = {name.removeprefix("./") for name in tar.getnames()}
        config = yaml.safe_load(tar.extractfile("./model_config.yaml"))
    assert {"model_weights/metadata.json", "model_weights/.metadata", "model_weights/common.pt"} <= names
    tokenizer = config["tokenizer"]["model"]
    assert tokenizer.startswith("nemo:") and tokenizer.removeprefix("nemo:") in names
    assert config["mm_cfg"]["mm_mlp_adapter_type"] == "mlp2x_gelu"
    assert config["mm_cfg"]["vision_encoder"]["crop_size"] == [64, 64]
    assert config["data"]["conv_template"] == "v1"


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_shipped_sample_images(name):
    image = Image.open(ROOT / "demo" / "images" / f"{name}.png")
    assert image.mode == "RGB" and image.size == (64, 64)
    color = name.split("_")[0]
    mean = np.asarray(image, dtype=np.float64)[_shape_mask(image)].mean(axis=0)
    assert np.abs(mean - builder.COLORS[color]).max() < 40
