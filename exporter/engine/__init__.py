"""The on-disk engine format: ``export_engine`` writes it, ``load_engine`` reads it."""

from .directory import Engine, EngineError, export_engine, load_engine, prepare_model_dir, read_manifest
from .limits import EngineLimits, LimitError

__all__ = ["Engine", "EngineError", "EngineLimits", "LimitError", "export_engine", "load_engine",
           "prepare_model_dir", "read_manifest"]
