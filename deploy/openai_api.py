"""An OpenAI-compatible HTTP front (FastAPI) over a loaded `TensorRTMMExporter`.

Routes: `GET /v1/models`, `GET /v1/models/{id}`, `GET /v1/health/live`, `GET /v1/health/ready`,
`POST /v1/chat/completions` (plain or `stream: true` as server-sent events in OpenAI's chunk format).

Translation to the pipeline (`exporter.runtime.Request`):
- `system` / `developer` messages replace the chat template's system prompt; the `user` messages (text parts joined
  by newlines) make the one user turn the checkpoint's template renders. Conversations with `assistant` turns are
  refused: the templates render a single turn as training did.
- Media parts (`image_url`, `video_url`, `input_audio`; http(s), `data:` or, when a folder is allowed, `file:` URLs)
  are fetched and checked under the server's `MediaPolicy`. Each message's media go in front of its text as
  placeholders (`<image>` / `<video>`), the layout LLaVA-style checkpoints were trained on, unless the text holds
  the placeholders itself: then the media fill them in order.
- `max_tokens` (or `max_completion_tokens`) → `max_output_len` (default: the engine's limit); `temperature`,
  `top_p`, `seed`, `stop` → `SamplingParams`; `top_k` and `repetition_penalty` are accepted as extensions. With
  neither `temperature` nor `top_p` the answer is greedy (NeMo's default); `temperature: 0` is greedy too.
- A streaming client that closes its connection cancels its generation at the next token (`relay`).
- `usage.prompt_tokens` counts the prompt's positions including media features; `completion_tokens` the tokens
  generated. Stop strings are cut from the text (they still count as generated tokens).

Errors are OpenAI error objects: 400 bad request or media, or a request over the engine's limits; 404 unknown model
or route; 413 media (or the body) over a size cap; 422 invalid parameters; 500 a model failure; 503 not ready.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Generator, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from exporter.llm.generate import SamplingParams
from exporter.media_safety import MediaError, MediaPolicy, MediaTooLargeError, load_checked
from exporter.runtime import Completion
from exporter.runtime import Request as PipelineRequest

LOGGER = logging.getLogger(__name__)
OWNER = "nemo-mm-deploy"
MAX_STOP_STRINGS = 4


# --- request body -------------------------------------------------------------------------------------------------

class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class MediaURL(_Body):
    url: str
    detail: str | None = None


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: MediaURL | str


class VideoPart(_Body):
    type: Literal["video_url"]
    video_url: MediaURL | str


class InputAudio(_Body):
    data: str = Field(description="base64 audio file")
    format: str = Field(pattern=r"^[A-Za-z0-9]{1,10}$")


class AudioPart(_Body):
    type: Literal["input_audio"]
    input_audio: InputAudio


ContentPart = Annotated[TextPart | ImagePart | VideoPart | AudioPart, Field(discriminator="type")]


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class ChatCompletionRequest(_Body):
    """The body of `POST /v1/chat/completions` (fields this server does not use are ignored)."""

    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS or not all(stops):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings")
        return stops

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("n must be 1: this server returns one choice per request")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("logprobs are not supported; leave logprobs unset or false")
        return value


# --- errors -------------------------------------------------------------------------------------------------------

class APIError(Exception):
    """An error answered as an OpenAI error object with an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def api_error(error: Exception) -> APIError:
    """The API error for an exception raised while fetching media or answering a request."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, MediaTooLargeError):
        return APIError(413, str(error), code="media_too_large")
    if isinstance(error, MediaError):
        return APIError(400, str(error), code="invalid_media")
    if isinstance(error, ValueError):  # the pipeline's input errors: limits, layout, undecodable media, parameters
        return APIError(400, f"{type(error).__name__}: {error}", code="invalid_request")
    LOGGER.error("the model failed a request", exc_info=error)
    return APIError(500, f"the model failed: {type(error).__name__}: {error}", code="internal_error")


# --- the served model ---------------------------------------------------------------------------------------------

@dataclass
class ServedModel:
    """The exporter behind the front, under the name clients use, and what its requests may carry."""

    name: str
    exporter: Any
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def engine(self):
        if getattr(self.exporter, "engine", None) is None or getattr(self.exporter, "pipeline", None) is None:
            raise APIError(503, f"model {self.name!r} is not loaded yet", code="not_ready")
        return self.exporter.engine

    def media_kinds(self) -> dict[str, str]:
        """Content-part type → media kind this model takes."""
        if self.exporter.modality == "audio":
            return {"input_audio": "audio"}
        if getattr(self.engine.perception, "media_name", "image") == "video":  # an image is a one-frame video
            return {"image_url": "image", "video_url": "video"}
        return {"image_url": "image"}

    def placeholders(self) -> tuple[str, ...]:
        """The placeholder media take in the text (first) and the spellings the model also accepts."""
        perception = self.engine.perception
        placeholder = getattr(perception, "placeholder", None)
        return (placeholder, *getattr(perception, "placeholder_aliases", ())) if placeholder else ()

    def card(self) -> dict[str, Any]:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": OWNER}


def to_pipeline_request(body: ChatCompletionRequest, model: ServedModel, policy: MediaPolicy) -> PipelineRequest:
    """The pipeline request for a chat body: one user turn with placeholders, fetched media, sampling parameters."""
    system_texts, user_texts, media = [], [], []
    kinds = model.media_kinds()
    for index, message in enumerate(body.messages):
        parts = [TextPart(type="text", text=message.content)] if isinstance(message.content, str) else \
            list(message.content or [])
        if message.role in ("assistant", "tool"):
            raise APIError(400, f"messages[{index}] is an {message.role} turn, but this model's chat template "
                                "renders one user turn; send the system prompt and the user's message only",
                           param=f"messages[{index}]", code="unsupported_conversation")
        texts = [part.text for part in parts if isinstance(part, TextPart)]
        items = [part for part in parts if not isinstance(part, TextPart)]
        if message.role in ("system", "developer"):
            if items:
                raise APIError(400, f"messages[{index}] ({message.role}) carries media; put media in user messages",
                               param=f"messages[{index}].content")
            system_texts.append("\n".join(texts))
            continue
        user_texts.append(_with_placeholders("\n".join(texts), len(items), model.placeholders(), index))
        media.extend(_fetch(part, kinds, policy, f"messages[{index}]") for part in _checked_count(
            items, len(media), policy))
    if not user_texts:
        raise APIError(400, "messages hold no user message; add one with role 'user'", param="messages")
    return PipelineRequest(text="\n".join(user_texts), media=(media[0] if len(media) == 1 else media or None),
                           params=sampling_params(body, model.engine.limits.max_output_len),
                           system=_system_prompt(system_texts, model.engine.template.system))


def _checked_count(items: list, already: int, policy: MediaPolicy) -> list:
    if already + len(items) > policy.max_items:
        raise APIError(400, f"the request carries more than {policy.max_items} media items (option media_max_items); "
                            "send fewer", param="messages", code="too_many_media")
    return items


def _with_placeholders(text: str, count: int, placeholders: tuple[str, ...], index: int) -> str:
    """The message's text with one placeholder per media item: in front, unless the text already places them."""
    if not placeholders or not count:
        return text
    present = sum(text.count(p) for p in placeholders)
    if present == 0:
        return "\n".join([placeholders[0]] * count + ([text] if text else []))
    if present != count:
        raise APIError(400, f"messages[{index}] has {present} {placeholders[0]} placeholder(s) in its text but "
                            f"{count} media part(s); use one per media part, or none to put the media first",
                       param=f"messages[{index}].content")
    return text


