"""Video frames for the video model types: decoding (PyAV), NeMo's frame-sampling rules, safety caps.

A source is a file path, the encoded bytes of a file (MP4, WebM, AVI, MKV, MOV: whatever FFmpeg reads), a uint8
frame array `[T, H, W, 3]`, or an image (PIL image, uint8 `[H, W, 3]`, or a PNG/JPEG path or bytes), which counts
as a video of one frame. `read_frames` asks a selector for the frame indices once it knows the frame count and
keeps only those frames, each distinct one once (a selection padded with repeats costs no more memory), so a long
video never sits in memory whole.

Sampling rules (`exporter.models` picks the one its model type follows):
- `padded_indices`: NeMo training's, for every video model (`TarOrFolderVideoLoader.flatten_frames`):
  `linspace(0, len-1, min(len, num_frames), dtype=int)` (truncation), then the last frame repeated up to
  `num_frames`; `video_neva_indices` adds Video-NeVA's all-frames and single-frame settings;
- `lita_num_sample_frames` + `rounded_indices`: NeMo's export runtime for LITA/VITA (`get_num_sample_frames`,
  `round(linspace(0, len-1, k))`, numpy rounding: halves to even), kept as an opt-in.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

VideoSource = str | os.PathLike | bytes | np.ndarray | Image.Image
FrameSelector = Callable[[int], Sequence[int]]
SPLICE_SINGLE_FRAME = ("first", "middle", "last")


class VideoLoadError(ValueError):
    """A video could not be read or is past one of the `VideoLimits` (the message says which and what to do)."""


@dataclass(frozen=True)
class VideoLimits:
    """Safety caps checked before (and while) decoding; each error names the option to raise."""

    max_frames: int = 20_000  # frames in the source video (not the sampled ones)
    max_duration_s: float = 3600.0
    max_frame_pixels: int = 3840 * 2160  # width * height of one frame

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"VideoLimits.{name} must be positive, got {value}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def video_neva_indices(length: int, num_frames: int, splice_single_frame: str | None = None) -> list[int]:
    """Video-NeVA's frames: all (`num_frames == -1`), one (`splice_single_frame`), or `num_frames` evenly spaced
    ones (truncated `linspace`), the last repeated when the video is shorter."""
    _check_length(length)
    if splice_single_frame:
        positions = {"first": 0, "middle": length // 2, "last": length - 1}
        if splice_single_frame not in positions:
            raise ValueError(
                f"data.splice_single_frame {splice_single_frame!r} is not one of {', '.join(SPLICE_SINGLE_FRAME)}"
            )
        return [positions[splice_single_frame]]
    if num_frames == -1:
        return list(range(length))
    if num_frames < 1:
        raise ValueError(f"data.num_frames must be -1 (all frames) or at least 1, got {num_frames}")
    return padded_indices(length, num_frames)


def padded_indices(length: int, num_frames: int) -> list[int]:
    """NeMo training's frames: `num_frames` evenly spaced ones (truncated `linspace`), the last repeated when the
    video is shorter."""
    _check_length(length)
    indices = np.linspace(0, length - 1, min(length, num_frames), dtype=int).tolist()
    return indices + [indices[-1]] * (num_frames - len(indices))


def lita_num_sample_frames(length: int, num_frames: int, sample_frames: int, visual_token_format: str) -> int:
    """LITA/VITA's `get_num_sample_frames`: with `im_vid_start_end`, every frame up to `num_frames`, else
    `round(length / ceil(length / num_frames))`; other formats take `sample_frames`."""
    _check_length(length)
    if visual_token_format != "im_vid_start_end":
        return sample_frames
    if length <= num_frames:
        return length
    return int(np.round(length / math.ceil(length / num_frames)))


def rounded_indices(length: int, count: int) -> list[int]:
    """`round(linspace(0, length - 1, count))` as LITA/VITA sample frames (repeats when count > length)."""
    _check_length(length)
    if count < 1:
        raise ValueError(f"the number of frames to sample must be at least 1, got {count}")
    return np.round(np.linspace(0, length - 1, count)).astype(int).tolist()


def _check_length(length: int) -> None:
    if length < 1:
        raise VideoLoadError("the video has no frames")


@dataclass(frozen=True)
class FrameSet:
    """The frames a selection names, each distinct frame once: the i-th selected frame is `frames[order[i]]`."""

    frames: np.ndarray  # uint8 [distinct, H, W, 3], in order of first selection
    order: tuple[int, ...]  # one row of `frames` per selected index


def read_frames(source: VideoSource, select: FrameSelector, limits: VideoLimits = VideoLimits()) -> FrameSet:
    """The frames `select(frame_count)` names, in that order (repeats allowed)."""
    name = _describe(source)
    if isinstance(source, np.ndarray):
        return _pick(_checked_array(source, name, limits), select, name)
    if isinstance(source, Image.Image):
        return _pick(_image_frames(source, name, limits), select, name)
    if not isinstance(source, (str, os.PathLike, bytes)):
        raise VideoLoadError(
            f"unsupported video input {type(source).__name__}; pass a file path, the file's bytes, "
            "a uint8 frame array [T, H, W, 3] or an image"
        )
    if isinstance(source, bytes) and not source:
        raise VideoLoadError("the video is empty (0 bytes); send a video file")
    image = _open_image(source, name)
    if image is not None:
        return _pick(_image_frames(image, name, limits), select, name)
    return _decode_selected(source, select, limits, name)


def _describe(source: Any) -> str:
    if isinstance(source, (str, os.PathLike)):
        return repr(os.fspath(source))
    if isinstance(source, bytes):
        return f"<{len(source)} bytes>"
    if isinstance(source, np.ndarray):
        return f"<array {tuple(source.shape)}>"
    return f"<{type(source).__name__}>"


def _pick(frames: np.ndarray, select: FrameSelector, name: str) -> FrameSet:
    distinct, order = _distinct(_checked_indices(select(len(frames)), len(frames), name))
    return FrameSet(np.ascontiguousarray(frames[distinct]), order)


def _distinct(indices: list[int]) -> tuple[list[int], tuple[int, ...]]:
    """The distinct indices in order of first use, and each index's position among them."""
    distinct = list(dict.fromkeys(indices))
    row = {index: position for position, index in enumerate(distinct)}
    return distinct, tuple(row[index] for index in indices)


