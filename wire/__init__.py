"""The Triton wire format shared by the engine (`exporter`), the server (`deploy`) and the client (`query`).

Tensor specs, the media kinds and what a server publishes about its model (`wire.media`), a request's rows, the
one mapping from parameter tensors to the engine's sampling fields, output encoding, and the `ITritonDeployable`
contract. numpy only: PyTriton is imported when specs are built.
"""

from wire.deployable import ITritonDeployable, default_warmup_request
from wire.media import (
    AUDIO,
    IMAGE,
    MEDIA_KINDS,
    MODALITIES,
    VIDEO,
    MediaKind,
    ServedModel,
    media_kind,
    served_parameters,
)
from wire.params import (
    LORA_UIDS,
    NO_LORA_UIDS,
    PARAMS,
    WireParam,
    lora_uids_per_row,
    param_tensors,
    sampling_fields,
)
from wire.request import (
    PROMPT_BYTES_PER_TOKEN,
    InferRequest,
    RequestRow,
    WireError,
    WireLimits,
    split_request,
)
from wire.response import decode_answer, encode_outputs
from wire.tensors import (
    STREAM_MODEL_SUFFIX,
    multimodal_triton_inputs,
    multimodal_triton_outputs,
    stream_model_name,
)

__all__ = [
    "AUDIO",
    "IMAGE",
    "LORA_UIDS",
    "MEDIA_KINDS",
    "MODALITIES",
    "NO_LORA_UIDS",
    "PARAMS",
    "PROMPT_BYTES_PER_TOKEN",
    "STREAM_MODEL_SUFFIX",
    "VIDEO",
    "ITritonDeployable",
    "InferRequest",
    "MediaKind",
    "RequestRow",
    "ServedModel",
    "WireError",
    "WireLimits",
    "WireParam",
    "decode_answer",
    "default_warmup_request",
    "encode_outputs",
    "lora_uids_per_row",
    "media_kind",
    "multimodal_triton_inputs",
    "multimodal_triton_outputs",
    "param_tensors",
    "sampling_fields",
    "served_parameters",
    "split_request",
    "stream_model_name",
]
