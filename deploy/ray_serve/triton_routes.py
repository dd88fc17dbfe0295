"""Triton's HTTP routes, answered by the engine replicas, so that Triton's HTTP clients (`NemoQueryMultimodal` and
`scripts/query.py` with an `http://` URL, `tritonclient.http`, curl) reach a Ray deployment as they reach Triton:

- `POST /v2/models/<name>/infer`: Triton's JSON body with NeMo's tensors (`wire.http_json`), or its binary tensor
  extension as `tritonclient.http` sends it; the answer's `outputs` hold one answer per beam for each prompt.
- `POST /v2/models/<name>/generate_stream` (also under `<name>_stream`): Triton's generate extension, one prompt,
  answered as server-sent events `data: {"model_name", "model_version", "outputs": "<piece>"}`.
- `POST /v2/repository/index`: the served names (the model and `<name>_stream`), as Triton lists its models.
- `GET /v2/models/<name>` (metadata: the tensors) and `/v2/models/<name>/config` (Triton's config: the tensors,
  `max_batch_size`, and the parameters the model publishes for its clients), also under `<name>_stream`.

A failure answers `{"error": "<one line>"}` with Triton's statuses: 400 bad input, 404 an unknown model, 500 a
fault of the model, 503 a replica that died under the request.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deploy.openai.app import relay
from deploy.ray_serve.remote import RemoteEngine
from deploy.ray_serve.transport import Failure
from deploy.triton_errors import BAD_REQUEST, one_line
from wire import WireError, multimodal_triton_inputs, multimodal_triton_outputs, stream_model_name
from wire.http_json import (
    HEADER_LENGTH,
    datatype_of,
    generate_request_from_json,
    infer_request_from_body,
    outputs_to_binary,
    outputs_to_json,
)

NOT_FOUND = 404
PLATFORM = "ray_serve"


def config_type(datatype: str) -> str:
    """A Triton config's `data_type` for a datatype name (`BYTES` is `TYPE_STRING`)."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def triton_error(status: int, message: str) -> JSONResponse:
    """Triton's error answer: one line under `error`."""
    return JSONResponse({"error": message}, status_code=status)


def add_triton_routes(app: FastAPI, remote: RemoteEngine, model_name: str) -> None:
    """Add Triton's model routes for `model_name` to `app`, answered by `remote`."""
    inputs = multimodal_triton_inputs(remote.modality)
    datatypes = {tensor.name: datatype_of(tensor.dtype) for tensor in inputs}
    names = (model_name, stream_model_name(model_name))

    def unknown(name: str) -> JSONResponse:
        return triton_error(NOT_FOUND, f"unknown model {name!r}; this server serves {model_name!r}")

    tensors = {"input": inputs, "output": multimodal_triton_outputs()}

    @app.get("/v2/models/{name}")
    async def model_metadata(name: str) -> Any:
        if name not in names:
            return unknown(name)
        return {"name": name, "versions": ["1"], "platform": PLATFORM,
                **{f"{kind}s": [{"name": t.name, "datatype": datatype_of(t.dtype), "shape": [-1, *t.shape]}
                                for t in specs] for kind, specs in tensors.items()}}

    @app.get("/v2/models/{name}/config")
    async def model_config(name: str) -> Any:
        if name not in names:
            return unknown(name)
        return {"name": name, "platform": PLATFORM, "max_batch_size": remote.facts.limits.max_batch_size,
                **{kind: [{"name": t.name, "data_type": config_type(datatype_of(t.dtype)), "dims": list(t.shape)}
                          for t in specs] for kind, specs in tensors.items()},
                "parameters": {key: {"string_value": value} for key, value in remote.facts.parameters.items()}}

    @app.get("/v2/models/{name}/ready")
    async def unknown_ready(name: str) -> JSONResponse:
        return unknown(name)  # the served names' readiness is answered in front of the app (`front.ReadyRoutes`)

    @app.post("/v2/repository/index")
    async def repository_index() -> list[dict[str, str]]:
        return [{"name": served, "version": "1", "state": "READY"} for served in names]

    @app.post("/v2/models/{name}/infer")
    async def infer(name: str, request: Request) -> Response:
        if name != model_name:
            return unknown(name)
        body, header_length = await request.body(), request.headers.get(HEADER_LENGTH)
        try:
            tensors, binary = await anyio.to_thread.run_sync(
                lambda: infer_request_from_body(body, header_length, datatypes))
        except WireError as error:
            return triton_error(BAD_REQUEST, one_line(str(error)))
        result = await anyio.to_thread.run_sync(remote.call, "infer", tensors)
        if isinstance(result, Failure):
            return triton_error(result.status, result.message)
        if not binary:
            return JSONResponse(outputs_to_json(name, result))
        content, length = outputs_to_binary(name, result)
        return Response(content, media_type="application/octet-stream", headers={HEADER_LENGTH: str(length)})

    @app.post("/v2/models/{name}/generate_stream")
    async def generate_stream(name: str, request: Request) -> Response:
        if name not in names:
            return unknown(name)
        body = await request.body()
        try:
            tensors = await anyio.to_thread.run_sync(lambda: generate_request_from_json(_json(body)))
        except WireError as error:
            return triton_error(BAD_REQUEST, one_line(str(error)))
        items = remote.items("infer_stream", tensors)
        first = await anyio.to_thread.run_sync(next, items, None)  # an error before any text keeps its status
        if isinstance(first, Failure):
            items.close()
            return triton_error(first.status, first.message)
        events = _events(name, itertools.chain([] if first is None else [first], items), items)
        return StreamingResponse(relay(events), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _json(body: bytes) -> object:
    try:
        return json.loads(body)
    except ValueError as error:
        raise WireError(f"the body is not valid JSON ({error}); send a JSON object") from None


def _events(name: str, pieces: Iterator[str | Failure], source: Iterator[Any]) -> Iterator[str]:
    """Server-sent events of a streamed answer; a failure after the first piece is an error event. Closing the
    events closes `source` (the replica's stream is cancelled)."""
    try:
        for piece in pieces:
            if isinstance(piece, Failure):
                yield f"data: {json.dumps({'error': piece.message})}\n\n"
                return
            yield f"data: {json.dumps({'model_name': name, 'model_version': '1', 'outputs': piece})}\n\n"
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()
