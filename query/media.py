"""Client-side media loading: a path, an http(s) URL, a base64 `data:` URL, bytes, a PIL image or an array.

URLs are fetched with a total time limit and a byte cap; every failure is a `MediaError` naming the source and
what to change.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MAX_BYTES = 100 * 1024 * 1024
MAX_VIDEO_FRAMES = 256

MediaSource = str | os.PathLike | bytes | Image.Image | np.ndarray


class MediaError(ValueError):
    """Media could not be loaded; the message names the source and what to change."""


def _describe(source: object) -> str:
    if isinstance(source, bytes):
        return f"<{len(source)} bytes>"
    text = str(source)
    return text if len(text) <= 80 else text[:60] + "..." + text[-15:]


def _check_size(size: int, max_bytes: int, source: object) -> None:
    if size > max_bytes:
        raise MediaError(
            f"media {_describe(source)} has {size} bytes, over the cap of {max_bytes}; raise max_bytes"
        )


def read_media_bytes(
    source: str | os.PathLike | bytes,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> bytes:
    """The bytes of a media file given as bytes, a path, a `file://`, `http(s)://` or base64 `data:` URL."""
    if isinstance(source, bytes):
        data = source
    elif isinstance(source, str) and source.startswith("data:"):
        data = _decode_data_url(source, max_bytes)
    elif isinstance(source, str) and source.startswith(("http://", "https://")):
        return _fetch_url(source, timeout_s, max_bytes)
    elif isinstance(source, (str, os.PathLike)):
        data = _read_file(source, max_bytes)
    else:
        raise MediaError(
            f"cannot read media from a {type(source).__name__}; give a path, URL, data: URL or bytes"
        )
    _check_size(len(data), max_bytes, source)
    return data


def _read_file(source: str | os.PathLike, max_bytes: int) -> bytes:
    text = os.fspath(source)
    path = Path(
        urllib.parse.unquote(text[len("file://") :]) if text.startswith("file://") else text
    ).expanduser()
    if not path.is_file():
        raise MediaError(f"media file {path} does not exist (or is not a file); check the path")
    _check_size(path.stat().st_size, max_bytes, path)
    return path.read_bytes()


def _decode_data_url(url: str, max_bytes: int) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma:
        raise MediaError("data: URL has no ',' before its payload; use data:<mime>;base64,<data>")
    # base64 grows data by 4/3: refuse oversized payloads before decoding them.
    _check_size(len(payload) * 3 // 4, max_bytes, "data: URL")
    if header.endswith(";base64"):
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as error:
            raise MediaError(f"data: URL payload is not valid base64 ({error})") from None
    return urllib.parse.unquote_to_bytes(payload)


def _fetch_url(url: str, timeout_s: float, max_bytes: int) -> bytes:
    deadline = time.monotonic() + timeout_s
    timeout_hint = (
        f"fetching {url} took longer than {timeout_s} s; raise the media timeout or download it first"
    )
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit():
                _check_size(int(length), max_bytes, url)
            chunks, size = [], 0
            while chunk := response.read(64 * 1024):
                chunks.append(chunk)
                size += len(chunk)
                _check_size(size, max_bytes, url)
                if time.monotonic() > deadline:
                    raise MediaError(timeout_hint)
            return b"".join(chunks)
    except urllib.error.HTTPError as error:
        raise MediaError(f"fetching {url} failed: HTTP {error.code} {error.reason}") from None
    except urllib.error.URLError as error:
        if isinstance(error.reason, TimeoutError):
            raise MediaError(timeout_hint) from None
        raise MediaError(f"fetching {url} failed: {error.reason}") from None
    except TimeoutError:
        raise MediaError(timeout_hint) from None


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


def subsample_frames(frames: np.ndarray, max_frames: int = MAX_VIDEO_FRAMES) -> np.ndarray:
    """NeMo's LITA/VITA client rule: keep all frames up to `max_frames`, else evenly spaced ones (rounded)."""
    count = len(frames)
    if count <= max_frames:
        return frames
    keep = int(np.round(count / int(np.ceil(count / max_frames))))
    return frames[np.round(np.linspace(0, count - 1, keep)).astype(int)]


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
