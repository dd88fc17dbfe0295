"""Client-side media loading and request building (no Triton server needed)."""

from __future__ import annotations

import asyncio
import base64
import io
import time

import numpy as np
import pytest
from PIL import Image

from query import MediaError, NemoQueryMultimodal
from query import media as media_io
from query.query_multimodal import _request_groups, _stack
from query.triton_client import server_error_summary
from support.media_host import MediaHost
from wire import AUDIO, IMAGE, VIDEO


def _pixels(seed: int = 0, size=(6, 5)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(size[0], size[1], 3), dtype=np.uint8)


def _png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def png_file(tmp_path):
    pixels = _pixels()
    path = tmp_path / "image.png"
    path.write_bytes(_png(pixels))
    return path, pixels


@pytest.fixture(scope="module")
def http_url():
    with MediaHost({"image.png": _png(_pixels(1))}, trickle_s=0.2) as host:
        yield host.url


def test_path_is_sent_as_its_file_bytes(png_file):
    path, pixels = png_file
    assert media_io.image_bytes(str(path)) == path.read_bytes()
    assert media_io.image_bytes(path) == path.read_bytes()
    np.testing.assert_array_equal(media_io.image_pixels(str(path)), pixels)
    np.testing.assert_array_equal(media_io.image_pixels(f"file://{path}"), pixels)


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(MediaError, match="does not exist"):
        media_io.image_bytes(str(tmp_path / "nope.jpg"))


def test_data_url(png_file):
    path, pixels = png_file
    url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    np.testing.assert_array_equal(media_io.image_pixels(url), pixels)
    with pytest.raises(MediaError, match="not valid base64"):
        media_io.read_media_bytes("data:image/png;base64,@@@")
    with pytest.raises(MediaError, match="over the cap"):
        media_io.read_media_bytes(url, max_bytes=10)


def test_pil_image_and_array_are_encoded_losslessly():
    pixels = _pixels(2)
    for source in (Image.fromarray(pixels), pixels):
        encoded = media_io.image_bytes(source)
        np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(encoded))), pixels)
    np.testing.assert_array_equal(media_io.image_pixels(Image.fromarray(pixels).convert("RGBA")), pixels)


def test_bad_arrays_and_bytes_are_refused():
    with pytest.raises(MediaError, match="uint8 RGB array"):
        media_io.image_bytes(np.zeros((4, 4, 3), dtype=np.float32))
    with pytest.raises(MediaError, match="uint8 RGB array"):
        media_io.image_bytes(np.zeros((4, 4), dtype=np.uint8))
    with pytest.raises(MediaError, match="not a decodable image"):
        media_io.image_bytes(b"definitely not an image")


def test_url(http_url):
    np.testing.assert_array_equal(media_io.image_pixels(f"{http_url}/image.png"), _pixels(1))


def test_url_byte_cap(http_url):
    assert len(media_io.read_media_bytes(f"{http_url}/big", max_bytes=5000)) == 5000
    with pytest.raises(MediaError, match="over the cap"):
        media_io.read_media_bytes(f"{http_url}/big", max_bytes=1000)
    with pytest.raises(MediaError, match="over the cap"):
        media_io.read_media_bytes(f"{http_url}/big_no_length", max_bytes=1000)


def test_url_timeout_and_http_error(http_url):
    started = time.monotonic()
    with pytest.raises(MediaError, match="longer than 0.3 s"):
        media_io.read_media_bytes(f"{http_url}/trickle-headers", timeout_s=0.3)
    assert time.monotonic() - started < 1.4
    with pytest.raises(MediaError, match="HTTP 404"):
        media_io.read_media_bytes(f"{http_url}/missing")


def test_url_from_inside_an_event_loop(http_url):
    """The synchronous fetch also works where an event loop already runs (a notebook, an async caller)."""
    async def caller() -> np.ndarray:
        return media_io.image_pixels(f"{http_url}/image.png")

    np.testing.assert_array_equal(asyncio.run(caller()), _pixels(1))


def test_video_frames_decoded(tmp_path):
    import av

    path = tmp_path / "clip.mp4"
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for value in (0, 120, 250):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), value, np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    frames = media_io.video_frames(str(path))
    assert frames.shape == (3, 32, 32, 3) and frames.dtype == np.uint8
    np.testing.assert_allclose(frames.reshape(3, -1).mean(axis=1), [0, 120, 250], atol=6)


