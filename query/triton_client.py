"""One served model over Triton's HTTP or gRPC protocol (`tritonclient`, no server package): wait until it is ready,
read what it takes from its config, send a request, or stream one (gRPC).

Every failure is a `QueryError` carrying the server's message and status when the server answered.
"""

from __future__ import annotations

import queue
import re
import socket
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import tritonclient.grpc
import tritonclient.http
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from wire import ServedModel

DEFAULT_PORTS = {"http": 8000, "grpc": 8001}
_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception)): ", re.MULTILINE)
_WRAPPER_ERRORS = {"TritonModelException", "InferenceServerException"}
_POLL_S = 0.5


class QueryError(RuntimeError):
    """The server refused or failed a request; `server_message` holds Triton's text and `status` its status
    (an HTTP code such as "400", or a gRPC code such as "StatusCode.INVALID_ARGUMENT"), when the server answered."""

    def __init__(self, message: str, server_message: str = "", status: str | None = None):
        super().__init__(message)
        self.server_message = server_message
        self.status = status


def server_error_summary(message: str) -> str:
    """The model's own `XxxError: text` out of Triton's wrapped traceback, or the message as it is."""
    message = message.split("\n\n\n\nAt:")[0]
    matches = [m for m in _ERROR_LINE.finditer(message) if m.group(1) not in _WRAPPER_ERRORS]
    if not matches:
        return message.strip()
    last = matches[-1]
    return f"{last.group(1)}: {message[last.end() :].strip()}"


@dataclass(frozen=True)
class TritonUrl:
    """A Triton server's address: `host[:port]` or `http://host[:port]` (HTTP), `grpc://host[:port]` (gRPC); the
    port defaults to Triton's (8000 HTTP, 8001 gRPC)."""

    scheme: str
    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> TritonUrl:
        parsed = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        scheme = parsed.scheme.lower()
        try:
            port = parsed.port
        except ValueError:
            port = -1
        if scheme not in DEFAULT_PORTS or not parsed.hostname or port == -1:
            raise ValueError(f"bad Triton URL {url!r}: give host[:port] (HTTP) or grpc://host[:port]")
        return cls(scheme, parsed.hostname, port or DEFAULT_PORTS[scheme])

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return f"{self.scheme}://{self.address}"


class TritonModel:
    """A model served by Triton: connects, waits up to `init_timeout` s until it is ready and reads its config
    (`served`); `infer` sends a request, `stream` streams one over gRPC. Use it from one thread at a time."""

    def __init__(self, url: str, model_name: str, *, init_timeout: float, inference_timeout: float):
        self.url = TritonUrl.parse(url)
        self.model_name = model_name
        self.inference_timeout = inference_timeout
        self._grpc = self.url.scheme == "grpc"
        if self._grpc:
            self._client: Any = tritonclient.grpc.InferenceServerClient(self.url.address)
        else:
            self._client = tritonclient.http.InferenceServerClient(
                self.url.address, connection_timeout=inference_timeout, network_timeout=inference_timeout
            )
        try:
            self.served = self._wait_until_ready(init_timeout)
        except BaseException:
            self.close()
            raise

    def infer(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """The `outputs` of one request (every input with the batch axis first)."""
        extra = {"client_timeout": self.inference_timeout} if self._grpc else {}
        try:
            result = self._client.infer(self.model_name, self._inputs(inputs), **extra)
        except InferenceServerException as error:
            raise self._error(error) from None
        except OSError as error:  # HTTP: a timeout or a dropped connection
            raise self._transport_error(error) from None
        return result.as_numpy("outputs")

    def stream(self, row: dict[str, np.ndarray]) -> Iterator[np.ndarray]:
        """The `outputs` of the request's one row, `[beams]`, from each response of a decoupled model (gRPC);
        closing the iterator early cancels the request."""
        responses: queue.Queue = queue.Queue()
        self._client.start_stream(callback=lambda result, error: responses.put((result, error)))
        finished = False
        try:
            batch = {name: value[np.newaxis] for name, value in row.items()}
            self._client.async_stream_infer(self.model_name, self._inputs(batch), enable_empty_final_response=True)
            while True:
                try:
                    result, error = responses.get(timeout=self.inference_timeout)
                except queue.Empty:
                    raise QueryError(f"no answer within {self.inference_timeout} s (inference_timeout)") from None
                if error is not None:
                    raise self._error(error)
                final = result.get_response().parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    finished = True
                    return
                yield result.as_numpy("outputs")[0]
        finally:
            self._client.stop_stream(cancel_requests=not finished)

    def close(self) -> None:
        """Close the connection."""
        self._client.close()

    def _inputs(self, inputs: dict[str, np.ndarray]) -> list:
        library = tritonclient.grpc if self._grpc else tritonclient.http
        wrapped = []
        for name, value in inputs.items():
            tensor = library.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
            tensor.set_data_from_numpy(value)
            wrapped.append(tensor)
        return wrapped

    def _wait_until_ready(self, init_timeout: float) -> ServedModel:
        deadline = time.monotonic() + init_timeout
        while True:
            try:
                if self._client.is_server_ready():
                    if self._client.is_model_ready(self.model_name):
                        return ServedModel.from_config(self._config())
                    self._check_listed()
                    problem = "the model is not ready"
                else:
                    problem = "the server is not ready"
            except InferenceServerException as error:
                problem = error.message()
            except OSError as error:
                problem = str(error) or type(error).__name__
            if time.monotonic() >= deadline:
                raise QueryError(f"model {self.model_name!r} at {self.url} is not available after {init_timeout} s "
                                 f"(init_timeout): {problem}", problem)
            time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))

    def _config(self) -> dict[str, Any]:
        if self._grpc:
            return self._client.get_model_config(self.model_name, as_json=True)["config"]
        return self._client.get_model_config(self.model_name)

    def _check_listed(self) -> None:
        """A QueryError at once when the server's repository has no model of this name (no point waiting)."""
        index = self._client.get_model_repository_index(**({"as_json": True} if self._grpc else {}))
        names = sorted({model["name"] for model in (index.get("models", []) if self._grpc else index)})
        if self.model_name not in names:
            raise QueryError(f"no model named {self.model_name!r} at {self.url}; it serves "
                             f"{', '.join(repr(name) for name in names) or 'no models'}")

    def _error(self, error: InferenceServerException) -> QueryError:
        message = error.message()
        if "Deadline Exceeded" in message:
            return QueryError(f"no answer within {self.inference_timeout} s (inference_timeout)", message)
        status = error.status()
        return QueryError(f"the server failed the request: {server_error_summary(message)}", message,
                          None if status is None else str(status))

    def _transport_error(self, error: OSError) -> QueryError:
        if isinstance(error, (socket.timeout, TimeoutError)):
            return QueryError(f"no answer within {self.inference_timeout} s (inference_timeout)", str(error))
        return QueryError(f"the query failed: {error}", str(error))
