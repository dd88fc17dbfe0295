"""`NemoQueryMultimodal`: send prompts and media to a served multimodal model (NeMo's client, arguments)."""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import threading
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from PIL import Image
from pytriton.client import DecoupledModelClient, ModelClient
from pytriton.client.exceptions import (
    PyTritonClientError,
    PyTritonClientInferenceServerError,
    PyTritonClientTimeoutError,
)
from pytriton.client.utils import TritonUrl
from pytriton.client.warnings import NotSupportedTimeoutWarning
from tritonclient.utils import InferenceServerException

from query import http_json
from query import media as media_io
from wire import (
    LORA_UIDS,
    MODEL_TYPE_MODALITY,
    VIDEO_MODEL_TYPES,
    decode_answer,
    lora_uids_per_row,
    param_tensors,
    stream_model_name,
)

DEFAULT_INFERENCE_TIMEOUT_S = 300.0
BACKENDS = ("triton", "ray")

# PyTriton warns on each client that gRPC ignores timeouts outside inference; those that matter still apply.
warnings.filterwarnings("ignore", category=NotSupportedTimeoutWarning)


class _OwnCancellationFilter(logging.Filter):
    """Drops PyTriton's error log for a stream that `query_stream` cancels because its reader stopped early."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Locally cancelled by application" not in record.getMessage()


logging.getLogger("pytriton.client.client").addFilter(_OwnCancellationFilter())

_HTTP_STREAM_INPUTS = ("input_text", "input_media_bytes")  # JSON carries text and files; raw arrays need gRPC
_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception)): ", re.MULTILINE)
_WRAPPER_ERRORS = {"TritonModelException", "InferenceServerException"}


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


def _as_list(value, single_types: tuple[type, ...]) -> list:
    if value is None or isinstance(value, single_types):
        return [value]
    return list(value)


class NemoQueryMultimodal:
    """Sends queries to a multimodal model served by `DeployPyTriton`.

    Example:
        nq = NemoQueryMultimodal(url="localhost:8000", model_name="neva", model_type="neva")
        print(nq.query(input_text="What is in this image?", input_media="cat.jpg", max_output_len=30))

    Images go on the wire encoded (`input_media_bytes`); `raw_pixels=True` sends decoded pixels as
    `input_media` (video frames; the waveform for salm) as NeMo's client did. One Triton client is opened on
    the first query and kept; use one object per thread for concurrent queries.

    `backend="ray"` queries a Ray Serve deployment (`scripts/deploy_ray.py`, `url` such as `http://host:1024`)
    through its Triton-shaped HTTP JSON routes instead of Triton's protocol; streaming works as over Triton's HTTP.
    """

    def __init__(
        self,
        url: str,
        model_name: str,
        model_type: str,
        *,
        raw_pixels: bool = False,
        media_timeout_s: float = media_io.DEFAULT_TIMEOUT_S,
        media_max_bytes: int = media_io.DEFAULT_MAX_BYTES,
        backend: str = "triton",
    ):
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if model_type not in MODEL_TYPE_MODALITY:
            raise ValueError(
                f"unknown model_type {model_type!r}; choose one of {', '.join(MODEL_TYPE_MODALITY)}"
            )
        self.url = url
        self.model_name = model_name
        self.model_type = model_type
        self.raw_pixels = raw_pixels
        self.backend = backend
        self._read_options = {"timeout_s": media_timeout_s, "max_bytes": media_max_bytes}
        self._client = None
        self._client_timeouts: tuple[float, float] | None = None
        self._lock = threading.Lock()

    def query(
        self,
        input_text: str | Sequence[str],
        input_media=None,
        batch_size: int = 1,
        max_output_len: int = 30,
        top_k: int = 1,
        top_p: float = 0.0,
        temperature: float = 1.0,
        repetition_penalty: float = 1.0,
        num_beams: int = 1,
        init_timeout: float = 60.0,
        lora_uids: Sequence[str] | None = None,
        inference_timeout: float = DEFAULT_INFERENCE_TIMEOUT_S,
    ) -> np.ndarray:
        """Answers as a str array `[prompt][beam]`; text and media may be lists (one each, or one shared).

        `lora_uids`: the LoRA adapter of every prompt (one uid) or of each (one per prompt, "-1" for none).
        Raises QueryError with the server's message when the server fails the request.
        """
        texts = _as_list(input_text, (str,))
        medias = _as_list(input_media, (str, os.PathLike, bytes, np.ndarray, Image.Image))
        if any(not isinstance(text, str) for text in texts):
            raise TypeError("input_text must be a str or a list of str")
        media_rows = [self._media_inputs(media) for media in medias]
        if len(media_rows) == 1 and len(texts) > 1:
            media_rows *= len(texts)
        elif len(texts) == 1 and len(media_rows) > 1:
            texts *= len(media_rows)
        elif len(texts) != len(media_rows):
            raise ValueError(
                f"got {len(texts)} prompts but {len(media_rows)} media; give one media or one each"
            )
        params = {
            "batch_size": batch_size, "max_output_len": max_output_len, "top_k": top_k, "num_beams": num_beams,
            "top_p": top_p, "temperature": temperature, "repetition_penalty": repetition_penalty,
        }
        rows = [
            {"input_text": np.array([text.encode("utf-8")], dtype=np.bytes_), **media_row,
             **param_tensors({**params, LORA_UIDS: [uid] if uid else None})}
            for text, media_row, uid in zip(texts, media_rows, lora_uids_per_row(lora_uids, len(texts)))
        ]
        with self._lock:
            infer, max_rows = self._transport(init_timeout, inference_timeout)
            answers: list[np.ndarray | None] = [None] * len(rows)
            for indices in _request_groups(rows, max(1, max_rows)):
                outputs = infer(_stack([rows[i] for i in indices]))
                for index, output in zip(indices, outputs, strict=True):
                    answers[index] = output
        return np.array([[decode_answer(answer) for answer in row] for row in answers])

    def query_stream(
        self,
        input_text: str,
        input_media=None,
        max_output_len: int = 30,
        top_k: int = 1,
        top_p: float = 0.0,
        temperature: float = 1.0,
        repetition_penalty: float = 1.0,
        init_timeout: float = 60.0,
        lora_uids: Sequence[str] | None = None,
        inference_timeout: float = DEFAULT_INFERENCE_TIMEOUT_S,
    ) -> Iterator[str]:
        """Yield the answer to one prompt piece by piece as the server generates it; the pieces join to the answer.

        Asks the streaming model `<model_name>_stream` that `deploy_triton.py --streaming` serves: over gRPC
        (`grpc://host:port`) with a decoupled stream, over HTTP with Triton's `generate_stream` (server-sent
        events; media go as base64 `data:` URLs). Stopping early closes the stream. Raises QueryError with the
        server's message when the server fails the request.
        """
        if not isinstance(input_text, str):
            raise TypeError("query_stream answers one prompt: input_text must be a str (use query for several)")
        params = param_tensors({
            "max_output_len": max_output_len, "top_k": top_k, "top_p": top_p, "temperature": temperature,
            "repetition_penalty": repetition_penalty, LORA_UIDS: _row_uid(lora_uids),
        })
        row = {"input_text": np.array([input_text.encode("utf-8")], dtype=np.bytes_)}
        row.update(self._media_inputs(input_media), **params)
        model_name = stream_model_name(self.model_name)
        if self.backend == "ray":
            return _http_stream(http_json.http_base(self.url), model_name, _generate_json(row), inference_timeout)
        url = TritonUrl.from_url(self.url)
        if url.scheme == "grpc":
            return _grpc_stream(url.with_scheme, model_name, row, init_timeout, inference_timeout)
        return _http_stream(url.with_scheme, model_name, _generate_json(row), inference_timeout)

    def close(self) -> None:
        """Close the Triton client (a later query opens a new one)."""
        with self._lock:
            self._close_client()

    def __enter__(self) -> NemoQueryMultimodal:
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def _media_inputs(self, media) -> dict[str, np.ndarray]:
        """One row's media tensors (without the batch axis); a list or tuple is several items for one prompt."""
        if media is None:
            return {}
        if isinstance(media, (list, tuple)):
            if self.raw_pixels:
                raise ValueError("several media items per prompt go encoded; do not set raw_pixels")
            encoded = [self._encoded(item) for item in media]
            return {"input_media_bytes": np.array(encoded, dtype=object)}
        options = self._read_options
        if self.model_type == "salm" and (self.raw_pixels or isinstance(media, np.ndarray)):
            signal = media_io.audio_signal(media, **options)
            return {"input_signal": signal, "input_signal_length": np.array([signal.shape[0]], dtype=np.int32)}
        if self.model_type in VIDEO_MODEL_TYPES and (self.raw_pixels or isinstance(media, np.ndarray)):
            return {"input_media": media_io.video_frames(media, **options)}  # the server samples the frames
        if self.raw_pixels and self.model_type not in VIDEO_MODEL_TYPES and self.model_type != "salm":
            return {"input_media": media_io.image_pixels(media, **options)[np.newaxis]}
        return {"input_media_bytes": np.array([self._encoded(media)], dtype=object)}

    def _encoded(self, media) -> bytes:
        """One media item as the bytes of its file: images re-encoded as needed, videos and audio as they are."""
        if self.model_type == "salm" or self.model_type in VIDEO_MODEL_TYPES:
            return media_io.read_media_bytes(media, **self._read_options)
        return media_io.image_bytes(media, **self._read_options)

    def _transport(self, init_timeout: float, inference_timeout: float) -> tuple[Callable, int]:
        """(a function answering one request's stacked tensors with its `outputs`, the most rows a request holds)."""
        if self.backend == "ray":
            base = http_json.http_base(self.url)
            max_rows = _json_call(http_json.max_rows, base, self.model_name, init_timeout)
            return (lambda inputs: _json_call(http_json.infer, base, self.model_name, inputs, inference_timeout),
                    max_rows)
        client = self._open_client(init_timeout, inference_timeout)
        return (lambda inputs: self._infer(client, inputs, inference_timeout)), self._max_rows(client)

    def _open_client(self, init_timeout: float, inference_timeout: float) -> ModelClient:
        if self._client is not None and self._client_timeouts != (init_timeout, inference_timeout):
            self._close_client()
        if self._client is None:
            self._client = ModelClient(
                self.url, self.model_name, init_timeout_s=init_timeout, inference_timeout_s=inference_timeout
            )
            self._client_timeouts = (init_timeout, inference_timeout)
        return self._client

    def _close_client(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _max_rows(self, client: ModelClient) -> int:
        try:
            return client.model_config.max_batch_size
        except PyTritonClientError as error:
            self._close_client()
            raise QueryError(
                f"model {self.model_name!r} at {self.url} is not available: {error.message}", error.message
            ) from None

    def _infer(
        self, client: ModelClient, inputs: dict[str, np.ndarray], inference_timeout: float
    ) -> np.ndarray:
        try:
            return client.infer_batch(**inputs)["outputs"]
        except PyTritonClientError as error:
            if not isinstance(error, PyTritonClientInferenceServerError):
                self._close_client()
            raise _query_error(error, inference_timeout) from None


def _json_call(function: Callable, *args):
    """`function(*args)` of `query.http_json`, its failure as a QueryError."""
    try:
        return function(*args)
    except http_json.JsonRequestError as error:
        if error.status is None:
            raise QueryError(f"the query failed: {error.message}", error.message) from None
        raise QueryError(f"the server failed the request: {error.message}", error.message, str(error.status)) from None


def _query_error(error: PyTritonClientError, inference_timeout: float) -> QueryError:
    """A failed Triton call as a QueryError: the server's own message, a timeout, or the client's failure."""
    if isinstance(error, PyTritonClientInferenceServerError):
        server = error.__cause__  # Triton's own error, which PyTriton's client wraps
        if isinstance(server, InferenceServerException):
            message = server.message()
            return QueryError(f"the server failed the request: {server_error_summary(message)}", message,
                              server.status())
        return QueryError(f"the server failed the request: {server_error_summary(error.message)}", error.message)
    if isinstance(error, PyTritonClientTimeoutError):
        return QueryError(f"no answer within {inference_timeout} s (inference_timeout)", error.message)
    return QueryError(f"the query failed: {error.message}", error.message)


def _grpc_stream(
    url: str, model_name: str, row: dict[str, np.ndarray], init_timeout: float, inference_timeout: float
) -> Iterator[str]:
    client = DecoupledModelClient(url, model_name, init_timeout_s=init_timeout, inference_timeout_s=inference_timeout)
    responses = None
    finished = False
    try:
        responses = client.infer_sample(**row)
        for result in responses:
            yield decode_answer(result["outputs"][0])
        finished = True
    except PyTritonClientError as error:
        raise _query_error(error, inference_timeout) from None
    finally:
        if not finished:  # PyTriton's close() would wait for the rest of the answer: cancel the stream instead
            client._infer_client.stop_stream(cancel_requests=True)
        if responses is not None:
            responses.close()
        client.close()


def _http_stream(url: str, model_name: str, body: dict[str, object], inference_timeout: float) -> Iterator[str]:
    request = urllib.request.Request(
        f"{url}/v2/models/{model_name}/generate_stream",
        data=json.dumps(body).encode("utf-8"),
        headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
    )
    try:
        response = urllib.request.urlopen(request, timeout=inference_timeout)
    except urllib.error.HTTPError as error:  # failed before the first piece: the body holds the error
        message = _sse_error(error.read()) or f"HTTP {error.code} {error.reason}"
        raise QueryError(f"the server failed the request: {server_error_summary(message)}", message,
                         str(error.code)) from None
    except (urllib.error.URLError, TimeoutError) as error:
        raise QueryError(f"the query failed: {error}", str(error)) from None
    with response:
        for line in response:
            if not line.startswith(b"data:"):
                continue
            event = json.loads(line[len(b"data:") :])
            if "error" in event:
                raise QueryError(
                    f"the server failed the request: {server_error_summary(event['error'])}", event["error"]
                )
            outputs = event.get("outputs", "")
            yield outputs if isinstance(outputs, str) else "".join(outputs)


def _generate_json(row: dict[str, np.ndarray]) -> dict[str, object]:
    """A request row as the JSON of Triton's generate extension: strings, numbers, lists; media as data: URLs."""
    raw = sorted(name for name in row if name.startswith("input_") and name not in _HTTP_STREAM_INPUTS)
    if raw:
        raise ValueError(
            f"{', '.join(raw)} cannot be streamed over HTTP; stream over gRPC (grpc://host:port) "
            "or send the media as files (raw_pixels=False)"
        )
    body: dict[str, object] = {}
    for name, value in row.items():
        items = [_json_value(name, item) for item in value.tolist()]
        body[name] = items[0] if len(items) == 1 and name != "input_media_bytes" else items
    return body


def _json_value(name: str, item: object) -> object:
    if not isinstance(item, bytes):
        return item
    if name == "input_media_bytes":
        return "data:application/octet-stream;base64," + base64.b64encode(item).decode("ascii")
    return item.decode("utf-8")


def _sse_error(body: bytes) -> str | None:
    """The error message in a Triton error body (plain JSON or one server-sent event)."""
    text = body.decode("utf-8", errors="replace").strip().removeprefix("data:")
    try:
        return str(json.loads(text)["error"])
    except (ValueError, KeyError, TypeError):
        return text or None


def _row_uid(lora_uids: Sequence[str] | None) -> list[str] | None:
    """The `lora_uids` of a one-prompt request: its one uid, or None for no adapter."""
    (uid,) = lora_uids_per_row(lora_uids, 1)
    return [uid] if uid else None


def _row_key(row: dict[str, np.ndarray]) -> tuple:
    """Rows with equal keys share a request; raw pixels must also share their shape (signals get padded)."""
    return tuple(
        sorted((name, value.shape if name == "input_media" else None) for name, value in row.items())
    )


def _request_groups(rows: list[dict[str, np.ndarray]], max_rows: int) -> list[list[int]]:
    groups: dict[tuple, list[int]] = {}
    for index, row in enumerate(rows):
        groups.setdefault(_row_key(row), []).append(index)
    return [
        indices[i : i + max_rows] for indices in groups.values() for i in range(0, len(indices), max_rows)
    ]


def _stack(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    stacked = {}
    for name in rows[0]:
        values = [row[name] for row in rows]
        if name == "input_signal":
            width = max(len(v) for v in values)
            values = [np.pad(v, (0, width - len(v))) for v in values]
        stacked[name] = np.stack(values)
    return stacked
