"""Serve an `ITritonDeployable` on Triton through PyTriton: every request runs on its own as soon as it arrives.

The model gets `max_batch_size` Triton instances under Triton's default scheduler (no dynamic batching): each
instance takes one request at a time and calls the model for it at once, from its own thread. Concurrent requests
meet in the model's in-flight scheduler, which shares decode steps among them; each request is answered as soon as
its own rows are done, and a failed request fails alone. With `streaming=True` a second, decoupled model
`<name>_stream` is served next to it: the same inputs, one response per piece of text as it is generated (gRPC
streams, HTTP `generate_stream`), `max_batch_size` instances each streaming one request.

Around Triton:

- Triton starts beside the model's load: `deploy` writes the models into Triton's repository and starts Triton,
  then loads the model (`deploy(load=...)`) and runs the warm-up request, while Triton's processes start. Its
  model instances wait at a gate (`deploy.triton_gate`) meanwhile, so Triton's ports stay closed.
- Ready means a request succeeds: `run` opens the gate only once the model has answered the warm-up request, and
  Triton opens its ports (and `/v2/health/ready` answers 200) only once every model is loaded.
- Ready means the first request is not slow either: once Triton is up, `run` sends the warm-up request through
  Triton itself over loopback (one per instance, and one through the streaming model), so that Triton's and
  PyTriton's path to the model is warm before `run` returns and the server says READY (the OpenAI front's
  `/health/ready`, the script's READY line). Triton's own ready endpoints answer 200 a moment earlier: Triton
  reports ready before PyTriton connects to it, and that cannot be held. A failed warm-up through Triton is
  logged and the server serves on. Its requests carry a parameter with a token of this process, by which they are
  left out of the metrics; a client's request meanwhile is counted.
- A failed request reaches its client as one line with a status: 400 bad input, 500 server fault, 503 stopping
  (`deploy.triton_errors`, applied inside Triton by `deploy/triton_stub_model.py`); the log keeps the traceback.
- Triton and its backend processes die with this process, even on SIGKILL, and leave no shared memory behind
  (`deploy.process_guard`).
- The metrics port serves this server's metrics followed by Triton's own (`deploy.metrics`).
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import logging
import secrets
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from pytriton.client import DecoupledModelClient, ModelClient
from pytriton.constants import PYTRITON_HOME
from pytriton.model_config import ModelConfig
from pytriton.triton import Triton, TritonConfig, TritonLifecyclePolicy
from pytriton.utils.workspace import Workspace

from deploy.metrics import MetricsServer, ServerMetrics
from deploy.process_guard import ProcessGuard, clean_stale_files, workspace_path
from deploy.startup import (
    DeployError,
    check_port_free,
    ensure_libpython_on_library_path,
    free_port,
    pick_metrics_port,
    raise_stack_limit_for_triton,
)
from deploy.triton_errors import (
    BAD_REQUEST,
    INPUT_CAPS_FILE,
    INTERNAL,
    UNAVAILABLE,
    RequestFailed,
    client_failure,
)
from deploy.triton_gate import SERVE, STOP, decide, decided, held
from wire import InferRequest, default_warmup_request, stream_model_name

LOGGER = logging.getLogger(__name__)

# Models are written into Triton's repository and loaded when Triton starts, before its ports open.
_LOCAL_MODELS = TritonLifecyclePolicy(launch_triton_on_startup=False, local_model_store=True)
_MONITOR_INTERVAL_S = 0.5
_BACKEND_FILES = {"model.py": "triton_stub_model.py", "triton_errors.py": "triton_errors.py",
                  "triton_gate.py": "triton_gate.py"}
_WARM_UP_TIMEOUT_S = 120.0  # for each warm-up request through Triton, its client's set-up included
_LOOPBACK = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}  # where this process reaches its own Triton
_WARM_UP_PARAMETER = "nemo_mm_warm_up"  # a request parameter: this process's token on its own warm-up requests


_READY_POLL_S = 0.02  # how often a starting Triton is asked whether it is ready
_READY_POLL_LIMIT_S = 60.0  # then PyTriton's own wait, with its own timeout, takes over


def wait_until_ready(host: str, port: int, alive: Callable[[], bool], limit_s: float = _READY_POLL_LIMIT_S) -> bool:
    """Ask Triton's HTTP endpoint `/v2/health/ready` on `host:port` every `_READY_POLL_S` until it answers 200
    (True), `alive()` turns False or `limit_s` has passed (False)."""
    deadline = time.monotonic() + limit_s
    while alive() and time.monotonic() < deadline:
        connection = http.client.HTTPConnection(host, port, timeout=1.0)  # no proxy on loopback
        try:
            connection.request("GET", "/v2/health/ready")
            if connection.getresponse().status == 200:
                return True
        except OSError:  # not listening yet
            pass
        finally:
            connection.close()
        time.sleep(_READY_POLL_S)
    return False


class _PromptTriton(Triton):
    """PyTriton's `Triton`, started sooner (PyTriton 0.7.0 has no option for any of these, so they go around it):

    - `launch` starts the `tritonserver` process alone; `run` then waits for it and connects PyTriton's proxies
      (PyTriton's `run` does both).
    - Triton loads each model's config as PyTriton wrote it, which is complete (`--strict-model-config true`).
      Otherwise its Python backend starts one more backend process per model before the instances, only to ask
      `model.py` to complete the config: 1.3-1.6 s of every start on a 2-core machine.
    - It is seen ready within `_READY_POLL_S` through its HTTP endpoint (`ready_at`: host and port, or None).
      PyTriton asks once a second, so a Triton ready 0.8 s after its launch was waited for until 1 s."""

    def __init__(self, ready_at: tuple[str, int] | None, **kwargs):
        super().__init__(**kwargs)
        self._ready_at = ready_at
        self._triton_server_config["strict-model-config"] = "true"

    def launch(self) -> None:
        """Start `tritonserver` (its model instances wait at the gate), without waiting for it."""
        self._run_server()

    def server_alive(self) -> bool:
        """Whether the launched `tritonserver` process still runs."""
        return self._is_alive_impl()

    def run(self) -> None:
        """Wait for the launched Triton and connect PyTriton's proxies to it (PyTriton's `run` would start a
        Triton that exited again)."""
        self.connect()

    def _wait_for_server(self) -> None:
        if self._ready_at is not None:
            wait_until_ready(*self._ready_at, alive=self._is_alive_impl)
        if not self._is_alive_impl():
            raise RuntimeError("tritonserver exited")
        super()._wait_for_server()  # PyTriton's own wait: its first check finds Triton ready


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class DeployPyTriton:
    """Deploys a model implementing `ITritonDeployable` on Triton (HTTP and gRPC), NeMo's class and arguments.

    Example:
        nm = DeployPyTriton(model=exporter, triton_model_name="neva", http_port=8000)
        nm.deploy()   # port checks, binding, Triton started (its ports still closed), warm-up request
        nm.serve()    # blocks; or nm.run() ... nm.stop(); run() warms Triton's path up before it returns

    `deploy` and `run` must be called from a thread that lives as long as the server (the main thread, as a rule):
    the kernel stops Triton when the thread that started it ends.
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
        self.metrics: ServerMetrics | None = None
        self.triton: _PromptTriton | None = None
        self._workspace: Workspace | None = None
        self._guard: ProcessGuard | None = None
        self._metrics_server: MetricsServer | None = None
        self._triton_metrics_port: int | None = None
        self._running = False
        self._stopping = False
        self._launched_at = 0.0
        self._warm_up_mark = {_WARM_UP_PARAMETER: secrets.token_hex(16)}

    def deploy(self, load: Callable[[], object] | None = None) -> None:
        """Check ports, bind the model to Triton and start Triton, its models held at the gate; then `load()`, if
        given, while Triton starts (the model's own load: its Triton inputs, outputs, byte caps and parameters
        must be known before it), run the warm-up request and hold the metrics port. Triton's ports open in
        `run`. A failure stops Triton again."""
        if self.triton is not None:
            raise DeployError("deploy() was already called")
        self._check_ports()
        ensure_libpython_on_library_path()
        for path in clean_stale_files(PYTRITON_HOME):
            LOGGER.info("removed %s, left behind by a serving process that is gone", path)
        try:
            started = time.monotonic()
            self._triton_metrics_port = free_port("127.0.0.1")
            self.triton = self._bound_triton()
            self._launch()
            LOGGER.info("phase Triton launch: %.2f s (its models written, its process started)",
                        time.monotonic() - started)
            if load is not None:
                load()
            self._warm_up()
            self.metrics = ServerMetrics(getattr(self.model, "pipeline", None))
            # bound now, served from run(): no other socket (a warm-up client's) can take the port between
            self._metrics_server = MetricsServer(self.metrics, self.address, self.metrics_port,
                                                 f"http://127.0.0.1:{self._triton_metrics_port}/metrics")
        except BaseException:
            self.stop()
            raise

    def serve(self) -> None:
        """Start Triton (unless `run` did) and block until Ctrl-C or SIGTERM, then clean up; DeployError if Triton
        exits on its own."""
        in_main_thread = threading.current_thread() is threading.main_thread()
        # SIGINT too: a process started in the background by a script (or by a parent that ignores it) inherits an
        # ignored SIGINT, and Ctrl-C or `kill -INT` would then never stop it
        signals = (signal.SIGTERM, signal.SIGINT) if in_main_thread else ()
        previous = {number: signal.signal(number, _interrupt) for number in signals}
        try:
            self.run()
            while self.triton.is_alive():
                time.sleep(_MONITOR_INTERVAL_S)
            raise DeployError("Triton exited unexpectedly; see its log above")
        except KeyboardInterrupt:
            LOGGER.info("interrupted, stopping")
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)
            self.stop()

    def run(self) -> None:
        """Let Triton's models go (Triton started in `deploy`); returns once every model is loaded, its ports are
        open and a warm-up request has gone through Triton to each instance."""
        if self.triton is None:
            raise DeployError("deploy() must be called first")
        if self._running:
            return
        try:
            self._let_models_go()
            try:
                self.triton.run()
            except Exception as error:
                message = f"Triton did not start ({type(error).__name__}: {error}); see its log above"
                raise DeployError(message) from error
            self._warm_up_through_triton()
            self._metrics_server.start()
            started = getattr(self.model, "serving_started", None)
            if started is not None:  # work the model keeps for after READY (the other step graphs' captures)
                started()
        except BaseException:
            self.stop()
            raise
        self._running = True

    def stop(self) -> None:
        """Refuse new requests (503), stop Triton and the metrics endpoint, end the guard; safe to call twice."""
        self._stopping = True
        if self.triton is not None:
            workspace = self._workspace.path
            # a Triton still starting: its instances fail their load (one that exited has no workspace left)
            with contextlib.suppress(FileNotFoundError):
                if not decided(workspace):
                    decide(workspace, STOP)
            self.triton.stop()
            shutil.rmtree(workspace, ignore_errors=True)  # Triton leaves it when it never ran
        if self._metrics_server is not None:
            self._metrics_server.stop()
            self._metrics_server = None
        if self._guard is not None:
            self._guard.stop()
            self._guard = None
        if self.metrics is not None:
            self.metrics.close()
        self._running = False

    def _launch(self) -> None:
        """Start Triton's process (its models held at the gate), guarded to die with this process."""
        self._guard = ProcessGuard(self._workspace.path)
        raise_stack_limit_for_triton()
        self._launched_at = time.monotonic()
        try:
            self.triton.launch()
        except Exception as error:
            raise DeployError(f"Triton did not start ({type(error).__name__}: {error}); see its log above") from error

    def _let_models_go(self) -> None:
        """Open the gate: Triton loads its models and opens its ports (a DeployError if Triton exited meanwhile)."""
        waiting = held(self._workspace.path)
        exited = DeployError("Triton exited while the model was loading; see its log above")
        if not self.triton.server_alive():
            raise exited
        try:
            decide(self._workspace.path, SERVE)
        except FileNotFoundError:  # it exited just now: PyTriton removed its workspace
            raise exited from None
        LOGGER.info("Triton started %.2f s before its models were let go; %d of its %d model instances were waiting",
                    time.monotonic() - self._launched_at, waiting, self.max_batch_size * (1 + self.streaming))

    def _bound_triton(self) -> _PromptTriton:
        config = TritonConfig(
            allow_http=self.allow_http,
            allow_grpc=self.allow_grpc,
            http_address=self.address,
            grpc_address=self.address,
            metrics_address="127.0.0.1",  # read through this server's own metrics endpoint
            http_port=self.http_port,
            grpc_port=self.grpc_port,
            metrics_port=self._triton_metrics_port,
            # Triton stops the instances one after another, each taking about 2 s.
            exit_timeout_secs=30 + 2 * self.max_batch_size,
        )
        self._workspace = Workspace(workspace_path(PYTRITON_HOME))
        ready_at = (self._loopback_host(), self.http_port) if self.allow_http else None
        triton = _PromptTriton(ready_at, config=config, workspace=self._workspace,
                               triton_lifecycle_policy=_LOCAL_MODELS)
        models = [(self.triton_model_name, self._instance_fn, False)]
        if self.streaming:
            models.append((stream_model_name(self.triton_model_name), self._stream_instance_fn, True))
        for name, instance_fn, decoupled in models:
            triton.bind(
                model_name=name,
                model_version=self.triton_model_version,
                infer_func=[instance_fn(i) for i in range(self.max_batch_size)],
                inputs=list(self.model.get_triton_input),
                outputs=list(self.model.get_triton_output),
                # batcher=None: Triton's default scheduler hands each instance one request at a time.
                config=ModelConfig(batching=True, max_batch_size=self.max_batch_size, batcher=None,
                                   decoupled=decoupled),
                strict=False,
            )
            self._install_backend_model(name)
        return triton

    def _install_backend_model(self, name: str) -> None:
        """Put this package's backend model (clean errors, input byte caps) in front of PyTriton's in Triton's
        repository, and add the model's `triton_model_parameters` to its Triton config."""
        folder = self._workspace.model_store_path / name / str(self.triton_model_version)
        (folder / "model.py").rename(folder / "pytriton_model.py")
        for target, source in _BACKEND_FILES.items():
            shutil.copyfile(Path(__file__).with_name(source), folder / target)
        caps = getattr(self.model, "triton_input_byte_caps", dict)()
        (folder / INPUT_CAPS_FILE).write_text(json.dumps(caps))
        with (folder.parent / "config.pbtxt").open("a") as config:  # what clients read about the model
            for key, value in getattr(self.model, "triton_model_parameters", dict)().items():
                config.write(f"parameters {{ key: {json.dumps(key)} value {{ string_value: {json.dumps(value)} }} }}\n")

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

    def _warmup_request(self) -> InferRequest:
        make_request = getattr(self.model, "triton_warmup_request", None)
        return make_request() if make_request else default_warmup_request(self.model.get_triton_input)

    def _warm_up(self) -> None:
        request = self._warmup_request()
        started = time.monotonic()
        try:
            self.model.triton_infer_fn(**request)
        except Exception as error:
            raise DeployError(
                f"the warm-up request failed, so the model is not served: {type(error).__name__}: {error}"
            ) from error
        LOGGER.info("phase warm-up request: %.2f s", time.monotonic() - started)

    def _loopback_host(self) -> str:
        """Where this process reaches its own Triton."""
        return _LOOPBACK.get(self.address, self.address)

    def _warm_up_through_triton(self) -> None:
        """Send the warm-up request through the running Triton as a client does: `max_batch_size` at once, so
        that each instance gets one, then one through the streaming model (over gRPC, its streaming protocol).
        A failure is logged, never raised: the model answered the in-process warm-up, so it is served. Each request
        carries `_warm_up_mark`, which leaves it out of the metrics."""
        request = self._warmup_request()
        host = self._loopback_host()
        host = f"[{host}]" if ":" in host else host  # an IPv6 address in a URL
        url = f"http://{host}:{self.http_port}" if self.allow_http else f"grpc://{host}:{self.grpc_port}"
        stream = self.streaming and self.allow_grpc

        def infer(_: int) -> None:
            with ModelClient(url, self.triton_model_name, init_timeout_s=_WARM_UP_TIMEOUT_S,
                             inference_timeout_s=_WARM_UP_TIMEOUT_S) as client:
                client.infer_batch(parameters=self._warm_up_mark, **request)

        started = time.monotonic()
        try:
            with ThreadPoolExecutor(self.max_batch_size, thread_name_prefix="triton-warm-up") as pool:
                list(pool.map(infer, range(self.max_batch_size)))
            if stream:
                with _MarkedStreamClient(f"grpc://{host}:{self.grpc_port}", stream_model_name(self.triton_model_name),
                                         self._warm_up_mark, init_timeout_s=_WARM_UP_TIMEOUT_S,
                                         inference_timeout_s=_WARM_UP_TIMEOUT_S) as client:
                    for _ in client.infer_batch(**request):
                        pass
        except Exception as error:  # noqa: BLE001 - the server serves on; the first requests may be slower
            LOGGER.warning("the warm-up request through Triton failed, serving anyway (the first requests may be "
                           "slower): %s: %s", type(error).__name__, error)
            detail = "failed"
        else:
            detail = f"{self.max_batch_size} request{'s' * (self.max_batch_size > 1)}{', 1 streamed' * stream}"
        LOGGER.info("phase warm-up through Triton: %.2f s (%s)", time.monotonic() - started, detail)

    def _failed(self, kind: str, error: Exception) -> RequestFailed:
        """The client's failure for a request of `kind` that raised `error`, logged and counted."""
        failure = client_failure(error, stopping=self._stopping)
        if failure.status == INTERNAL:
            LOGGER.error("a %s request failed: %s", kind, failure.message, exc_info=error)
        else:
            LOGGER.info("a %s request was refused (%d): %s", kind, failure.status, failure.message)
        self.metrics.count(kind, failure.status)
        return failure

    def _uncounted_if_warm_up(self, request) -> contextlib.AbstractContextManager:
        """`metrics.uncounted()` for one of this server's warm-up requests (its parameter carries the token), else
        a block that changes nothing."""
        warm_up = (request.parameters or {}).get(_WARM_UP_PARAMETER) == self._warm_up_mark[_WARM_UP_PARAMETER]
        return self.metrics.uncounted() if warm_up else contextlib.nullcontext()

    def _refuse_while_stopping(self) -> None:
        if self._stopping:
            raise RequestFailed(UNAVAILABLE, "the server is stopping; retry on a running server")

    def _instance_fn(self, index: int) -> Callable[[list], list[dict[str, np.ndarray]]]:
        def infer(requests: list) -> list[dict[str, np.ndarray]]:
            answers = []
            for request in requests:  # one, under Triton's default scheduler
                with self._uncounted_if_warm_up(request):
                    try:
                        self._refuse_while_stopping()
                        answers.append(self.model.triton_infer_fn(**request.data))
                    except Exception as error:  # noqa: BLE001 - every failure goes to its client as one line
                        raise self._failed("infer", error) from None
                    self.metrics.count("infer", 200)
            return answers

        infer.__name__ = f"{self.triton_model_name}_instance_{index}"
        return infer

    def _stream_instance_fn(self, index: int) -> Callable[[list], Iterator[list[dict[str, np.ndarray]]]]:
        def stream(requests: list) -> Iterator[list[dict[str, np.ndarray]]]:
            uncounted = functools.partial(self._uncounted_if_warm_up, requests[0])  # entered anew after each yield
            try:
                if len(requests) != 1:  # Triton's default scheduler hands an instance one request at a time
                    raise RequestFailed(BAD_REQUEST, f"a streaming instance got {len(requests)} requests; it takes one")
                self._refuse_while_stopping()
                for outputs in _each_within(self.model.triton_stream_request(dict(requests[0].data)), uncounted):
                    yield [outputs]
            except Exception as error:  # noqa: BLE001 - every failure goes to its client as one line
                with uncounted():
                    raise self._failed("stream", error) from None
            with uncounted():
                self.metrics.count("stream", 200)

        stream.__name__ = f"{stream_model_name(self.triton_model_name)}_instance_{index}"
        return stream


class _MarkedStreamClient(DecoupledModelClient):
    """PyTriton's streaming client, sending `parameters` with its request (PyTriton's own refuses parameters;
    Triton's gRPC stream carries them to the model)."""

    def __init__(self, url: str, model_name: str, parameters: dict[str, str], **kwargs):
        super().__init__(url, model_name, **kwargs)
        self._parameters = parameters

    def _get_infer_extra_args(self) -> dict:
        return {**super()._get_infer_extra_args(), "parameters": self._parameters}


_END = object()


def _each_within(items: Iterator, scope: Callable[[], contextlib.AbstractContextManager]) -> Iterator:
    """`items`, each taken inside a new `scope()`, which is left before the item is yielded."""
    while True:
        with scope():
            item = next(items, _END)
        if item is _END:
            return
        yield item
