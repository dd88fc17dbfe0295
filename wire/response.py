"""The `outputs` tensor: UTF-8 answers, one entry per beam for each row."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def encode_outputs(answers: Sequence[Sequence[str]]) -> dict[str, np.ndarray]:
    """Pack `[row][beam]` answer strings into the `outputs` tensor of one request."""
    widths = {len(beams) for beams in answers}
    if len(widths) != 1:
        raise ValueError(f"every row must have the same number of beams, got {sorted(widths)}")
    return {"outputs": np.array([[a.encode("utf-8") for a in beams] for beams in answers], dtype=np.bytes_)}


def decode_answer(value: object) -> str:
    """One `outputs` entry as text (bytes that are not UTF-8 are replaced, never raised on)."""
    return (value if isinstance(value, bytes) else bytes(value)).decode("utf-8", errors="replace")  # type: ignore[call-overload]
