"""Serving-time execution: the request pipeline (and, on GPU, the in-flight scheduler)."""

from .pipeline import Pipeline, Request

__all__ = ["Pipeline", "Request"]
