"""Audio clips for the SALM engine: decode WAV/FLAC/OGG/MP3 (paths or bytes) with soundfile, mix to mono, resample
to the model's rate with soxr (librosa's default resampler, which NeMo's training data loader used).

A raw waveform (a float array, as Triton's ``input_signal`` carries it) is taken to be mono at the model's rate
already, as NeMo took it. Every failure is an :class:`AudioLoadError` naming the clip and what to change.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

AUDIO_FORMATS = ("WAV", "FLAC", "OGG", "MP3")
DEFAULT_MAX_AUDIO_BYTES = 128 * 1024 * 1024
DEFAULT_MAX_AUDIO_DURATION_S = 600.0

AudioSource = str | os.PathLike | bytes | bytearray | memoryview | np.ndarray


class AudioLoadError(ValueError):
    """An audio clip cannot be read, or is over a limit; the message says which and what to change."""


@dataclass(frozen=True)
class AudioLimits:
    """Caps on one clip: bytes of the encoded file and seconds of audio."""

    max_bytes: int = DEFAULT_MAX_AUDIO_BYTES
    max_duration_s: float = DEFAULT_MAX_AUDIO_DURATION_S

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or self.max_duration_s <= 0:
            raise ValueError(f"audio limits must be positive, got max_bytes={self.max_bytes}, "
                             f"max_duration_s={self.max_duration_s}")

    def check_size(self, size: int, what: str) -> None:
        if size > self.max_bytes:
            raise AudioLoadError(f"{what} has {size} bytes, over the limit of {self.max_bytes}; send a smaller file "
                                 "or raise the limit (--media_max_bytes)")

    def check_duration(self, seconds: float, what: str) -> None:
        if seconds > self.max_duration_s:
            raise AudioLoadError(f"{what} lasts {seconds:.1f} s, over the limit of {self.max_duration_s:g} s; "
                                 "send a shorter clip or raise the limit (--media_max_audio_duration_s)")


def load_audio(source: AudioSource, sample_rate: int, limits: AudioLimits | None = None) -> np.ndarray:
    """One clip as a mono float32 waveform ``[N]`` at ``sample_rate``.

    ``source`` is a path, the bytes of an audio file, or a waveform array (mono ``[N]`` at ``sample_rate``).
    """
    limits = limits or AudioLimits()
    if isinstance(source, np.ndarray):
        return _checked_waveform(source, sample_rate, limits)
    what = _describe(source)
    data = _file_bytes(source, limits, what)
    signal, rate = _decode(data, limits, what)
    if signal.shape[1] > 1:
        signal = signal.mean(axis=1, keepdims=True)  # NeMo's channel_selector="average"
    signal = signal[:, 0]
    if rate != sample_rate:
        import soxr

        signal = soxr.resample(signal, rate, sample_rate, quality="HQ").astype(np.float32, copy=False)
    if signal.size == 0:
        raise AudioLoadError(f"{what} holds no audio samples; send a non-empty clip")
    return np.ascontiguousarray(signal, dtype=np.float32)


def _checked_waveform(array: np.ndarray, sample_rate: int, limits: AudioLimits) -> np.ndarray:
    if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.floating):
        raise AudioLoadError(f"an audio waveform must be a non-empty 1-D float array of samples at {sample_rate} Hz, "
                             f"got {array.dtype} {list(array.shape)}")
    limits.check_duration(array.size / sample_rate, "the audio waveform")
    signal = np.ascontiguousarray(array, dtype=np.float32)
    if not np.isfinite(signal).all():
        raise AudioLoadError("the audio waveform holds NaN or infinite samples")
    return signal


def _file_bytes(source: Any, limits: AudioLimits, what: str) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, (str, os.PathLike)):
        try:
            size = os.path.getsize(source)
            limits.check_size(size, what)
            with open(source, "rb") as file:
                data = file.read()
        except OSError as error:
            raise AudioLoadError(f"{what} cannot be read ({error.strerror or error}); check the path") from None
    else:
        raise AudioLoadError(f"audio must be a path, the bytes of an audio file or a float waveform array, got "
                             f"{type(source).__name__}")
    limits.check_size(len(data), what)
    if not data:
        raise AudioLoadError(f"{what} is empty; send an audio file ({', '.join(AUDIO_FORMATS)})")
    return data


def _decode(data: bytes, limits: AudioLimits, what: str) -> tuple[np.ndarray, int]:
    """Samples ``[N, channels]`` float32 and the file's rate; the header's duration is checked before decoding."""
    import soundfile

    try:
        info = soundfile.info(io.BytesIO(data))
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as error:
        raise AudioLoadError(f"{what} is not a decodable audio file ({', '.join(AUDIO_FORMATS)}): {error}") from None
    limits.check_duration(info.frames / info.samplerate if info.samplerate else 0.0, what)
    try:
        signal, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as error:
        raise AudioLoadError(f"{what} could not be decoded: {error}") from None
    limits.check_duration(signal.shape[0] / rate, what)
    if not np.isfinite(signal).all():
        raise AudioLoadError(f"{what} holds NaN or infinite samples")
    return signal, int(rate)


def _describe(source: Any) -> str:
    if isinstance(source, (str, os.PathLike)):
        return f"audio file {os.fspath(source)!r}"
    return "the audio bytes"
