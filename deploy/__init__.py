"""Serving exported multimodal models behind Triton (NeMo's `nemo.deploy` names).

PyTriton is imported when `DeployPyTriton` is first used, so that exporting and running a model in-process
(`exporter`) works where PyTriton is not installed.
"""

from __future__ import annotations

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


def __getattr__(name: str):
    if name in ("DeployPyTriton", "RequestBatcher"):
        from deploy import deploy_pytriton

        return getattr(deploy_pytriton, name)
    raise AttributeError(name)
