"""SALM audio perception in plain PyTorch: NeMo's mel front end, FastConformer encoder, modality adapter and `proj`."""

from .onnx_export import export_audio_onnx
from .perception import FRONTENDS, AudioPerception, AudioPerceptionError

__all__ = ["FRONTENDS", "AudioPerception", "AudioPerceptionError", "export_audio_onnx"]
