"""From an OpenAI chat body to a pipeline request, and from a finished answer back to a `chat.completion` object.

Translation to the pipeline (`exporter.runtime.Request`):
- `system` / `developer` messages replace the chat template's system prompt; the `user` messages (text parts joined
  by newlines) make the one user turn the checkpoint's template renders. Conversations with `assistant` turns are
  refused: the templates render a single turn as training did.
- Media parts (`image_url`, `video_url`, `input_audio`; http(s), `data:` or, when a folder is allowed, `file:` URLs)
  are fetched and checked under the server's `MediaPolicy` by its `MediaFetcher`, all at once and only after the
  whole body was checked. Each message's media go in front of its text as
  placeholders (`<image>` / `<video>`), the layout LLaVA-style checkpoints were trained on, unless the text holds
  the placeholders itself: then the media fill them in order. The text of one request is capped at
  `MAX_TEXT_BYTES` (413) before anything is tokenized.
- `model` is the served name, or `<served name>:<uid>` for LoRA adapter `uid` (`/v1/models` lists each).
- `max_tokens` (or `max_completion_tokens`) → `max_output_len` (default: the engine's limit); `temperature`,
  `top_p`, `seed`, `stop` → `SamplingParams`; `top_k` and `repetition_penalty` are accepted as extensions. With
  neither `temperature` nor `top_p` the answer is greedy (NeMo's default); `temperature: 0` is greedy too.
- A streaming client that closes its connection cancels its generation at the next token (`relay`).
- `usage.prompt_tokens` counts the prompt's positions including media features; `completion_tokens` the tokens
  generated. Stop strings are cut from the text (they still count as generated tokens).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from deploy.openai.errors import APIError, api_error
from deploy.openai.schema import AudioPart, ChatCompletionRequest, ImagePart, TextPart, VideoPart
from exporter.llm.generate import SamplingParams
from exporter.media_safety import MediaError, MediaFetcher
from exporter.runtime import Completion
from exporter.runtime import Request as PipelineRequest

OWNER = "nemo-mm-deploy"
MAX_TEXT_BYTES = 1 << 20  # the text of one request, far more than any model's max_input_len of tokens


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
        return {kind.openai_part: kind.name for kind in self.engine.perception.media}

    def placeholders(self) -> tuple[str, ...]:
        """The placeholder media take in the text (first) and the spellings the model also accepts."""
        perception = self.engine.perception
        return (perception.placeholder, *perception.placeholder_aliases) if perception.placeholder else ()

    def cards(self) -> list[dict[str, Any]]:
        """The model list: the base model, then each LoRA adapter served as ``<name>:<uid>``."""
        adapters = [{**self._card(f"{self.name}:{uid}"), "parent": self.name, "root": self.name}
                    for uid in getattr(self.exporter, "lora_uids", ())]
        return [self._card(self.name), *adapters]

    def lora_uid(self, model: str) -> str | None:
        """The LoRA adapter a request's ``model`` names (``<name>:<uid>``; None: the base model); 404 otherwise."""
        if model == self.name:
            return None
        uids = getattr(self.exporter, "lora_uids", ())
        prefix = f"{self.name}:"
        if model.startswith(prefix) and model[len(prefix):] in uids:
            return model[len(prefix):]
        served = ", ".join(repr(card["id"]) for card in self.cards())
        raise APIError(404, f"the model {model!r} does not exist; this server serves {served}", param="model",
                       code="model_not_found")

    def _card(self, model_id: str) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": self.created, "owned_by": OWNER}


@dataclass(frozen=True)
class MediaItem:
    """One media part of a chat body: where it is, its source (a URL or a `data:` URL) and the kind it must be."""

    where: str
    source: str
    kind: str


