"""Perception: vision towers (transformers CLIP / SigLIP), NeMo projectors, image preprocessing, ONNX."""

from .image_preprocess import DEFAULT_MAX_IMAGE_PIXELS, ImageLoadError, ImagePreprocessor
from .onnx_export import export_vision_onnx
from .projector import DownSampleBlock, ProjectorError, build_projector, load_projector
from .vision_encoder import SPEC_FORMAT, VisionEncoder, VisionEncoderError, build_vision_encoder
from .vision_tower import VisionTower, VisionTowerError, build_vision_tower

__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS",
    "SPEC_FORMAT",
    "DownSampleBlock",
    "ImageLoadError",
    "ImagePreprocessor",
    "ProjectorError",
    "VisionEncoder",
    "VisionEncoderError",
    "VisionTower",
    "VisionTowerError",
    "build_projector",
    "build_vision_encoder",
    "build_vision_tower",
    "export_vision_onnx",
    "load_projector",
]
