"""Streaming from the exported demo Neva behind a real PyTriton server on loopback: the decoupled `<name>_stream`
model over gRPC (DecoupledModelClient) and HTTP (`generate_stream`, server-sent events), errors, abandoned
streams, and the scripts with --streaming."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from pytriton.client import DecoupledModelClient
from pytriton.client.exceptions import PyTritonClientInferenceServerError

from deploy import DeployPyTriton
from query import NemoQueryMultimodal, QueryError
from support.demo import COLOR_Q, DEMO_NEMO, MODEL, SHAPE_Q, demo_deployed, load_demo_builder
from support.ports import free_port
from support.servers import assert_short_error, stop_server, wait_until_ready

REPO = Path(__file__).resolve().parent.parent
RED_CIRCLE = REPO / "demo" / "images" / "red_circle.png"
WHOLE_TOKENS = re.compile(r" ?circle( circle)*")  # a streamed piece of the red circle's answer: whole tokens
MAX_OUTPUT_LEN = 300
# The demo model answers one word; a repetition "penalty" far below 1 makes it repeat that word up to
# max_output_len: a long, greedy answer (300 tokens take about 0.3 s on a CPU core).
LONG = {"repetition_penalty": 0.001}
PROTOCOLS = ("http", "grpc")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with demo_deployed(tmp_path_factory.mktemp("engine"), max_batch_size=4, max_output_len=MAX_OUTPUT_LEN,
                       streaming=True) as (http, grpc, deployer):
        yield {"http": http, "grpc": grpc, "deployer": deployer}


@pytest.fixture(scope="module")
def examples():
    """Four fresh demo images with their shape and colour, all different."""
    drawn = load_demo_builder().sample_examples(np.random.default_rng(11), 4)
    return [(np.asarray(image), shape, color) for image, shape, color in drawn]


def _client(server, protocol: str) -> NemoQueryMultimodal:
    return NemoQueryMultimodal(server[protocol], MODEL, "neva")


@pytest.fixture
def submitted(server, monkeypatch):
    """The scheduler handles of the requests the server submits during a test, in order (observed, not altered)."""
    scheduler = server["deployer"].model.pipeline.scheduler
    handles = []
    submit = scheduler.submit

    def observed_submit(*args, **kwargs):
        handles.append(submit(*args, **kwargs))
        return handles[-1]

    monkeypatch.setattr(scheduler, "submit", observed_submit)
    return handles


def _slots_free(deployer: DeployPyTriton, timeout_s: float = 30) -> bool:
    scheduler = deployer.model.pipeline.scheduler
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(slot is None for slot in scheduler.slots) and not scheduler.waiting:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_pieces_join_to_the_non_streaming_answer(server, examples, protocol):
    with _client(server, protocol) as client:
        for image, shape, color in examples[:2]:
            for question, expected in ((SHAPE_Q, shape), (COLOR_Q, color)):
                pieces = list(client.query_stream(question, image, max_output_len=8))
                assert "".join(pieces) == expected
                assert client.query(question, image, max_output_len=8).tolist() == [[expected]]
        answer = client.query(SHAPE_Q, str(RED_CIRCLE), max_output_len=12, **LONG)[0, 0]
        pieces = list(client.query_stream(SHAPE_Q, str(RED_CIRCLE), max_output_len=12, **LONG))
    assert answer == " ".join(["circle"] * 12)
    # each piece is the text of the tokens generated since the one before (one, or several on a busy machine)
    assert all(WHOLE_TOKENS.fullmatch(piece) for piece in pieces) and pieces[0].startswith("circle")
    assert "".join(pieces) == answer


def test_decoupled_client_and_generate_stream_wire_format(server):
    """The raw protocols as docs/serving.md shows them: PyTriton's DecoupledModelClient and curl on SSE."""
    png = RED_CIRCLE.read_bytes()
    with DecoupledModelClient(server["grpc"], MODEL + "_stream", inference_timeout_s=60) as client:
        responses = list(client.infer_sample(input_text=np.array([SHAPE_Q.encode()]),
                                             input_media_bytes=np.array([png], dtype=object),
                                             max_output_len=np.array([3]),
                                             repetition_penalty=np.array([0.01], dtype=np.float32)))
    assert all(len(r["outputs"]) == 1 and WHOLE_TOKENS.fullmatch(r["outputs"][0].decode()) for r in responses)
    assert b"".join(r["outputs"][0] for r in responses) == b"circle circle circle"
    body = {"input_text": COLOR_Q, "input_media_bytes": "data:image/png;base64," + base64.b64encode(png).decode(),
            "max_output_len": 4}
    done = subprocess.run(["curl", "-sN", "-X", "POST", f"http://{server['http']}/v2/models/demo_stream/generate_stream",
                           "-d", json.dumps(body)], capture_output=True, text=True, timeout=60, check=True)
    events = [json.loads(line[len("data:"):]) for line in done.stdout.splitlines() if line.startswith("data:")]
    assert events == [{"model_name": "demo_stream", "model_version": "1", "outputs": "red"}]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_bad_requests_get_errors_not_text(server, examples, protocol):
    """Each bad request ends its stream with one short line (no traceback, no server paths); over HTTP with status
    400 (a gRPC stream carries its errors in-band, as text without a code)."""
    image = examples[0][0]
    status = {"http": "400", "grpc": None}[protocol]
    with _client(server, protocol) as client:
        for params, message in (({"top_p": 2.0}, "top_p"),
                                ({"max_output_len": MAX_OUTPUT_LEN + 1}, f"max_output_len={MAX_OUTPUT_LEN}"),
                                ({"max_output_len": 4, "prompt": "tell me " * 300 + SHAPE_Q}, "max_input_len=200")):
            prompt = params.pop("prompt", SHAPE_Q)
            with pytest.raises(QueryError, match=message) as failure:
                list(client.query_stream(prompt, image, **params))
            assert failure.value.status == status
            assert_short_error(failure.value.server_message)
        assert "".join(client.query_stream(SHAPE_Q, image, max_output_len=4)) == examples[0][1]


