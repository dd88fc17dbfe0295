"""The warm-up request through Triton: `DeployPyTriton.run` sends it to each instance (and through the streaming
model) before it returns, i.e. before the server says READY; a failing one is logged and the server serves on; its
requests are left out of the metrics, a client's request sent meanwhile is counted."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
from pytriton.client import DecoupledModelClient, ModelClient

from deploy import DeployPyTriton
from deploy.deploy_pytriton import wait_until_ready
from support.ports import free_port
from support.stub_model import StubMultimodalModel, describe_pixels, expected_answer

MODEL = "stub"
INSTANCES = 3


class RecordingModel(StubMultimodalModel):
    """Records the thread of every call (the in-process warm-up runs on the caller's, Triton's on PyTriton's) and
    fails the calls numbered in `failing`; streams its one answer."""

    def __init__(self, failing: range = range(0), **kwargs):
        super().__init__(**kwargs)
        self.threads: list[str] = []
        self.streamed = 0
        self._failing = failing

    def triton_infer_fn(self, **inputs: np.ndarray) -> dict[str, np.ndarray]:
        with self._lock:
            self.threads.append(threading.current_thread().name)
            call = len(self.threads)
        if call in self._failing:
            raise ValueError("the model is broken for this call")
        return super().triton_infer_fn(**inputs)

    def triton_stream_request(self, request: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        with self._lock:
            self.streamed += 1
        yield super().triton_infer_fn(**request)


def _run(model: RecordingModel, caplog) -> tuple[DeployPyTriton, str]:
    http_port = free_port()
    deployer = DeployPyTriton(model, MODEL, max_batch_size=INSTANCES, http_port=http_port, grpc_port=free_port(),
                              address="127.0.0.1", streaming=True)
    deployer.deploy()
    assert model.threads == [threading.current_thread().name] and model.streamed == 0  # the in-process warm-up
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="deploy.deploy_pytriton"):
        try:
            deployer.run()
        except BaseException:
            deployer.stop()
            raise
    return deployer, f"127.0.0.1:{http_port}"


def _phase_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("phase warm-up through Triton")]


def _tritonserver_arguments(deployer: DeployPyTriton) -> list[str]:
    """The command line of the `tritonserver` serving `deployer`'s workspace."""
    workspace = str(deployer._workspace.path)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            arguments = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if arguments[0].endswith("/tritonserver") and any(workspace in argument for argument in arguments):
            return arguments
    raise AssertionError(f"no tritonserver serves {workspace}")


def _requests_counted(deployer: DeployPyTriton, kind: str | None = None) -> float:
    return sum(sample.value for metric in deployer.metrics.requests.collect() for sample in metric.samples
               if sample.name.endswith("_total") and kind in (None, sample.labels["kind"]))


def _assert_serves(url: str) -> None:
    media = np.full((1, 1, 8, 8, 3), 10, dtype=np.uint8)
    with ModelClient(url, MODEL, init_timeout_s=30, inference_timeout_s=30) as client:
        answer = client.infer_batch(input_text=np.array([[b"hello"]], dtype=np.bytes_), input_media=media)
    assert answer["outputs"][0, 0].decode() == expected_answer("hello", describe_pixels(media[0]))


def test_warm_up_goes_through_triton_to_each_instance_before_run_returns(caplog):
    model = RecordingModel(delay_s=0.3)  # long enough for the instances to take one request each at once
    deployer, url = _run(model, caplog)
    try:
        arguments = _tritonserver_arguments(deployer)  # the configs load as written: no auto-complete process
        assert arguments[arguments.index("--strict-model-config") + 1] == "true"
        through_triton = model.threads[1:]
        assert len(through_triton) == INSTANCES and model.streamed == 1
        assert threading.current_thread().name not in through_triton
        assert model.concurrent_peak == INSTANCES  # each instance had one at the same time
        [line] = _phase_lines(caplog)
        assert line.endswith(f"s ({INSTANCES} requests, 1 streamed)"), line
        assert _requests_counted(deployer) == 0  # the warm-up's requests are not counted
        _assert_serves(url)
        assert _requests_counted(deployer) == 1
    finally:
        deployer.stop()


def test_failing_warm_up_through_triton_is_logged_and_the_server_serves(caplog):
    model = RecordingModel(failing=range(2, 2 + INSTANCES))  # every call after the in-process warm-up's, at first
    deployer, url = _run(model, caplog)
    try:
        assert deployer.triton.is_alive()
        warnings = [r.getMessage() for r in caplog.records
                    if r.levelno == logging.WARNING and r.name == "deploy.deploy_pytriton"]
        assert any("warm-up request through Triton failed, serving anyway" in w for w in warnings), warnings
        assert all("Traceback" not in w for w in warnings)
        [line] = _phase_lines(caplog)
        assert line.endswith("s (failed)"), line
        _assert_serves(url)
    finally:
        deployer.stop()


def test_warm_up_reaches_a_server_bound_to_every_address_over_http_alone(caplog):
    model = RecordingModel()
    http_port = free_port()
    deployer = DeployPyTriton(model, MODEL, max_batch_size=1, http_port=http_port, grpc_port=free_port(),
                              address="0.0.0.0", allow_grpc=False)
    deployer.deploy()
    with caplog.at_level(logging.INFO, logger="deploy.deploy_pytriton"):
        try:
            deployer.run()
        finally:
            deployer.stop()
    assert len(model.threads) == 2
    [line] = _phase_lines(caplog)
    assert line.endswith("s (1 request)"), line


class HoldingModel(RecordingModel):
    """Holds the warm-up's requests through Triton (the calls after the in-process one) until `release` is set;
    `held` is set once each instance holds one."""

    def __init__(self):
        super().__init__()
        self.held, self.release = threading.Event(), threading.Event()
        self._holding = 0

    def triton_infer_fn(self, **inputs: np.ndarray) -> dict[str, np.ndarray]:
        with self._lock:
            warm_up = 0 < len(self.threads) <= INSTANCES
        answer = super().triton_infer_fn(**inputs)
        if warm_up:
            with self._lock:
                self._holding += 1
                if self._holding == INSTANCES:
                    self.held.set()
            assert self.release.wait(60), "the test never released the warm-up"
        return answer


def test_a_client_request_during_the_warm_up_is_counted_and_the_warm_up_is_not():
    """A client streams a request while the warm-up's requests through Triton are held in the model (every infer
    instance busy, the streaming ones free): after READY the metrics count that request alone."""
    model = HoldingModel()
    grpc_port = free_port()
    deployer = DeployPyTriton(model, MODEL, max_batch_size=INSTANCES, http_port=free_port(), grpc_port=grpc_port,
                              address="127.0.0.1", streaming=True)
    deployer.deploy()
    ready, serving, failures = threading.Event(), threading.Event(), []

    def run() -> None:  # Triton lives as long as the thread that started it
        try:
            deployer.run()
        except BaseException as error:  # noqa: BLE001 - reported by the test
            failures.append(error)
        ready.set()
        serving.wait(120)

    runner = threading.Thread(target=run, name="runner")
    runner.start()
    try:
        assert model.held.wait(120), failures
        media = np.full((1, 1, 8, 8, 3), 10, dtype=np.uint8)
        with DecoupledModelClient(f"grpc://127.0.0.1:{grpc_port}", f"{MODEL}_stream", init_timeout_s=30,
                                  inference_timeout_s=30) as client:
            answers = list(client.infer_batch(input_text=np.array([[b"hello"]], dtype=np.bytes_), input_media=media))
        assert answers and model.streamed == 1 and not ready.is_set()  # answered during the warm-up
        model.release.set()
        assert ready.wait(120) and not failures, failures
        assert model.streamed == 2  # the warm-up's own stream came after
        assert _requests_counted(deployer, "stream") == 1 and _requests_counted(deployer) == 1
    finally:
        model.release.set()
        deployer.stop()
        serving.set()
        runner.join(60)


def test_a_starting_triton_is_seen_ready_within_a_few_polls():
    """PyTriton asks once a second; `wait_until_ready` sees the ready endpoint's first 200 within ~20 ms, and stops
    asking when the server is no longer alive."""
    ready_after = time.monotonic() + 0.3

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200 if self.path == "/v2/health/ready" and time.monotonic() >= ready_after else 400)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        assert wait_until_ready("127.0.0.1", port, alive=lambda: True, limit_s=5.0)
        assert 0.0 <= time.monotonic() - ready_after < 0.15
        started = time.monotonic()
        assert not wait_until_ready("127.0.0.1", free_port(), alive=lambda: time.monotonic() < started + 0.2)
        assert time.monotonic() - started < 0.5
    finally:
        server.shutdown()
        server.server_close()
