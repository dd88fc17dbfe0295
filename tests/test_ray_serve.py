"""Ray Serve: `scripts/deploy_ray.py` exporting the demo Neva and serving it with two replicas (one CPU each) on a
local Ray cluster it starts, queried over the OpenAI API (raw HTTP and the `openai` package), Triton's HTTP routes
(`NemoQueryMultimodal`, `scripts/query.py` and `tritonclient`, as against Triton) and
`scripts/query_ray_deployment.py`; answers are compared with the same engine run in this process. One replica's
process is killed under load: every request ends, answered or with a clear error, and the replacement replica
serves."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil
import pytest
import tomllib

from query import NemoQueryMultimodal, QueryError
from support.demo import load_demo_builder
from support.ports import free_port
from support.servers import assert_short_error, poll_ready
from wire import param_tensors

pytest.importorskip("ray.serve", reason="Ray Serve is the [ray] extra: pip install -e '.[ray]'")

REPO = Path(__file__).resolve().parent.parent
DEMO_NEMO = REPO / "demo" / "neva_demo.nemo"
MODEL = "demo"
SHAPE_Q, COLOR_Q = "What shape is this?", "What color is the shape?"
CLIENT_TIMEOUT_S = 120
CLIENTS = 24  # concurrent clients while a replica is killed
ENGINE_TITLE = f"ray::ServeReplica:{MODEL}:Engine"


class RayServer:
    """A running `deploy_ray.py`: its base URL, process, log, and the engine replicas' processes."""

    def __init__(self, process: subprocess.Popen, url: str, log: Path, repo: Path):
        self.process, self.url, self.log, self.repo = process, url, log, repo

    def engine_pids(self) -> list[int]:
        found = []
        for child in psutil.Process(self.process.pid).children(recursive=True):
            try:
                if any(ENGINE_TITLE in part for part in child.cmdline()):
                    found.append(child.pid)
            except psutil.Error:
                pass
        return sorted(found)

    def served_by(self, pid: int) -> bool:
        """Whether the log shows replica `pid` answering a model call."""
        pattern = re.compile(rf"ServeReplica:{MODEL}:Engine pid={pid}\).*CALL (generate|stream|infer|infer_stream) OK")
        return bool(pattern.search(self.log.read_text(errors="replace")))


def _stop(process: subprocess.Popen, ray_tmp: Path) -> None:
    """Ctrl-C the script (it shuts its Ray cluster down); kill what is left of its processes by pid."""
    try:
        family = psutil.Process(process.pid).children(recursive=True)
    except psutil.Error:
        family = []
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
        for child in family:
            try:
                child.kill()
            except psutil.Error:
                pass
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ray")
    ray_tmp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # Ray's socket paths must stay short
    port = free_port()
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp), "RAY_DEDUP_LOGS": "0",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(REPO / "scripts/deploy_ray.py"), "--config", "demo", "-vc", str(DEMO_NEMO),
               "-tmr", str(folder / "repo"), "--host", "127.0.0.1", "--port", str(port), "--num_replicas", "2",
               "--num_cpus", "2", "--num_cpus_per_replica", "1"]
    log = folder / "server.log"
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        poll_ready(process, f"http://127.0.0.1:{port}/v1/health/ready", timeout_s=400)
        yield RayServer(process, f"http://127.0.0.1:{port}", log, folder / "repo")
    except BaseException:
        print(log.read_text()[-5000:])
        raise
    finally:
        _stop(process, ray_tmp)


@pytest.fixture(scope="module")
def reference(served):
    """The exported engine run in this process: the answer to (text, image bytes) with greedy decoding."""
    from exporter import TensorRTMMExporter
    from exporter.llm.generate import SamplingParams
    from exporter.runtime import Request

    exporter = TensorRTMMExporter(served.repo, device="cpu")

    def answer(jobs: list[tuple[str, bytes | None, int]]) -> list[str]:
        results = exporter.generate([Request(text, image, SamplingParams(max_output_len=n)) for text, image, n in jobs])
        return [result.texts[0] for result in results]

    yield answer
    exporter.pipeline.close()


