"""VILA: SigLIP tower, mlp_downsample, the resize aspect mode, several images per prompt, mixed batches."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from exporter import TensorRTMMExporter
from support.media import random_image
from support.neva_reference import reference_tokens
from support.tokenizer_files import tokenizer_file
from support.vlm import CHAT, build_vlm

STEPS = 6
TWO_IMAGES = "<image>\n<image>\ndescribe the image"
VERBATIM_V1 = (CHAT + " USER: {q} ASSISTANT:", True)  # the user text already holds its placeholders


@pytest.fixture(scope="module")
def vila(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vila")
    vlm = build_vlm(folder / "ckpt", tokenizer_file(folder), tower_type="siglip", projector_type="mlp_downsample",
                    layout="torch_dist", aspect="resize")
    exporter = TensorRTMMExporter(folder / "engine", device="cpu")
    exporter.export(vlm.nemo, model_type="vila", dtype="float32", max_batch_size=4, max_input_len=256,
                    max_output_len=8, max_multimodal_len=4 * 4)
    return vlm, exporter


def _text(exporter, ids) -> str:
    return exporter.engine.tokenizer.decode(ids).strip()


def test_several_images_in_one_prompt(vila):
    vlm, exporter = vila
    images = [random_image(11, size=(40, 24)), random_image(12, size=(20, 50))]
    expected = reference_tokens(vlm, TWO_IMAGES, images, STEPS, prompt=VERBATIM_V1)
    assert exporter.forward(TWO_IMAGES, images, max_output_len=STEPS) == [[_text(exporter, expected)]]
    other = reference_tokens(vlm, TWO_IMAGES, [images[0], Image.new("RGB", (30, 30), "white")], STEPS,
                             prompt=VERBATIM_V1)
    assert expected != other  # the second image matters, so the check above can fail


def test_batch_mixing_image_counts(vila):
    vlm, exporter = vila
    one, two = random_image(13), [random_image(14), random_image(15)]
    answers = exporter.forward(["describe the image", TWO_IMAGES], [one, two], max_output_len=STEPS)
    assert answers[0] == [_text(exporter, reference_tokens(vlm, "describe the image", one, STEPS))]
    assert answers[1] == [_text(exporter, reference_tokens(vlm, TWO_IMAGES, two, STEPS, prompt=VERBATIM_V1))]


def test_placeholder_count_must_match_the_images(vila):
    _, exporter = vila
    with pytest.raises(ValueError, match="2 <image> placeholder"):
        exporter.forward(TWO_IMAGES, [random_image(16)], max_output_len=2)


def test_client_sends_several_images_encoded(vila, tmp_path: Path):
    """The Triton rows carry several encoded images for one prompt (input_media_bytes), as the client sends them."""
    import numpy as np

    from query.media import image_bytes
    from wire import split_request

    vlm, exporter = vila
    images = [random_image(17), random_image(18)]
    request = {"input_text": np.array([[TWO_IMAGES.encode()]]),
               "input_media_bytes": np.array([[image_bytes(image) for image in images]], dtype=object),
               "max_output_len": np.array([[STEPS]])}
    assert len(split_request(request)[0].media_bytes) == 2
    answer = exporter.triton_infer_fn(**request)
    expected = reference_tokens(vlm, TWO_IMAGES, images, STEPS, prompt=VERBATIM_V1)
    assert answer["outputs"].tolist() == [[_text(exporter, expected).encode()]]
