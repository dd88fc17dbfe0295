"""The exported demo Neva behind a real PyTriton server on loopback (HTTP and gRPC), queried by the client and CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from pytriton.client import ModelClient
from pytriton.client.exceptions import PyTritonClientInferenceServerError

from query import NemoQueryMultimodal, QueryError
from support.demo import COLOR_Q, DEMO_NEMO, MODEL, SHAPE_Q, load_demo_builder
from support.ports import free_port
from support.servers import (
    REPO,
    assert_short_error,
    http_infer,
    json_tensor,
    poll_ready,
    query_concurrently,
    stop_server,
)


@pytest.fixture(scope="module")
def examples():
    """Eight fresh demo images with their labels, all different."""
    builder = load_demo_builder()
    drawn = builder.sample_examples(np.random.default_rng(7), 8)
    return [(np.asarray(image), shape, color) for image, shape, color in drawn]


def _send_raw_bytes(url: str, prompt: str, media: bytes, start: threading.Barrier):
    with ModelClient(url, MODEL, init_timeout_s=60, inference_timeout_s=120) as client:
        start.wait(timeout=60)
        try:
            return client.infer_batch(input_text=np.array([[prompt.encode()]]),
                                      input_media_bytes=np.array([[media]], dtype=object),
                                      max_output_len=np.array([[4]]))
        except PyTritonClientInferenceServerError as error:
            return error


def test_client_answers_over_http_and_grpc(demo_server):
    http_url, grpc_url, _ = demo_server
    for url in (http_url, grpc_url):
        with NemoQueryMultimodal(url, MODEL, "neva") as client:
            assert client.query(SHAPE_Q, str(REPO / "demo/images/red_circle.png"), max_output_len=8).tolist() == [
                ["circle"]]
            assert client.query(COLOR_Q, str(REPO / "demo/images/blue_triangle.png"), max_output_len=8).tolist() == [
                ["blue"]]


def test_concurrent_requests_with_different_images_and_parameters(demo_server, examples):
    params = [{"max_output_len": 4 + k, "temperature": 0.5 + k / 4, "num_beams": 1 + k % 2} for k in range(8)]
    questions = [SHAPE_Q if k % 2 else COLOR_Q for k in range(8)]
    jobs = [(questions[k], examples[k][0], params[k]) for k in range(8)]
    answers = query_concurrently(demo_server[0], demo_server[1], MODEL, jobs, send_bytes=_send_raw_bytes)
    for k, answer in enumerate(answers):
        _, shape, color = examples[k]
        assert not isinstance(answer, Exception), answer
        assert answer.shape == (1, params[k]["num_beams"])
        assert answer[0, 0] == (shape if questions[k] == SHAPE_Q else color)


def test_bad_requests_fail_alone_and_the_server_keeps_serving(demo_server, examples):
    bad = {
        2: (SHAPE_Q, b"\x89PNG this is not an image", {}),
        4: ("tell me " * 300 + SHAPE_Q, examples[4][0], {"max_output_len": 4}),
        6: (SHAPE_Q, examples[6][0], {"top_p": 2.0, "max_output_len": 4}),
    }
    jobs = [bad.get(k, (SHAPE_Q, examples[k][0], {"max_output_len": 4})) for k in range(8)]
    answers = query_concurrently(demo_server[0], demo_server[1], MODEL, jobs, send_bytes=_send_raw_bytes)
    assert isinstance(answers[2], PyTritonClientInferenceServerError) and "image" in str(answers[2]).lower()
    assert isinstance(answers[4], QueryError) and "max_input_len=200" in str(answers[4])
    assert isinstance(answers[6], QueryError) and "top_p" in str(answers[6])
    assert_short_error(answers[2].__cause__.message())
    for answer in (answers[4], answers[6]):
        assert answer.status in ("400", "StatusCode.INVALID_ARGUMENT")
        assert_short_error(answer.server_message)
    for k, answer in enumerate(answers):
        if k not in bad:
            assert not isinstance(answer, Exception), answer
            assert answer[0, 0] == examples[k][1]
    with NemoQueryMultimodal(demo_server[0], MODEL, "neva") as client:
        assert client.query(COLOR_Q, examples[0][0], max_output_len=4).tolist() == [[examples[0][2]]]
    assert demo_server[2].triton.is_alive()


def test_deploy_script_exports_serves_and_query_script_answers(tmp_path):
    """NeMo's CLI semantics: a checkpoint is exported into the repository, then served; query.py prints. The
    OpenAI front says ready only once Triton answers too."""
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    http_port, grpc_port, openai_port = free_port(), free_port(), free_port()
    deploy = [sys.executable, str(REPO / "scripts/deploy_triton.py"), "--config", "demo", "-vc", str(DEMO_NEMO),
              "-tmr", str(tmp_path / "repo"), "-trp", str(http_port), "--grpc_port", str(grpc_port), "-mbs", "2",
              "--openai_port", str(openai_port)]
    server = subprocess.Popen(deploy, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        poll_ready(server, f"http://127.0.0.1:{openai_port}/v1/health/ready")
        png = (REPO / "demo/images/red_circle.png").read_bytes()
        status, answer = http_infer(f"127.0.0.1:{http_port}", MODEL, [
            json_tensor("input_text", np.array([[COLOR_Q.encode()]], dtype=object)),
            json_tensor("input_media_bytes", np.array([[png]], dtype=object))])
        assert (status, answer["outputs"][0]["data"]) == (200, ["red"])
        assert (tmp_path / "repo" / "manifest.json").is_file()
        for image, question, expected in (("green_square", SHAPE_Q, "square"), ("yellow_circle", COLOR_Q, "yellow")):
            query = [sys.executable, str(REPO / "scripts/query.py"), "-u", f"127.0.0.1:{http_port}", "-mn", MODEL,
                     "-mt", "neva", "-int", question, "-im", str(REPO / f"demo/images/{image}.png"), "-mol", "8"]
            done = subprocess.run(query, env=env, capture_output=True, text=True, timeout=120, check=False)
            assert done.returncode == 0, done.stderr
            assert done.stdout.strip() == expected
    finally:
        stop_server(server, 120)
    assert server.returncode == 0
    log = server.stderr.read()
    for phase in ("imports", "exporter import", "write the LLM weights", "Triton launch", "LLM weights: read + transfer",
                  "warm-up request", "Triton start"):
        assert f"phase {phase}: " in log, phase  # each start-up phase with its time
    # Triton started before the export's engine was loaded: the load's phases come after its launch
    assert log.index("phase Triton launch: ") < log.index("phase LLM weights: read + transfer: ")
    assert " s after the process started" in log
