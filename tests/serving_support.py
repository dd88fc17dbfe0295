"""Helpers for tests against a running server: raw Triton requests over HTTP and gRPC with their status, the check
that an error a client sees is one short line, readiness polling and the server's memory."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from conftest import stop_server
from deploy.startup import free_port

REPO = Path(__file__).resolve().parent.parent

LEAKS = ("Traceback", 'File "', "/work/", "/tmp/", "/root/", "/home/", "/opt/", "site-packages", "\n")
MAX_ERROR_CHARS = 500


def assert_short_error(message: str) -> None:
    """A client-visible error: one line, short, naming something, without traceback text or server paths."""
    assert message and len(message) <= MAX_ERROR_CHARS, message
    leaked = [leak for leak in LEAKS if leak in message.strip()]
    assert not leaked, f"{leaked} in {message!r}"


def json_tensor(name: str, array: np.ndarray) -> dict:
    """One input of Triton's JSON /infer body; bytes that are not UTF-8 go as base64 `data:` URLs."""
    array = np.asarray(array)
    data = array.reshape(-1).tolist()
    if array.dtype == object or array.dtype.kind == "S":
        data = [_json_text(item) if isinstance(item, bytes) else item for item in data]
    return {"name": name, "shape": list(array.shape), "datatype": np_to_triton_dtype(array.dtype), "data": data}


def _json_text(item: bytes) -> str:
    try:
        return item.decode("utf-8")
    except UnicodeDecodeError:
        return "data:application/octet-stream;base64," + base64.b64encode(item).decode()


def http_infer(url: str, model: str, inputs: list[dict] | bytes, timeout_s: float = 60) -> tuple[int, dict]:
    """POST /v2/models/<model>/infer with a JSON body; (HTTP status, parsed body)."""
    body = inputs if isinstance(inputs, bytes) else json.dumps({"inputs": inputs}).encode()
    request = urllib.request.Request(f"http://{url}/v2/models/{model}/infer", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def grpc_infer(url: str, model: str, arrays: dict[str, np.ndarray], timeout_s: float = 60) -> tuple[str, object]:
    """One gRPC inference: ("OK", the `outputs` array) or (the gRPC status code's name, the error message)."""
    with grpcclient.InferenceServerClient(url.removeprefix("grpc://")) as client:
        inputs = []
        for name, array in arrays.items():
            tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        try:
            result = client.infer(model, inputs, client_timeout=timeout_s)
        except InferenceServerException as error:
            return str(error.status()).removeprefix("StatusCode."), error.message()
    return "OK", result.as_numpy("outputs")


def poll_ready(process: subprocess.Popen, url: str, timeout_s: float = 240) -> None:
    """Poll a readiness `url` every 20 ms until it answers 200; fail if the server process exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, "the server process exited"
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.02)
    raise AssertionError(f"{url} never answered 200")


def process_rss(pid: int) -> int:
    """Resident memory of a process in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


@dataclass
class ScriptServer:
    """A running `deploy_triton.py` with its URLs and its log file."""

    process: subprocess.Popen
    http: str
    grpc: str
    openai: str
    metrics: str
    log: Path

    def rss(self) -> int:
        """Resident memory of the serving process (the model, the Triton callables and the OpenAI front)."""
        return process_rss(self.process.pid)


@contextmanager
def demo_script_server(folder: Path, *flags: str) -> Iterator[ScriptServer]:
    """`deploy_triton.py --config demo` exporting the demo Neva into `folder`, with the OpenAI front, on free
    loopback ports, its output in `folder/server.log`; ready when entered (its OpenAI front answers only then),
    stopped as by Ctrl-C on exit."""
    ports = {name: free_port() for name in ("http", "grpc", "openai", "metrics")}
    command = [sys.executable, str(REPO / "scripts/deploy_triton.py"), "--config", "demo", "-vc",
               str(REPO / "demo" / "neva_demo.nemo"), "-tmr", str(folder / "repo"), "-trp", str(ports["http"]),
               "--grpc_port", str(ports["grpc"]), "--openai_port", str(ports["openai"]), "--metrics_port",
               str(ports["metrics"]), *flags]
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    log = folder / "server.log"
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    server = ScriptServer(process, f"127.0.0.1:{ports['http']}", f"grpc://127.0.0.1:{ports['grpc']}",
                          f"http://127.0.0.1:{ports['openai']}/v1", f"http://127.0.0.1:{ports['metrics']}/metrics",
                          log)
    try:
        poll_ready(process, f"{server.openai}/health/ready")
        yield server
    finally:
        stop_server(process, 120)


@contextmanager
def demo_deployed(engine_dir: Path, max_batch_size: int, max_output_len: int, streaming: bool = False,
                  max_beam_width: int = 1, model_type: str = "neva") -> Iterator[tuple[str, str, object]]:
    """The demo Neva exported into `engine_dir` (float32, CPU, max_input_len 200) as `model_type` and served in this
    process by `DeployPyTriton` on free loopback ports: (HTTP URL, gRPC URL, the deployer), stopped on exit."""
    from deploy import DeployPyTriton
    from exporter import TensorRTMMExporter

    exporter = TensorRTMMExporter(engine_dir, device="cpu")
    exporter.export(REPO / "demo" / "neva_demo.nemo", model_type=model_type, dtype="float32",
                    max_batch_size=max_batch_size, max_input_len=200, max_output_len=max_output_len,
                    max_multimodal_len=max_batch_size * 64, max_beam_width=max_beam_width)
    http_port, grpc_port = free_port(), free_port()
    deployer = DeployPyTriton(exporter, "demo", max_batch_size=max_batch_size, http_port=http_port,
                              grpc_port=grpc_port, address="127.0.0.1", streaming=streaming)
    deployer.deploy()
    try:
        deployer.run()
        yield f"127.0.0.1:{http_port}", f"grpc://127.0.0.1:{grpc_port}", deployer
    finally:
        deployer.stop()
