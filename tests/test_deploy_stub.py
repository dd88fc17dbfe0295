"""The serving layer with a stub model on a real PyTriton server (loopback, free ports, HTTP and gRPC)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from pytriton.client import ModelClient
from pytriton.client.exceptions import PyTritonClientInferenceServerError

from deploy import DeployError, DeployPyTriton, PortInUseError
from query import NemoQueryMultimodal, QueryError
from support.ports import free_port
from support.servers import (
    DEPLOY_SCRIPT,
    assert_short_error,
    deploy_script,
    grpc_infer,
    http_infer,
    json_tensor,
    poll_ready,
    query_concurrently,
    stop_server,
    wait_until_ready,
)
from support.stub_model import StubMultimodalModel, describe_pixels, expected_answer

REPO = Path(__file__).resolve().parent.parent
MODEL = "stub"


@pytest.fixture(scope="module")
def server():
    model = StubMultimodalModel(delay_s=0.2)
    http_port, grpc_port = free_port(), free_port()
    deployer = DeployPyTriton(
        model,
        MODEL,
        max_batch_size=8,
        http_port=http_port,
        grpc_port=grpc_port,
        address="127.0.0.1",
    )
    deployer.deploy()
    try:
        deployer.run()
        yield model, f"127.0.0.1:{http_port}", f"grpc://127.0.0.1:{grpc_port}", deployer
    finally:
        deployer.stop()


def _image(k: int) -> np.ndarray:
    return np.full((6 + k, 9, 3), (10 * k, 200 - 10 * k, 7 * k), dtype=np.uint8)


def _params(k: int) -> dict:
    return {
        "max_output_len": 10 + k,
        "top_k": k + 1,
        "top_p": k / 10,
        "temperature": 0.5 + k,
        "num_beams": 1 + k % 2,
    }


def test_model_is_warmed_up_and_configured(server):
    model, http_url, _, _ = server
    assert model.prompts[0] == ["Describe this."]  # the warm-up ran before Triton loaded the model
    with urllib.request.urlopen(f"http://{http_url}/v2/models/{MODEL}/config", timeout=10) as response:
        config = json.load(response)
    assert config["max_batch_size"] == 8
    assert sum(group["count"] for group in config["instance_group"]) == 8
    assert "dynamic_batching" not in config  # each instance takes one request and answers it on its own
    inputs = {tensor["name"]: tensor for tensor in config["input"]}
    assert inputs["input_media_bytes"]["optional"] and inputs["input_media"]["dims"] == [-1, -1, -1, 3]


def test_concurrent_requests_each_get_their_own_answer(server):
    model = server[0]
    jobs = [(f"prompt-{k}", _image(k), _params(k)) for k in range(8)]
    answers = query_concurrently(server[1], server[2], MODEL, jobs, timeout_s=30)
    for k, answer in enumerate(answers):
        params = _params(k)
        beams = params.pop("num_beams")
        expected = [
            expected_answer(f"prompt-{k}", describe_pixels(_image(k)), b, **params) for b in range(beams)
        ]
        assert answer.tolist() == [expected]
    assert model.concurrent_peak > 1, "the requests were answered one after another"


def test_bad_request_fails_alone_among_concurrent_ones(server):
    jobs = [(f"batch-{k}", _image(k), {"temperature": 0.0 if k == 3 else 1.0}) for k in range(8)]
    answers = query_concurrently(server[1], server[2], MODEL, jobs, timeout_s=30)
    assert isinstance(answers[3], QueryError)
    assert str(answers[3]) == "the server failed the request: ValueError: temperature must be > 0, got 0.0"
    for k, answer in enumerate(answers):
        if k != 3:
            assert answer.tolist() == [[expected_answer(f"batch-{k}", describe_pixels(_image(k)))]]


def test_undecodable_media_fails_over_grpc_and_server_keeps_serving(server):
    _, http_url, grpc_url, deployer = server
    broken = {
        "input_text": np.array([[b"x"]]),
        "input_media_bytes": np.array([[b"\x89PNG broken"]], dtype=object),
    }
    with (
        ModelClient(grpc_url, MODEL, init_timeout_s=30) as client,
        pytest.raises(PyTritonClientInferenceServerError, match="input_media_bytes is not a decodable image"),
    ):
        client.infer_batch(**broken)
    with NemoQueryMultimodal(http_url, MODEL, "neva", raw_pixels=True) as client:
        answer = client.query(["after-a", "after-b"], _image(1), lora_uids=["task7"])
    expected = expected_answer("after-a", describe_pixels(_image(1))) + "|lora=task7"
    assert answer.shape == (2, 1) and answer[0, 0] == expected
    assert deployer.triton.is_alive()


def test_http_error_status_for_a_failed_request(server):
    http_url = server[1]
    body = {
        "inputs": [
            {"name": "input_text", "shape": [1, 1], "datatype": "BYTES", "data": ["hi"]},
            {"name": "temperature", "shape": [1, 1], "datatype": "FP32", "data": [-1.0]},
        ]
    }
    request = urllib.request.Request(
        f"http://{http_url}/v2/models/{MODEL}/infer", data=json.dumps(body).encode(), method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as failure:
        urllib.request.urlopen(request, timeout=30)
    assert failure.value.code == 400
    assert json.loads(failure.value.read()) == {"error": "ValueError: temperature must be > 0, got -1.0"}


TEXT = np.array([[b"hi"]], dtype=object)
ERROR_CASES = {  # inputs, HTTP status, gRPC code, message (None: Triton's own words, checked for shortness only)
    "bad parameter": ({"input_text": TEXT, "temperature": np.array([[0.0]], np.float32)}, 400, "INVALID_ARGUMENT",
                      "ValueError: temperature must be > 0, got 0.0"),
    "model fault": ({"input_text": np.array([[b"crash now"]], dtype=object)}, 500, "INTERNAL",
                    "internal server error: RuntimeError: the stub crashed in <path>"),
    "zero-size media": ({"input_text": TEXT, "input_media": np.zeros((1, 1, 0, 0, 3), np.uint8)}, 400,
                        "INVALID_ARGUMENT",
                        "input input_media is empty (shape [1, 1, 0, 0, 3]); send a value or leave it out"),
    "empty media bytes": ({"input_text": TEXT, "input_media_bytes": np.array([[b""]], dtype=object)}, 400,
                          "INVALID_ARGUMENT", "WireError: input_media_bytes of row 0 is empty; send an encoded media file"),
    "undecodable image": ({"input_text": TEXT, "input_media_bytes": np.array([[b"\x89PNG broken"]], dtype=object)},
                          400, "INVALID_ARGUMENT",
                          "ValueError: input_media_bytes is not a decodable image (UnidentifiedImageError)"),
    "invalid UTF-8": ({"input_text": np.array([[b"\xff\xfe"]], dtype=object)}, None, "INVALID_ARGUMENT",
                      "WireError: input_text of row 0 is not valid UTF-8 ('utf-8' codec can't decode byte 0xff in "
                      "position 0: invalid start byte)"),
    "no prompt": ({"max_output_len": np.array([[3]])}, 400, "INVALID_ARGUMENT", None),
    "unknown input": ({"input_text": TEXT, "input_nonsense": np.array([[3]])}, 400, "INVALID_ARGUMENT", None),
}


@pytest.mark.parametrize("case", ERROR_CASES)
def test_errors_are_one_short_line_with_their_status(server, case):
    """Each failure reaches HTTP and gRPC clients as one line (no traceback, no server paths) with its status."""
    _, http_url, grpc_url, deployer = server
    inputs, http_status, grpc_code, message = ERROR_CASES[case]
    code, grpc_message = grpc_infer(grpc_url, MODEL, inputs)
    assert code == grpc_code, grpc_message
    assert_short_error(grpc_message)
    if message is not None:
        assert grpc_message == message
    if http_status is not None:
        status, body = http_infer(http_url, MODEL, [json_tensor(name, value) for name, value in inputs.items()])
        assert status == http_status, body
        assert_short_error(body["error"])
        if message is not None:
            assert body["error"] == message
    assert grpc_infer(grpc_url, MODEL, {"input_text": TEXT})[0] == "OK"  # the server keeps serving
    assert deployer.triton.is_alive()


def test_out_of_range_uint8_json_values_arrive_wrapped(server):
    """Triton's JSON parser stores 300 in a UINT8 tensor as 300 mod 256 = 44; a negative value is refused."""
    http_url = server[1]
    wrapped = {"name": "input_media", "shape": [1, 1, 1, 1, 3], "datatype": "UINT8", "data": [300, 256, 511]}
    status, body = http_infer(http_url, MODEL, [json_tensor("input_text", TEXT), wrapped])
    assert status == 200 and body["outputs"][0]["data"][0] == expected_answer("hi", "mean=44,0,255|size=1x1|frames=1")
    negative = {**wrapped, "data": [-1, 0, 0]}
    status, body = http_infer(http_url, MODEL, [json_tensor("input_text", TEXT), negative])
    assert status >= 400
    assert_short_error(body["error"])


