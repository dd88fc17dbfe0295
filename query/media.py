"""Client-side media loading: a path, an http(s) URL, a base64 `data:` URL, bytes, a PIL image or an array, put
on the wire as its media kind says (`wire.media`).

Fetching is `exporter.media_safety`'s with a client policy (any local file, any host, a total time limit and a
byte cap); every failure is a `MediaError` naming the source and what to change.
"""

from __future__ import annotations

import io
import os

import numpy as np
from PIL import Image, UnidentifiedImageError

from exporter import media_safety
from exporter.media_safety import MediaError
from exporter.media_safety import describe_source as _describe
from wire.media import AUDIO, IMAGE, VIDEO, MediaKind

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MAX_BYTES = 100 * 1024 * 1024

MediaSource = str | os.PathLike | bytes | Image.Image | np.ndarray

__all__ = ["MediaError", "audio_signal", "file_bytes", "image_bytes", "image_pixels", "load_image", "media_tensors",
           "read_media_bytes", "video_frames"]


def read_media_bytes(
    source: str | os.PathLike | bytes,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> bytes:
    """The bytes of a media file given as bytes, a path, a `file://`, `http(s)://` or base64 `data:` URL."""
    return media_safety.read_media_bytes(source, media_safety.MediaPolicy.client(timeout_s, max_bytes))


def _check_pixels(array: np.ndarray, what: str, ndim: int) -> np.ndarray:
    shape = "[H, W, 3]" if ndim == 3 else "[frames, H, W, 3]"
    if array.dtype != np.uint8 or array.ndim != ndim or array.shape[-1] != 3 or 0 in array.shape:
        raise MediaError(f"{what} must be a uint8 RGB array {shape}, got {array.dtype} {list(array.shape)}")
    return array


def load_image(source: MediaSource, **read_options) -> Image.Image:
    """An RGB PIL image from any media source (`read_options`: timeout_s, max_bytes)."""
    if isinstance(source, Image.Image):
        return source.convert("RGB")
    if isinstance(source, np.ndarray):
        return Image.fromarray(_check_pixels(source, "an image array", 3))
    data = read_media_bytes(source, **read_options)
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError) as error:
        raise MediaError(f"media {_describe(source)} is not a decodable image ({error})") from None
    return image.convert("RGB")


def image_pixels(source: MediaSource, **read_options) -> np.ndarray:
    """The image as a uint8 `[H, W, 3]` array."""
    return np.asarray(load_image(source, **read_options))


def image_bytes(source: MediaSource, **read_options) -> bytes:
    """The image encoded for the wire: files as they are (once checked to decode), pixels as PNG."""
    if isinstance(source, (Image.Image, np.ndarray)):
        png = io.BytesIO()
        load_image(source).save(png, format="PNG")
        return png.getvalue()
    data = read_media_bytes(source, **read_options)
    load_image(data)
    return data


def video_frames(source: MediaSource, **read_options) -> np.ndarray:
    """All frames of a video as uint8 `[frames, H, W, 3]`; an array is checked and returned as it is."""
    if isinstance(source, np.ndarray):
        return _check_pixels(source, "a video array", 4)
    import av

    data = read_media_bytes(source, **read_options)
    try:
        with av.open(io.BytesIO(data)) as container:
            frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    except (av.error.FFmpegError, IndexError, ValueError) as error:
        raise MediaError(f"media {_describe(source)} is not a decodable video ({error})") from None
    if not frames:
        raise MediaError(f"media {_describe(source)} has no video frames")
    return np.stack(frames)


def audio_signal(source: MediaSource, **read_options) -> np.ndarray:
    """A mono float32 waveform from an audio file (channels averaged); an array is checked and returned."""
    if isinstance(source, np.ndarray):
        signal = np.asarray(source, dtype=np.float32)
    else:
        import soundfile

        data = read_media_bytes(source, **read_options)
        try:
            signal, _ = soundfile.read(io.BytesIO(data), dtype="float32")
        except (soundfile.LibsndfileError, RuntimeError, TypeError) as error:
            raise MediaError(f"media {_describe(source)} is not a decodable audio file ({error})") from None
        if signal.ndim == 2:
            signal = signal.mean(axis=1)
    if signal.ndim != 1 or signal.size == 0:
        raise MediaError(f"an audio signal must be a non-empty 1-D array, got shape {list(signal.shape)}")
    return signal


def file_bytes(kind: MediaKind, source: MediaSource, **read_options) -> bytes:
    """One media item as the bytes of its file: an image checked to decode (pixels sent as PNG), a video or an
    audio clip as it is."""
    if kind == IMAGE:
        return image_bytes(source, **read_options)
    return read_media_bytes(source, **read_options)


def media_tensors(kind: MediaKind, source: MediaSource, *, raw: bool = False, **read_options) -> dict[str, np.ndarray]:
    """One media item's input tensors (without the batch axis), encoded as clients send its kind: the file in
    `input_media_bytes`, or with `raw` (always, for an array of video frames or audio samples) decoded: an image's
    pixels `[1, H, W, 3]` or a video's frames in `input_media`, a waveform in `input_signal`."""
    if kind == AUDIO and (raw or isinstance(source, np.ndarray)):
        signal = audio_signal(source, **read_options)
        return {"input_signal": signal, "input_signal_length": np.array([signal.shape[0]], dtype=np.int32)}
    if kind == VIDEO and (raw or isinstance(source, np.ndarray)):
        return {"input_media": video_frames(source, **read_options)}  # the server samples the frames
    if kind == IMAGE and raw:
        return {"input_media": image_pixels(source, **read_options)[np.newaxis]}
    return {"input_media_bytes": np.array([file_bytes(kind, source, **read_options)], dtype=object)}