@pytest.fixture(scope="module")
def images():
    """Fresh demo pictures as PNG bytes."""
    def png(image) -> bytes:
        buffer = io.BytesIO()
        image.save(buffer, "PNG")
        return buffer.getvalue()

    return [png(image) for image, _, _ in load_demo_builder().sample_examples(np.random.default_rng(11), 16)]


# --- clients ---------------------------------------------------------------------------------------------------------

def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def openai_chat(url: str, question: str, png: bytes | None, stream: bool = False, max_tokens: int = 8,
                **fields) -> tuple[int, str]:
    """(200, the answer) or (the HTTP status, the error message; 0 for an error event after the first piece)."""
    content = [{"type": "text", "text": question}]
    if png is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": _data_url(png)}})
    body = {"model": MODEL, "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": content}], **fields}
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=CLIENT_TIMEOUT_S) as response:
            if not stream:
                return 200, json.loads(response.read())["choices"][0]["message"]["content"]
            text, done = "", False
            for line in response:
                if line.strip() == b"data: [DONE]":
                    done = True
                elif line.startswith(b"data:"):
                    event = json.loads(line[5:])
                    if "error" in event:
                        return 0, event["error"]["message"]
                    text += event["choices"][0]["delta"].get("content") or "" if event["choices"] else ""
            assert done, "the stream ended without [DONE] or an error event"
            return 200, text
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())["error"]["message"]


def nemo_query(url: str, question: str, png: bytes | None, stream: bool = False, max_tokens: int = 8,
               client: NemoQueryMultimodal | None = None, **params) -> tuple[int, str]:
    """NeMo's client over Triton's HTTP routes (`client`, kept open by the caller, or a new one): (200, the answer)
    or (the status, 0 after the first piece; the server's message)."""
    own = client is None
    client = client or NemoQueryMultimodal(url, MODEL, "neva")
    try:
        if stream:
            return 200, "".join(client.query_stream(question, png, max_output_len=max_tokens,
                                                    init_timeout=CLIENT_TIMEOUT_S, inference_timeout=CLIENT_TIMEOUT_S,
                                                    **params))
        answer = client.query(question, png, max_output_len=max_tokens, init_timeout=CLIENT_TIMEOUT_S,
                              inference_timeout=CLIENT_TIMEOUT_S, **params)
        return 200, str(answer[0][0])
    except QueryError as error:
        return int(error.status or 0), error.server_message
    finally:
        if own:
            client.close()


def _openai_text(question: str, png: bytes | None) -> str:
    """The prompt text the OpenAI front hands the engine: the image's placeholder in front."""
    return question if png is None else f"<image>\n{question}"


# --- tests -----------------------------------------------------------------------------------------------------------

def test_two_replicas_answer_64_concurrent_mixed_requests(served, reference, images):
    jobs = []  # (client, question, image, stream, extra fields, expected status)
    for k in range(64):
        png, question = images[k % len(images)], (SHAPE_Q, COLOR_Q)[k % 2]
        kind = k % 8
        if kind == 0:
            jobs.append(("openai", question, png, False, {}, 200))
        elif kind == 1:
            jobs.append(("openai", question, png, True, {}, 200))
        elif kind == 2:
            jobs.append(("nemo", question, png, False, {}, 200))
        elif kind == 3:
            jobs.append(("nemo", question, png, True, {}, 200))
        elif kind == 4:
            jobs.append(("openai", "Say something.", None, k % 16 == 4, {}, 200))
        elif kind == 5:
            jobs.append(("openai", question, b"GIF89a not really a picture", False, {}, 400))
        elif kind == 6:
            jobs.append(("nemo", question, png, False, {"top_p": 2.0}, 400))
        else:
            jobs.append(("openai", question, png, k % 16 == 7, {"temperature": 5.0}, 422))
    start = threading.Barrier(len(jobs))

    def run(job):
        client, question, png, stream, fields, _ = job
        start.wait(timeout=60)
        began = time.monotonic()
        send = openai_chat if client == "openai" else nemo_query
        return send(served.url, question, png, stream, **fields), time.monotonic() - began

    with ThreadPoolExecutor(len(jobs)) as pool:
        outcomes = list(pool.map(run, jobs, timeout=300))
    expected_texts = reference([(_openai_text(q, p) if c == "openai" else q, p, 8)
                                for c, q, p, _, _, status in jobs if status == 200])
    answered = iter(expected_texts)
    for job, ((status, text), seconds) in zip(jobs, outcomes, strict=True):
        assert seconds < CLIENT_TIMEOUT_S
        assert status == job[5], (job[:4], status, text)
        if status == 200:
            assert text == next(answered), job[:4]
        else:
            assert_short_error(text)
    assert "image" in outcomes[5][0][1].lower() and "top_p" in outcomes[6][0][1]
    engines = served.engine_pids()
    assert len(engines) == 2
    deadline = time.monotonic() + 30  # the driver's log trails the replicas' a little
    while not all(served.served_by(pid) for pid in engines) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert all(served.served_by(pid) for pid in engines), "both replicas answered requests"


