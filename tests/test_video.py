"""Video decoding (PyAV), NeMo's frame-sampling rules and the safety caps, on videos generated here."""

import io

import numpy as np
import pytest
import soundfile
from PIL import Image

from exporter.perception import video
from exporter.perception.video import (
    VideoLimits,
    VideoLoadError,
    lita_num_sample_frames,
    padded_indices,
    read_frames,
    rounded_indices,
    video_neva_indices,
)
from support.media import encode_video, first_available, lossless_video, random_frames

LEVEL_STEP = 20  # frame i of a generated lossy video is flat grey i * LEVEL_STEP


CONTAINERS = {  # container format -> codecs to try, in order
    "mp4": ("libx264", "mpeg4"),
    "webm": ("libvpx", "libvpx-vp9"),
    "avi": ("mpeg4", "msmpeg4v2"),
}


def grey_frames(count: int, height: int = 24, width: int = 32) -> np.ndarray:
    return np.stack([np.full((height, width, 3), i * LEVEL_STEP, np.uint8) for i in range(count)])


def frame_numbers(frames: np.ndarray) -> list[int]:
    """Which generated grey frame each decoded frame is (lossy codecs move levels by a few units)."""
    return [round(float(frame.mean()) / LEVEL_STEP) for frame in frames]


def selected(source, select) -> np.ndarray:
    """`read_frames` expanded to one frame per selected index."""
    frame_set = read_frames(source, select)
    return frame_set.frames[list(frame_set.order)]


# --- sampling rules ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "length, num_frames, expected",
    [
        (20, 8, [0, 2, 5, 8, 10, 13, 16, 19]),  # truncation, not rounding (5.43 -> 5, 10.86 -> 10)
        (8, 8, [0, 1, 2, 3, 4, 5, 6, 7]),
        (5, 8, [0, 1, 2, 3, 4, 4, 4, 4]),  # short video: last frame repeated up to num_frames
        (1, 3, [0, 0, 0]),
        (4, -1, [0, 1, 2, 3]),
    ],
)
def test_video_neva_indices(length, num_frames, expected):
    assert video_neva_indices(length, num_frames) == expected


@pytest.mark.parametrize("splice, expected", [("first", [0]), ("middle", [5]), ("last", [10])])
def test_video_neva_single_frame(splice, expected):
    assert video_neva_indices(11, 8, splice) == expected


@pytest.mark.parametrize(
    "length, expected",
    [(100, 100), (256, 256), (257, 128), (300, 150), (513, 171), (1000, 250), (1025, 205)],
)
def test_lita_num_sample_frames(length, expected):
    # vid_len if vid_len <= 256 else round(vid_len / ceil(vid_len / 256)), worked out by hand (257 / 2 = 128.5
    # rounds to the even 128, as numpy did in training)
    assert lita_num_sample_frames(length, 256, 4, "im_vid_start_end") == expected
    assert lita_num_sample_frames(length, 256, 4, "v1") == 4


@pytest.mark.parametrize(
    "length, count, expected",
    [
        (10, 4, [0, 3, 6, 9]),
        (6, 4, [0, 2, 3, 5]),  # 1.67 -> 2, 3.33 -> 3
        (4, 3, [0, 2, 3]),  # 1.5 -> 2
        (3, 5, [0, 0, 1, 2, 2]),  # 0.5 -> 0 and 1.5 -> 2: numpy rounds halves to even, as training did
        (6, 3, [0, 2, 5]),  # 2.5 -> 2
    ],
)
def test_rounded_indices(length, count, expected):
    assert rounded_indices(length, count) == expected


# --- decoding ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("container", sorted(CONTAINERS))
@pytest.mark.parametrize("from_path", [False, True])
def test_decodes_generated_videos(tmp_path, container, from_path):
    data = encode_video(grey_frames(10), container, first_available(*CONTAINERS[container]))
    source = data
    if from_path:
        source = tmp_path / f"clip.{container}"
        source.write_bytes(data)
    everything = selected(source, lambda length: range(length))
    assert everything.shape == (10, 24, 32, 3) and everything.dtype == np.uint8
    assert frame_numbers(everything) == list(range(10))
    picked = read_frames(source, lambda length: [length - 1, 0, 3, 3])
    assert frame_numbers(picked.frames) == [9, 0, 3] and picked.order == (0, 1, 2, 2)  # a repeat is kept once


