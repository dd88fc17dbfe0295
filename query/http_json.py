"""Requests in Triton's HTTP JSON (`wire.http_json`) with the standard library, for servers without Triton's binary
protocol: the Ray Serve front's `/v2/models/<name>/infer` and `/config` routes."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping

import numpy as np

from wire.http_json import infer_request_to_json, outputs_from_json


class JsonRequestError(RuntimeError):
    """A request failed: `message` is the server's (or the connection's) and `status` the HTTP status, if any."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.message, self.status = message, status


def http_base(url: str) -> str:
    """`http://host:port` for a URL given with or without its scheme (gRPC URLs are refused)."""
    if url.startswith("grpc://"):
        raise ValueError(f"{url} is a gRPC URL; a Ray Serve deployment answers HTTP: give http://host:port")
    return (url if url.startswith(("http://", "https://")) else f"http://{url}").rstrip("/")


def open_url(url: str, body: dict | None, timeout_s: float):
    """The response to a GET (`body` None) or a JSON POST; JsonRequestError with the server's message if it failed."""
    data = None if body is None else json.dumps(body).encode("utf-8")
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                     method="GET" if body is None else "POST")
    try:
        return urllib.request.urlopen(request, timeout=timeout_s)
    except urllib.error.HTTPError as error:
        raise JsonRequestError(error_message(error.read()) or f"HTTP {error.code} {error.reason}",
                               error.code) from None
    except (urllib.error.URLError, TimeoutError) as error:
        raise JsonRequestError(f"cannot reach {url}: {getattr(error, 'reason', error)}") from None


def _request(url: str, body: dict | None, timeout_s: float) -> object:
    with open_url(url, body, timeout_s) as response:
        try:
            return json.loads(response.read())
        except (ValueError, OSError) as error:
            raise JsonRequestError(f"{url}: unreadable answer ({error})") from None


def error_message(body: bytes) -> str | None:
    """The message of a Triton error body (`{"error": "..."}`) or an OpenAI one (`{"error": {"message": ...}}`)."""
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", errors="replace").strip() or None
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)


def max_rows(base_url: str, model_name: str, timeout_s: float) -> int:
    """The most prompts one request may carry (the model's `max_batch_size`)."""
    config = _request(f"{base_url}/v2/models/{model_name}/config", None, timeout_s)
    return int(config.get("max_batch_size", 1)) if isinstance(config, dict) else 1


def infer(base_url: str, model_name: str, inputs: Mapping[str, np.ndarray], timeout_s: float) -> np.ndarray:
    """The `outputs` tensor (bytes, `[rows, beams]`) for one request's tensors (batch axis first)."""
    answer = _request(f"{base_url}/v2/models/{model_name}/infer", infer_request_to_json(inputs), timeout_s)
    return outputs_from_json(answer)
