"""Serve an `ITritonDeployable` on Triton through PyTriton: batching across requests, errors per request.

PyTriton 0.7.0 fails a whole Triton batch when the inference callable raises, and cannot return an error for
one request of a batch (its proxy wraps every response as outputs; its error flag applies to all requests).
So Triton never batches here: the model gets `max_batch_size` instances under Triton's default scheduler, each
instance receives one request at a time, and the instances hand their requests to one `RequestBatcher` that
runs the model on all waiting requests together (dynamic batching inside this process). A failed request
raises in its own instance only, so Triton answers it with an error while the others of the batch succeed.

With `streaming=True` a second, decoupled model `<name>_stream` is served next to it: the same inputs, one
response per piece of text as it is generated (gRPC streams, HTTP `generate_stream`). Its instances (as many as
`max_batch_size`) each stream one request straight from the model; they share the model's in-flight scheduler.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future

import numpy as np
from pytriton.model_config import ModelConfig
from pytriton.triton import Triton, TritonConfig

from deploy.startup import DeployError, check_port_free, ensure_libpython_on_library_path, pick_metrics_port
from deploy.triton_deployable import (
    InferRequest,
    default_warmup_request,
    infer_requests_one_by_one,
    stream_model_name,
)

LOGGER = logging.getLogger(__name__)

InferRequests = Callable[[Sequence[InferRequest]], Sequence["dict[str, np.ndarray] | Exception"]]


# PyTriton 0.7.0 races when several instances start: instance 0 opens a handshake socket that the others poll
# for 1 s and connect to; on a busy machine they can miss it (connection refused, timeout): the load fails.
_HANDSHAKE_RACE = "get_config_from_handshake_server"
_START_ATTEMPTS = 3


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _rows(request: InferRequest) -> int:
    text = request.get("input_text")
    return 1 if text is None else max(1, int(np.asarray(text).shape[0]))


class RequestBatcher:
    """Runs a model on the requests submitted from many threads, several at a time, in one worker thread.

    A batch starts with the oldest waiting request and takes the requests arriving within `max_queue_delay_s`
    of it, up to `max_batch_size` rows.
    """

    def __init__(self, infer_requests: InferRequests, max_batch_size: int, max_queue_delay_s: float):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        self._infer_requests = infer_requests
        self._max_batch_size = max_batch_size
        self._max_queue_delay_s = max(0.0, max_queue_delay_s)
        self._queue: queue.Queue[tuple[InferRequest, Future] | None] = queue.Queue()
        self._held: tuple[InferRequest, Future] | None = None
        self._stopped = False
        self._worker = threading.Thread(target=self._run, name="request-batcher", daemon=True)
        self._worker.start()

    def submit(self, request: InferRequest) -> Future:
        """Queue one request; the future holds its outputs or the exception it failed with."""
        if self._stopped:
            raise DeployError("the model is stopped and takes no more requests")
        future: Future = Future()
        self._queue.put((request, future))
        return future

    def infer(self, request: InferRequest) -> dict[str, np.ndarray]:
        """Run one request with whatever else is waiting and return its outputs (or raise its error)."""
        return self.submit(request).result()

    def stop(self) -> None:
        """Finish the requests already queued, then end the worker thread."""
        if not self._stopped:
            self._stopped = True
            self._queue.put(None)
            self._worker.join()

    def _run(self) -> None:
        while True:
            batch, stop = self._collect()
            if batch:
                self._execute(batch)
            if stop:
                return

    def _collect(self) -> tuple[list[tuple[InferRequest, Future]], bool]:
        first = self._held if self._held is not None else self._queue.get()
        self._held = None
        if first is None:
            return [], True
        batch, rows = [first], _rows(first[0])
        deadline = time.monotonic() + self._max_queue_delay_s
        while rows < self._max_batch_size:
            try:
                item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if item is None:
                return batch, True
            if rows + _rows(item[0]) > self._max_batch_size:
                self._held = item
                break
            batch.append(item)
            rows += _rows(item[0])
        return batch, False

    def _execute(self, batch: list[tuple[InferRequest, Future]]) -> None:
        try:
            results = list(self._infer_requests([request for request, _ in batch]))
            if len(results) != len(batch):
                raise RuntimeError(f"the model answered {len(results)} results for {len(batch)} requests")
        except Exception as error:  # a failure of the whole batch goes to every request in it
            LOGGER.exception("the model failed on a batch of %d requests", len(batch))
            results = [error] * len(batch)
        for (_, future), result in zip(batch, results, strict=True):
            if isinstance(result, BaseException):
                future.set_exception(result)
            elif isinstance(result, dict) and "outputs" in result:
                future.set_result(result)
            else:
                future.set_exception(
                    TypeError(f"the model answered {type(result).__name__}, not an outputs dict")
                )


class DeployPyTriton:
    """Deploys a model implementing `ITritonDeployable` on Triton (HTTP and gRPC), NeMo's class and arguments.

    Example:
        nm = DeployPyTriton(model=exporter, triton_model_name="neva", http_port=8000)
        nm.deploy()   # warm-up request, port checks, binding
        nm.serve()    # blocks; or nm.run() ... nm.stop()
    """

    def __init__(
        self,
        model,
        triton_model_name: str,
        triton_model_version: int = 1,
        max_batch_size: int = 8,
        http_port: int = 8000,
        grpc_port: int = 8001,
        address: str = "0.0.0.0",
        allow_http: bool = True,
        allow_grpc: bool = True,
        streaming: bool = False,
        max_queue_delay_microseconds: int = 5000,
        metrics_port: int | None = None,
    ):
        for attribute in ("get_triton_input", "get_triton_output", "triton_infer_fn"):
            if not hasattr(model, attribute):
                raise TypeError(f"the model must implement ITritonDeployable; it has no {attribute}")
        if not triton_model_name:
            raise ValueError("triton_model_name is empty; give the name clients will query")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if not (allow_http or allow_grpc):
            raise ValueError("allow_http and allow_grpc are both False; enable at least one protocol")
        if streaming and not hasattr(model, "triton_stream_request"):
            raise TypeError("streaming=True needs a model with triton_stream_request; deploy with streaming=False")
        self.model = model
        self.triton_model_name = triton_model_name
        self.triton_model_version = triton_model_version
        self.max_batch_size = max_batch_size
        self.http_port = http_port
        self.grpc_port = grpc_port
        self.metrics_port = metrics_port
        self.address = address
        self.allow_http = allow_http
        self.allow_grpc = allow_grpc
        self.streaming = streaming
        self.max_queue_delay_microseconds = max_queue_delay_microseconds
        self.triton = None
        self._batcher: RequestBatcher | None = None

    def deploy(self) -> None:
        """Check ports, run the warm-up request, and bind the model to a (not yet started) Triton server."""
        if self.triton is not None:
            raise DeployError("deploy() was already called")
        self._check_ports()
        ensure_libpython_on_library_path()
        self._batcher = RequestBatcher(
            self._model_infer_requests(), self.max_batch_size, self.max_queue_delay_microseconds / 1e6
        )
        try:
            self._warm_up()
            self.triton = self._bound_triton()
        except BaseException:
            self._batcher.stop()
            self._batcher = None
            raise

    def serve(self) -> None:
        """Start Triton and block until it stops (Ctrl-C or SIGTERM), then clean up."""
        in_main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _interrupt) if in_main_thread else None
        try:
            self.run()
            self.triton.serve()
        except KeyboardInterrupt:
            LOGGER.info("interrupted, stopping")
        finally:
            if in_main_thread:
                signal.signal(signal.SIGTERM, previous)
            self.stop()

    def run(self) -> None:
        """Start Triton in the background; returns once the model is loaded and ready."""
        self._require_deployed()
        for attempt in range(1, _START_ATTEMPTS + 1):
            try:
                self.triton.run()
                return
            except Exception as error:
                if _HANDSHAKE_RACE not in str(error) or attempt == _START_ATTEMPTS:
                    raise
                LOGGER.warning("a model instance missed PyTriton's start-up handshake; restarting Triton")
                self.triton.stop()
                self.triton = self._bound_triton()

    def stop(self) -> None:
        """Stop Triton and the model's request worker; safe to call twice."""
        if self.triton is not None:
            self.triton.stop()
        if self._batcher is not None:
            self._batcher.stop()

    def _bound_triton(self) -> Triton:
        config = TritonConfig(
            allow_http=self.allow_http,
            allow_grpc=self.allow_grpc,
            http_address=self.address,
            grpc_address=self.address,
            metrics_address=self.address,
            http_port=self.http_port,
            grpc_port=self.grpc_port,
            metrics_port=self.metrics_port,
            # Triton stops the instances one after another, each taking about 2 s.
            exit_timeout_secs=30 + 2 * self.max_batch_size,
        )
        triton = Triton(config=config)
        triton.bind(
            model_name=self.triton_model_name,
            model_version=self.triton_model_version,
            infer_func=[self._instance_fn(i) for i in range(self.max_batch_size)],
            inputs=list(self.model.get_triton_input),
            outputs=list(self.model.get_triton_output),
            # batcher=None: Triton's default scheduler hands each instance one request (see module doc).
            config=ModelConfig(batching=True, max_batch_size=self.max_batch_size, batcher=None),
            strict=False,
        )
        if self.streaming:
            triton.bind(
                model_name=stream_model_name(self.triton_model_name),
                model_version=self.triton_model_version,
                infer_func=[self._stream_instance_fn(i) for i in range(self.max_batch_size)],
                inputs=list(self.model.get_triton_input),
                outputs=list(self.model.get_triton_output),
                config=ModelConfig(batching=True, max_batch_size=self.max_batch_size, batcher=None, decoupled=True),
                strict=False,
            )
        return triton

    def _require_deployed(self) -> None:
        if self.triton is None:
            raise DeployError("deploy() must be called first")

    def _check_ports(self) -> None:
        ports = []
        if self.allow_http:
            check_port_free(
                self.address, self.http_port, "HTTP", "--triton_port (-trp) / DeployPyTriton(http_port=)"
            )
            ports.append(self.http_port)
        if self.allow_grpc:
            check_port_free(self.address, self.grpc_port, "gRPC", "--grpc_port / DeployPyTriton(grpc_port=)")
            ports.append(self.grpc_port)
        if self.metrics_port is None:
            self.metrics_port = pick_metrics_port(self.address, self.http_port, ports)
        else:
            check_port_free(self.address, self.metrics_port, "metrics", "DeployPyTriton(metrics_port=)")

    def _model_infer_requests(self) -> InferRequests:
        batched = getattr(self.model, "triton_infer_requests", None)
        if batched is not None:
            return batched
        return lambda requests: infer_requests_one_by_one(self.model.triton_infer_fn, requests)

    def _warm_up(self) -> None:
        make_request = getattr(self.model, "triton_warmup_request", None)
        request = make_request() if make_request else default_warmup_request(self.model.get_triton_input)
        started = time.monotonic()
        try:
            self._batcher.infer(request)
        except Exception as error:
            raise DeployError(
                f"the warm-up request failed, so the model is not served: {type(error).__name__}: {error}"
            ) from error
        LOGGER.info("warm-up request answered in %.2f s", time.monotonic() - started)

    def _instance_fn(self, index: int) -> Callable[[list], list[dict[str, np.ndarray]]]:
        def infer(requests: list) -> list[dict[str, np.ndarray]]:
            futures = [self._batcher.submit(dict(request.data)) for request in requests]
            return [future.result() for future in futures]

        infer.__name__ = f"{self.triton_model_name}_instance_{index}"
        return infer

    def _stream_instance_fn(self, index: int) -> Callable[[list], Iterator[list[dict[str, np.ndarray]]]]:
        def stream(requests: list) -> Iterator[list[dict[str, np.ndarray]]]:
            if len(requests) != 1:  # Triton's default scheduler hands an instance one request at a time
                raise DeployError(f"a streaming instance got {len(requests)} requests at once; it takes one")
            for outputs in self.model.triton_stream_request(dict(requests[0].data)):
                yield [outputs]

        stream.__name__ = f"{stream_model_name(self.triton_model_name)}_instance_{index}"
        return stream
