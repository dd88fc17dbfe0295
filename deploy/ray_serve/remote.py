"""`RemoteEngine`: the engine replicas behind a Ray Serve deployment handle, with the exporter's surface that the
OpenAI app uses (`modality`, `lora_uids`, `engine`, `generate`, `stream`).

Calls block (the apps make them from worker threads). A request whose replica dies is sent again to another
replica when none of its answer was sent yet (up to `retries` times); otherwise it fails with a 503 `Failure`
saying so. Nothing waits on a dead replica: Ray fails its calls as soon as its process is gone.
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Iterator
from typing import Any

from deploy.ray_serve.transport import Failure, ModelFacts, lost_failure, replica_lost
from exporter.runtime import Completion
from exporter.runtime import Request as PipelineRequest

LOGGER = logging.getLogger(__name__)


class RemoteEngine:
    """The replicas of `handle` (an `EngineReplica` deployment) as one engine whose facts are `facts`."""

    def __init__(self, handle: Any, facts: ModelFacts, retries: int = 1):
        self.handle = handle
        self.facts = facts
        self.retries = retries
        self.modality = facts.modality
        self.lora_uids = facts.lora_uids
        self.engine = facts  # what the OpenAI app reads of an engine: limits, perception, template
        self.pipeline = facts  # loaded: the replicas answer

    def call(self, method: str, *args: Any) -> Any:
        """`method` of a replica, answered; sent again to another replica if the first one died under it."""
        for attempt in range(self.retries + 1):
            try:
                return getattr(self.handle, method).remote(*args).result()
            except Exception as error:
                if not replica_lost(error):
                    raise
                if attempt == self.retries:
                    return lost_failure(error, partial=False)
                _retrying(method, error)
        raise AssertionError("unreachable")

    def items(self, method: str, argument: Any) -> Iterator[Any]:
        """The items a replica streams for `method`; sent again to another replica if the first one died before
        its first item; a replica that dies later ends the items with a 503 `Failure`. Closing this iterator
        cancels the replica's stream."""
        for attempt in range(self.retries + 1):
            response = getattr(self.handle.options(stream=True), method).remote(argument)
            sent, finished = False, False
            try:
                for item in response:
                    sent = True
                    yield item
                finished = True
                return
            except Exception as error:
                finished = True
                if not replica_lost(error):
                    raise
                if sent or attempt == self.retries:
                    yield lost_failure(error, partial=sent)
                    return
                _retrying(method, error)
            finally:
                if not finished:
                    response.cancel()  # the reader went away: the replica stops generating

    def generate(self, requests: list[PipelineRequest]) -> list[Completion | Exception]:
        """The OpenAI app's batch call: each request's `Completion` or its error."""
        results = self.call("generate", list(requests))
        if isinstance(results, Failure):
            return [results.api_error() for _ in requests]
        return [result.api_error() if isinstance(result, Failure) else result for result in results]

    def stream(self, request: PipelineRequest) -> Generator[str, None, Completion | None]:
        """The OpenAI app's streamed call: pieces of text, then the `Completion` as the return value."""
        for item in self.items("stream", request):
            if isinstance(item, Failure):
                raise item.api_error()
            if isinstance(item, Completion):
                return item
            yield item
        return None

    def ready(self, timeout_s: float) -> bool:
        """Whether a replica answers within `timeout_s`."""
        try:
            return bool(self.handle.ready.remote().result(timeout_s=timeout_s))
        except Exception:  # noqa: BLE001 - no replica answered: not ready
            return False


def _retrying(method: str, error: BaseException) -> None:
    LOGGER.warning("a model replica stopped under a %s request (%s); sending it to another replica", method,
                   type(error).__name__)
