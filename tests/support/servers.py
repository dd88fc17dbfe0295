"""Servers in tests: start and stop `deploy_triton.py`, poll readiness, send raw Triton requests over HTTP and gRPC
with their status, check that an error a client sees is one short line, and read a server's memory."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from query import NemoQueryMultimodal, QueryError

REPO = Path(__file__).resolve().parents[2]
DEPLOY_SCRIPT = REPO / "scripts" / "deploy_triton.py"

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


def post(url: str, body: dict | bytes, timeout_s: float = 60) -> tuple[int, dict]:
    """POST a JSON body (or raw bytes) to `url`; the status and the decoded answer, errors included."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    return _answer(request, timeout_s)


def get(url: str, timeout_s: float = 30) -> tuple[int, dict]:
    """GET `url`; the status and the decoded JSON answer, errors included."""
    return _answer(urllib.request.Request(url), timeout_s)


def _answer(request: urllib.request.Request, timeout_s: float) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def http_infer(url: str, model: str, inputs: list[dict] | bytes, timeout_s: float = 60) -> tuple[int, dict]:
    """POST /v2/models/<model>/infer with a JSON body (`inputs`, or raw bytes); (HTTP status, parsed body)."""
    return post(f"http://{url}/v2/models/{model}/infer", inputs if isinstance(inputs, bytes) else {"inputs": inputs},
                timeout_s)


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



def query_concurrently(http_url: str, grpc_url: str, model: str, jobs: list[tuple], timeout_s: float = 60,
                       send_bytes: Callable[[str, str, bytes, threading.Barrier], object] | None = None) -> list:
    """Send `jobs` (prompt, media, params) at once with the client, alternating gRPC and HTTP; each job's answer or
    its QueryError. Media given as bytes go through `send_bytes(url, prompt, media, start)` (the client would refuse
    to encode them)."""
    start = threading.Barrier(len(jobs))

    def run(index: int):
        prompt, media, params = jobs[index]
        url = http_url if index % 2 else grpc_url
        if isinstance(media, bytes) and send_bytes is not None:
            return send_bytes(url, prompt, media, start)
        with NemoQueryMultimodal(url, model, "neva") as client:
            start.wait(timeout=timeout_s)
            try:
                return client.query(prompt, media, init_timeout=timeout_s, inference_timeout=2 * timeout_s, **params)
            except QueryError as error:
                return error

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(run, range(len(jobs)), timeout=4 * timeout_s))


def poll_ready(process: subprocess.Popen, url: str, timeout_s: float = 240) -> None:
    """Poll a readiness `url` every 20 ms until it answers 200; fail if the server process exits first (with its
    stderr, when that is a pipe)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server process exited:\n{process.stderr.read() if process.stderr else ''}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.02)
    raise AssertionError(f"{url} never answered 200")


def wait_until_ready(url: str, model: str, process: subprocess.Popen, timeout_s: float = 240) -> None:
    """`poll_ready` on Triton's model-ready endpoint of `model` at `url` (host:port)."""
    poll_ready(process, f"http://{url}/v2/models/{model}/ready", timeout_s)


def stop_server(process, timeout_s: float = 120) -> int:
    """Stop a server subprocess as Ctrl-C would (SIGINT), killing it if it does not exit in time; its exit code."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=timeout_s)
    finally:
        if process.poll() is None:
            process.kill()
    return process.returncode



def deploy_script() -> ModuleType:
    """scripts/deploy_triton.py imported as a module (its `main` and `parse_settings` called in this process)."""
    sys.path.insert(0, str(DEPLOY_SCRIPT.parent))
    try:
        import deploy_triton
    finally:
        sys.path.pop(0)
    return deploy_triton


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