def _fetch(part: ImagePart | VideoPart | AudioPart, kinds: dict[str, str], policy: MediaPolicy, where: str) -> bytes:
    if part.type not in kinds:
        takes = " or ".join(sorted(kinds)) or "no media"
        raise APIError(400, f"{where} has a {part.type} part, but this model takes {takes}",
                       param=f"{where}.content", code="unsupported_media")
    if isinstance(part, AudioPart):
        source = f"data:audio/{part.input_audio.format.lower()};base64,{part.input_audio.data}"
    else:
        ref = part.image_url if isinstance(part, ImagePart) else part.video_url
        source = ref if isinstance(ref, str) else ref.url
    try:
        data, _ = load_checked(source, kinds[part.type], policy)
    except MediaError as error:
        mapped = api_error(error)
        mapped.param = f"{where}.content"
        raise mapped from None
    return data


def _system_prompt(texts: list[str], default: str) -> str | None:
    """The client's system prompt followed by the template's own separator (the default's trailing whitespace)."""
    if not texts:
        return None
    return "\n".join(texts) + default[len(default.rstrip()):]


def sampling_params(body: ChatCompletionRequest, max_output_len: int) -> SamplingParams:
    """OpenAI's sampling fields as `SamplingParams` (see the module notes for the defaults)."""
    wanted = body.max_completion_tokens or body.max_tokens or max_output_len
    if wanted > max_output_len:
        raise APIError(400, f"max_tokens={wanted} is over this model's limit of {max_output_len} new tokens; ask "
                            "for fewer (or export the model with a larger max_output_len)",
                       param="max_tokens", code="limit_exceeded")
    sampled = body.temperature != 0 and (body.temperature, body.top_p, body.top_k) != (None, None, None)
    try:
        return SamplingParams(
            max_output_len=wanted,
            top_k=(body.top_k if body.top_k is not None else 0) if sampled else 1,
            top_p=body.top_p if body.top_p is not None else 1.0,
            temperature=body.temperature if body.temperature is not None else 1.0,
            repetition_penalty=body.repetition_penalty or 1.0,
            stop=tuple(body.stop or ()),
            seed=body.seed,
        )
    except ValueError as error:
        raise APIError(422, str(error), code="invalid_parameter") from None