def test_raw_bad_requests_get_triton_errors(server, examples):
    """What the client would refuse to send: bytes that are no image, two prompts in one streamed request."""
    bad_image = b"\x89PNG this is not an image"
    with DecoupledModelClient(server["grpc"], MODEL + "_stream", inference_timeout_s=60) as client:
        with pytest.raises(PyTritonClientInferenceServerError, match="(?i)image"):
            list(client.infer_sample(input_text=np.array([SHAPE_Q.encode()]),
                                     input_media_bytes=np.array([bad_image], dtype=object)))
    with DecoupledModelClient(server["grpc"], MODEL + "_stream", inference_timeout_s=60) as client:
        with pytest.raises(PyTritonClientInferenceServerError, match="one prompt, got 2"):
            list(client.infer_batch(input_text=np.array([[SHAPE_Q.encode()], [COLOR_Q.encode()]])))
    body = {"input_text": SHAPE_Q, "input_media_bytes": "data:image/png;base64," + base64.b64encode(bad_image).decode()}
    done = subprocess.run(["curl", "-sN", "-w", "\n%{http_code}", "-X", "POST",
                           f"http://{server['http']}/v2/models/demo_stream/generate_stream", "-d", json.dumps(body)],
                          capture_output=True, text=True, timeout=60, check=True)
    event, status = done.stdout.strip().rsplit("\n", 1)
    message = json.loads(event.removeprefix("data:"))["error"]
    assert status == "400" and "image" in message.lower()
    assert_short_error(message)
    with pytest.raises(ValueError, match="gRPC"):
        NemoQueryMultimodal(server["http"], MODEL, "neva", raw_pixels=True).query_stream(SHAPE_Q, examples[0][0])
    with pytest.raises(QueryError, match="nonexistent_stream"):
        list(NemoQueryMultimodal(server["http"], "nonexistent", "neva").query_stream(SHAPE_Q, examples[0][0]))


