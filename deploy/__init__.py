"""Serving exported multimodal models behind Triton (NeMo's `nemo.deploy` names)."""

from deploy.deploy_pytriton import DeployPyTriton, RequestBatcher
from deploy.startup import DeployError, ModelRepositoryError, PortInUseError
from deploy.triton_deployable import (
    MODEL_TYPE_MODALITY,
    GenerationParams,
    ITritonDeployable,
    RequestRow,
    encode_outputs,
    modality_of,
    multimodal_triton_inputs,
    multimodal_triton_outputs,
    split_request,
)

__all__ = [
    "MODEL_TYPE_MODALITY",
    "DeployError",
    "DeployPyTriton",
    "GenerationParams",
    "ITritonDeployable",
    "ModelRepositoryError",
    "PortInUseError",
    "RequestBatcher",
    "RequestRow",
    "encode_outputs",
    "modality_of",
    "multimodal_triton_inputs",
    "multimodal_triton_outputs",
    "split_request",
]