# --- answers ------------------------------------------------------------------------------------------------------

class StopFilter:
    """Cuts streamed text at the first stop string, holding back a tail that may be the start of one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.pending = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """The text that can be sent now."""
        if self.stopped:
            return ""
        text = self.pending + piece
        cuts = [text.find(stop) for stop in self.stops if stop in text]
        if cuts:
            self.stopped, self.pending = True, ""
            return text[:min(cuts)]
        hold = max((n for stop in self.stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)
        self.pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold]

    def flush(self) -> str:
        """What was held back, once the answer has ended."""
        rest, self.pending = self.pending, ""
        return rest


def finish_reason(completion: Completion | None, stopped: bool, max_output_len: int) -> str:
    """"stop" at EOS or a stop string, "length" when max_tokens ended the answer."""
    if not stopped and completion is not None and len(completion.token_ids[0]) >= max_output_len:
        return "length"
    return "stop"


def _usage(completion: Completion) -> dict[str, int]:
    generated = len(completion.token_ids[0])
    return {"prompt_tokens": completion.prompt_tokens, "completion_tokens": generated,
            "total_tokens": completion.prompt_tokens + generated}


def completion_body(completion: Completion, request: PipelineRequest, model: str) -> dict[str, Any]:
    """The `chat.completion` object for a finished answer."""
    stops = StopFilter(request.params.stop)
    text = stops.feed(completion.texts[0]) + stops.flush()
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": finish_reason(completion, stops.stopped, request.params.max_output_len)}],
        "usage": _usage(completion),
    }


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
            yield _event({**base, "choices": [], "usage": _usage(completion)})
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
            return await too_large.response()(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message]), send)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await too_large.response()(scope, receive, send)
            more = message.get("more_body", False)
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        return await self.app(scope, _replay([body], receive), send)


def _replay(messages: list[dict], then=None):
    async def receive():
        if messages:
            return messages.pop(0)
        return await then() if then is not None else {"type": "http.disconnect"}
    return receive


def default_max_request_bytes(policy: MediaPolicy) -> int:
    """Room for the policy's media as base64 in one body, plus 1 MiB of text."""
    return policy.max_items * policy.max_bytes * 4 // 3 + (1 << 20)


def create_app(exporter: Any, model_name: str, policy: MediaPolicy | None = None,
               max_request_bytes: int | None = None) -> FastAPI:
    """The FastAPI app serving `exporter` as model `model_name`; `app.state.ready` gates `/v1/health/ready`."""
    if max_request_bytes is not None and max_request_bytes < 1:
        raise ValueError(f"openai_max_request_bytes must be a positive number of bytes, got {max_request_bytes}")
    policy = policy or MediaPolicy()
    model = ServedModel(model_name, exporter)
    app = FastAPI(title="nemo-mm-deploy OpenAI-compatible API")
    app.state.ready = True
    app.state.model = model
    app.add_middleware(_BodyLimit, max_bytes=max_request_bytes or default_max_request_bytes(policy))

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        if first.get("type") == "json_invalid":
            reason = (first.get("ctx") or {}).get("error", "invalid JSON")
            return APIError(400, f"the request body is not valid JSON ({reason}); send a JSON object",
                            code="invalid_json").response()
        where = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = f"{'.'.join(where) or 'body'}: {first.get('msg', 'invalid')}"
        return APIError(422, message, param=".".join(where) or None, code="invalid_parameter").response()

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

    def require_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    @app.get("/v1/models")
    def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model.card()]}

    @app.get("/v1/models/{name}")
    def get_model(name: str) -> dict[str, Any]:
        require_model(name)
        return model.card()

    @app.get("/v1/health/live")
    def live() -> dict[str, str]:
        return {"status": "live"}

    @app.get("/v1/health/ready")
    def ready() -> dict[str, str]:
        require_ready()
        return {"status": "ready"}

    @app.post("/v1/chat/completions")
    def chat_completions(body: ChatCompletionRequest):
        require_model(body.model)
        require_ready()
        try:
            request = to_pipeline_request(body, model, policy)
            if not body.stream:
                result = exporter.generate([request])[0]
                if isinstance(result, Exception):
                    raise result
                return completion_body(result, request, model_name)
            pieces = peeked(iter(exporter.stream(request)))  # errors before any text still get their status
        except Exception as error:  # noqa: BLE001 - mapped to an OpenAI error object
            raise api_error(error) from error
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(relay(stream_events(pieces, request, model_name, include_usage)),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app
