"""A Triton request (batch axis first) checked against size limits, then split into its rows and decoded.

Every cap is checked from tensor shapes and byte lengths before any text is decoded or tokenized and before any
media is decoded, so an oversized request costs nothing but its transfer.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from wire.params import LORA_UIDS, PARAMS, lora_uids_per_row, sampling_fields

PROMPT_BYTES_PER_TOKEN = 32
"""A prompt of `max_input_len` tokens is refused unread above `max_input_len` × this many UTF-8 bytes (a
generous bound: tokenizers of the served LLMs hold pieces of at most 16 characters)."""

MAX_SAMPLE_RATE = 48_000
"""A raw waveform (`input_signal`) may hold the media policy's longest clip at this rate."""

_DATA_URL_HEADER_BYTES = 256

InferRequest = dict[str, np.ndarray]
"""Input name -> array with the batch axis first, as Triton hands a request over."""


class WireError(ValueError):
    """A request breaks the wire format or a size limit; the message names the input."""


@dataclass(frozen=True)
class WireLimits:
    """Per-request caps checked before any decoding; None: no cap."""

    max_rows: int | None = None
    max_text_bytes: int | None = None
    max_media_items: int | None = None
    max_media_item_bytes: int | None = None
    max_image_pixels: int | None = None
    max_frames: int | None = None
    max_signal_samples: int | None = None

    @classmethod
    def for_engine(cls, *, max_input_len: int, max_batch_size: int, max_media_items: int,
                   max_media_item_bytes: int, max_image_pixels: int, max_frames: int,
                   max_audio_duration_s: float) -> WireLimits:
        """The caps of an engine (its export limits) under a media policy's per-item caps."""
        return cls(max_rows=max_batch_size, max_text_bytes=max_input_len * PROMPT_BYTES_PER_TOKEN,
                   max_media_items=max_media_items, max_media_item_bytes=max_media_item_bytes,
                   max_image_pixels=max_image_pixels, max_frames=max_frames,
                   max_signal_samples=int(max_audio_duration_s * MAX_SAMPLE_RATE))

    def input_byte_caps(self) -> dict[str, int]:
        """The most bytes each capped input of a whole request may hold (a coarse first check, made before a
        request's tensors are handed on; `split_request` checks each row exactly)."""
        if self.max_rows is None:
            return {}
        caps = {}
        if self.max_text_bytes is not None:
            caps["input_text"] = self.max_rows * self.max_text_bytes
        if self.max_media_items is not None and self.max_media_item_bytes is not None:
            item = _encoded_item_cap(self.max_media_item_bytes)
            caps["input_media_bytes"] = self.max_rows * self.max_media_items * item
        if self.max_frames is not None and self.max_image_pixels is not None:
            caps["input_media"] = self.max_rows * self.max_frames * self.max_image_pixels * 3
        if self.max_signal_samples is not None:
            caps["input_signal"] = self.max_rows * self.max_signal_samples * 4
        return caps


@dataclass(frozen=True)
class RequestRow:
    """One prompt of a request, decoded: `sampling` holds the `SamplingParams` fields the row sets, `lora_uid` the
    LoRA adapter it asks for (None: none)."""

    text: str
    media_bytes: tuple[bytes, ...] | None = None
    media: np.ndarray | None = None
    signal: np.ndarray | None = None
    sampling: Mapping[str, int | float] = field(default_factory=dict)
    lora_uid: str | None = None


