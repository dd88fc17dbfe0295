"""Serving exported multimodal models behind Triton (NeMo's `nemo.deploy` names).

PyTriton is imported when `DeployPyTriton` is first used, so that exporting and running a model in-process
(`exporter`) works where PyTriton is not installed. `ITritonDeployable` is the wire format's contract
(`wire.ITritonDeployable`), under NeMo's name.
"""

from __future__ import annotations

from deploy.startup import DeployError, ModelRepositoryError, PortInUseError
from wire import ITritonDeployable

__all__ = ["DeployError", "DeployPyTriton", "ITritonDeployable", "ModelRepositoryError", "PortInUseError"]


def __getattr__(name: str):
    if name == "DeployPyTriton":
        from deploy.deploy_pytriton import DeployPyTriton

        return DeployPyTriton
    raise AttributeError(name)
