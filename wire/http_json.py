"""Triton's HTTP bodies for the wire tensors, for a server that speaks Triton's HTTP protocol without Triton (the Ray
Serve front), so that Triton's clients (`tritonclient.http`, `NemoQueryMultimodal`, curl) reach it.

- `infer` (KServe v2): `{"inputs": [{"name", "shape", "datatype", "data"}]}`, `data` flattened row-major; `BYTES`
  items are strings: UTF-8 text, or a media file as a base64 `data:` URL (`wire.request` decodes those).
- its answer: `{"model_name", "outputs": [{"name": "outputs", "shape": [rows, beams], "datatype": "BYTES", "data"}]}`.
- Triton's binary tensor extension on both (what `tritonclient.http` sends): the JSON header, then the tensors' raw
  bytes in order; the header's length in the `Inference-Header-Content-Length` HTTP header, each binary tensor's
  size in its `parameters.binary_data_size` instead of `data` (BYTES items: a 4-byte little-endian length, then the
  bytes). The answer is binary when the request asks (`parameters.binary_data_output`, or `binary_data` on its
  requested output).
- generate (Triton's generate extension, one prompt): `{"input_text": "...", "input_media_bytes": "data:..." or a
  list of them, "max_output_len": 30, ...}`.

Every malformed body is a `WireError` naming the input. numpy only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from wire.params import LORA_UIDS, PARAMS
from wire.request import InferRequest, WireError

DATATYPES: dict[str, Any] = {"BYTES": np.object_, "UINT8": np.uint8, "INT32": np.int32, "INT64": np.int64,
                             "FP32": np.float32, "FP64": np.float64}
"""Triton's datatype names for the dtypes the wire tensors use."""

HEADER_LENGTH = "Inference-Header-Content-Length"
"""The HTTP header giving the JSON header's length in a binary body."""
_MEDIA_BYTES = "input_media_bytes"
_TEXT_INPUTS = ("input_text", _MEDIA_BYTES, LORA_UIDS)  # what a generate body may carry besides the parameters


def datatype_of(dtype: Any) -> str:
    """Triton's datatype name for a numpy dtype (bytes and object arrays are `BYTES`)."""
    kind = np.dtype(dtype)
    if kind == np.object_ or kind.kind in "SU":
        return "BYTES"
    for name, known in DATATYPES.items():
        if known is not np.object_ and kind == np.dtype(known):
            return name
    raise ValueError(f"dtype {kind} has no Triton datatype here; use one of {', '.join(DATATYPES)}")


def infer_request_from_body(body: bytes, header_length: str | None,
                            datatypes: Mapping[str, str]) -> tuple[InferRequest, bool]:
    """The tensors of an `infer` body (JSON, or binary with `header_length`, the `HEADER_LENGTH` HTTP header), and
    whether the answer should be binary."""
    binary = b""
    if header_length is not None:
        try:
            length = int(header_length)
        except ValueError:
            length = -1
        if not 0 <= length <= len(body):
            raise WireError(f"{HEADER_LENGTH} is {header_length!r}; give the JSON header's length in bytes")
        body, binary = body[:length], body[length:]
    try:
        header = json.loads(body)
    except ValueError as error:
        raise WireError(f"the body is not valid JSON ({error}); send a JSON object") from None
    return infer_request_from_json(header, datatypes, binary), _wants_binary(header)


def _wants_binary(header: object) -> bool:
    if not isinstance(header, dict):
        return False
    parameters = header.get("parameters")
    if isinstance(parameters, dict) and parameters.get("binary_data_output") is True:
        return True
    outputs = header.get("outputs")
    return any(isinstance(o, dict) and isinstance(o.get("parameters"), dict) and o["parameters"].get("binary_data")
               is True for o in (outputs if isinstance(outputs, list) else ()))


def infer_request_from_json(body: object, datatypes: Mapping[str, str], binary: bytes = b"") -> InferRequest:
    """The tensors of an `infer` body; `datatypes` maps each input the model takes to its datatype; `binary`: the
    raw tensors after a binary body's JSON header."""
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), list):
        raise WireError('the body must be a JSON object with an "inputs" list of {"name", "shape", "datatype", '
                        '"data"} objects')
    request: InferRequest = {}
    offset = 0
    for index, spec in enumerate(body["inputs"]):
        name = spec.get("name") if isinstance(spec, dict) else None
        if not isinstance(name, str):
            raise WireError(f'inputs[{index}] must be an object with a "name"')
        if name in request:
            raise WireError(f"input {name} is given twice")
        if name not in datatypes:
            raise WireError(f"unknown input {name!r}; this model takes {', '.join(datatypes)}")
        size = _binary_size(name, spec)
        if size is None:
            request[name] = _tensor(name, spec, datatypes[name])
            continue
        if offset + size > len(binary):
            raise WireError(f"input {name} has binary_data_size {size} but the body holds "
                            f"{max(0, len(binary) - offset)} more bytes")
        request[name] = _binary_tensor(name, spec, datatypes[name], binary[offset:offset + size])
        offset += size
    if offset != len(binary):
        raise WireError(f"the body holds {len(binary) - offset} bytes after its binary inputs")
    return request


def _binary_size(name: str, spec: dict) -> int | None:
    parameters = spec.get("parameters")
    size = parameters.get("binary_data_size") if isinstance(parameters, dict) else None
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
        raise WireError(f"input {name} has binary_data_size {size!r}; give a byte count")
    return size