def _encoded_item_cap(max_item_bytes: int) -> int:
    """The bytes a media item of `max_item_bytes` may take on the wire: room for it as a base64 `data:` URL."""
    return 4 * -(-max_item_bytes // 3) + _DATA_URL_HEADER_BYTES


def split_request(request: Mapping[str, np.ndarray], limits: WireLimits = WireLimits()) -> list[RequestRow]:
    """Check one request against `limits`, then decode it into its rows; WireError naming a bad input."""
    arrays = {name: np.asarray(value) for name, value in request.items()}
    rows = _check_shapes(arrays, limits)
    _check_sizes(arrays, limits)
    return [_decode_row(arrays, row, rows, limits) for row in range(rows)]


def _check_shapes(arrays: Mapping[str, np.ndarray], limits: WireLimits) -> int:
    if "input_text" not in arrays:
        raise WireError("request has no input_text; send the prompt as input_text")
    texts = arrays["input_text"]
    rows = texts.shape[0] if texts.ndim else 0
    for name, array in arrays.items():
        if array.ndim == 0 or array.shape[0] != rows:
            raise WireError(f"input {name} has shape {list(array.shape)}, but input_text has {rows} rows; "
                            "give every input the same number of rows")
        if array.size == 0:
            raise WireError(f"input {name} is empty (shape {list(array.shape)}); send a value or leave it out")
    if limits.max_rows is not None and rows > limits.max_rows:
        raise WireError(f"the request holds {rows} prompts, over max_batch_size={limits.max_rows}; "
                        "send fewer prompts at once")
    for name in ("input_text", "input_signal_length", *(p.name for p in PARAMS)):
        if name in arrays and arrays[name].size != rows:
            raise WireError(f"input {name} must hold one value per row, got shape {list(arrays[name].shape)}")
    if "input_media" in arrays:
        media = arrays["input_media"]
        if media.dtype != np.uint8 or media.ndim != 5 or media.shape[-1] != 3:
            raise WireError(f"input_media must be uint8 [rows, images or frames, height, width, 3], got "
                            f"{media.dtype} {list(media.shape)}")
    if "input_signal" in arrays:
        signal = arrays["input_signal"]
        if signal.dtype != np.float32 or signal.ndim != 2:
            raise WireError(f"input_signal must be float32 [rows, samples], got {signal.dtype} {list(signal.shape)}")
    return rows


def _check_sizes(arrays: Mapping[str, np.ndarray], limits: WireLimits) -> None:
    if limits.max_text_bytes is not None:
        longest = max(len(item) for item in arrays["input_text"].reshape(-1))
        if longest > limits.max_text_bytes:
            raise WireError(f"input_text is {longest} bytes, over the {limits.max_text_bytes} bytes a prompt of "
                            "max_input_len tokens can take; shorten the text")
    if "input_media_bytes" in arrays:
        items = arrays["input_media_bytes"]
        count = items.size // items.shape[0]
        if limits.max_media_items is not None and count > limits.max_media_items:
            raise WireError(f"input_media_bytes holds {count} media items per prompt, over the cap of "
                            f"{limits.max_media_items}; send fewer")
        if limits.max_media_item_bytes is not None:
            cap = _encoded_item_cap(limits.max_media_item_bytes)
            largest = max(len(item) for item in items.reshape(-1))
            if largest > cap:
                raise WireError(f"an input_media_bytes item is {largest} bytes, over the cap of "
                                f"{limits.max_media_item_bytes} bytes per media item")
    if "input_media" in arrays:
        _, frames, height, width, _ = arrays["input_media"].shape
        if limits.max_frames is not None and frames > limits.max_frames:
            raise WireError(f"input_media holds {frames} images or frames per prompt, over the cap of "
                            f"{limits.max_frames}")
        if limits.max_image_pixels is not None and height * width > limits.max_image_pixels:
            raise WireError(f"input_media images are {width}x{height} pixels, over the cap of "
                            f"{limits.max_image_pixels} pixels")
    if "input_signal" in arrays and limits.max_signal_samples is not None:
        samples = arrays["input_signal"].shape[1]
        if samples > limits.max_signal_samples:
            raise WireError(f"input_signal holds {samples} samples, over the cap of {limits.max_signal_samples}")


def _decode_row(arrays: Mapping[str, np.ndarray], row: int, rows: int, limits: WireLimits) -> RequestRow:
    text = _utf8(arrays["input_text"][row].reshape(-1)[0], f"input_text of row {row}")
    media_bytes = None
    if "input_media_bytes" in arrays:
        media_bytes = tuple(_media_item(item, row, limits) for item in arrays["input_media_bytes"][row].reshape(-1))
    media = arrays["input_media"][row] if "input_media" in arrays else None
    signal = None
    if "input_signal" in arrays:
        signal = arrays["input_signal"][row]
        if "input_signal_length" in arrays:
            length = int(arrays["input_signal_length"][row].reshape(-1)[0])
            if not 0 < length <= signal.shape[0]:
                raise WireError(f"input_signal_length of row {row} is {length}, "
                                f"but input_signal has {signal.shape[0]} samples")
            signal = signal[:length]
    uid = None
    if LORA_UIDS in arrays:
        uids = [_utf8(uid, f"{LORA_UIDS} of row {row}") for uid in arrays[LORA_UIDS][row].reshape(-1)]
        try:
            uid = lora_uids_per_row(uids, rows)[row]
        except ValueError as error:
            raise WireError(f"{LORA_UIDS} of row {row}: {error}") from None
    return RequestRow(text=text, media_bytes=media_bytes, media=media, signal=signal,
                      sampling=sampling_fields(arrays, row), lora_uid=uid)


def _media_item(value: object, row: int, limits: WireLimits) -> bytes:
    """An encoded media file, given as its bytes or, for JSON clients such as curl, as a base64 `data:` URL."""
    raw = _as_bytes(value)
    if raw.startswith(b"data:"):
        header, _, payload = raw.partition(b",")
        if not header.endswith(b";base64"):
            raise WireError(f"input_media_bytes of row {row} is a data: URL without ;base64; send base64 data")
        try:
            raw = base64.b64decode(payload, validate=True)
        except binascii.Error as error:
            raise WireError(f"input_media_bytes of row {row} has invalid base64 data ({error})") from None
    if not raw:
        raise WireError(f"input_media_bytes of row {row} is empty; send an encoded media file")
    if limits.max_media_item_bytes is not None and len(raw) > limits.max_media_item_bytes:
        raise WireError(f"input_media_bytes of row {row} is {len(raw)} bytes, over the cap of "
                        f"{limits.max_media_item_bytes} bytes per media item")
    return raw


def _as_bytes(value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    return bytes(value)  # type: ignore[call-overload]


def _utf8(value: object, what: str) -> str:
    try:
        return _as_bytes(value).decode("utf-8")
    except UnicodeDecodeError as error:
        raise WireError(f"{what} is not valid UTF-8 ({error})") from None
