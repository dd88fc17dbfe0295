"""Export NeMo multimodal checkpoints to engine directories and run them (NeMo's ``TensorRTMMExporter``)."""

from __future__ import annotations

__all__ = ["TensorRTMMExporter"]


def __getattr__(name: str):
    if name == "TensorRTMMExporter":
        from .tensorrt_mm_exporter import TensorRTMMExporter

        return TensorRTMMExporter
    raise AttributeError(name)
