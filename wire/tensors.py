"""The Triton tensors of a served multimodal model: NeMo's names, shapes and dtypes, and the model names.

Every tensor has Triton's batch axis first; one row is one prompt.

- `input_text` bytes (1,): the prompt, UTF-8.
- `input_media_bytes` object (-1,), optional: the row's encoded media files (JPEG/PNG images, an MP4 video, a WAV
  clip); several images for models that take several per prompt (VILA). JSON clients (curl) may send each as a
  base64 `data:` URL.
- vision: `input_media` uint8 (-1,-1,-1,3), optional: raw RGB pixels `[frames, H, W, 3]` as NeMo sends them.
- audio: `input_signal` float32 (-1,) + `input_signal_length` int32 (1,), optional: the raw waveform (NeMo).
- optional per-row generation parameters (`wire.params`): `batch_size, max_output_len, top_k, num_beams` (int64,
  (1,)), `top_p, temperature, repetition_penalty` (float32, (1,)), `lora_uids` (bytes, (-1,)).
- output `outputs` bytes (-1,): the answer of each row, one entry per beam.

PyTriton is imported only when specs are built, so clients and the engine import this module without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from wire.media import MODALITIES
from wire.params import LORA_UIDS, PARAMS

if TYPE_CHECKING:
    from pytriton.model_config import Tensor

STREAM_MODEL_SUFFIX = "_stream"
"""`DeployPyTriton(streaming=True)` serves the decoupled (streaming) model as `<triton_model_name>_stream`."""


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
    params = tuple(Tensor(name=p.name, shape=(1,), dtype=p.dtype, optional=True) for p in PARAMS)
    return (
        Tensor(name="input_text", shape=(1,), dtype=bytes),
        *media,
        Tensor(name="input_media_bytes", shape=(-1,), dtype=object, optional=True),
        *params,
        Tensor(name=LORA_UIDS, shape=(-1,), dtype=bytes, optional=True),
    )


def multimodal_triton_outputs() -> tuple[Tensor, ...]:
    """Triton output specs: `outputs`, one UTF-8 answer per beam for each row."""
    from pytriton.model_config import Tensor

    return (Tensor(name="outputs", shape=(-1,), dtype=bytes),)
