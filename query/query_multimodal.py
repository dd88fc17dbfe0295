"""`NemoQueryMultimodal`: send prompts and media to a served multimodal model (NeMo's client, arguments).

The client holds no table of model types: it reads the media kinds the served model takes (and its model type)
from the model's Triton config, which `deploy_triton.py` publishes from the model type's declaration.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence

import numpy as np
from PIL import Image

from query import media as media_io
from query.triton_client import QueryError, TritonModel, TritonUrl, server_error_summary
from wire import (
    LORA_UIDS,
    MediaKind,
    ServedModel,
    decode_answer,
    lora_uids_per_row,
    param_tensors,
    stream_model_name,
)

DEFAULT_INFERENCE_TIMEOUT_S = 300.0

_HTTP_STREAM_INPUTS = ("input_text", "input_media_bytes")  # JSON carries text and files; raw arrays need gRPC


def _as_list(value, single_types: tuple[type, ...]) -> list:
    if value is None or isinstance(value, single_types):
        return [value]
    return list(value)


class NemoQueryMultimodal:
    """Sends queries to a multimodal model served by `DeployPyTriton`.

    Example:
        nq = NemoQueryMultimodal(url="localhost:8000", model_name="neva", model_type="neva")
        print(nq.query(input_text="What is in this image?", input_media="cat.jpg", max_output_len=30))

    Media go on the wire as files (`input_media_bytes`); `raw_pixels=True` sends them decoded as NeMo's client did:
    pixels or video frames as `input_media`, an audio clip's waveform as `input_signal`. `model_type` must be the
    served model's (checked against what the server publishes). One Triton connection is opened on the first query
    and kept; use one object per thread for concurrent queries.
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
    ):
        TritonUrl.parse(url)  # a bad URL fails here
        self.url = url
        self.model_name = model_name
        self.model_type = model_type
        self.raw_pixels = raw_pixels
        self._read_options = {"timeout_s": media_timeout_s, "max_bytes": media_max_bytes}
        self._model: TritonModel | None = None
        self._model_timeouts: tuple[float, float] | None = None
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
        if len(medias) == 1 and len(texts) > 1:
            medias *= len(texts)
        elif len(texts) == 1 and len(medias) > 1:
            texts *= len(medias)
        elif len(texts) != len(medias):
            raise ValueError(f"got {len(texts)} prompts but {len(medias)} media; give one media or one each")
        params = {
            "batch_size": batch_size, "max_output_len": max_output_len, "top_k": top_k, "num_beams": num_beams,
            "top_p": top_p, "temperature": temperature, "repetition_penalty": repetition_penalty,
        }
        row_params = [param_tensors({**params, LORA_UIDS: [uid] if uid else None})
                      for uid in lora_uids_per_row(lora_uids, len(texts))]
        with self._lock:
            model = self._open_model(init_timeout, inference_timeout)
            rows = [self._row(text, media, model.served, tensors)
                    for text, media, tensors in zip(texts, medias, row_params, strict=True)]
            answers: list[np.ndarray | None] = [None] * len(rows)
            for indices in _request_groups(rows, max(1, model.served.max_batch_size)):
                outputs = self._infer(model, _stack([rows[i] for i in indices]))
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
        model = TritonModel(self.url, stream_model_name(self.model_name), init_timeout=init_timeout,
                            inference_timeout=inference_timeout)
        try:
            row = self._row(input_text, input_media, model.served, params)
            if model.url.scheme == "grpc":
                return _grpc_stream(model, row)
            body = _generate_json(row)
        except BaseException:
            model.close()
            raise
        model.close()
        return _http_stream(str(model.url), model.model_name, body, inference_timeout)

    def close(self) -> None:
        """Close the Triton connection (a later query opens a new one)."""
        with self._lock:
            self._close_model()

    def __enter__(self) -> NemoQueryMultimodal:
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def _row(self, text: str, media, served: ServedModel, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One prompt's tensors (without the batch axis), its media encoded for the served model's default kind."""
        if served.model_type is not None and served.model_type != self.model_type:
            raise QueryError(f"model {self.model_name!r} at {self.url} is a {served.model_type!r} model, not "
                             f"{self.model_type!r}; pass model_type={served.model_type!r}")
        return {"input_text": np.array([text.encode("utf-8")], dtype=np.bytes_),
                **self._media_inputs(media, served.media[0]), **params}

    def _media_inputs(self, media, kind: MediaKind) -> dict[str, np.ndarray]:
        """One row's media tensors (without the batch axis); a list or tuple is several items for one prompt."""
        if media is None:
            return {}
        if isinstance(media, (list, tuple)):
            if self.raw_pixels:
                raise ValueError("several media items per prompt go encoded; do not set raw_pixels")
            encoded = [media_io.file_bytes(kind, item, **self._read_options) for item in media]
            return {"input_media_bytes": np.array(encoded, dtype=object)}
        return media_io.media_tensors(kind, media, raw=self.raw_pixels, **self._read_options)

    def _open_model(self, init_timeout: float, inference_timeout: float) -> TritonModel:
        if self._model is not None and self._model_timeouts != (init_timeout, inference_timeout):
            self._close_model()
        if self._model is None:
            self._model = TritonModel(self.url, self.model_name, init_timeout=init_timeout,
                                      inference_timeout=inference_timeout)
            self._model_timeouts = (init_timeout, inference_timeout)
        return self._model

    def _close_model(self) -> None:
        if self._model is not None:
            self._model.close()
            self._model = None

    def _infer(self, model: TritonModel, inputs: dict[str, np.ndarray]) -> np.ndarray:
        try:
            return model.infer(inputs)
        except QueryError as error:
            if error.status is None:  # no answer from the server: connect again next time
                self._close_model()
            raise


def _grpc_stream(model: TritonModel, row: dict[str, np.ndarray]) -> Iterator[str]:
    try:
        for beams in model.stream(row):
            yield decode_answer(beams[0])
    finally:
        model.close()


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
