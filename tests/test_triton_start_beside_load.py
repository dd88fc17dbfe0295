"""Triton starts beside the model's load (`DeployPyTriton.deploy(load=...)`), a real PyTriton server on loopback:
its model instances reach the gate while the load runs, its ports stay closed until `run`, and a deployment stopped
(or failed) before `run` ends the starting Triton at once."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import psutil
import pytest
from pytriton.client import ModelClient

from deploy import DeployError, DeployPyTriton
from deploy.startup import port_in_use
from deploy.triton_gate import held
from support.ports import free_port
from support.stub_model import StubMultimodalModel

MODEL = "gated"
INSTANCES = 2
HELD_WAIT_S = 120.0  # Triton's start on a loaded 2-core machine


def _deployer(model: StubMultimodalModel) -> DeployPyTriton:
    return DeployPyTriton(model, MODEL, max_batch_size=INSTANCES, http_port=free_port(), grpc_port=free_port(),
                          address="127.0.0.1")


def _tritonservers(deployer: DeployPyTriton) -> list[psutil.Process]:
    """The `tritonserver` processes running from this deployment's workspace."""
    workspace = str(deployer._workspace.path)
    found = []
    for process in psutil.process_iter(["name", "cmdline"]):
        if process.info["name"] == "tritonserver" and any(workspace in part for part in process.info["cmdline"] or []):
            found.append(process)
    return found


def test_instances_start_beside_the_load_and_ports_open_only_in_run():
    deployer = _deployer(StubMultimodalModel())
    seen = {}

    def load() -> None:  # returns once every instance waits at the gate: Triton started before the load ended
        def look() -> None:
            seen["port open while held"] = seen.get("port open while held") or port_in_use("127.0.0.1",
                                                                                          deployer.http_port)

        _wait_held(deployer, look)
        seen["held"] = held(deployer._workspace.path)

    deployer.deploy(load=load)
    try:
        assert seen == {"held": INSTANCES, "port open while held": False}
        assert not port_in_use("127.0.0.1", deployer.http_port)  # the warm-up answered, the gate still shut
        deployer.run()
        with ModelClient(f"127.0.0.1:{deployer.http_port}", MODEL, init_timeout_s=30) as client:
            answer = client.infer_batch(input_text=np.array([[b"What is this?"]]))
        assert answer["outputs"].shape[0] == 1
    finally:
        deployer.stop()


def test_stop_before_run_ends_a_starting_triton():
    deployer = _deployer(StubMultimodalModel())
    deployer.deploy(load=lambda: _wait_held(deployer))
    servers = _tritonservers(deployer)
    assert len(servers) == 1, servers
    started = time.monotonic()
    deployer.stop()
    assert time.monotonic() - started < 20.0  # not Triton's exit timeout: its instances fail their load
    assert not servers[0].is_running() or servers[0].status() == psutil.STATUS_ZOMBIE
    assert not deployer._workspace.path.exists()


def test_a_failing_load_stops_triton_and_is_raised():
    deployer = _deployer(StubMultimodalModel())

    def load() -> None:
        _wait_held(deployer)
        raise DeployError("loading the model repository failed: EngineError: the engine's weights are short")

    with pytest.raises(DeployError, match="weights are short"):
        deployer.deploy(load=load)
    assert not deployer.triton.is_alive()
    assert not port_in_use("127.0.0.1", deployer.http_port)


def test_triton_exiting_during_the_load_is_a_deploy_error():
    deployer = _deployer(StubMultimodalModel())

    def load() -> None:  # Triton dies while the model loads
        _wait_held(deployer)
        (server,) = _tritonservers(deployer)
        server.kill()
        server.wait(30)
        deadline = time.monotonic() + 30
        while deployer._workspace.path.exists() and time.monotonic() < deadline:  # PyTriton sees it exit
            time.sleep(0.05)

    deployer.deploy(load=load)
    with pytest.raises(DeployError, match="Triton exited while the model was loading"):
        deployer.run()


def _wait_held(deployer: DeployPyTriton, each: Callable[[], None] = lambda: None) -> None:
    """Wait until every model instance of `deployer`'s Triton waits at the gate, calling `each` while it waits."""
    deadline = time.monotonic() + HELD_WAIT_S
    while held(deployer._workspace.path) < INSTANCES:
        assert time.monotonic() < deadline, "Triton's instances never reached the gate"
        each()
        time.sleep(0.05)