def test_metrics_on_the_metrics_port(server):
    """Requests and errors by kind, and Triton's own metrics, read from the running server's metrics port."""
    _, http_url, grpc_url, deployer = server
    before = _metric(deployer, 'nemo_mm_requests_total{kind="infer"}')
    bad_before = _metric(deployer, 'nemo_mm_request_errors_total{error="bad_request",kind="infer"}')
    assert grpc_infer(grpc_url, MODEL, {"input_text": TEXT})[0] == "OK"
    assert grpc_infer(grpc_url, MODEL, ERROR_CASES["bad parameter"][0])[0] == "INVALID_ARGUMENT"
    text = _metrics_text(deployer)
    assert _metric(deployer, 'nemo_mm_requests_total{kind="infer"}', text) == before + 2
    assert _metric(deployer, 'nemo_mm_request_errors_total{error="bad_request",kind="infer"}', text) == bad_before + 1
    assert 'nv_inference_request_success{model="stub",version="1"}' in text  # Triton's, on the same port


def _metrics_text(deployer: DeployPyTriton) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{deployer.metrics_port}/metrics", timeout=10) as response:
        return response.read().decode()


def _metric(deployer: DeployPyTriton, name: str, text: str | None = None) -> float:
    for line in (text or _metrics_text(deployer)).splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_port_in_use_is_reported_before_start():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        deployer = DeployPyTriton(
            StubMultimodalModel(), MODEL, http_port=port, grpc_port=free_port(), address="127.0.0.1"
        )
        with pytest.raises(
            PortInUseError, match=f"HTTP port {port} on 127.0.0.1 is already in use.*--triton_port"
        ):
            deployer.deploy()
        deployer = DeployPyTriton(
            StubMultimodalModel(), MODEL, http_port=free_port(), grpc_port=port, address="127.0.0.1"
        )
        with pytest.raises(PortInUseError, match=f"gRPC port {port}.*--grpc_port"):
            deployer.deploy()
    assert deployer.triton is None


