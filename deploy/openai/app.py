"""The OpenAI-compatible HTTP app (FastAPI) over a loaded `TensorRTMMExporter`: routes, SSE, body cap.

Routes: `GET /v1/models`, `GET /v1/models/{id}`, `GET /v1/health/live`, `GET /v1/health/ready`,
`POST /v1/chat/completions` (plain or `stream: true` as server-sent events in OpenAI's chunk format).

Errors are OpenAI error objects: 400 bad request or media, or a request over the engine's limits; 404 unknown model
or route; 413 media (or the body) over a size cap; 422 invalid parameters; 500 a model failure; 503 not ready.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Generator, Iterator
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from deploy.openai.errors import APIError, api_error, validation_error
from deploy.openai.schema import ChatCompletionRequest
from deploy.openai.translate import (
    MAX_TEXT_BYTES,
    ServedModel,
    StopFilter,
    completion_body,
    finish_reason,
    to_pipeline_request,
    usage,
)
from exporter.media_safety import MediaFetcher, MediaPolicy
from exporter.runtime import Completion
from exporter.runtime import Request as PipelineRequest

# --- server-sent events -------------------------------------------------------------------------------------------

def _event(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def peeked(pieces: Iterator[str]) -> Iterator[str]:
    """`pieces` with its first piece taken now, so that errors before any text raise here; the rest and the
    stream's return value follow."""
    try:
        first = next(pieces)
    except StopIteration as end:
        return _ended(end.value)

    def resumed():
        yield first
        return (yield from pieces)

    return resumed()


def _ended(value: Any) -> Iterator[str]:
    """A stream with no more pieces that returns `value`."""
    return value
    yield  # makes this a generator


def stream_events(pieces: Iterator[str], request: PipelineRequest, model: str, include_usage: bool) -> Iterator[str]:
    """Server-sent events for a streamed answer.

    The stream's return value, when it is a `Completion`, gives the finish reason and the usage chunk.
    """
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}

    def chunk(delta: dict[str, Any], reason: str | None = None) -> str:
        return _event({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]})

    stops = StopFilter(request.params.stop)
    completion = None
    try:
        yield chunk({"role": "assistant", "content": ""})
        while not stops.stopped:
            try:
                piece = next(pieces)
            except StopIteration as end:
                completion = end.value
                break
            if text := stops.feed(piece):
                yield chunk({"content": text})
        if text := stops.flush():
            yield chunk({"content": text})
        completion = completion if isinstance(completion, Completion) else None
        yield chunk({}, finish_reason(completion, stops.stopped, request.params.max_output_len))
        if include_usage and completion is not None:
            yield _event({**base, "choices": [], "usage": usage(completion)})
        yield _event("[DONE]")
    except Exception as error:  # noqa: BLE001 - after the headers went out, the error travels as an event
        yield _event(api_error(error).body())
    finally:
        close = getattr(pieces, "close", None)
        if close is not None:
            close()  # a client that went away frees its generation slot


async def relay(events: Generator[str, None, None]) -> AsyncIterator[str]:
    """`events` (blocking) relayed from worker threads, and closed as soon as the relay ends: when a client goes
    away mid-answer, its generation is cancelled at the next token rather than whenever the generator is collected."""
    try:
        while (event := await anyio.to_thread.run_sync(next, events, None)) is not None:
            yield event
    finally:
        events.close()  # not running: a cancelled relay returns only once its worker thread's next() did


# --- the app ------------------------------------------------------------------------------------------------------

