"""The warm-up request through Triton: `DeployPyTriton.run` sends it to each instance (and through the streaming
model) before it returns, i.e. before the server says READY; a failing one is logged and the server serves on."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import numpy as np
from pytriton.client import ModelClient

from deploy import DeployPyTriton
from deploy.startup import free_port
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


def _requests_counted(deployer: DeployPyTriton) -> float:
    return sum(sample.value for metric in deployer.metrics.requests.collect() for sample in metric.samples
               if sample.name.endswith("_total"))


def _assert_serves(url: str) -> None:
    media = np.full((1, 1, 8, 8, 3), 10, dtype=np.uint8)
    with ModelClient(url, MODEL, init_timeout_s=30, inference_timeout_s=30) as client:
        answer = client.infer_batch(input_text=np.array([[b"hello"]], dtype=np.bytes_), input_media=media)
    assert answer["outputs"][0, 0].decode() == expected_answer("hello", describe_pixels(media[0]))


def test_warm_up_goes_through_triton_to_each_instance_before_run_returns(caplog):
    model = RecordingModel(delay_s=0.3)  # long enough for the instances to take one request each at once
    deployer, url = _run(model, caplog)
    try:
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