def _checked_indices(indices: Sequence[int], length: int, name: str) -> list[int]:
    indices = [int(i) for i in indices]
    if not indices or not all(0 <= i < length for i in indices):
        raise VideoLoadError(f"frame selection {indices} is empty or outside the {length} frames of video {name}")
    return indices


def _check_pixels(width: int, height: int, name: str, limits: VideoLimits) -> None:
    if width * height > limits.max_frame_pixels:
        raise VideoLoadError(
            f"video {name} has {width}x{height} = {width * height} pixels per frame, over the limit of "
            f"{limits.max_frame_pixels} (option max_frame_pixels); downscale it or raise max_frame_pixels"
        )


def _check_frame_count(count: int, name: str, limits: VideoLimits) -> None:
    if count > limits.max_frames:
        raise VideoLoadError(
            f"video {name} has {count} frames, over the limit of {limits.max_frames} "
            "(VideoLimits.max_frames, --media_max_video_frames); send a shorter clip or raise the limit"
        )


def _checked_array(frames: np.ndarray, name: str, limits: VideoLimits) -> np.ndarray:
    if frames.dtype != np.uint8:
        raise VideoLoadError(f"video arrays must be uint8 RGB (0..255), got dtype {frames.dtype} for {name}")
    if frames.ndim == 3 and frames.shape[-1] == 3:  # one image
        frames = frames[np.newaxis]
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise VideoLoadError(f"video arrays must be RGB frames [T, H, W, 3] (or one image [H, W, 3]), got {name}")
    if frames.size == 0:
        raise VideoLoadError(f"the video array {name} is empty; send at least one frame of at least 1x1 pixels")
    _check_frame_count(frames.shape[0], name, limits)
    _check_pixels(frames.shape[2], frames.shape[1], name, limits)
    return frames


def _open_image(source: str | os.PathLike | bytes, name: str) -> Image.Image | None:
    """The source as a PIL image if it is an image file, None if PIL does not recognise it (a video)."""
    try:
        image = Image.open(io.BytesIO(source) if isinstance(source, bytes) else os.fspath(source))
    except UnidentifiedImageError:
        return None
    except FileNotFoundError:
        raise VideoLoadError(f"video file {name} does not exist") from None
    except (OSError, Image.DecompressionBombError) as error:
        raise VideoLoadError(f"cannot read {name}: {error}") from None
    if image.format == "MPEG":  # PIL names MPEG-1 streams but cannot decode them: a video
        image.close()
        return None
    return image