class _BodyLimit:
    """ASGI middleware: 413 for request bodies over `max_bytes` (read before the app sees them)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = APIError(413, f"the request body is over {self.max_bytes} bytes (option openai_max_request_bytes)",
                             code="request_too_large")
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _drain(receive, int(declared))
            return await too_large.response()(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message]), send)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                if more:
                    await _drain(receive, size)
                return await too_large.response()(scope, receive, send)
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        return await self.app(scope, _replay([body], receive), send)


#: A refused body is read to its end (so the client, still sending, reads the 413 instead of a reset connection)
#: up to this many bytes; a longer one is answered at once.
DRAIN_LIMIT_BYTES = 64 << 20


async def _drain(receive, declared: int) -> None:
    """Read and drop the rest of a refused request body, up to `DRAIN_LIMIT_BYTES` in all."""
    read = 0
    while declared <= DRAIN_LIMIT_BYTES and read <= DRAIN_LIMIT_BYTES:
        message = await receive()
        read += len(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


def _replay(messages: list[dict], then=None):
    async def receive():
        if messages:
            return messages.pop(0)
        return await then() if then is not None else {"type": "http.disconnect"}
    return receive


def default_max_request_bytes(policy: MediaPolicy) -> int:
    """What the policy's media allow in one body (`max_request_bytes`, or `max_items` × `max_bytes` if smaller, as
    base64) plus the text cap and 64 KiB for the JSON around them."""
    media = min(policy.max_request_bytes, policy.max_items * policy.max_bytes)
    return media * 4 // 3 + MAX_TEXT_BYTES + (64 << 10)


async def _chat_body(request: Request) -> ChatCompletionRequest:
    """The request's body parsed and validated in a worker thread (a large body does not hold up the event loop)."""
    raw = await request.body()
    try:
        return await anyio.to_thread.run_sync(ChatCompletionRequest.model_validate_json, raw)
    except ValidationError as error:
        raise validation_error(error.errors()) from None


def create_app(exporter: Any, model_name: str, policy: MediaPolicy | None = None,
               max_request_bytes: int | None = None) -> FastAPI:
    """The FastAPI app serving `exporter` as model `model_name`; `app.state.ready` gates `/v1/health/ready`.

    Media URLs are fetched on the app's event loop (`MediaFetcher`), and parsing, media checks and the model run in
    worker threads, so the model list and health answer at once while requests wait on slow hosts or the model.
    """
    if max_request_bytes is not None and max_request_bytes < 1:
        raise ValueError(f"openai_max_request_bytes must be a positive number of bytes, got {max_request_bytes}")
    policy = policy or MediaPolicy()
    model = ServedModel(model_name, exporter)
    fetcher = MediaFetcher(policy)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await fetcher.aclose()

    app = FastAPI(title="nemo-mm-deploy OpenAI-compatible API", lifespan=lifespan)
    app.state.ready = True
    app.state.model = model
    app.add_middleware(_BodyLimit, max_bytes=max_request_bytes or default_max_request_bytes(policy))

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return APIError(error.status_code, str(error.detail), code="not_found" if error.status_code == 404 else None
                        ).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, error: Exception) -> JSONResponse:
        return api_error(error).response()

    def require_ready() -> None:
        if not app.state.ready:
            raise APIError(503, f"model {model_name!r} is not ready (starting or stopping); retry shortly",
                           code="not_ready")
        _ = model.engine

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": model.cards()}

    @app.get("/v1/models/{name}")
    async def get_model(name: str) -> dict[str, Any]:
        model.lora_uid(name)  # 404 unless served
        return next(card for card in model.cards() if card["id"] == name)

    @app.get("/v1/health/live")
    async def live() -> dict[str, str]:
        return {"status": "live"}

    @app.get("/v1/health/ready")
    async def ready() -> dict[str, str]:
        require_ready()
        return {"status": "ready"}

    @app.post("/v1/chat/completions")
    async def chat_completions(http_request: Request):
        body = await _chat_body(http_request)
        model.lora_uid(body.model)  # 404 for a model not served
        require_ready()
        try:
            request = await to_pipeline_request(body, model, fetcher)
            if not body.stream:
                result = (await anyio.to_thread.run_sync(exporter.generate, [request]))[0]
                if isinstance(result, Exception):
                    raise result
                return completion_body(result, request, body.model)
            # the first piece is awaited here, so that errors before any text still get their status
            pieces = await anyio.to_thread.run_sync(lambda: peeked(iter(exporter.stream(request))))
        except Exception as error:  # noqa: BLE001 - mapped to an OpenAI error object
            raise api_error(error) from error
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(relay(stream_events(pieces, request, body.model, include_usage)),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app