def _checked_shape(name: str, spec: dict, expected: str) -> list[int]:
    shape, datatype = spec.get("shape"), spec.get("datatype")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise WireError(f"input {name} needs a shape: a list of non-negative integers")
    if datatype != expected:
        raise WireError(f"input {name} has datatype {datatype!r}; this model takes {expected}")
    return shape


def _binary_tensor(name: str, spec: dict, datatype: str, raw: bytes) -> np.ndarray:
    shape = _checked_shape(name, spec, datatype)
    count = math.prod(shape)
    if datatype != "BYTES":
        dtype = np.dtype(DATATYPES[datatype])
        if len(raw) != count * dtype.itemsize:
            raise WireError(f"input {name} has shape {shape} ({count * dtype.itemsize} bytes of {datatype}) but "
                            f"{len(raw)} binary bytes")
        return np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype).reshape(shape)
    items, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise WireError(f"input {name}: a BYTES item's 4-byte length is cut off")
        length = int.from_bytes(raw[offset:offset + 4], "little")
        if offset + 4 + length > len(raw):
            raise WireError(f"input {name}: a BYTES item of {length} bytes is cut off")
        items.append(raw[offset + 4:offset + 4 + length])
        offset += 4 + length
    if len(items) != count:
        raise WireError(f"input {name} has shape {shape} ({count} values) but {len(items)} BYTES items")
    array = np.empty(count, dtype=object)
    array[:] = items
    return array.reshape(shape)


def _tensor(name: str, spec: dict, expected: str) -> np.ndarray:
    shape, datatype, data = _checked_shape(name, spec, expected), expected, spec.get("data")
    flat = _flatten(data, name)
    if len(flat) != math.prod(shape):
        raise WireError(f"input {name} has shape {shape} ({math.prod(shape)} values) but {len(flat)} data values")
    if datatype == "BYTES":
        if not all(isinstance(item, str) for item in flat):
            raise WireError(f"input {name} is BYTES: send its items as strings")
        array = np.empty(len(flat), dtype=object)
        array[:] = [item.encode("utf-8") for item in flat]
        return array.reshape(shape)
    return _numbers(name, flat, DATATYPES[datatype]).reshape(shape)


def _flatten(data: object, name: str) -> list:
    if not isinstance(data, list):
        raise WireError(f"input {name} needs its values as a \"data\" list")
    flat: list = []
    stack = [iter(data)]
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
        elif isinstance(item, list):
            stack.append(iter(item))
        else:
            flat.append(item)
    return flat


_END = object()


def _numbers(name: str, values: list, dtype: Any) -> np.ndarray:
    integral = np.issubdtype(dtype, np.integer)
    allowed = (int,) if integral else (int, float)
    if not all(isinstance(v, allowed) and not isinstance(v, bool) for v in values):
        raise WireError(f"input {name} takes {'integers' if integral else 'numbers'}")
    if integral:
        info = np.iinfo(dtype)
        if values and not info.min <= min(values) <= max(values) <= info.max:
            raise WireError(f"input {name} holds values outside {info.min}..{info.max}")
    return np.array(values, dtype=dtype)


def generate_request_from_json(body: object) -> InferRequest:
    """The one-row tensors of a generate body: text inputs as strings (media as `data:` URLs), parameters as
    numbers; raw arrays (pixels, waveforms) do not fit it."""
    if not isinstance(body, dict):
        raise WireError("the body must be a JSON object mapping input names to values")
    params = {param.name: param.dtype for param in PARAMS}
    request: InferRequest = {}
    for name, value in body.items():
        if name in params:
            if isinstance(value, list) and len(value) == 1:
                value = value[0]
            request[name] = _numbers(name, [value], params[name]).reshape(1, 1)
        elif name in _TEXT_INPUTS:
            items = value if isinstance(value, list) and name != "input_text" else [value]
            if not items or not all(isinstance(item, str) for item in items):
                raise WireError(f"{name} takes a string" + (" or a list of strings" if name != "input_text" else ""))
            array = np.empty((1, len(items)), dtype=object)
            array[0, :] = [item.encode("utf-8") for item in items]
            request[name] = array
        elif name.startswith("input_"):
            raise WireError(f"{name} cannot be sent in a generate body; send media as files in {_MEDIA_BYTES} "
                            "(base64 data: URLs)")
        else:
            raise WireError(f"unknown input {name!r}; a generate body takes {', '.join(_TEXT_INPUTS)} and "
                            f"{', '.join(params)}")
    return request


def outputs_to_json(model_name: str, outputs: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The `infer` answer for an engine's `outputs` tensor (UTF-8 answers, `[rows, beams]`)."""
    array = np.asarray(outputs["outputs"])
    data = [bytes(item).decode("utf-8", errors="replace") for item in array.reshape(-1)]
    return {"model_name": model_name, "model_version": "1",
            "outputs": [{"name": "outputs", "shape": list(array.shape), "datatype": "BYTES", "data": data}]}


def outputs_to_binary(model_name: str, outputs: Mapping[str, np.ndarray]) -> tuple[bytes, int]:
    """The binary `infer` answer for an engine's `outputs` tensor, and its JSON header's length (`HEADER_LENGTH`)."""
    array = np.asarray(outputs["outputs"])
    raw = b"".join(len(item).to_bytes(4, "little") + item for item in (bytes(x) for x in array.reshape(-1)))
    header = json.dumps({"model_name": model_name, "model_version": "1",
                         "outputs": [{"name": "outputs", "shape": list(array.shape), "datatype": "BYTES",
                                      "parameters": {"binary_data_size": len(raw)}}]}).encode("utf-8")
    return header + raw, len(header)
