"""A bounded load test: 64 concurrent mixed requests against one `deploy_triton.py --openai_port` server on loopback.

Triton over HTTP and gRPC (NemoQueryMultimodal, raw PyTriton clients), OpenAI plain and streamed (some streams
dropped by the client after their first chunk) and invalid requests of every kind, all at once. Every valid
request must get the answer its own picture got when asked alone, every invalid one its own clear error, one
result per request; afterwards the server still answers and its memory is back at the level it had before.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import openai
import pytest
from pytriton.client import ModelClient
from pytriton.client.exceptions import PyTritonClientInferenceServerError

from query import NemoQueryMultimodal, QueryError
from support.demo import COLOR_Q, MODEL, SHAPE_Q, demo_script_server, load_demo_builder
from support.servers import ScriptServer as Server
from support.servers import assert_short_error

CONCURRENT = 64
PICTURES = 16
RSS_TOLERANCE = 24 * 1024 * 1024  # allocator slack (a round moves RSS by about 1 MiB)
TOO_LONG = "tell me " * 300 + SHAPE_Q  # past the demo config's max_input_len=512


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with demo_script_server(tmp_path_factory.mktemp("load"), "-mbs", "4", "-mol", "16") as running:
        yield running


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    """PICTURES freshly drawn demo pictures: (PNG path, PNG bytes, pixels, shape, colour)."""
    folder = tmp_path_factory.mktemp("pictures")
    drawn = load_demo_builder().sample_examples(np.random.default_rng(2026), PICTURES)
    result = []
    for index, (image, shape, color) in enumerate(drawn):
        buffer = io.BytesIO()
        image.save(buffer, "PNG")
        path = folder / f"{index}.png"
        path.write_bytes(buffer.getvalue())
        result.append((path, buffer.getvalue(), np.asarray(image.convert("RGB")), shape, color))
    return result


# --- one request of each kind ---------------------------------------------------------------------------------------

@dataclass
class Job:
    kind: str
    question: str = SHAPE_Q
    picture: int = 0


def _openai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.openai, api_key="unused", timeout=120, max_retries=0)


def _messages(question: str, data: bytes) -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": question}]}]


def run_job(job: Job, server: Server, pictures, start: threading.Barrier):
    """The answer text, or the error, of one request; "cancelled" for a stream the client dropped."""
    path, data, pixels, _, _ = pictures[job.picture]
    if job.kind in ("triton_http", "triton_grpc", "triton_long", "triton_params"):
        url = server.grpc if job.kind == "triton_grpc" else server.http
        media = pixels if job.kind == "triton_grpc" else str(path)
        question = TOO_LONG if job.kind == "triton_long" else job.question
        params = {"top_p": 2.0} if job.kind == "triton_params" else {}
        with NemoQueryMultimodal(url, MODEL, "neva") as client:
            start.wait(timeout=120)
            try:
                return str(client.query(question, media, max_output_len=8, init_timeout=120,
                                        inference_timeout=120, **params)[0, 0])
            except QueryError as error:
                return error
    if job.kind == "triton_bad_media":
        with ModelClient(server.grpc, MODEL, init_timeout_s=120, inference_timeout_s=120) as client:
            start.wait(timeout=120)
            try:
                return client.infer_batch(input_text=np.array([[job.question.encode()]]),
                                          input_media_bytes=np.array([[b"\x89PNG\r\n\x1a\n broken"]], dtype=object),
                                          max_output_len=np.array([[8]]))
            except PyTritonClientInferenceServerError as error:
                return error
    api = _openai(server)
    start.wait(timeout=120)
    try:
        if job.kind == "openai":
            answer = api.chat.completions.create(model=MODEL, messages=_messages(job.question, data), max_tokens=8)
            return answer.choices[0].message.content, answer.id
        if job.kind in ("openai_stream", "openai_cancel"):
            with api.chat.completions.create(model=MODEL, messages=_messages(job.question, data), max_tokens=8,
                                             stream=True) as chunks:
                if job.kind == "openai_cancel":
                    next(iter(chunks))
                    return "cancelled"  # leaving the block closes the connection mid-answer
                pieces = list(chunks)
            return "".join(c.choices[0].delta.content or "" for c in pieces), pieces[0].id
        if job.kind == "openai_bad_media":
            api.chat.completions.create(model=MODEL, messages=_messages(job.question, b"GIF89a broken"))
        if job.kind == "openai_long":
            api.chat.completions.create(model=MODEL, messages=_messages(TOO_LONG, data))
        if job.kind == "openai_params":
            api.chat.completions.create(model=MODEL, messages=_messages(job.question, data), temperature=9)
        if job.kind == "openai_bad_json":
            return _post_raw(server.openai + "/chat/completions", b'{"model": "demo", "messages": [{')
    except openai.APIStatusError as error:
        return error
    raise AssertionError(f"job {job.kind} should have failed")


def _post_raw(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


INVALID = ("triton_bad_media", "triton_long", "triton_params", "openai_bad_media", "openai_long", "openai_params",
           "openai_bad_json")
VALID = ("triton_http", "triton_grpc", "openai", "openai_stream")


def mixed_jobs() -> list[Job]:
    """CONCURRENT jobs: each invalid kind once, 6 dropped streams, the rest valid, over all pictures and questions."""
    kinds = [*INVALID, *["openai_cancel"] * 6]
    kinds += [VALID[k % len(VALID)] for k in range(CONCURRENT - len(kinds))]
    order = np.random.default_rng(5).permutation(len(kinds))
    return [Job(kinds[i], (SHAPE_Q, COLOR_Q)[k % 2], (k * 5) % PICTURES) for k, i in enumerate(order)]


def check_invalid(kind: str, result) -> None:
    """Each invalid request's own error, naming what to change, in one short line."""
    if isinstance(result, QueryError):
        assert_short_error(result.server_message)
    elif isinstance(result, PyTritonClientInferenceServerError):
        assert_short_error(result.__cause__.message())
    elif isinstance(result, openai.APIStatusError):
        assert_short_error(result.message)
    if kind == "triton_bad_media":
        assert isinstance(result, PyTritonClientInferenceServerError) and "image" in str(result).lower(), result
    elif kind == "triton_long":
        assert isinstance(result, QueryError) and "max_input_len=512" in str(result), result
    elif kind == "triton_params":
        assert isinstance(result, QueryError) and "top_p" in str(result), result
    elif kind == "openai_bad_json":
        status, body = result
        assert status == 400 and body["error"]["code"] == "invalid_json", result
    else:
        expected = {"openai_bad_media": (400, "invalid_media"), "openai_long": (400, "invalid_request"),
                    "openai_params": (422, "invalid_parameter")}[kind]
        assert isinstance(result, openai.APIStatusError), result
        assert (result.status_code, result.code) == expected, result
        assert {"openai_long": "max_input_len", "openai_params": "temperature"}.get(kind, "image") in result.message