def test_metrics_port_is_held_from_deploy_and_released_by_stop_without_run():
    deployer = DeployPyTriton(
        StubMultimodalModel(), MODEL, http_port=free_port(), grpc_port=free_port(), address="127.0.0.1"
    )
    deployer.deploy()
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", deployer.metrics_port))  # a warm-up client or Triton cannot take it
    finally:
        deployer.stop()
    with socket.socket() as other:
        other.bind(("127.0.0.1", deployer.metrics_port))


def test_failing_warm_up_stops_the_deployment():
    class BrokenModel(StubMultimodalModel):
        def triton_warmup_request(self):
            return {"input_text": np.array([[b"x"]]), "temperature": np.array([[0.0]], dtype=np.float32)}

    deployer = DeployPyTriton(
        BrokenModel(), MODEL, http_port=free_port(), grpc_port=free_port(), address="127.0.0.1"
    )
    with pytest.raises(DeployError, match="warm-up request failed.*temperature must be > 0"):
        deployer.deploy()
    assert not deployer.triton.is_alive()  # Triton, started beside the warm-up, is stopped again


def test_streaming_needs_a_model_that_streams():
    with pytest.raises(TypeError, match="triton_stream_request"):
        DeployPyTriton(StubMultimodalModel(), MODEL, streaming=True)


def _write_fake_exporter(root: Path) -> None:
    """An `exporter` package whose TensorRTMMExporter is the stub, shadowing the real one for the script."""
    package = root / "exporter"
    package.mkdir()
    (package / "__init__.py").write_text("from support.stub_model import StubMultimodalModel as TensorRTMMExporter\n")