def test_selection_gets_the_exact_frames_in_order():
    frames = random_frames(5)
    got = selected(lossless_video(frames), lambda length: video_neva_indices(length, 8))
    np.testing.assert_array_equal(got, frames[[0, 1, 2, 3, 4, 4, 4, 4]])


def test_a_wrong_packet_count_is_corrected_by_the_decoded_count(monkeypatch):
    frames = random_frames(6)
    real_scan = video._scan
    monkeypatch.setattr(video, "_scan", lambda *args: real_scan(*args) + 3)  # as if the container said 9 frames
    got = selected(lossless_video(frames), lambda length: rounded_indices(length, 3))
    np.testing.assert_array_equal(got, frames[[0, 2, 5]])  # sampled from the 6 frames actually decoded


def test_frame_arrays_and_images_are_accepted():
    frames = random_frames(7)
    np.testing.assert_array_equal(selected(frames, lambda n: rounded_indices(n, 3)), frames[[0, 3, 6]])
    padded = read_frames(frames[:2], lambda n: padded_indices(n, 5))
    np.testing.assert_array_equal(padded.frames, frames[:2])  # the repeated last frame is held once
    assert padded.order == (0, 1, 1, 1, 1)
    image = frames[0]
    np.testing.assert_array_equal(selected(image, lambda n: [0] * n), image[np.newaxis])
    np.testing.assert_array_equal(selected(Image.fromarray(image), lambda n: [0, 0]), np.stack([image] * 2))
    png = io.BytesIO()
    Image.fromarray(image).save(png, format="PNG")
    np.testing.assert_array_equal(selected(png.getvalue(), lambda n: range(n)), image[np.newaxis])


# --- caps ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ten_frame_mp4() -> bytes:  # 10 frames at 5 fps: 2 s of 32x24
    return encode_video(grey_frames(10), "mp4", first_available(*CONTAINERS["mp4"]))


@pytest.mark.parametrize(
    "limits, option",
    [
        (VideoLimits(max_frames=5), "max_frames"),
        (VideoLimits(max_duration_s=1.5), "max_duration_s"),
        (VideoLimits(max_frame_pixels=32 * 24 - 1), "max_frame_pixels"),
    ],
)
def test_caps_on_decoded_videos(ten_frame_mp4, limits, option):
    with pytest.raises(VideoLoadError, match=option):
        read_frames(ten_frame_mp4, lambda n: [0], limits)


def test_caps_on_arrays_and_images():
    with pytest.raises(VideoLoadError, match="10 frames, over the limit of 5 .*max_frames"):
        read_frames(random_frames(10), lambda n: [0], VideoLimits(max_frames=5))
    with pytest.raises(VideoLoadError, match="32x24 = 768 pixels.*max_frame_pixels"):
        read_frames(random_frames(2), lambda n: [0], VideoLimits(max_frame_pixels=700))
    with pytest.raises(VideoLoadError, match="max_frame_pixels"):
        read_frames(Image.new("RGB", (32, 24)), lambda n: [0], VideoLimits(max_frame_pixels=700))


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="max_frames must be positive"):
        VideoLimits(max_frames=0)


# --- unreadable input ----------------------------------------------------------------------------------------------


def wav_bytes() -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(1600, np.float32), 16000, format="WAV")
    return buffer.getvalue()


@pytest.mark.parametrize(
    "make_source, message",
    [
        (lambda tmp, mp4: b"this is not a video" * 20, "not a readable video file"),
        (lambda tmp, mp4: mp4[: len(mp4) // 2], "not a readable video file"),  # index (moov) cut off
        (lambda tmp, mp4: tmp / "missing.mp4", "missing.mp4' does not exist"),
        (lambda tmp, mp4: wav_bytes(), "has no video stream"),
        (lambda tmp, mp4: np.zeros((2, 4, 4, 3), np.float32), "must be uint8"),
        (lambda tmp, mp4: np.zeros((2, 4, 4), np.uint8), r"\[T, H, W, 3\]"),
        (lambda tmp, mp4: 42, "unsupported video input int"),
    ],
)
def test_unreadable_input_is_named(tmp_path, ten_frame_mp4, make_source, message):
    with pytest.raises(VideoLoadError, match=message):
        read_frames(make_source(tmp_path, ten_frame_mp4), lambda n: [0])


def test_selection_outside_the_video_is_an_error():
    with pytest.raises(VideoLoadError, match="outside the 3 frames"):
        read_frames(random_frames(3), lambda n: [n])
