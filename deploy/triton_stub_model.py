"""Triton's Python-backend model for `DeployPyTriton`: PyTriton's proxy model, with clean client errors.

This file runs inside Triton's backend processes, not in the serving process. `DeployPyTriton` copies it into
Triton's model repository as `model.py`, next to PyTriton's own proxy model (renamed `pytriton_model.py`) and
`triton_errors.py`. It changes three things about PyTriton's model:

- a failed request is answered with its one-line message and its status's error code (see `triton_errors`),
  never with a traceback;
- a request with an empty input tensor, or an input over its byte cap (`input_caps.json`, written by
  `DeployPyTriton` from the model's `triton_input_byte_caps`), is refused naming the input, before PyTriton
  hands the tensors to the serving process (PyTriton's transfer cannot carry an empty one);
- the instances other than the first wait for the first one's handshake socket, so a slow start on a busy machine
  does not fail the load;
- each instance, once set up, waits at the gate (`triton_gate`) until the serving process lets it go: Triton starts
  beside the model's load and opens its ports after it.
"""

import json
import pathlib
import time

import triton_python_backend_utils as pb_utils

from . import pytriton_model as _pytriton
from .triton_errors import BAD_REQUEST, INPUT_CAPS_FILE, INTERNAL, TRITON_CODES, UNKNOWN_FAILURE, parse_failure
from .triton_gate import wait_at_gate

HANDSHAKE_WAIT_S = 300.0


def _error(status, message):
    return pb_utils.TritonError(message, getattr(pb_utils.TritonError, TRITON_CODES[status]))


def _failure(text):
    """The client's error for a failure PyTriton reported as `text` (a formatted traceback)."""
    status, message = parse_failure(str(text))
    if status == INTERNAL and message == UNKNOWN_FAILURE:
        pb_utils.Logger.log_error(f"request failed in the Python backend: {text}")
    return _error(status, message)


class _ProxyUtils:
    """`pb_utils` as PyTriton's proxy model sees it: the errors it builds for failed streams keep their status."""

    def __getattr__(self, name):
        return getattr(pb_utils, name)

    @staticmethod
    def TritonError(error):  # noqa: N802 - pb_utils' name
        return _failure(error)


_pytriton.pb_utils = _ProxyUtils()


def _refusal(request, caps):
    """The error for a request with an empty input tensor or an input over its byte cap, or None."""
    for tensor in request.inputs():
        array = tensor.as_numpy()
        if array.size == 0:
            return _error(BAD_REQUEST, f"input {tensor.name()} is empty (shape {list(array.shape)}); "
                                       "send a value or leave it out")
        cap = caps.get(tensor.name())
        if cap is not None:
            size = sum(len(item) for item in array.flat) if array.dtype == object else array.nbytes
            if size > cap:
                return _error(BAD_REQUEST, f"input {tensor.name()} is {size} bytes, over this server's cap of {cap} "
                                           "bytes per request")
    return None


class TritonPythonModel(_pytriton.TritonPythonModel):
    """PyTriton's proxy model (see the module doc for what differs)."""

    def initialize(self, args):
        self._caps = json.loads(pathlib.Path(__file__).with_name(INPUT_CAPS_FILE).read_text())
        name = args["model_instance_name"]
        config = json.loads(args["model_config"])
        workspace = pathlib.Path(config["parameters"]["workspace-path"]["string_value"])
        if name != "_".join(name.split("_")[:-1] + ["0"]):  # PyTriton's test for the first instance
            handshake = workspace / f"{args['model_name']}-config.sock"
            deadline = time.monotonic() + HANDSHAKE_WAIT_S
            while not handshake.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        super().initialize(args)
        if not wait_at_gate(workspace, name):
            raise pb_utils.TritonModelException("the serving process stopped before its model was served")

    def execute(self, requests):
        refused = [_refusal(request, self._caps) for request in requests]
        accepted = [request for request, error in zip(requests, refused) if error is None]
        if self._decoupled_model:
            for request, error in zip(requests, refused):
                if error is not None:
                    request.get_response_sender().send(pb_utils.InferenceResponse(error=error),
                                                       flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return super().execute(accepted) if accepted else None
        answers = iter(self._answer(accepted) if accepted else [])
        return [pb_utils.InferenceResponse(error=error) if error is not None else next(answers) for error in refused]

    def _answer(self, requests):
        try:
            return super().execute(requests)
        except pb_utils.TritonModelException as exception:
            error = _failure(exception)
            return [pb_utils.InferenceResponse(error=error) for _ in requests]
