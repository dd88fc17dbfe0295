"""The on-disk engine format: ``export_engine`` writes it, ``load_engine`` reads it."""

from .directory import Engine, LoraOptions, export_engine, load_engine, read_manifest
from .errors import EngineError
from .limits import EngineLimits, LimitError

__all__ = ["Engine", "EngineError", "EngineLimits", "LimitError", "LoraOptions", "export_engine", "load_engine", "read_manifest"]
