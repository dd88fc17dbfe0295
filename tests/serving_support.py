"""Helpers for tests against a running server: raw Triton requests over HTTP and gRPC with their status, and the
check that an error a client sees is one short line."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

LEAKS = ("Traceback", 'File "', "/work/", "/tmp/", "/root/", "/home/", "/opt/", "site-packages", "\n")
MAX_ERROR_CHARS = 500


def assert_short_error(message: str) -> None:
    """A client-visible error: one line, short, naming something, without traceback text or server paths."""
    assert message and len(message) <= MAX_ERROR_CHARS, message
    leaked = [leak for leak in LEAKS if leak in message.strip()]
    assert not leaked, f"{leaked} in {message!r}"


def json_tensor(name: str, array: np.ndarray) -> dict:
    """One input of Triton's JSON /infer body; bytes that are not UTF-8 go as base64 `data:` URLs."""
    array = np.asarray(array)
    data = array.reshape(-1).tolist()
    if array.dtype == object or array.dtype.kind == "S":
        data = [_json_text(item) if isinstance(item, bytes) else item for item in data]
    return {"name": name, "shape": list(array.shape), "datatype": np_to_triton_dtype(array.dtype), "data": data}


def _json_text(item: bytes) -> str:
    try:
        return item.decode("utf-8")
    except UnicodeDecodeError:
        return "data:application/octet-stream;base64," + base64.b64encode(item).decode()


def http_infer(url: str, model: str, inputs: list[dict] | bytes, timeout_s: float = 60) -> tuple[int, dict]:
    """POST /v2/models/<model>/infer with a JSON body; (HTTP status, parsed body)."""
    body = inputs if isinstance(inputs, bytes) else json.dumps({"inputs": inputs}).encode()
    request = urllib.request.Request(f"http://{url}/v2/models/{model}/infer", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def grpc_infer(url: str, model: str, arrays: dict[str, np.ndarray], timeout_s: float = 60) -> tuple[str, object]:
    """One gRPC inference: ("OK", the `outputs` array) or (the gRPC status code's name, the error message)."""
    with grpcclient.InferenceServerClient(url.removeprefix("grpc://")) as client:
        inputs = []
        for name, array in arrays.items():
            tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        try:
            result = client.infer(model, inputs, client_timeout=timeout_s)
        except InferenceServerException as error:
            return str(error.status()).removeprefix("StatusCode."), error.message()
    return "OK", result.as_numpy("outputs")
