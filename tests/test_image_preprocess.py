"""ImagePreprocessor against transformers' CLIP / SigLIP image processors (those NeMo trained with)."""

import json
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from exporter.perception import ImageLoadError, ImagePreprocessor
from exporter.perception.image_preprocess import CLIP_MEAN, SIGLIP_MEAN

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from transformers import CLIPImageProcessor, SiglipImageProcessor

SIZE = 32


def random_image(width, height, seed=0):
    return np.random.RandomState(seed).randint(0, 256, size=(height, width, 3), dtype=np.uint8)


def hf_processor(tower_type, size=SIZE, crop=SIZE):
    if tower_type == "clip":
        return CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": crop, "width": crop})
    return SiglipImageProcessor(size={"height": size, "width": size})


def hf_pixels(processor, image: np.ndarray) -> torch.Tensor:
    return torch.as_tensor(
        np.asarray(processor(images=Image.fromarray(image), return_tensors="np")["pixel_values"])
    )


def pad_to_square(image: np.ndarray, mean) -> np.ndarray:
    """Centre `image` on a square canvas of colour int(255 * mean) (written independently of the module)."""
    height, width, _ = image.shape
    side = max(height, width)
    canvas = np.empty((side, side, 3), dtype=np.uint8)
    canvas[:] = [int(255 * m) for m in mean]
    top, left = (side - height) // 2, (side - width) // 2
    canvas[top : top + height, left : left + width] = image
    return canvas


@pytest.mark.parametrize("tower_type", ["clip", "siglip"])
@pytest.mark.parametrize("width, height", [(57, 31), (30, 61), (40, 40), (12, 9)])
@pytest.mark.parametrize("aspect", ["pad", "resize", "square", None])
def test_matches_hf_processor(tower_type, width, height, aspect):
    image = random_image(width, height)
    preprocessor = ImagePreprocessor.for_tower(tower_type, SIZE, aspect_ratio=aspect)
    processor = hf_processor(tower_type)
    mean = CLIP_MEAN if tower_type == "clip" else SIGLIP_MEAN
    if aspect == "pad":
        reference_input = pad_to_square(image, mean)
    elif aspect == "resize":
        reference_input = np.asarray(Image.fromarray(image).resize((SIZE, SIZE), Image.Resampling.BICUBIC))
    else:
        reference_input = image
    got = preprocessor(image)
    assert got.shape == (1, 3, SIZE, SIZE) and got.dtype == torch.float32
    assert torch.equal(got, hf_pixels(processor, reference_input))


def test_processor_config_from_tower_folder_is_followed():
    config = {
        "size": {"shortest_edge": 40},
        "crop_size": {"height": SIZE, "width": SIZE},
        "image_mean": [0.1, 0.2, 0.3],
        "image_std": [0.5, 0.6, 0.7],
    }
    preprocessor = ImagePreprocessor.for_tower("clip", SIZE, processor_config=config)
    processor = CLIPImageProcessor(**config)
    image = random_image(70, 45)
    assert torch.equal(preprocessor(image), hf_pixels(processor, image))


def test_processor_crop_must_match_tower():
    with pytest.raises(ValueError, match="preprocessor_config"):
        ImagePreprocessor.for_tower("clip", SIZE, processor_config={"size": 48, "crop_size": 48})


def test_unknown_aspect_ratio_is_rejected():
    with pytest.raises(ValueError, match="image_aspect_ratio"):
        ImagePreprocessor.for_tower("clip", SIZE, aspect_ratio="anyres")


def test_input_kinds_agree(tmp_path):
    rgb = random_image(45, 38)
    path = tmp_path / "img.png"
    Image.fromarray(rgb).save(path)
    preprocessor = ImagePreprocessor.for_tower("clip", SIZE, aspect_ratio="pad")
    expected = preprocessor(rgb)
    for image in (Image.fromarray(rgb), str(path), path, path.read_bytes()):
        assert torch.equal(preprocessor(image), expected)


def test_non_rgb_inputs_convert_like_pil(tmp_path):
    preprocessor = ImagePreprocessor.for_tower("siglip", SIZE)
    gray = random_image(40, 30)[..., 0]
    rgba = np.concatenate([random_image(40, 30), random_image(40, 30, seed=1)[..., :1]], axis=-1)
    palette = Image.fromarray(random_image(40, 30)).convert("P")
    for image, as_pil in ((gray, Image.fromarray(gray)), (rgba, Image.fromarray(rgba)), (palette, palette)):
        expected = preprocessor(np.asarray(as_pil.convert("RGB")))
        assert torch.equal(preprocessor(image), expected)


def test_frames_and_lists_batch():
    preprocessor = ImagePreprocessor.for_tower("siglip", SIZE)
    frames = np.stack([random_image(40, 30, seed=s) for s in range(3)])
    batch = preprocessor(frames)
    assert batch.shape == (3, 3, SIZE, SIZE)
    assert torch.equal(batch, preprocessor(list(frames)))
    assert torch.equal(batch[1], preprocessor(frames[1])[0])


def test_pixel_cap_names_the_option(tmp_path):
    preprocessor = ImagePreprocessor.for_tower("clip", SIZE, max_image_pixels=1000)
    with pytest.raises(ImageLoadError, match="max_image_pixels"):
        preprocessor(random_image(50, 30))
    path = tmp_path / "big.png"
    Image.fromarray(random_image(50, 30)).save(path)
    with pytest.raises(ImageLoadError, match="max_image_pixels"):
        preprocessor(path)


def test_unreadable_files_are_named(tmp_path):
    preprocessor = ImagePreprocessor.for_tower("clip", SIZE)
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"not an image")
    with pytest.raises(ImageLoadError, match="broken.jpg"):
        preprocessor(broken)
    with pytest.raises(ImageLoadError, match="missing.png"):
        preprocessor(tmp_path / "missing.png")
    truncated = tmp_path / "truncated.png"
    Image.fromarray(random_image(40, 40)).save(truncated)
    truncated.write_bytes(truncated.read_bytes()[:200])
    with pytest.raises(ImageLoadError, match="truncated.png"):
        preprocessor(truncated)


def test_bad_arrays_are_rejected():
    preprocessor = ImagePreprocessor.for_tower("clip", SIZE)
    with pytest.raises(ImageLoadError, match="uint8"):
        preprocessor(np.zeros((8, 8, 3), dtype=np.float32))
    with pytest.raises(ImageLoadError, match="shape"):
        preprocessor(np.zeros((8, 8, 2), dtype=np.uint8))


def test_spec_round_trip():
    preprocessor = ImagePreprocessor.for_tower("clip", SIZE, aspect_ratio="resize", crop_size=[SIZE, SIZE])
    rebuilt = ImagePreprocessor.from_spec(json.loads(json.dumps(preprocessor.to_spec())))
    assert rebuilt.to_spec() == preprocessor.to_spec()
    image = random_image(50, 20)
    assert torch.equal(rebuilt(image), preprocessor(image))
    assert ImagePreprocessor.from_spec(preprocessor.to_spec(), max_image_pixels=10).max_image_pixels == 10