def _image_frames(image: Image.Image, name: str, limits: VideoLimits) -> np.ndarray:
    _check_pixels(image.width, image.height, name, limits)
    try:
        return np.asarray(image.convert("RGB"))[np.newaxis]
    except OSError as error:
        raise VideoLoadError(f"cannot decode image {name}: {error}") from None


def _pyav():
    """PyAV, imported on first use, so its FFmpeg libraries load only where videos are read."""
    import av

    return av


def _open_container(source: str | os.PathLike | bytes, name: str):
    av = _pyav()
    try:
        return av.open(io.BytesIO(source) if isinstance(source, bytes) else os.fspath(source))
    except FileNotFoundError:
        raise VideoLoadError(f"video file {name} does not exist") from None
    except (av.error.FFmpegError, OSError) as error:
        raise VideoLoadError(f"{name} is not a readable video file: {_reason(error)}") from None


def _reason(error: Exception) -> str:
    """FFmpeg's message without the errno and file name PyAV adds."""
    return getattr(error, "strerror", None) or str(error)


def _video_stream(container, name: str):
    if not container.streams.video:
        raise VideoLoadError(f"{name} has no video stream (format {container.format.name}); send a video file")
    return container.streams.video[0]


def _check_duration(seconds: float, name: str, limits: VideoLimits) -> None:
    if seconds > limits.max_duration_s:
        raise VideoLoadError(
            f"video {name} lasts {seconds:.1f} s, over the limit of {limits.max_duration_s:g} s "
            "(VideoLimits.max_duration_s, --media_max_video_duration_s); send a shorter clip or raise the limit"
        )


def _scan(source: str | os.PathLike | bytes, name: str, limits: VideoLimits) -> int:
    """Check size and duration, then count the frames from the packets (no decoding)."""
    av = _pyav()
    with _open_container(source, name) as container:
        stream = _video_stream(container, name)
        _check_pixels(stream.codec_context.width, stream.codec_context.height, name, limits)
        if container.duration is not None:
            _check_duration(container.duration / av.time_base, name, limits)
        count, first, last = 0, None, None
        try:
            for packet in container.demux(stream):
                if packet.size == 0:
                    continue
                count += 1
                _check_frame_count(count, name, limits)
                if packet.pts is not None:
                    end = packet.pts + (packet.duration or 0)
                    first = packet.pts if first is None else min(first, packet.pts)
                    last = end if last is None else max(last, end)
        except av.error.FFmpegError as error:
            raise VideoLoadError(f"{name} is not a readable video file: {_reason(error)}") from None
        if first is not None and stream.time_base is not None:  # headers may lack or understate it
            _check_duration(float((last - first) * stream.time_base), name, limits)
    if count == 0:
        raise VideoLoadError(f"video {name} has no video frames")
    return count


def _decode(source: str | os.PathLike | bytes, wanted: set[int], name: str, limits: VideoLimits):
    """Decode every frame, keep the wanted ones as RGB arrays; returns (kept frames by index, frames decoded)."""
    av = _pyav()
    kept: dict[int, np.ndarray] = {}
    index = -1
    with _open_container(source, name) as container:
        stream = _video_stream(container, name)
        stream.thread_type = "AUTO"
        try:
            for index, frame in enumerate(container.decode(stream)):
                _check_frame_count(index + 1, name, limits)
                if index in wanted:
                    _check_pixels(frame.width, frame.height, name, limits)
                    kept[index] = frame.to_ndarray(format="rgb24")
        except av.error.FFmpegError as error:
            raise VideoLoadError(f"cannot decode frame {index + 1} of video {name}: {_reason(error)}") from None
    return kept, index + 1


def _decode_selected(source: str | os.PathLike | bytes, select: FrameSelector, limits: VideoLimits,
                     name: str) -> FrameSet:
    count = _scan(source, name, limits)
    indices = _checked_indices(select(count), count, name)
    kept, decoded = _decode(source, set(indices), name, limits)
    if decoded != count:  # the packet count was not the frame count: sample again from the decoded count
        if decoded == 0:
            raise VideoLoadError(f"video {name} has no decodable frames")
        indices = _checked_indices(select(decoded), decoded, name)
        if not set(indices) <= kept.keys():
            kept, _ = _decode(source, set(indices), name, limits)
    distinct, order = _distinct(indices)
    shapes = {kept[i].shape for i in distinct}
    if len(shapes) != 1:
        raise VideoLoadError(f"video {name} changes frame size mid-stream ({sorted(shapes)}); re-encode it")
    return FrameSet(np.stack([kept[i] for i in distinct]), order)
