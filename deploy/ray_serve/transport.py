"""What crosses between the front and the engine replicas: the model's facts, a request's failure, and which Ray
errors mean that the replica serving a request is gone.

A failure crosses as a `Failure` (a status and one line), never as the exception: Ray would wrap an exception in
its traceback, and some exceptions do not survive pickling.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from deploy.openai.errors import APIError, api_error
from deploy.triton_errors import INTERNAL, UNAVAILABLE, client_failure, one_line
from exporter.engine import EngineLimits
from exporter.models.templates import ChatTemplate
from wire import MediaKind

LOGGER = logging.getLogger(__name__)

REPLICA_LOST_CODE = "replica_lost"


@dataclass(frozen=True)
class PerceptionFacts:
    """What a request's media are: their kinds (the default first) and their placeholders in the text."""

    media: tuple[MediaKind, ...]
    placeholder: str | None
    placeholder_aliases: tuple[str, ...]


@dataclass(frozen=True)
class ModelFacts:
    """What the front needs to know of the engine to check and translate requests; it stands in for the exporter's
    `engine` in the OpenAI app (`limits`, `perception`, `template`). `lora_uids`: the LoRA adapters served from the
    start (every replica loads the same); `parameters`: what the model publishes in its Triton config."""

    modality: str
    limits: EngineLimits
    perception: PerceptionFacts
    template: ChatTemplate
    lora_uids: tuple[str, ...] = ()
    parameters: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, exporter: Any) -> ModelFacts:
        """The facts of a loaded `TensorRTMMExporter`."""
        engine = exporter.engine
        perception = engine.perception
        return cls(modality=exporter.modality, limits=engine.limits, template=engine.template,
                   lora_uids=tuple(exporter.lora_uids),
                   parameters=exporter.triton_model_parameters(),
                   perception=PerceptionFacts(media=tuple(perception.media), placeholder=perception.placeholder,
                                              placeholder_aliases=tuple(perception.placeholder_aliases)))


@dataclass(frozen=True)
class Failure:
    """A request's failure as its client is told it: an HTTP status, one line, and OpenAI's `code` and `param`."""

    status: int
    message: str
    code: str | None = None
    param: str | None = None

    @classmethod
    def openai(cls, error: Exception) -> Failure:
        """As the OpenAI front answers `error` (statuses and codes of `deploy.openai.errors`)."""
        answer = api_error(error)
        return cls(answer.status, answer.message, answer.code, answer.param)

    @classmethod
    def triton(cls, error: Exception) -> Failure:
        """As Triton's routes answer `error` (400 bad input, 500 a fault; `deploy.triton_errors`)."""
        failed = client_failure(error)
        if failed.status == INTERNAL:
            LOGGER.error("the model failed a request", exc_info=error)
        return cls(failed.status, failed.message)

    def api_error(self) -> APIError:
        """The OpenAI error object for this failure."""
        return APIError(self.status, self.message, param=self.param, code=self.code)


def replica_lost(error: BaseException) -> bool:
    """Whether `error`, raised by a call on a deployment handle, means the replica serving it died or went away
    (rather than the request failing)."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import ReplicaUnavailableError

    return isinstance(error, (RayActorError, ReplicaUnavailableError))


def lost_failure(error: BaseException, partial: bool) -> Failure:
    """The failure of a request whose replica died under it: after part of its answer was sent (`partial`), or
    on its last try."""
    what = "after sending part of the answer" if partial else "and no retry was left"
    LOGGER.warning("a model replica stopped under a request %s: %s", what, one_line(f"{type(error).__name__}: {error}"))
    return Failure(UNAVAILABLE, f"the model replica serving this request stopped (its process died) {what}; "
                                "retry the request", code=REPLICA_LOST_CODE)
