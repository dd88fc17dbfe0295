"""NeMo's `AudioToMelSpectrogramPreprocessor` / `FilterbankFeatures` at inference (no dither, no augmentation).

Two behaviours (`frontend`): "nemo-2.4" (NeMo <= 2.4: `len//hop + 1` frames, reflect STFT padding, pre-emphasis over
the padded tail) and "nemo-2.5" (NeMo >= 2.5.0rc0: `len//hop` frames, zero STFT padding, pre-emphasised samples past
each clip's length zeroed). See docs/fidelity.md (SALM).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from .errors import AudioPerceptionError

NEMO_24 = "nemo-2.4"
NEMO_25 = "nemo-2.5"
FRONTENDS = (NEMO_24, NEMO_25)

_WINDOWS = {
    "hann": torch.hann_window,
    "hamming": torch.hamming_window,
    "blackman": torch.blackman_window,
    "bartlett": torch.bartlett_window,
}
_STD_GUARD = 1e-5  # added to the per-feature / per-utterance standard deviation (NeMo's CONSTANT)
_PREPROCESSOR_CLASS = "AudioToMelSpectrogramPreprocessor"


def check_frontend(frontend: str) -> str:
    if frontend not in FRONTENDS:
        raise AudioPerceptionError(f"unknown audio frontend {frontend!r}; use one of {', '.join(FRONTENDS)}")
    return frontend


def _hz_to_slaney_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz (3 mel per 200 Hz), logarithmic above."""
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    hz = np.asarray(hz, dtype=np.float64)
    mel = hz / f_sp
    high = hz >= min_log_hz
    return np.where(high, min_log_mel + np.log(np.maximum(hz, 1e-300) / min_log_hz) / logstep, mel)


def _slaney_mel_to_hz(mel: np.ndarray) -> np.ndarray:
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    mel = np.asarray(mel, dtype=np.float64)
    return np.where(mel >= min_log_mel, min_log_hz * np.exp(logstep * (mel - min_log_mel)), f_sp * mel)


def slaney_mel_filterbank(
    sample_rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float, norm: str | None = "slaney"
) -> Tensor:
    """Triangular mel filters on the Slaney scale, area-normalised when `norm == "slaney"` (librosa's `mel` with
    `htk=False`), computed in float64 and returned as float32 `[n_mels, n_fft // 2 + 1]`."""
    if norm not in ("slaney", None):
        raise AudioPerceptionError(f"preprocessor mel_norm={norm!r} is not supported; use 'slaney' or null")
    fft_freqs = np.linspace(0.0, sample_rate / 2.0, 1 + n_fft // 2)
    mel_edges = np.linspace(_hz_to_slaney_mel(fmin), _hz_to_slaney_mel(fmax), n_mels + 2)
    hz_edges = _slaney_mel_to_hz(mel_edges)
    widths = np.diff(hz_edges)
    ramps = hz_edges[:, None] - fft_freqs[None, :]
    rising = -ramps[:-2] / widths[:-1, None]
    falling = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling))
    if norm == "slaney":
        weights *= (2.0 / (hz_edges[2:] - hz_edges[:-2]))[:, None]
    return torch.from_numpy(weights.astype(np.float32))