def run_round(server: Server, pictures, jobs: list[Job]) -> list:
    start = threading.Barrier(len(jobs))
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: run_job(job, server, pictures, start), jobs, timeout=240))


def check_round(jobs: list[Job], results: list, alone: dict) -> None:
    """One result per job: each valid one the answer its picture got alone, each invalid one its own error."""
    assert len(results) == len(jobs)
    openai_ids = []
    for job, result in zip(jobs, results):
        if job.kind in INVALID:
            check_invalid(job.kind, result)
        elif job.kind == "openai_cancel":
            assert result == "cancelled"
        else:
            text, *request_id = result if isinstance(result, tuple) else (result,)
            openai_ids += request_id
            assert text == alone[job.question, job.picture], (job, result)
    assert len(set(openai_ids)) == len(openai_ids) == sum(job.kind in ("openai", "openai_stream") for job in jobs)


# --- the test -------------------------------------------------------------------------------------------------------

def test_concurrent_mixed_requests_each_get_their_own_answer_and_memory_returns(server, pictures):
    began = time.monotonic()
    alone, right = {}, 0  # each (question, picture) asked alone, one at a time
    with NemoQueryMultimodal(server.http, MODEL, "neva") as client:
        for index, (path, _, _, shape, color) in enumerate(pictures):
            for question, label in ((SHAPE_Q, shape), (COLOR_Q, color)):
                alone[question, index] = answer = str(client.query(question, str(path), max_output_len=8)[0, 0])
                right += answer == label
    assert right >= 0.9 * len(alone), alone  # the model knows these pictures

    jobs = mixed_jobs()
    check_round(jobs, run_round(server, pictures, jobs), alone)  # also the warm-up: pools reach their sizes
    time.sleep(1.0)
    before = server.rss()
    check_round(jobs, run_round(server, pictures, jobs), alone)
    time.sleep(1.0)  # dropped streams end at their next token
    after = server.rss()
    assert after - before < RSS_TOLERANCE, f"server RSS grew from {before >> 20} MiB to {after >> 20} MiB"
    assert server.process.poll() is None
    path, data, *_ = pictures[3]
    with NemoQueryMultimodal(server.grpc, MODEL, "neva") as client:
        assert client.query(SHAPE_Q, str(path), max_output_len=8)[0, 0] == alone[SHAPE_Q, 3]
    answer = _openai(server).chat.completions.create(model=MODEL, messages=_messages(COLOR_Q, data))
    assert answer.choices[0].message.content == alone[COLOR_Q, 3]
    print(f"load test: {time.monotonic() - began:.1f} s, server RSS {before >> 20} -> {after >> 20} MiB")
