"""Prometheus metrics of a served model, on the metrics port, followed by Triton's own.

`ServerMetrics` counts requests and errors by kind (`infer`, `stream`, `openai`), reads the in-flight scheduler
(queue length, running rows, KV-cache use) and the encoder-output cache (hits, misses) at each scrape, and
records every request's time to first token, time per output token and generated tokens from the scheduler's
request handles, which the pipeline hands to its `submitted` observers. What a thread counts or submits inside
`ServerMetrics.uncounted()` is left out (the server's own warm-up requests). `MetricsServer` answers `GET /metrics`
with them and appends the text of Triton's metrics endpoint, which listens on a loopback port of its own.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from deploy.startup import PortInUseError

LOGGER = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_WATCH_INTERVAL_S = 0.05
_TRITON_TIMEOUT_S = 2.0


class ServerMetrics:
    """The metrics of one served model; `pipeline` (an `exporter.runtime.Pipeline`, optional) adds the engine's."""

    def __init__(self, pipeline: Any = None):
        self.registry = CollectorRegistry()
        self.requests = Counter("nemo_mm_requests", "Requests answered (or failed), by front end kind", ["kind"],
                                registry=self.registry)
        self.errors = Counter("nemo_mm_request_errors", "Failed requests, by front end kind and error kind",
                              ["kind", "error"], registry=self.registry)
        self.time_to_first_token = Histogram(
            "nemo_mm_time_to_first_token_seconds", "From a request's submission to the scheduler to its first token",
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.time_per_output_token = Histogram(
            "nemo_mm_time_per_output_token_seconds", "Mean time between a request's tokens after the first",
            buckets=_TOKEN_BUCKETS, registry=self.registry)
        self.generated_tokens = Counter("nemo_mm_generated_tokens", "Tokens generated", registry=self.registry)
        self._pipeline = pipeline
        self._quiet = threading.local()  # its `on`: this thread's counts and submissions are left out
        if pipeline is not None:
            self.registry.register(_EngineCollector(pipeline))
            self._watcher = _HandleWatcher(self._record)
            pipeline.submitted.append(self._watch)

    def close(self) -> None:
        """Stop observing the pipeline's requests."""
        if self._pipeline is not None and self._watch in self._pipeline.submitted:
            self._pipeline.submitted.remove(self._watch)

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Leave out what this thread counts, and the requests it submits to the pipeline, inside the block (the
        server's own warm-up requests). Not to be held across a generator's `yield`: its caller may resume it on
        another thread."""
        self._quiet.on = True
        try:
            yield
        finally:
            self._quiet.on = False

    def count(self, kind: str, status: int) -> None:
        """Count one answered request of `kind` with its HTTP status (a 4xx counts as `bad_request`, 503 as
        `unavailable`, another 5xx as `internal`), unless `uncounted`."""
        if self._left_out():
            return
        self.requests.labels(kind).inc()
        if status >= 400:
            error = "bad_request" if status < 500 else "unavailable" if status == 503 else "internal"
            self.errors.labels(kind, error).inc()

    def text(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)

    def _left_out(self) -> bool:
        return getattr(self._quiet, "on", False)

    def _watch(self, handle: Any) -> None:
        if not self._left_out():
            self._watcher.add(handle)

    def _record(self, handle: Any) -> None:
        tokens = len(handle.tokens)
        self.generated_tokens.inc(tokens)
        if handle.first_token_at is None:
            return
        self.time_to_first_token.observe(handle.first_token_at - handle.submitted_at)
        if tokens > 1 and handle.finished_at is not None:
            self.time_per_output_token.observe((handle.finished_at - handle.first_token_at) / (tokens - 1))


class CountRequests:
    """ASGI middleware counting the requests to paths under `prefix` as `kind`, with their response status (as the
    response starts)."""

    def __init__(self, app: Any, metrics: ServerMetrics, kind: str, prefix: str):
        self.app, self.metrics, self.kind, self.prefix = app, metrics, kind, prefix

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        counted = False

        async def send_counted(message: dict) -> None:
            nonlocal counted
            if message["type"] == "http.response.start" and not counted:
                counted = True
                self.metrics.count(self.kind, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            if not counted:  # the app failed before it answered
                self.metrics.count(self.kind, 500)


class _EngineCollector(Collector):
    """The scheduler's queue and KV cache and the encoder-output cache, read at each scrape."""

    def __init__(self, pipeline: Any):
        self._pipeline = pipeline

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._pipeline.scheduler.stats()
        yield GaugeMetricFamily("nemo_mm_queue_length", "Requests waiting for a scheduler slot", value=stats.waiting)
        yield GaugeMetricFamily("nemo_mm_running_rows", "Rows decoding in the scheduler", value=stats.running_rows)
        yield GaugeMetricFamily("nemo_mm_max_rows", "Rows the scheduler can decode at once", value=stats.max_rows)
        yield GaugeMetricFamily("nemo_mm_kv_cache_used_fraction", "Share of the KV cache in use",
                                value=stats.kv_used_fraction)
        yield GaugeMetricFamily("nemo_mm_kv_cache_blocks", "Blocks of the paged KV cache", value=stats.kv_blocks_total)
        yield GaugeMetricFamily("nemo_mm_kv_cache_blocks_cached", "KV-cache blocks kept only for prefix reuse",
                                value=stats.kv_blocks_cached)
        cache = self._pipeline.feature_cache.stats()
        yield CounterMetricFamily("nemo_mm_encoder_cache_hits", "Media whose encoder output was reused",
                                  value=cache["hits"])
        yield CounterMetricFamily("nemo_mm_encoder_cache_misses", "Media encoded", value=cache["misses"])


class _HandleWatcher:
    """Calls `on_finished(handle)` from a background thread once each added request handle is done."""

    def __init__(self, on_finished: Callable[[Any], None]):
        self._on_finished = on_finished
        self._added: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="metrics-watcher", daemon=True).start()

    def add(self, handle: Any) -> None:
        self._added.put(handle)

    def _run(self) -> None:
        pending: list[Any] = []
        while True:
            if not pending:
                pending.append(self._added.get())
            while not self._added.empty():
                pending.append(self._added.get())
            running = []
            for handle in pending:
                if not handle.done:
                    running.append(handle)
                    continue
                try:
                    self._on_finished(handle)
                except Exception:  # noqa: BLE001 - a metric must never stop the watcher
                    LOGGER.exception("recording a request's metrics failed")
            pending = running
            if pending:
                pending[0].wait(_WATCH_INTERVAL_S)


class MetricsServer:
    """`GET /metrics` on (address, port): `metrics`' text, then Triton's metrics from `triton_metrics_url`."""

    def __init__(self, metrics: ServerMetrics, address: str, port: int, triton_metrics_url: str | None):
        handler = _handler(metrics, triton_metrics_url)
        server_class = type("MetricsHTTPServer", (ThreadingHTTPServer,),
                            {"address_family": socket.AF_INET6 if ":" in address else socket.AF_INET,
                             "daemon_threads": True})
        try:
            self._server = server_class((address, port), handler)
        except OSError as error:
            raise PortInUseError(f"metrics port {port} on {address} could not be bound ({error.strerror}); "
                                 "choose a free port with --metrics_port / DeployPyTriton(metrics_port=)") from None
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-server", daemon=True)

    def start(self) -> None:
        """Serve from a background thread; the port is held from construction on."""
        self._thread.start()

    def stop(self) -> None:
        """Stop serving (if started) and release the port."""
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()


def _handler(metrics: ServerMetrics, triton_metrics_url: str | None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404, "only /metrics is served here")
                return
            body = metrics.text() + _triton_metrics(triton_metrics_url)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
            LOGGER.debug("metrics: " + format, *args)

    return Handler


def _triton_metrics(url: str | None) -> bytes:
    if url is None:
        return b""
    try:
        with urllib.request.urlopen(url, timeout=_TRITON_TIMEOUT_S) as response:
            return response.read()
    except OSError as error:
        return f"# Triton's metrics are unavailable: {type(error).__name__}\n".encode()