def test_audio_signal_decoded(tmp_path):
    import soundfile

    samples = np.sin(np.linspace(0, 20, 1600)).astype(np.float32) * 0.5
    path = tmp_path / "speech.wav"
    soundfile.write(str(path), np.stack([samples, samples], axis=1), 16000, subtype="FLOAT")
    np.testing.assert_allclose(media_io.audio_signal(str(path)), samples, atol=1e-6)
    with pytest.raises(MediaError, match="not a decodable audio"):
        media_io.audio_signal(b"RIFF nonsense")


def test_media_goes_on_the_wire_encoded_by_default(png_file):
    path, pixels = png_file
    encoded = NemoQueryMultimodal("localhost", "m", "neva")._media_inputs(str(path), IMAGE)
    assert list(encoded) == ["input_media_bytes"] and encoded["input_media_bytes"][0] == path.read_bytes()
    raw = NemoQueryMultimodal("localhost", "m", "vila", raw_pixels=True)._media_inputs(str(path), IMAGE)
    np.testing.assert_array_equal(raw["input_media"], pixels[np.newaxis])
    with pytest.raises(MediaError, match="not a decodable image"):
        media_io.media_tensors(IMAGE, b"RIFF....")  # an image file is checked before it is sent


def test_video_and_audio_wire_forms(tmp_path):
    video = media_io.media_tensors(VIDEO, np.zeros((300, 4, 4, 3), np.uint8))
    assert video["input_media"].shape == (300, 4, 4, 3)  # every frame: the server samples them as trained
    (tmp_path / "a.wav").write_bytes(b"RIFF....")
    audio = media_io.media_tensors(AUDIO, str(tmp_path / "a.wav"))
    assert audio["input_media_bytes"][0] == b"RIFF...."  # video and audio files go as they are
    raw = media_io.media_tensors(AUDIO, np.ones(10, np.float32))
    assert raw["input_signal"].shape == (10,) and raw["input_signal_length"].tolist() == [10]


def test_rows_are_grouped_into_requests():
    rows = [
        {"input_text": np.array([b"a"]), "input_media": np.zeros((1, 2, 2, 3), np.uint8)},
        {"input_text": np.array([b"b"]), "input_media": np.zeros((1, 3, 3, 3), np.uint8)},
        {"input_text": np.array([b"c"]), "input_media": np.zeros((1, 2, 2, 3), np.uint8)},
        {"input_text": np.array([b"d"]), "input_signal": np.ones(3, np.float32)},
        {"input_text": np.array([b"e"]), "input_signal": np.ones(5, np.float32)},
    ]
    assert _request_groups(rows, max_rows=8) == [[0, 2], [1], [3, 4]]
    assert _request_groups(rows[:1] * 5, max_rows=2) == [[0, 1], [2, 3], [4]]
    stacked = _stack(rows[3:])
    assert stacked["input_signal"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]


def test_server_error_summary_keeps_the_model_error():
    message = (
        "Failed to process the request(s) for model 'm_0_3', message: TritonModelException: "
        'Model execute error: Traceback (most recent call last):\n  File "model.py", line 492, in execute\n'
        "c_python_backend_utils.TritonModelException: Traceback (most recent call last):\n"
        '  File "stub.py", line 18, in fn\nValueError: temperature must be > 0\n'
        "\n\n\nAt:\n  model.py(501): execute\n"
    )
    assert server_error_summary(message) == "ValueError: temperature must be > 0"
    assert server_error_summary("[400] unexpected input") == "[400] unexpected input"


def test_server_side_rows_accept_base64_data_urls():
    """JSON clients (curl) send encoded media as base64 data: URLs; the server decodes them to the file bytes."""
    import base64

    from wire import split_request

    png = b"\x89PNG\r\n\x1a\n payload"
    request = {
        "input_text": np.array([[b"q"]]),
        "input_media_bytes": np.array([[b"data:image/png;base64," + base64.b64encode(png)]], dtype=object),
    }
    assert split_request(request)[0].media_bytes == (png,)
    request["input_media_bytes"] = np.array([[b"data:image/png,notbase64"]], dtype=object)
    with pytest.raises(ValueError, match="without ;base64"):
        split_request(request)
