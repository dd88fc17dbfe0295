"""The contract between a model and `DeployPyTriton` (NeMo's `ITritonDeployable`), and the wire format.

Wire format (every tensor has Triton's batch axis first; one row = one prompt):

- `input_text` bytes (1,): the prompt, UTF-8.
- `input_media_bytes` object (-1,), optional: the row's encoded media files (JPEG/PNG images, an MP4 video, a WAV
  clip); several images for models that take several per prompt (VILA). JSON clients (curl) may send each as a
  base64 `data:` URL.
- vision: `input_media` uint8 (-1,-1,-1,3), optional: raw RGB pixels `[frames, H, W, 3]` as NeMo sends them.
- audio: `input_signal` float32 (-1,) + `input_signal_length` int32 (1,), optional: the raw waveform (NeMo).
- optional per-row generation parameters: `batch_size, max_output_len, top_k, num_beams` (int64, (1,)),
  `top_p, temperature, repetition_penalty` (float32, (1,)), `lora_uids` (bytes, (-1,)).
- output `outputs` bytes (-1,): the answer of each row, one entry per beam.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pytriton.model_config import Tensor

MODEL_TYPE_MODALITY: dict[str, str] = {
    "neva": "vision",
    "video-neva": "vision",
    "vila": "vision",
    "lita": "vision",
    "vita": "vision",
    "salm": "audio",
}
"""Every model type served, with the modality it takes."""

MODALITIES = ("vision", "audio")
VIDEO_MODEL_TYPES = ("video-neva", "lita", "vita")

STREAM_MODEL_SUFFIX = "_stream"
"""`DeployPyTriton(streaming=True)` serves the decoupled (streaming) model as `<triton_model_name>_stream`."""

_INT_PARAMS = ("batch_size", "max_output_len", "top_k", "num_beams")
_FLOAT_PARAMS = ("top_p", "temperature", "repetition_penalty")

InferRequest = dict[str, np.ndarray]


def modality_of(model_type: str) -> str:
    """The modality ("vision" or "audio") of a model type; ValueError naming the valid types otherwise."""
    try:
        return MODEL_TYPE_MODALITY[model_type]
    except KeyError:
        raise ValueError(
            f"unknown model_type {model_type!r}; choose one of {', '.join(MODEL_TYPE_MODALITY)}"
        ) from None


def stream_model_name(model_name: str) -> str:
    """The name of the streaming model served next to `model_name` (a name already ending in the suffix stays)."""
    return model_name if model_name.endswith(STREAM_MODEL_SUFFIX) else model_name + STREAM_MODEL_SUFFIX


def multimodal_triton_inputs(modality: str) -> tuple[Tensor, ...]:
    """Triton input specs for a modality: text, media (encoded or raw), then the generation parameters."""
    from pytriton.model_config import Tensor

    if modality not in MODALITIES:
        raise ValueError(f"unknown modality {modality!r}; choose one of {', '.join(MODALITIES)}")
    media: tuple[Tensor, ...]
    if modality == "vision":
        media = (Tensor(name="input_media", shape=(-1, -1, -1, 3), dtype=np.uint8, optional=True),)
    else:
        media = (
            Tensor(name="input_signal", shape=(-1,), dtype=np.float32, optional=True),
            Tensor(name="input_signal_length", shape=(1,), dtype=np.int32, optional=True),
        )
    params = tuple(Tensor(name=n, shape=(1,), dtype=np.int_, optional=True) for n in _INT_PARAMS)
    params += tuple(Tensor(name=n, shape=(1,), dtype=np.float32, optional=True) for n in _FLOAT_PARAMS)
    params += (Tensor(name="lora_uids", shape=(-1,), dtype=bytes, optional=True),)
    return (
        Tensor(name="input_text", shape=(1,), dtype=bytes),
        *media,
        Tensor(name="input_media_bytes", shape=(-1,), dtype=object, optional=True),
        *params,
    )


def multimodal_triton_outputs() -> tuple[Tensor, ...]:
    """Triton output specs: `outputs`, one UTF-8 answer per beam for each row."""
    from pytriton.model_config import Tensor

    return (Tensor(name="outputs", shape=(-1,), dtype=bytes),)


@dataclasses.dataclass(frozen=True)
class GenerationParams:
    """Per-row generation parameters with NeMo's query defaults."""

    batch_size: int = 1
    max_output_len: int = 30
    top_k: int = 1
    num_beams: int = 1
    top_p: float = 0.0
    temperature: float = 1.0
    repetition_penalty: float = 1.0
    lora_uids: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class RequestRow:
    """One prompt of a request, decoded from the wire format."""

    text: str
    media_bytes: tuple[bytes, ...] | None
    media: np.ndarray | None
    signal: np.ndarray | None
    params: GenerationParams


def split_request(request: Mapping[str, np.ndarray]) -> list[RequestRow]:
    """Decode one Triton request (batch axis first) into its rows; ValueError naming a bad input."""
    if "input_text" not in request:
        raise ValueError("request has no input_text; send the prompt as input_text")
    texts = np.asarray(request["input_text"])
    num_rows = texts.shape[0]
    for name, value in request.items():
        if np.asarray(value).shape[:1] != (num_rows,):
            raise ValueError(
                f"input {name} has {np.asarray(value).shape[:1]} rows but input_text has {num_rows}"
            )
    return [_decode_row(request, row) for row in range(num_rows)]


