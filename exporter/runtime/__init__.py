"""Serving-time execution: the request pipeline (and, on GPU, the in-flight scheduler)."""

from .pipeline import Completion, Pipeline, Request

__all__ = ["Completion", "Pipeline", "Request"]
