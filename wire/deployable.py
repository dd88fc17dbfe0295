"""The contract between a model and `deploy.DeployPyTriton` (NeMo's `ITritonDeployable`), and its warm-up request."""

from __future__ import annotations

import io
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from wire.request import InferRequest

if TYPE_CHECKING:
    from pytriton.model_config import Tensor


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
    """A model `DeployPyTriton` can serve: NeMo's interface plus a warm-up request.

    `DeployPyTriton` calls `triton_infer_fn` with one request at a time from each of its Triton instances, so
    concurrent requests run concurrently; the model answers each as soon as its own rows are done. A model that
    also has `triton_stream_request(request) -> Iterator[outputs dict]` (one `outputs` piece of text per item) can
    be served with `DeployPyTriton(streaming=True)`.
    """

    @property
    @abstractmethod
    def get_triton_input(self) -> tuple[Tensor, ...]:
        """Input tensor specs (see `wire.multimodal_triton_inputs`)."""

    @property
    @abstractmethod
    def get_triton_output(self) -> tuple[Tensor, ...]:
        """Output tensor specs (see `wire.multimodal_triton_outputs`)."""

    @abstractmethod
    def triton_infer_fn(self, **inputs: np.ndarray) -> dict[str, np.ndarray]:
        """Answer one request (whole-batch arrays, one row per prompt); raise on bad input (NeMo's function)."""

    def triton_warmup_request(self) -> InferRequest:
        """A valid request run once before the model is reported ready; override it if need be."""
        return default_warmup_request(self.get_triton_input)

    def triton_model_parameters(self) -> dict[str, str]:
        """Parameters published in the model's Triton config for clients to read (`wire.served_parameters`: the
        model type and its media kinds). None by default."""
        return {}

    def triton_input_byte_caps(self) -> dict[str, int]:
        """The most bytes each input of one request may hold; a request over a cap is refused before its tensors
        reach the model. None by default."""
        return {}
