"""The one mapping between the wire's generation-parameter tensors and the engine's sampling fields.

Each parameter travels as a one-element tensor per row. The server turns a row's parameters into keyword
arguments of the engine's `SamplingParams` (which holds the defaults and checks the ranges); the client turns
keyword arguments into tensors. `batch_size` is NeMo's and carries no sampling field: it is accepted and ignored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WireParam:
    """A parameter tensor: its name on the wire, its dtype, and the `SamplingParams` field it sets (or None)."""

    name: str
    dtype: type
    field: str | None


PARAMS: tuple[WireParam, ...] = (
    WireParam("batch_size", np.int_, None),
    WireParam("max_output_len", np.int_, "max_output_len"),
    WireParam("top_k", np.int_, "top_k"),
    WireParam("num_beams", np.int_, "num_beams"),
    WireParam("top_p", np.float32, "top_p"),
    WireParam("temperature", np.float32, "temperature"),
    WireParam("repetition_penalty", np.float32, "repetition_penalty"),
)
"""Every generation parameter, in NeMo's order."""

LORA_UIDS = "lora_uids"
"""NeMo's LoRA adapter uids (bytes, (-1,) per row): the row's adapter, or NeMo's list of one uid per prompt of the
request in every row (`lora_uids_per_row`)."""
NO_LORA_UIDS = ("", "-1")
"""The uids that mean "no adapter" (TensorRT-LLM's -1)."""


def lora_uids_per_row(uids: Sequence[str] | None, rows: int) -> list[str | None]:
    """Each of `rows` prompts' LoRA uid from NeMo's `lora_uids`: one uid for all of them, or one per prompt; None
    for no adapter ("-1", "" or no uids). Another count is a ValueError."""
    if not uids:
        return [None] * rows
    names = [str(uid).strip() for uid in uids]
    if len(names) == 1:
        names *= rows
    elif len(names) != rows:
        raise ValueError(f"lora_uids holds {len(names)} uids for {rows} prompts; give one uid for all, or one per "
                         "prompt ('-1' for none)")
    return [None if name in NO_LORA_UIDS else name for name in names]


def sampling_fields(request: Mapping[str, np.ndarray], row: int) -> dict[str, int | float]:
    """The `SamplingParams` keyword arguments that a request's row sets (parameters it leaves out are absent)."""
    fields: dict[str, int | float] = {}
    for param in PARAMS:
        if param.field is not None and param.name in request:
            value = np.asarray(request[param.name][row]).reshape(-1)[0]
            fields[param.field] = int(value) if np.issubdtype(param.dtype, np.integer) else float(value)
    return fields


def param_tensors(values: Mapping[str, object]) -> dict[str, np.ndarray]:
    """One row's parameter tensors (no batch axis) from keyword values; None leaves a parameter out."""
    known = {param.name: param for param in PARAMS}
    unknown = sorted(set(values) - set(known) - {LORA_UIDS})
    if unknown:
        raise ValueError(f"unknown generation parameters {unknown}; known: {', '.join(known)}, {LORA_UIDS}")
    tensors = {
        name: np.array([value], dtype=known[name].dtype)
        for name, value in values.items()
        if name in known and value is not None
    }
    uids = values.get(LORA_UIDS)
    if uids:
        tensors[LORA_UIDS] = np.array([str(uid).encode("utf-8") for uid in uids], dtype=np.bytes_)  # type: ignore[union-attr]
    return tensors
