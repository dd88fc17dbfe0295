"""Empty and zero-size media get a short error naming the input, from every loader and through a real pipeline."""

from __future__ import annotations

import numpy as np
import pytest

from exporter.media_safety import MediaError, MediaPolicy, load_checked, read_media_bytes
from exporter.perception.audio_io import AudioLoadError, load_audio
from exporter.perception.image_preprocess import ImageLoadError, ImagePreprocessor
from exporter.perception.video import VideoLoadError, read_frames
from support.media_host import MediaHost
from support.vlm import tiny_neva

PREPROCESSOR = ImagePreprocessor(resize={"shortest_edge": 8}, crop_size={"height": 8, "width": 8},
                                 image_mean=(0.5,) * 3, image_std=(0.5,) * 3)


def _short(error: pytest.ExceptionInfo, *words: str) -> None:
    message = str(error.value)
    assert "\n" not in message and len(message) < 200 and "memoryview" not in message, message
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("image, words", [
    (np.zeros((0, 0, 3), np.uint8), ("empty", "[0, 0, 3]")),
    (np.zeros((4, 0, 3), np.uint8), ("empty", "[4, 0, 3]")),
    (np.zeros((1, 0, 0, 3), np.uint8), ("empty",)),  # NeMo's [T, H, W, 3] layout with no pixels
    (b"", ("empty", "0 bytes")),
    (b"not an image", ("not an image file",)),
])
def test_images(image, words):
    with pytest.raises(ImageLoadError) as refused:
        PREPROCESSOR(image)
    _short(refused, *words)


@pytest.mark.parametrize("video, words", [
    (np.zeros((1, 0, 0, 3), np.uint8), ("empty", "frame")),
    (np.zeros((0, 4, 4, 3), np.uint8), ("empty", "frame")),
    (b"", ("empty", "0 bytes")),
])
def test_videos(video, words):
    with pytest.raises(VideoLoadError) as refused:
        read_frames(video, lambda count: list(range(count)))
    _short(refused, *words)


@pytest.mark.parametrize("audio", [np.zeros(0, np.float32), np.zeros((1, 0), np.float32), b""])
def test_audio(audio):
    with pytest.raises(AudioLoadError) as refused:
        load_audio(audio, 16000)
    _short(refused, "empty")


@pytest.mark.parametrize("source", [b"", "data:image/png;base64,"])
def test_fetched_media(source, tmp_path):
    with pytest.raises(MediaError) as refused:
        read_media_bytes(source, MediaPolicy())
    _short(refused, "empty (0 bytes)")
    (tmp_path / "empty.png").write_bytes(b"")
    with pytest.raises(MediaError) as refused:
        load_checked(str(tmp_path / "empty.png"), "image", MediaPolicy(local_dir=str(tmp_path)))
    _short(refused, "empty (0 bytes)", "empty.png")
    with MediaHost({"empty.png": b""}) as host, pytest.raises(MediaError) as refused:
        read_media_bytes(host.url + "/empty.png", MediaPolicy(allow_private_networks=True))
    _short(refused, "empty (0 bytes)", "/empty.png")


def test_zero_size_media_through_the_pipeline(tmp_path):
    """`forward` with NeMo's uint8 media of zero size: the request is refused with the loader's short error, and
    the next request is answered."""
    exporter = tiny_neva(tmp_path, max_output_len=2)
    for empty in (np.zeros((0, 0, 3), np.uint8), np.zeros((1, 0, 0, 3), np.uint8)[0]):
        with pytest.raises(ImageLoadError) as refused:
            exporter.forward("What is this?", empty, max_output_len=2)
        _short(refused, "empty")
    assert len(exporter.forward("What is this?", np.zeros((8, 8, 3), np.uint8), max_output_len=2)[0]) == 1