def test_openai_client_and_query_script(served, images):
    import openai

    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)
    assert [model.id for model in client.models.list()] == [MODEL]
    red_circle = (REPO / "demo/images/red_circle.png").read_bytes()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(red_circle)}},
                                             {"type": "text", "text": SHAPE_Q}]}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    assert answer.choices[0].message.content == "circle" and answer.usage.completion_tokens >= 1
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == "circle"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="other", messages=messages)

    port = served.url.rsplit(":", 1)[1]
    script = [sys.executable, str(REPO / "scripts/query_ray_deployment.py"), "--host", "127.0.0.1", "--port", port,
              "--model_id", MODEL, "--max_tokens", "8"]
    for image, question, flags, expected in (
            ("blue_triangle", SHAPE_Q, [], "triangle"),
            ("yellow_circle", COLOR_Q, ["--stream"], "yellow"),
            ("green_square", SHAPE_Q, ["--api", "nemo"], "square"),
            ("green_square", COLOR_Q, ["--api", "nemo", "--stream"], "green")):
        done = subprocess.run([*script, "--prompt", question, "--image_path", str(REPO / f"demo/images/{image}.png"),
                               *flags], capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == expected, (flags, done.stdout)
    done = subprocess.run([*script, "--model_id", "other", "--prompt", SHAPE_Q], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 1 and "does not exist" in done.stderr
    assert_short_error(done.stderr.strip().splitlines()[-1])
    done = subprocess.run([sys.executable, str(REPO / "scripts/query.py"), "-u", served.url, "-mn", MODEL,
                           "-mt", "neva", "-im", str(REPO / "demo/images/red_circle.png"), "-int", SHAPE_Q,
                           "-mol", "8"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert (done.returncode, done.stdout) == (0, "circle\n"), done.stderr[-2000:]  # Triton's CLI, unchanged


def test_triton_routes_answer_and_refuse_like_triton(served):
    with NemoQueryMultimodal(served.url, MODEL, "neva") as client:
        pictures = [str(REPO / f"demo/images/{name}.png") for name in ("red_circle", "blue_triangle")]
        assert client.query([SHAPE_Q, COLOR_Q], pictures, max_output_len=8).tolist() == [["circle"], ["blue"]]
        with pytest.raises(QueryError) as refused:
            client.query("tell me " * 300 + SHAPE_Q, pictures[0], max_output_len=4)
        assert refused.value.status == "400" and "max_input_len=512" in refused.value.server_message
    with pytest.raises(QueryError, match="no model named 'other' .* it serves 'demo', 'demo_stream'"):
        NemoQueryMultimodal(served.url, "other", "neva").query(SHAPE_Q, pictures[0], init_timeout=30)
    with pytest.raises(QueryError, match="is a 'neva' model, not 'salm'"):
        NemoQueryMultimodal(served.url, MODEL, "salm").query(SHAPE_Q, pictures[0], init_timeout=30)
    for path, body in (("infer", b"{not json"), ("infer", b'{"inputs": [{"name": "input_text"}]}'),
                       ("generate_stream", b'{"input_text": "x", "input_media": [1, 2]}')):
        request = urllib.request.Request(f"{served.url}/v2/models/{MODEL}/{path}", data=body, method="POST")
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(request, timeout=60)
        assert failed.value.code == 400
        assert_short_error(json.loads(failed.value.read())["error"])
    with urllib.request.urlopen(f"{served.url}/v2/models/{MODEL}/ready", timeout=30) as ready:
        assert ready.status == 200


def test_tritonclient_speaks_to_the_front_as_to_triton(served):
    """Triton's own HTTP client (binary tensors both ways) against the front's Triton routes."""
    import tritonclient.http as triton_http
    from tritonclient.utils import np_to_triton_dtype

    client = triton_http.InferenceServerClient(served.url.removeprefix("http://"), network_timeout=CLIENT_TIMEOUT_S)
    assert client.is_server_ready() and client.is_model_ready(MODEL) and client.is_model_ready(f"{MODEL}_stream")
    config = client.get_model_config(MODEL)
    assert config["max_batch_size"] == 4 and config == client.get_model_config(f"{MODEL}_stream") | {"name": MODEL}
    assert {"name": "input_text", "data_type": "TYPE_STRING", "dims": [1]} in config["input"]
    tensors = {"input_text": np.array([[SHAPE_Q.encode()], [COLOR_Q.encode()]], dtype=object),
               "input_media_bytes": np.array([[(REPO / f"demo/images/{name}.png").read_bytes()]
                                              for name in ("green_square", "yellow_circle")], dtype=object),
               **{name: np.stack([value, value]) for name, value in param_tensors({"max_output_len": 8}).items()}}
    inputs = []
    for name, value in tensors.items():
        inputs.append(triton_http.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype)))
        inputs[-1].set_data_from_numpy(value)
    assert client.infer(MODEL, inputs).as_numpy("outputs").tolist() == [[b"square"], [b"yellow"]]
    client.close()
    for name in (MODEL, f"{MODEL}_stream"):
        with urllib.request.urlopen(f"{served.url}/v2/models/{name}", timeout=30) as metadata:
            inputs = {t["name"]: t["datatype"] for t in json.loads(metadata.read())["inputs"]}
        assert inputs["input_text"] == inputs["input_media_bytes"] == "BYTES" and inputs["input_media"] == "UINT8"


def test_killing_a_replica_under_load_ends_every_request_and_the_replacement_serves(served, reference, images):
    victim, survivor = served.engine_pids()
    jobs = [("openai", False), ("openai", True), ("nemo", False), ("nemo", True)]
    records = []  # (client, stream, question, image, status, text, seconds)
    pending: dict[int, float] = {}  # client thread -> when its request in flight was sent
    stop, lock = threading.Event(), threading.Lock()

    def load(index: int) -> None:  # clients kept open, so that the replicas rather than the clients are busy
        k = index
        with NemoQueryMultimodal(served.url, MODEL, "neva") as nemo:
            while not stop.is_set():
                client, stream = jobs[k % len(jobs)]
                png, question = images[k % len(images)], (SHAPE_Q, COLOR_Q)[k % 2]
                began = time.monotonic()
                with lock:
                    pending[index] = began
                if client == "openai":
                    status, text = openai_chat(served.url, question, png, stream)
                else:
                    status, text = nemo_query(served.url, question, png, stream, client=nemo)
                with lock:
                    records.append((client, stream, question, png, status, text, time.monotonic() - began))
                    del pending[index]
                k += CLIENTS

    threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    time.sleep(3)
    os.kill(victim, signal.SIGSTOP)  # its requests in flight stay there (a demo request lasts only tens of ms)
    stuck_for, deadline = 1.0, time.monotonic() + 30
    while True:  # kill only once a request is held by the stopped replica (pending far past a demo answer's time)
        with lock:
            stuck = [began for began in pending.values() if time.monotonic() - began > stuck_for]
        if stuck:
            break
        assert time.monotonic() < deadline, "no request reached the stopped replica"
        time.sleep(0.1)
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    time.sleep(4)
    stop.set()
    for thread in threads:
        thread.join(timeout=CLIENT_TIMEOUT_S)
        assert not thread.is_alive(), "a request never ended"
    assert time.monotonic() - killed_at < 60, "requests on the killed replica took too long to end"

    answered = [r for r in records if r[4] == 200]
    failed = [r for r in records if r[4] != 200]
    assert len(records) > 40 and len(answered) >= len(records) - CLIENTS
    for client, stream, _, _, status, text, seconds in failed:
        assert stream, f"a {client} request was not retried on the other replica: {status} {text}"
        assert status in (0, 503), (client, status, text)  # 0: an error event after the first piece
        assert "replica" in text and "retry" in text
        assert_short_error(text)
    expected = reference([(_openai_text(q, p) if c == "openai" else q, p, 8) for c, _, q, p, _, _, _ in answered])
    assert [r[5] for r in answered] == expected
    assert any(seconds > stuck_for for *_, seconds in records), "the requests the killed replica held never ended"

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        engines = served.engine_pids()
        if len(engines) == 2 and victim not in engines:
            break
        time.sleep(1)
    replacement = next(pid for pid in served.engine_pids() if pid not in (victim, survivor))
    poll_ready(served.process, f"{served.url}/v1/health/ready", timeout_s=60)
    while not served.served_by(replacement) and time.monotonic() < deadline:
        with ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(lambda k: openai_chat(served.url, SHAPE_Q, images[k]), range(8)))
        assert all(status == 200 for status, _ in outcomes), outcomes
        time.sleep(1)
    assert served.served_by(replacement), "the replacement replica never answered"


def test_base_install_does_not_import_ray():
    code = ("import sys, importlib.util, deploy, deploy.openai, deploy.deploy_pytriton, exporter, query, wire; "
            "spec = importlib.util.spec_from_file_location('deploy_triton', 'scripts/deploy_triton.py'); "
            "spec.loader.exec_module(importlib.util.module_from_spec(spec)); "
            "assert 'ray' not in sys.modules, 'ray imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "ray[serve]>=2.56" in project["optional-dependencies"]["ray"]
    assert not any(requirement.startswith("ray") for requirement in project["dependencies"])


@pytest.mark.parametrize(("flags", "expected"), [
    (["--triton_port", "9000"], "serves on --host and --port"),
    (["--num_replicas", "2", "--max_replicas", "3"], "not both"),
    (["--autoscaling_config", '{"min_replicas": 3, "max_replicas": 1}'], "autoscaling config"),
    (["--autoscaling_config", "[1"], "not valid JSON"),
    (["--device", "cpu", "--num_gpus_per_replica", "1"], "take no GPU"),
    (["--address", "auto", "--num_cpus", "2"], "ray start"),
    (["--num_replicas", "0"], "at least 1"),
])
def test_deploy_script_refuses_bad_flags_before_starting_anything(flags, expected, tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "scripts/deploy_ray.py"), "-tmr", str(tmp_path), *flags],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1 and expected in done.stderr, done.stderr
    assert_short_error(done.stderr.strip().splitlines()[-1])


def test_replicas_that_do_not_fit_the_local_cluster_are_refused(served):
    env = {**os.environ, "RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp")}
    command = [sys.executable, str(REPO / "scripts/deploy_ray.py"), "-tmn", MODEL, "-tmr", str(served.repo),
               "--host", "127.0.0.1", "--port", str(free_port()), "--num_cpus", "1", "--num_replicas", "2"]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    finally:
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "do not fit the local cluster's 1 CPUs" in last and "--num_cpus_per_replica" in last
    assert_short_error(last)


def test_serve_bench_measures_ray_replicas(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp")}
    command = [sys.executable, str(REPO / "bench/serve_bench.py"), "--demo", "--target", "ray", "--ray_replicas", "1",
               "--concurrency", "2", "--requests", "4", "--processes", "1"]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    finally:
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    phases = json.loads((tmp_path / "serve_bench.json").read_text())["phases"]
    assert [(p["server"], p["protocol"], p["mode"]) for p in phases] == [
        ("ray x1", "openai_plain", "c=2"), ("ray x1", "openai", "c=2")]
    assert all(p["errors"] == 0 and p["requests"] == 4 and p["output_tok_s"] > 0 for p in phases), phases
    assert any(line.startswith("ray x1") and " 1.00x " in line for line in done.stdout.splitlines())
    assert all(p["server_cpus"] > 0 for p in phases)