class MelSpectrogram(nn.Module):
    """FilterbankFeatures: signal [B, N] + lengths (samples) -> log-mel [B, n_mels, T] + lengths (frames).

    Buffers `window` [win_length] and `fb` [1, n_mels, n_fft//2+1] carry NeMo's names so checkpoint values load.
    """

    def __init__(
        self,
        *,
        frontend: str,
        sample_rate: int = 16000,
        n_window_size: int = 320,
        n_window_stride: int = 160,
        window: str = "hann",
        normalize: Any = "per_feature",
        n_fft: int | None = None,
        preemph: float | None = 0.97,
        nfilt: int = 64,
        lowfreq: float = 0.0,
        highfreq: float | None = None,
        log: bool = True,
        log_zero_guard_type: str = "add",
        log_zero_guard_value: float | str = 2**-24,
        pad_to: int = 16,
        frame_splicing: int = 1,
        exact_pad: bool = False,
        pad_value: float = 0.0,
        mag_power: float = 2.0,
        mel_norm: str | None = "slaney",
    ):
        super().__init__()
        self.frontend = check_frontend(frontend)
        if window not in _WINDOWS:
            raise AudioPerceptionError(f"preprocessor window={window!r} is not supported; use one of {list(_WINDOWS)}")
        if exact_pad and n_window_stride % 2 == 1:
            raise AudioPerceptionError("preprocessor exact_pad=True needs an even window stride (NeMo refuses it too)")
        if log_zero_guard_type not in ("add", "clamp"):
            raise AudioPerceptionError(f"log_zero_guard_type={log_zero_guard_type!r}: use 'add' or 'clamp'")
        if isinstance(log_zero_guard_value, str) and log_zero_guard_value not in ("tiny", "eps"):
            raise AudioPerceptionError(f"log_zero_guard_value={log_zero_guard_value!r}: use a number, 'tiny' or 'eps'")
        if isinstance(normalize, Mapping):
            raise AudioPerceptionError("preprocessor normalize with fixed_mean/fixed_std is not supported")
        if not isinstance(pad_to, int) or pad_to < 0:
            raise AudioPerceptionError(f"preprocessor pad_to={pad_to!r}: use a non-negative integer")
        if frame_splicing < 1:
            raise AudioPerceptionError(f"preprocessor frame_splicing={frame_splicing!r} must be >= 1")
        self.sample_rate = int(sample_rate)
        self.win_length = int(n_window_size)
        self.hop_length = int(n_window_stride)
        self.n_fft = int(n_fft or 2 ** math.ceil(math.log2(self.win_length)))
        self.exact_pad = bool(exact_pad)
        self.stft_pad = (self.n_fft - self.hop_length) // 2 if exact_pad else None
        self.normalize = normalize if normalize in ("per_feature", "all_features") else None
        self.preemph = preemph
        self.n_mels = int(nfilt)
        self.log = bool(log)
        self.log_zero_guard_type = log_zero_guard_type
        self.log_zero_guard_value = log_zero_guard_value
        self.pad_to = pad_to
        self.frame_splicing = int(frame_splicing)
        self.pad_value = float(pad_value)
        self.mag_power = float(mag_power)
        self.register_buffer("window", _WINDOWS[window](self.win_length, periodic=False))
        fb = slaney_mel_filterbank(self.sample_rate, self.n_fft, self.n_mels, lowfreq, highfreq or sample_rate / 2, mel_norm)
        self.register_buffer("fb", fb.unsqueeze(0))

    def frame_lengths(self, lengths: Tensor) -> Tensor:
        """Valid frames per clip for `lengths` samples (NeMo's `get_seq_len`, with the frontend's +1 or not)."""
        pad = 2 * self.stft_pad if self.stft_pad is not None else 2 * (self.n_fft // 2)
        frames = torch.div(lengths.to(torch.int64) + pad - self.n_fft, self.hop_length, rounding_mode="floor")
        if self.frontend == NEMO_24:
            frames = frames + 1
        return torch.where(lengths == 0, torch.zeros_like(frames), frames)

    def _log_guard(self, dtype: torch.dtype) -> float:
        value = self.log_zero_guard_value
        if value == "tiny":
            return torch.finfo(dtype).tiny
        if value == "eps":
            return torch.finfo(dtype).eps
        return float(value)

    def forward(self, signal: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        x = signal.to(torch.float32)
        lengths = lengths.to(x.device)
        frames = self.frame_lengths(lengths)
        pad_mode = "reflect" if self.frontend == NEMO_24 else "constant"
        if self.stft_pad is not None:
            x = nn.functional.pad(x.unsqueeze(1), (self.stft_pad, self.stft_pad), pad_mode).squeeze(1)
        if self.preemph is not None:
            x = torch.cat((x[:, :1], x[:, 1:] - self.preemph * x[:, :-1]), dim=1)
            if self.frontend == NEMO_25:
                in_clip = torch.arange(x.shape[1], device=x.device)[None, :] < lengths[:, None]
                x = x.masked_fill(~in_clip, 0.0)
        spec = torch.stft(
            x,
            n_fft=self.n_fft,
            hop_length=self.hop_length,
            win_length=self.win_length,
            window=self.window.to(torch.float32),
            center=not self.exact_pad,
            pad_mode=pad_mode,
            return_complex=True,
        )
        spec = torch.view_as_real(spec).pow(2).sum(-1).sqrt()
        if self.mag_power != 1.0:
            spec = spec.pow(self.mag_power)
        mel = torch.matmul(self.fb.to(torch.float32), spec)
        if self.log:
            guard = self._log_guard(mel.dtype)
            mel = torch.log(mel + guard) if self.log_zero_guard_type == "add" else torch.log(mel.clamp(min=guard))
        if self.frame_splicing > 1:  # NeMo's splice_frames concatenates unshifted copies
            mel = torch.cat([mel] * self.frame_splicing, dim=1)
        valid = torch.arange(mel.shape[-1], device=mel.device)[None, :] < frames[:, None]
        if self.normalize is not None:
            mel = _normalize(mel, valid, per_feature=self.normalize == "per_feature")
        mel = mel.masked_fill(~valid[:, None, :], self.pad_value)
        if self.pad_to > 0 and mel.shape[-1] % self.pad_to:
            mel = nn.functional.pad(mel, (0, self.pad_to - mel.shape[-1] % self.pad_to), value=self.pad_value)
        return mel, frames


def _normalize(mel: Tensor, valid: Tensor, *, per_feature: bool) -> Tensor:
    """Mean/unbiased-std normalisation over valid frames, per mel bin (`per_feature`) or per utterance; std + 1e-5."""
    mask = valid[:, None, :]
    dims = (2,) if per_feature else (1, 2)
    count = mask.sum(dim=dims, keepdim=True) * (1 if per_feature else mel.shape[1])
    mean = torch.where(mask, mel, 0.0).sum(dim=dims, keepdim=True) / count
    var = torch.where(mask, mel - mean, 0.0).pow(2).sum(dim=dims, keepdim=True) / (count - 1.0)
    std = var.sqrt().nan_to_num(0.0) + _STD_GUARD
    return (mel - mean) / std


class MelPreprocessor(nn.Module):
    """AudioToMelSpectrogramPreprocessor: holds the featurizer under NeMo's attribute name `featurizer`."""

    def __init__(self, featurizer: MelSpectrogram):
        super().__init__()
        self.featurizer = featurizer

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], frontend: str) -> MelPreprocessor:
        """Builds from NeMo's `preprocessor` config (seconds or samples for the window, NeMo's defaults)."""
        target = str(cfg.get("_target_", _PREPROCESSOR_CLASS)).rsplit(".", 1)[-1]
        if target != _PREPROCESSOR_CLASS:
            raise AudioPerceptionError(f"audio preprocessor {target} is not supported; only {_PREPROCESSOR_CLASS}")
        if cfg.get("use_torchaudio") and frontend == NEMO_24:
            raise AudioPerceptionError("preprocessor use_torchaudio=True (NeMo <= 2.4 FilterbankFeaturesTA) is not "
                                       "supported; set it to false or use the nemo-2.5 frontend, which ignores it")
        sample_rate = int(cfg.get("sample_rate", 16000))
        sizes = {}
        for seconds_key, samples_key, default in (("window_size", "n_window_size", 0.02),
                                                  ("window_stride", "n_window_stride", 0.01)):
            seconds, samples = cfg.get(seconds_key, default), cfg.get(samples_key)
            if seconds and samples:
                raise AudioPerceptionError(f"preprocessor sets both {seconds_key} and {samples_key}; keep one "
                                           f"(set {seconds_key}: null to use {samples_key})")
            sizes[samples_key] = int(seconds * sample_rate) if seconds else samples
        known = ("window", "normalize", "n_fft", "preemph", "lowfreq", "highfreq", "log", "log_zero_guard_type",
                 "log_zero_guard_value", "pad_to", "frame_splicing", "exact_pad", "pad_value", "mag_power", "mel_norm")
        kwargs = {key: cfg[key] for key in known if key in cfg}
        if "features" in cfg:
            kwargs["nfilt"] = cfg["features"]
        return cls(MelSpectrogram(frontend=frontend, sample_rate=sample_rate, **sizes, **kwargs))

    def forward(self, signal: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        return self.featurizer(signal, lengths)
