"""Serving-time execution: the request pipeline, the in-flight scheduler, CUDA graphs, the feature cache.

The pipeline's names are loaded on first use, so that model types can import the small runtime helpers
(the feature cache) without importing the engine.
"""

from __future__ import annotations

__all__ = ["Completion", "Pipeline", "Request"]


def __getattr__(name: str):
    if name in __all__:
        from . import pipeline

        return getattr(pipeline, name)
    raise AttributeError(name)
