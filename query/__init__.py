"""Querying served multimodal models (NeMo's `NemoQueryMultimodal`) and client-side media loading."""

from query.media import MediaError
from query.query_multimodal import NemoQueryMultimodal, QueryError

__all__ = ["MediaError", "NemoQueryMultimodal", "QueryError"]
