"""`EngineReplica`: one model replica of the Ray Serve application, an exported engine with its own in-flight
scheduler on the replica's GPU or CPUs.

The constructor loads the engine and runs a warm-up request, so Ray routes to a replica only once it has
answered. The methods are coroutines that run the engine's blocking calls in worker threads (Ray Serve
allows one per ongoing request), so the requests Ray sends a replica meet in its scheduler's decode steps.
Failures come back as `Failure`s; the streams end with their `Completion` (OpenAI) or stop (Triton's routes).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
import numpy as np

from deploy.ray_serve.transport import Failure, ModelFacts
from deploy.startup import DeployError
from exporter.runtime import Completion
from exporter.runtime import Request as PipelineRequest
from wire import InferRequest, decode_answer

LOGGER = logging.getLogger(__name__)


class EngineReplica:
    """Serves the engine in `model_dir`, loaded with `engine_options` (`TensorRTMMExporter`'s keyword arguments);
    `num_threads` sets torch's CPU threads (the CPUs Ray gives the replica)."""

    def __init__(self, model_dir: str, num_threads: int | None = None, engine_options: dict[str, Any] | None = None):
        import pytriton.model_config  # noqa: F401 - the warm-up request's specs: imported before the weights' stream
        import torch

        from exporter import TensorRTMMExporter

        if num_threads:
            torch.set_num_threads(num_threads)
        self.exporter = TensorRTMMExporter(model_dir, **(engine_options or {}))
        if self.exporter.pipeline is None:
            raise DeployError(f"no exported model in {model_dir} on this node; export it there (or onto storage "
                              "every node mounts at that path)")
        self.exporter.triton_infer_fn(**self.exporter.triton_warmup_request())  # READY only once a request ran
        self.exporter.serving_started()
        LOGGER.info("model replica ready: %s on %s, %d torch threads", model_dir, self.exporter.device,
                    torch.get_num_threads())

    async def facts(self) -> ModelFacts:
        """What the front needs to know of the engine."""
        return ModelFacts.of(self.exporter)

    async def ready(self) -> bool:
        """Answered once the replica is up (the front's readiness routes ask)."""
        return True

    async def generate(self, requests: list[PipelineRequest]) -> list[Completion | Failure]:
        """The OpenAI front's requests, answered together: a `Completion` or a `Failure` each."""
        results = await anyio.to_thread.run_sync(self.exporter.generate, requests)
        return [result if isinstance(result, Completion) else Failure.openai(result) for result in results]

    async def stream(self, request: PipelineRequest) -> AsyncIterator[str | Completion | Failure]:
        """One OpenAI request's answer piece by piece, then its `Completion`; or a `Failure` as the last item."""
        async for item in self._relay(lambda: self.exporter.stream(request), Failure.openai, lambda piece: piece):
            yield item

    async def infer(self, inputs: InferRequest) -> dict[str, np.ndarray] | Failure:
        """A Triton-shaped request (NeMo's tensors, batch axis first): its `outputs` tensor or a `Failure`."""
        try:
            return await anyio.to_thread.run_sync(lambda: self.exporter.triton_infer_fn(**inputs))
        except Exception as error:  # noqa: BLE001 - the client's failure, answered
            return Failure.triton(error)

    async def infer_stream(self, inputs: InferRequest) -> AsyncIterator[str | Failure]:
        """A one-prompt Triton-shaped request's answer piece by piece; or a `Failure` as the last item."""
        async for item in self._relay(lambda: self.exporter.triton_stream_request(inputs), Failure.triton,
                                      lambda outputs: decode_answer(outputs["outputs"].reshape(-1)[0])):
            yield item

    async def _relay(self, start: Callable[[], Iterator[Any]], failure: Callable[[Exception], Failure],
                     piece: Callable[[Any], str]) -> AsyncIterator[Any]:
        """The items of a blocking stream, each taken in a worker thread; its return value (if any) last, or its
        error as a `Failure`. A cancelled stream (the client went away) is closed, which frees its scheduler slot."""
        try:
            items = await anyio.to_thread.run_sync(lambda: iter(start()))
        except Exception as error:  # noqa: BLE001 - answered as the stream's only item
            yield failure(error)
            return
        try:
            while True:
                try:  # not cancellable while the thread runs, so `items` is never closed while it is running
                    done, value = await anyio.to_thread.run_sync(_step, items)
                except Exception as error:  # noqa: BLE001 - answered as the stream's last item
                    yield failure(error)
                    return
                if done:
                    if value is not None:
                        yield value
                    return
                yield piece(value)
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()


def _step(items: Iterator[Any]) -> tuple[bool, Any]:
    """(False, the next item), or (True, the iterator's return value) once it is exhausted."""
    try:
        return False, next(items)
    except StopIteration as end:
        return True, end.value