async def to_pipeline_request(body: ChatCompletionRequest, model: ServedModel,
                              fetcher: MediaFetcher) -> PipelineRequest:
    """The pipeline request for a chat body: one user turn with placeholders, fetched media, sampling parameters.

    The whole body is checked before any media is fetched; then its media are fetched at once.
    """
    system_texts, user_texts, items = [], [], []
    kinds, policy = model.media_kinds(), fetcher.policy
    for index, message in enumerate(body.messages):
        parts = [TextPart(type="text", text=message.content)] if isinstance(message.content, str) else \
            list(message.content or [])
        if message.role in ("assistant", "tool"):
            raise APIError(400, f"messages[{index}] is an {message.role} turn, but this model's chat template "
                                "renders one user turn; send the system prompt and the user's message only",
                           param=f"messages[{index}]", code="unsupported_conversation")
        texts = [part.text for part in parts if isinstance(part, TextPart)]
        media = [_media_item(part, kinds, f"messages[{index}]") for part in parts if not isinstance(part, TextPart)]
        if message.role in ("system", "developer"):
            if media:
                raise APIError(400, f"messages[{index}] ({message.role}) carries media; put media in user messages",
                               param=f"messages[{index}].content")
            system_texts.append("\n".join(texts))
            continue
        user_texts.append(_with_placeholders("\n".join(texts), len(media), model.placeholders(), index))
        items.extend(media)
    if not user_texts:
        raise APIError(400, "messages hold no user message; add one with role 'user'", param="messages")
    if len(items) > policy.max_items:
        raise APIError(400, f"the request carries {len(items)} media items, more than {policy.max_items} (option "
                            "media_max_items); send fewer", param="messages", code="too_many_media")
    _check_text_size([*system_texts, *user_texts])
    params = sampling_params(body, model.engine.limits.max_output_len)
    media = await fetch_all(items, fetcher)
    return PipelineRequest(text="\n".join(user_texts), media=(media[0] if len(media) == 1 else media or None),
                           params=params, system=_system_prompt(system_texts, model.engine.template.system),
                           lora_uid=model.lora_uid(body.model))


def _check_text_size(texts: list[str]) -> None:
    size = sum(len(text.encode()) for text in texts)
    if size > MAX_TEXT_BYTES:
        raise APIError(413, f"the messages hold {size} bytes of text, over this server's cap of {MAX_TEXT_BYTES}; "
                            "no model here takes a prompt that long", param="messages", code="request_too_large")


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


def _media_item(part: ImagePart | VideoPart | AudioPart, kinds: dict[str, str], where: str) -> MediaItem:
    if part.type not in kinds:
        takes = " or ".join(sorted(kinds)) or "no media"
        raise APIError(400, f"{where} has a {part.type} part, but this model takes {takes}",
                       param=f"{where}.content", code="unsupported_media")
    if isinstance(part, AudioPart):
        source = f"data:audio/{part.input_audio.format.lower()};base64,{part.input_audio.data}"
    else:
        ref = part.image_url if isinstance(part, ImagePart) else part.video_url
        source = ref if isinstance(ref, str) else ref.url
    return MediaItem(where, source, kinds[part.type])


async def fetch_all(items: list[MediaItem], fetcher: MediaFetcher) -> list[bytes]:
    """The items' bytes, fetched and checked at once; the first failure (an APIError naming its part) cancels the
    rest."""
    async def fetch(item: MediaItem) -> bytes:
        try:
            data, _ = await fetcher.load_checked(item.source, item.kind)
        except MediaError as error:
            mapped = api_error(error)
            mapped.param = f"{item.where}.content"
            raise mapped from None
        return data

    tasks = [asyncio.ensure_future(fetch(item)) for item in items]
    try:
        media = list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
    total, cap = sum(len(data) for data in media), fetcher.policy.max_request_bytes
    if total > cap:
        raise APIError(413, f"the request's media hold {total} bytes together, over the cap of {cap} (option "
                            "media_max_request_bytes); send fewer or smaller media", param="messages",
                       code="request_too_large")
    return media


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


def usage(completion: Completion) -> dict[str, int]:
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
        "usage": usage(completion),
    }