def test_closing_the_stream_early_cancels_the_generation(server, submitted):
    """In the server process: closing the model's stream after one piece ends the request in the scheduler."""
    exporter = server["deployer"].model
    request = {"input_text": np.array([[SHAPE_Q.encode()]]), "input_media_bytes": np.array([[RED_CIRCLE.read_bytes()]],
                                                                                             dtype=object),
               "max_output_len": np.array([[MAX_OUTPUT_LEN]]), "repetition_penalty": np.array([[0.01]], np.float32)}
    stream = exporter.triton_stream_request(request)
    (first,) = next(stream)["outputs"].tolist()
    assert WHOLE_TOKENS.fullmatch(first[0].decode())
    stream.close()
    (handle,) = submitted
    assert handle.wait(timeout=30)
    assert len(handle.tokens) < MAX_OUTPUT_LEN  # uncancelled, this answer runs to max_output_len (checked below)
    assert _slots_free(server["deployer"], timeout_s=5)
    assert len(exporter.forward(SHAPE_Q, str(RED_CIRCLE), max_output_len=MAX_OUTPUT_LEN, **LONG)[0][0].split()) == \
        MAX_OUTPUT_LEN


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_abandoned_stream_leaves_the_server_answering_correctly(server, examples, submitted, protocol):
    with _client(server, protocol) as client:
        stream = client.query_stream(SHAPE_Q, str(RED_CIRCLE), max_output_len=MAX_OUTPUT_LEN, **LONG)
        assert WHOLE_TOKENS.fullmatch(next(stream))
        assert not submitted[0].done  # the first piece came while the server was still generating
        started = time.monotonic()
        stream.close()  # the client stops reading mid-answer
        assert time.monotonic() - started < 5

    def ask(index: int) -> str:
        image, shape, color = examples[index]
        question, expected = (SHAPE_Q, shape) if index % 2 else (COLOR_Q, color)
        with _client(server, PROTOCOLS[index % 2]) as client:
            if index < 2:
                got = "".join(client.query_stream(question, image, max_output_len=8))
            else:
                got = client.query(question, image, max_output_len=8)[0, 0]
        return got == expected or f"request {index}: {got!r} != {expected!r}"

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(ask, range(4), timeout=120)) == [True] * 4
    assert _slots_free(server["deployer"])
    assert server["deployer"].triton.is_alive()


def test_scripts_deploy_and_query_with_streaming(tmp_path):
    """deploy_triton.py --streaming serves both models; query.py --streaming prints the answer as it comes."""
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    http_port, grpc_port = free_port(), free_port()
    deploy = [sys.executable, str(REPO / "scripts/deploy_triton.py"), "--config", "demo", "-vc", str(DEMO_NEMO),
              "-tmr", str(tmp_path / "repo"), "-trp", str(http_port), "--grpc_port", str(grpc_port), "-mbs", "1",
              "--streaming"]
    server = subprocess.Popen(deploy, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_ready(f"127.0.0.1:{http_port}", MODEL + "_stream", server)
        for url, extra, expected in ((f"127.0.0.1:{http_port}", [], "circle"),
                                     (f"grpc://127.0.0.1:{grpc_port}", ["-rp", "0.01", "-mol", "3"],
                                      "circle circle circle")):
            query = [sys.executable, str(REPO / "scripts/query.py"), "-u", url, "-mn", MODEL, "-mt", "neva",
                     "-int", SHAPE_Q, "-im", str(RED_CIRCLE), "--streaming", *extra]
            done = subprocess.run(query, env=env, capture_output=True, text=True, timeout=120, check=False)
            assert done.returncode == 0, done.stderr
            assert done.stdout == expected + "\n"
        plain = [sys.executable, str(REPO / "scripts/query.py"), "-u", f"127.0.0.1:{http_port}", "-mn", MODEL,
                 "-mt", "neva", "-int", COLOR_Q, "-im", str(RED_CIRCLE)]
        done = subprocess.run(plain, env=env, capture_output=True, text=True, timeout=120, check=False)
        assert (done.returncode, done.stdout) == (0, "red\n"), done.stderr
    finally:
        stop_server(server, 120)
    assert server.returncode == 0
