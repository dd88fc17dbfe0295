"""Querying served multimodal models (NeMo's `NemoQueryMultimodal`) and client-side media loading.

Needs neither torch nor Triton's server: the base install (`pip install .` from a clone) is enough.
"""

from query.media import MediaError
from query.query_multimodal import NemoQueryMultimodal
from query.triton_client import QueryError

__all__ = ["MediaError", "NemoQueryMultimodal", "QueryError"]