def test_scripts_serve_and_query_from_plain_python(tmp_path):
    """deploy_triton.py run with LD_LIBRARY_PATH unset serves (the libpython fix); query.py prints answers."""
    _write_fake_exporter(tmp_path)
    repository = tmp_path / "repo"
    repository.mkdir()
    (repository / "manifest.json").write_text("{}")
    image = tmp_path / "image.png"
    Image.fromarray(_image(2)).save(image)
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PYTHONPATH")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO / "tests"), str(REPO)])  # the stub shadows exporter
    http_port, grpc_port = free_port(), free_port()
    command = [
        sys.executable,
        str(REPO / "scripts/deploy_triton.py"),
        "-tmn",
        MODEL,
        "-tmr",
        str(repository),
        "-trp",
        str(http_port),
        "--grpc_port",
        str(grpc_port),
        "-tha",
        "127.0.0.1",
        "-mbs",
        "1",
    ]
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_ready(f"127.0.0.1:{http_port}", MODEL, server)
        query = [
            sys.executable,
            str(REPO / "scripts/query.py"),
            "-u",
            f"127.0.0.1:{http_port}",
            "-mn",
            MODEL,
            "-mt",
            "neva",
            "-int",
            "hello",
            "-im",
            str(image),
            "-mol",
            "12",
            "-nb",
            "2",
        ]
        done = subprocess.run(query, env=env, capture_output=True, text=True, timeout=60, check=False)
        media = describe_pixels(_image(2))
        expected = [expected_answer("hello", media, b, max_output_len=12) for b in range(2)]
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == expected
        failed = subprocess.run(
            query + ["-t", "0"], env=env, capture_output=True, text=True, timeout=60, check=False
        )
        assert failed.returncode == 1
        assert "error: the server failed the request: ValueError: temperature must be > 0" in failed.stderr
    finally:
        stop_server(server, 60)
    assert server.returncode == 0


def _stub_script_server(tmp_path: Path, http_port: int, grpc_port: int, log: Path) -> subprocess.Popen:
    """deploy_triton.py serving the stub (shadowing the exporter) with two instances, its output in `log`."""
    if not (tmp_path / "exporter").exists():
        _write_fake_exporter(tmp_path)
        (tmp_path / "repo").mkdir()
        (tmp_path / "repo" / "manifest.json").write_text("{}")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO / "tests"), str(REPO)])
    command = [sys.executable, str(REPO / "scripts/deploy_triton.py"), "-tmn", MODEL, "-tmr", str(tmp_path / "repo"),
               "-trp", str(http_port), "--grpc_port", str(grpc_port), "-tha", "127.0.0.1", "-mbs", "2"]
    with log.open("w") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


def _first_ready_answer(process: subprocess.Popen, http_url: str) -> tuple[int, dict]:
    """The answer of a request sent the moment /v2/health/ready says 200 (polled every 20 ms)."""
    poll_ready(process, f"http://{http_url}/v2/health/ready")
    return http_infer(http_url, MODEL, [json_tensor("input_text", TEXT)])


def _workspaces_of(pid: int) -> list[Path]:
    from pytriton.constants import PYTRITON_HOME

    return list(PYTRITON_HOME.glob(f"nemo-mm-deploy-{pid}-*"))


def _processes_running_from(folder: Path) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.readlink(entry / "exe").startswith(str(folder)):
                pids.append(int(entry.name))
        except OSError:
            pass
    return pids


def test_ready_means_answering_and_a_restart_after_sigkill_gets_the_same_ports(tmp_path):
    """The first request after /v2/health/ready says 200 succeeds; after SIGKILL of deploy_triton.py, Triton's
    processes, shared memory and workspace are gone within seconds and a restart at once serves on the same ports;
    when Triton itself dies, deploy_triton.py exits with an error."""
    http_port, grpc_port = free_port(), free_port()
    http_url = f"127.0.0.1:{http_port}"
    first = _stub_script_server(tmp_path, http_port, grpc_port, tmp_path / "first.log")
    second = None
    try:
        assert _first_ready_answer(first, http_url) == (200, {
            "model_name": MODEL, "model_version": "1", "outputs": [
                {"name": "outputs", "datatype": "BYTES", "shape": [1, 1], "data": [expected_answer("hi", "no-media")]}]})
        (workspace,) = _workspaces_of(first.pid)
        assert _processes_running_from(workspace)  # tritonserver and its backend processes
        first.kill()
        first.wait(10)
        second = _stub_script_server(tmp_path, http_port, grpc_port, tmp_path / "second.log")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (workspace.exists() or _processes_running_from(workspace)):
            time.sleep(0.1)
        assert not workspace.exists() and not _processes_running_from(workspace)
        assert not list(Path("/dev/shm").glob(f"pytrtion{first.pid}-*"))
        status, body = _first_ready_answer(second, http_url)
        assert status == 200, (body, (tmp_path / "second.log").read_text()[-3000:])
        assert grpc_infer(f"grpc://127.0.0.1:{grpc_port}", MODEL, {"input_text": TEXT})[0] == "OK"
        (workspace,) = _workspaces_of(second.pid)
        tritonserver = next(pid for pid in _processes_running_from(workspace)
                            if os.readlink(f"/proc/{pid}/exe").endswith("/bin/tritonserver"))
        os.kill(tritonserver, signal.SIGKILL)  # Triton dies under the serving process: it exits with an error
        assert second.wait(60) == 1
        assert "error: Triton exited unexpectedly" in (tmp_path / "second.log").read_text()
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                stop_server(process, 60)


