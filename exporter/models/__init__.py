"""The model types, by their ``--model_type`` name.

Each module of this package that defines ``MODEL_TYPES`` (a tuple of :class:`ModelType` instances) registers them,
so adding a model type is adding one module here. :func:`register_model_types` registers the types of a module
kept elsewhere (a plugin, a test).
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from .base import ModelType, MultimodalInputError, Perception, PromptLayout

_REGISTRY: dict[str, ModelType] = {}


def register_model_types(module: ModuleType) -> tuple[ModelType, ...]:
    """Register the ``MODEL_TYPES`` of ``module`` under their names; a name taken by another type is an error."""
    types = getattr(module, "MODEL_TYPES", None)
    if not isinstance(types, tuple) or not all(isinstance(kind, ModelType) for kind in types):
        raise TypeError(f"{module.__name__}.MODEL_TYPES must be a tuple of ModelType instances")
    for kind in types:
        registered = _REGISTRY.setdefault(kind.name, kind)
        if registered is not kind:
            raise ValueError(f"model_type {kind.name!r} of {module.__name__} is taken by "
                             f"{type(registered).__module__}.{type(registered).__name__}")
    return types


def _register_package_modules() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(module, "MODEL_TYPES"):
            register_model_types(module)


def model_types() -> dict[str, ModelType]:
    """Every registered model type by name."""
    return dict(_REGISTRY)


def get_model_type(name: str) -> ModelType:
    """The model type registered as ``name``; an unknown name is an error listing the known ones."""
    if name not in _REGISTRY:
        raise ValueError(f"unsupported model_type {name!r}; supported: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


_register_package_modules()

__all__ = ["ModelType", "MultimodalInputError", "Perception", "PromptLayout", "get_model_type", "model_types",
           "register_model_types"]