def _decode_row(request: Mapping[str, np.ndarray], row: int) -> RequestRow:
    text = _utf8(request["input_text"][row].reshape(-1)[0], f"input_text of row {row}")
    media_bytes = None
    if "input_media_bytes" in request:
        media_bytes = tuple(_media_item(item, row) for item in request["input_media_bytes"][row].reshape(-1))
        if not media_bytes or not all(media_bytes):
            raise ValueError(f"input_media_bytes of row {row} is empty; send an encoded media file")
    media = np.asarray(request["input_media"][row], dtype=np.uint8) if "input_media" in request else None
    signal = None
    if "input_signal" in request:
        signal = np.asarray(request["input_signal"][row], dtype=np.float32)
        if "input_signal_length" in request:
            length = int(request["input_signal_length"][row].reshape(-1)[0])
            if not 0 < length <= signal.shape[0]:
                raise ValueError(
                    f"input_signal_length of row {row} is {length}, "
                    f"but input_signal has {signal.shape[0]} samples"
                )
            signal = signal[:length]
    return RequestRow(
        text=text, media_bytes=media_bytes, media=media, signal=signal, params=_row_params(request, row)
    )


def _row_params(request: Mapping[str, np.ndarray], row: int) -> GenerationParams:
    values: dict[str, object] = {}
    for name in _INT_PARAMS:
        if name in request:
            values[name] = int(request[name][row].reshape(-1)[0])
    for name in _FLOAT_PARAMS:
        if name in request:
            values[name] = float(request[name][row].reshape(-1)[0])
    if "lora_uids" in request:
        uids = np.asarray(request["lora_uids"][row]).reshape(-1)
        values["lora_uids"] = tuple(_utf8(uid, f"lora_uids of row {row}") for uid in uids)
    return GenerationParams(**values)


def _media_item(value: object, row: int) -> bytes:
    """An encoded media file, given as its bytes or, for JSON clients such as curl, as a base64 `data:` URL."""
    raw = _as_bytes(value)
    if not raw.startswith(b"data:"):
        return raw
    header, _, payload = raw.partition(b",")
    if not header.endswith(b";base64"):
        raise ValueError(f"input_media_bytes of row {row} is a data: URL without ;base64; send base64 data")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as error:
        raise ValueError(f"input_media_bytes of row {row} has invalid base64 data ({error})") from None


def _as_bytes(value: object) -> bytes:
    return value if isinstance(value, bytes) else bytes(value)


def _utf8(value: object, what: str) -> str:
    try:
        return _as_bytes(value).decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{what} is not valid UTF-8 ({error})") from None


def encode_outputs(answers: Sequence[Sequence[str]]) -> dict[str, np.ndarray]:
    """Pack `[row][beam]` answer strings into the `outputs` tensor of one request."""
    widths = {len(beams) for beams in answers}
    if len(widths) != 1:
        raise ValueError(f"every row must have the same number of beams, got {sorted(widths)}")
    return {"outputs": np.array([[a.encode("utf-8") for a in beams] for beams in answers], dtype=np.bytes_)}


def infer_requests_one_by_one(
    infer_fn: Callable[..., dict[str, np.ndarray]], requests: Sequence[InferRequest]
) -> list[dict[str, np.ndarray] | Exception]:
    """Answer each request with a whole-batch `triton_infer_fn`; each failure stays in its request's slot."""
    results: list[dict[str, np.ndarray] | Exception] = []
    for request in requests:
        try:
            results.append(infer_fn(**request))
        except Exception as error:  # noqa: BLE001 - the failure belongs to this request only
            results.append(error)
    return results


def default_warmup_request(inputs: Sequence[Tensor]) -> InferRequest:
    """A small valid request for a model's input specs: a prompt plus a grey image or a silent signal."""
    names = {tensor.name for tensor in inputs}
    request: InferRequest = {"input_text": np.array([[b"Describe this."]], dtype=np.bytes_)}
    if "input_media" in names:
        request["input_media"] = np.full((1, 1, 64, 64, 3), 128, dtype=np.uint8)
    elif "input_signal" in names:
        request["input_signal"] = np.zeros((1, 16000), dtype=np.float32)
        request["input_signal_length"] = np.array([[16000]], dtype=np.int32)
    elif "input_media_bytes" in names:
        from PIL import Image

        png = io.BytesIO()
        Image.new("RGB", (64, 64), (128, 128, 128)).save(png, format="PNG")
        request["input_media_bytes"] = np.array([[png.getvalue()]], dtype=object)
    return request


class ITritonDeployable(ABC):
    """A model `DeployPyTriton` can serve: NeMo's interface, request-level batching and a warm-up request.

    A model that also has `triton_stream_request(request) -> Iterator[outputs dict]` (one `outputs` piece of text
    per item) can be served with `DeployPyTriton(streaming=True)`.
    """

    @property
    @abstractmethod
    def get_triton_input(self) -> tuple[Tensor, ...]:
        """Input tensor specs (see `multimodal_triton_inputs`)."""

    @property
    @abstractmethod
    def get_triton_output(self) -> tuple[Tensor, ...]:
        """Output tensor specs (see `multimodal_triton_outputs`)."""

    @abstractmethod
    def triton_infer_fn(self, **inputs: np.ndarray) -> dict[str, np.ndarray]:
        """Answer one batch of rows given as whole-batch arrays; raise on bad input (NeMo's function)."""

    def triton_infer_requests(
        self, requests: Sequence[InferRequest]
    ) -> list[dict[str, np.ndarray] | Exception]:
        """Answer several requests together; a failed request gets its Exception in its slot.

        Each request maps input names to arrays with the batch axis first. Override to batch across requests;
        the default answers them one by one with `triton_infer_fn`.
        """
        return infer_requests_one_by_one(self.triton_infer_fn, requests)

    def triton_warmup_request(self) -> InferRequest:
        """A valid request run once before the model is reported ready; override it if need be."""
        return default_warmup_request(self.get_triton_input)