def test_script_refuses_a_missing_repository(tmp_path, capsys):
    deploy_triton = deploy_script()
    port_flags = ["-trp", str(free_port()), "--grpc_port", str(free_port()), "-tha", "127.0.0.1"]
    assert deploy_triton.main(["-tmn", MODEL, "-tmr", str(tmp_path / "absent"), *port_flags]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert deploy_triton.main(["-tmn", MODEL, "-tmr", str(tmp_path), *port_flags]) == 1
    assert f"{tmp_path} has no manifest.json" in capsys.readouterr().err


def test_serving_an_engine_takes_the_modality_from_its_manifest_without_the_exporter(tmp_path):
    """The served engine's manifest says the modality of its model type, so validating the flags imports no model
    type (the flags are checked before the slow import); another type asks the registry."""
    (tmp_path / "manifest.json").write_text(json.dumps({"model_type": "salm", "modality": "audio"}))
    child = (f"import sys; sys.path.insert(0, {str(DEPLOY_SCRIPT.parent)!r}); import deploy_triton; "
             f"s = deploy_triton.parse_settings(['-tmn', 'm', '-mt', sys.argv[1], '-tmr', {str(tmp_path)!r}]); "
             "print(s.modality, 'exporter.models' in sys.modules, 'torch' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    answers = [subprocess.run([sys.executable, "-c", child, model_type], capture_output=True, text=True, env=env,
                              timeout=120, check=True).stdout.split() for model_type in ("salm", "lita")]
    assert answers == [["audio", "False", "False"], ["vision", "True", "True"]]


def test_deploy_script_flags_config_and_overrides(tmp_path):
    script = deploy_script()
    short = script.parse_settings(
        ["-tmn", "m", "-mt", "salm", "-mbs", "3", "-trp", "9000", "-ltm", "attn_qkv", "-ulp"]
    )
    long = script.parse_settings(
        [
            "--triton_model_name",
            "m",
            "--model_type",
            "salm",
            "--max_batch_size",
            "3",
            "--triton_port",
            "9000",
            "--lora_target_modules",
            "attn_qkv",
            "--use_lora_plugin",
        ]
    )
    assert vars(short) == vars(long)
    assert (short.modality, short.max_batch_size, short.triton_port, short.use_lora_plugin) == (
        "audio",
        3,
        9000,
        "auto",
    )
    assert (short.max_input_len, short.llm_model_type, short.grpc_port) == (
        4096,
        "llama",
        8001,
    )  # NeMo defaults
    assert short.triton_model_repository.endswith("trt_model_dir")

    from_config = script.parse_settings(
        ["--config", "neva", "-mbs", "2"]
    )  # a config name, and a flag over it
    assert (from_config.triton_model_name, from_config.max_batch_size, from_config.max_multimodal_len) == (
        "neva",
        2,
        3072,
    )
    config = tmp_path / "mine.yaml"
    config.write_text("triton_model_name: mine\nmax_output_len: 17\n")
    assert script.parse_settings(["--config", str(config)]).max_output_len == 17

    for argv, message in [
        (["-tmn", "m", "-mt", "salm", "-mod", "vision"], "takes --modality audio"),
        (["-mt", "neva"], "no model name"),
        (["-tmn", "m", "-vc", "x.nemo"], "needs -mt/--model_type"),
        (["--config", "no_such_config"], "not found"),
    ]:
        with pytest.raises(ValueError, match=message):
            script.parse_settings(argv)
    config.write_text("max_batch_sizes: 4\n")
    with pytest.raises(ValueError, match="unknown settings \\['max_batch_sizes'\\]"):
        script.parse_settings(["--config", str(config)])
    with pytest.raises(ValueError, match="unsupported model_type 'llava'; supported: lita, neva, .*salm"):
        script.parse_settings(["-tmn", "m", "-mt", "llava"])  # the registry's names
