"""Hardening of one `deploy_triton.py --openai_port --streaming` server (the demo Neva) on loopback: oversized
prompts refused before any work, a seeded fuzz run over Triton HTTP, gRPC and the OpenAI front, and the engine's
metrics read from the metrics port."""

from __future__ import annotations

import base64
import io
import json
import random
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest

from support.demo import COLOR_Q, MODEL, SHAPE_Q, demo_script_server, load_demo_builder
from support.servers import ScriptServer as Server
from support.servers import assert_short_error, grpc_infer, http_infer, json_tensor

MAX_OUTPUT_LEN = 8
FUZZ_REQUESTS = 2000
FUZZ_SEED = 2026
FUZZ_CONCURRENCY = 8
RSS_TOLERANCE = 48 * 1024 * 1024  # allocator slack over a few thousand requests


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with demo_script_server(tmp_path_factory.mktemp("hardening"), "-mbs", "4", "-mol", str(MAX_OUTPUT_LEN),
                            "--streaming") as running:
        yield running


@pytest.fixture(scope="module")
def pictures():
    """Four demo pictures: (PNG bytes, pixels [1, 64, 64, 3])."""
    drawn = load_demo_builder().sample_examples(np.random.default_rng(17), 4)
    result = []
    for image, _, _ in drawn:
        buffer = io.BytesIO()
        image.save(buffer, "PNG")
        result.append((buffer.getvalue(), np.asarray(image.convert("RGB"))[np.newaxis]))
    return result


def test_the_warm_up_through_triton_leaves_no_trace_in_the_metrics(server):
    """At READY the warm-up's requests through Triton (four infer, one streamed, through the engine's scheduler)
    have been answered: none is counted, and none of their latencies or tokens recorded (the recorder, polling each
    50 ms, is given a second)."""
    time.sleep(1.0)
    values = _metrics(server)
    assert not {name: value for name, value in values.items() if name.startswith("nemo_mm_requests_total")}
    assert values["nemo_mm_generated_tokens_total"] == 0
    assert values["nemo_mm_time_to_first_token_seconds_count"] == 0
    assert values["nemo_mm_encoder_cache_misses_total"] > 0  # the warm-up did run through the engine


# --- oversized prompts ----------------------------------------------------------------------------------------------

def test_a_50_mb_prompt_is_refused_at_once_and_memory_stays_flat(server):
    """Refused from its byte size before it reaches the model (over HTTP JSON too, which crashed Triton 2.51's
    HTTP front end above 4 MB before the server raised its threads' stack size)."""
    text = "tell me " * (50_000_000 // 8)
    body = json.dumps({"inputs": [json_tensor("input_text", np.array([[text]], dtype=object))]}).encode()
    grpc_text = {"input_text": np.array([[text.encode()]], dtype=object)}
    before = server.rss()
    timings = {"http": [], "grpc": []}
    for _ in range(3):
        started = time.monotonic()
        status, answer = http_infer(server.http, MODEL, body)
        timings["http"].append(time.monotonic() - started)
        assert status == 400 and answer["error"] == ("input input_text is 50000000 bytes, over this server's cap of "
                                                     "65536 bytes per request")
        started = time.monotonic()
        code, message = grpc_infer(server.grpc, MODEL, grpc_text)
        timings["grpc"].append(time.monotonic() - started)
        assert code == "INVALID_ARGUMENT" and "input_text is 50000000 bytes" in message
    print(f"50 MB prompt refused in {timings}")
    # Sending 50 MB alone takes ~0.4 s on a busy 2-core machine; tokenizing them would take far longer than 2 s.
    assert all(min(seconds) < 2.0 for seconds in timings.values()), timings
    assert server.rss() - before < 64 * 1024 * 1024, f"RSS {before >> 20} -> {server.rss() >> 20} MiB"
    assert server.process.poll() is None


def test_a_prompt_past_max_input_len_by_its_bytes_is_refused_unread(server, pictures):
    """Under the per-request cap but over max_input_len × PROMPT_BYTES_PER_TOKEN: the wire check names the limit."""
    text = "x" * (512 * 32 + 1)
    code, message = grpc_infer(server.grpc, MODEL, {"input_text": np.array([[text.encode()]], dtype=object),
                                                    "input_media_bytes": np.array([[pictures[0][0]]], dtype=object)})
    assert code == "INVALID_ARGUMENT"
    assert message == ("WireError: input_text is 16385 bytes, over the 16384 bytes a prompt of max_input_len tokens "
                       "can take; shorten the text")


# --- fuzzing ---------------------------------------------------------------------------------------------------------

@dataclass
class Case:
    """One fuzz request: the protocol, its payload, and the answer it must get if it is valid (None: mutated)."""

    protocol: str  # "http", "grpc" or "openai"
    payload: object
    expected: str | None
    label: str


def _reference(server: Server, pictures) -> dict[tuple[str, int], str]:
    answers = {}
    for index, (png, _) in enumerate(pictures):
        for question in (SHAPE_Q, COLOR_Q):
            code, outputs = grpc_infer(server.grpc, MODEL, _triton_inputs(question, png, MAX_OUTPUT_LEN))
            assert code == "OK", outputs
            answers[question, index] = outputs[0][0].decode()
    return answers


def _triton_inputs(question: str, png: bytes, max_output_len: int) -> dict[str, np.ndarray]:
    return {"input_text": np.array([[question.encode()]], dtype=object),
            "input_media_bytes": np.array([[png]], dtype=object),
            "max_output_len": np.array([[max_output_len]], dtype=np.int64)}


def _openai_body(question: str, png: bytes, **extra) -> dict:
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return {"model": MODEL, "max_tokens": MAX_OUTPUT_LEN, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]}], **extra}


_ODD_VALUES = [0, -1, 1, 2, 7, 9, 2**31, 2**62, -(2**62), 0.0, -0.5, 0.5, 1.5, 1e30, -1e30, float("nan"), float("inf"),
               float("-inf"), 1e-30]
_BEAM_VALUES = [0, -1, 1, 2, 3, 4000, 2**31, -(2**62)]


def _mutated_triton(rng: random.Random, inputs: dict[str, np.ndarray], pictures) -> tuple[dict, str]:
    """A random mutation of valid Triton inputs (several, sometimes), with a label."""
    inputs = dict(inputs)
    labels = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        kind = rng.choice(("param", "param", "text", "media", "pixels", "structure", "dtype"))
        labels.append(kind)
        if kind == "param":
            name = rng.choice(("max_output_len", "top_k", "num_beams", "batch_size", "top_p", "temperature",
                               "repetition_penalty"))
            # Beam counts stay small here: a huge one is the engine's max_beam_width check (the scheduler's tests).
            value = rng.choice(_BEAM_VALUES if name == "num_beams" else _ODD_VALUES)
            integer = name in ("max_output_len", "top_k", "num_beams", "batch_size")
            if integer:
                value = int(max(min(value, 2**62), -(2**62))) if np.isfinite(value) else 3
            inputs[name] = np.array([[value]], dtype=np.int64 if integer else np.float32)
        elif kind == "text":
            choice = rng.randrange(5)
            text = [b"", bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))),
                    b"<image> " * rng.randrange(1, 5) + SHAPE_Q.encode(),
                    "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(1, 200))).encode(),
                    b"tell me " * rng.randrange(100, 3000)][choice]
            inputs["input_text"] = np.array([[text]], dtype=object)
        elif kind == "media":
            png = pictures[rng.randrange(len(pictures))][0]
            item = rng.choice([png[: rng.randrange(1, len(png))], bytes(rng.randrange(256) for _ in range(100)),
                               b"data:image/png;base64,!!!", b"data:image/png," + png[:20],
                               b"data:image/png;base64," + base64.b64encode(png), b"GIF89a" + png])
            count = rng.choice((1, 1, 2, 9))
            inputs["input_media_bytes"] = np.array([[item] * count], dtype=object)
        elif kind == "pixels":
            inputs.pop("input_media_bytes", None)
            shape = rng.choice([(1, 1, 64, 64, 3), (1, 1, 0, 0, 3), (1, 3, 8, 8, 3), (1, 1, 1, 1, 3), (1, 2, 700, 9, 3)])
            inputs["input_media"] = np.full(shape, rng.randrange(256), dtype=np.uint8)
        elif kind == "structure":
            choice = rng.randrange(4)
            if choice == 0:
                inputs.pop("input_text", None)
            elif choice == 1:
                inputs["input_unknown"] = np.array([[1]], dtype=np.int64)
            elif choice == 2:
                inputs = {name: np.concatenate([value] * 5) for name, value in inputs.items()}  # 5 rows > max_batch 4
            else:
                inputs["lora_uids"] = np.array([[b"adapter"]], dtype=object)
        else:
            name = rng.choice(("temperature", "max_output_len"))
            inputs[name] = np.array([[1.0]], dtype=np.float64)  # a dtype the model does not declare
    return inputs, "+".join(labels)


def _raw_triton_body(rng: random.Random, inputs: dict[str, np.ndarray]) -> bytes:
    """A broken JSON /infer body: truncated, shapes that do not match the data, unknown datatypes, bad values."""
    body = {"inputs": [json_tensor(name, value) for name, value in inputs.items()]}
    choice = rng.randrange(5)
    if choice == 0:
        raw = json.dumps(body).encode()
        return raw[: rng.randrange(len(raw))]
    if choice == 1:
        body["inputs"][0]["shape"] = [1, rng.choice((0, 2, 1000))]
    elif choice == 2:
        body["inputs"][-1]["datatype"] = rng.choice(("FP16", "UINT99", "", "BYTES"))
    elif choice == 3:
        body["inputs"].append({"name": "input_media", "shape": [1, 1, 1, 1, 3], "datatype": "UINT8",
                               "data": [rng.choice((-1, 1.5, "x", None)), 0, 0]})
    else:
        body = rng.choice(([], {"inputs": "x"}, {"inputs": [{}]}, {"outputs": []}))
    return json.dumps(body).encode()


def _mutated_openai(rng: random.Random, body: dict) -> tuple[object, str]:
    body = json.loads(json.dumps(body))
    kind = rng.choice(("param", "param", "message", "media", "raw"))
    if kind == "param":
        name = rng.choice(("max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop", "repetition_penalty",
                           "stream", "logprobs"))
        body[name] = rng.choice([*_ODD_VALUES[:15], "x", None, [], {}, True, ["a"] * 5])
    elif kind == "message":
        choice = rng.randrange(4)
        if choice == 0:
            body["messages"] = []
        elif choice == 1:
            body["messages"][0]["role"] = rng.choice(("assistant", "tool", "nobody", 7))
        elif choice == 2:
            body["messages"].append({"role": "system", "content": "x" * rng.randrange(1, 30000)})
        else:
            del body["messages"]
    elif kind == "media":
        part = body["messages"][0]["content"][0]
        part["image_url"]["url"] = rng.choice(["data:image/png;base64,AAAA", "data:,", "file:///etc/passwd",
                                               "http://127.0.0.1:1/x.png", "data:image/png;base64," + "A" * 1001,
                                               "ftp://x/y", ""])
    else:
        raw = json.dumps(body).encode()
        return rng.choice([raw[: rng.randrange(len(raw))], b"[]", b"null", b"\xff\xfe", b"{" * 1000]), kind
    return body, kind


def fuzz_cases(pictures, reference, count: int, seed: int) -> list[Case]:
    """`count` requests, a quarter of them valid, the rest mutated, over the three protocols."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        protocol = rng.choice(("http", "grpc", "openai"))
        index, question = rng.randrange(len(pictures)), rng.choice((SHAPE_Q, COLOR_Q))
        png = pictures[index][0]
        valid = rng.random() < 0.25
        expected = reference[question, index] if valid else None
        if protocol == "openai":
            payload, label = (_openai_body(question, png), "valid") if valid else \
                _mutated_openai(rng, _openai_body(question, png))
        else:
            inputs = _triton_inputs(question, png, MAX_OUTPUT_LEN)
            if valid:
                payload, label = inputs, "valid"
            elif protocol == "http" and rng.random() < 0.2:
                payload, label = _raw_triton_body(rng, inputs), "raw"
            else:
                payload, label = _mutated_triton(rng, inputs, pictures)
        cases.append(Case(protocol, payload, expected, label))
    return cases


def _post(url: str, payload: object) -> tuple[int, object]:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def run_case(server: Server, case: Case) -> tuple[str, str]:
    """("ok", answer text) or (status, error message)."""
    if case.protocol == "grpc":
        code, result = grpc_infer(server.grpc, MODEL, case.payload, timeout_s=120)
        return (code, result) if code != "OK" else ("ok", result[0][0].decode())
    if case.protocol == "http":
        body = case.payload if isinstance(case.payload, bytes) else \
            [json_tensor(name, value) for name, value in case.payload.items()]
        status, answer = http_infer(server.http, MODEL, body, timeout_s=120)
        return ("ok", answer["outputs"][0]["data"][0]) if status == 200 else (str(status), answer["error"])
    status, text = _post(server.openai + "/chat/completions", case.payload)
    if status != 200:
        return str(status), json.loads(text)["error"]["message"]
    if text.startswith("data:"):  # a fuzzed `stream: true`
        events = [line[len("data:"):].strip() for line in text.splitlines() if line.startswith("data:")]
        chunks = [json.loads(event) for event in events if event != "[DONE]"]
        errors = [chunk["error"]["message"] for chunk in chunks if "error" in chunk]
        if errors:
            return "stream-error", errors[0]
        return "ok", "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    return "ok", json.loads(text)["choices"][0]["message"]["content"]


def check_case(case: Case, outcome: tuple[str, str]) -> None:
    status, text = outcome
    if case.expected is not None:
        assert outcome == ("ok", case.expected), (case.protocol, case.label, outcome)
    elif status == "ok":
        assert isinstance(text, str), (case.protocol, case.label, outcome)
    else:
        assert_short_error(text)
        assert not text.startswith("internal server error"), (case.protocol, case.label, outcome)
        if case.label != "raw":  # Triton answers some JSON it cannot parse with 500 (docs/serving.md)
            assert status not in ("INTERNAL", "500"), (case.protocol, case.label, outcome)


def test_seeded_fuzz_over_triton_http_grpc_and_openai(server, pictures):
    """2,000 random and mutated requests, 8 at a time: every valid one gets the answer its picture gets alone,
    every other one an answer or a short error; the server stays up and its memory flat."""
    reference = _reference(server, pictures)
    cases = fuzz_cases(pictures, reference, FUZZ_REQUESTS, FUZZ_SEED)
    warm, rest = cases[:200], cases[200:]
    with ThreadPoolExecutor(FUZZ_CONCURRENCY) as pool:
        outcomes = list(pool.map(lambda case: run_case(server, case), warm))
        time.sleep(1.0)
        before = server.rss()
        outcomes += list(pool.map(lambda case: run_case(server, case), rest))
    time.sleep(1.0)
    after = server.rss()
    for case, outcome in zip(cases, outcomes):
        check_case(case, outcome)
    statuses: dict[str, int] = {}
    for case, (status, _) in zip(cases, outcomes):
        key = f"{case.protocol}:{status}"
        statuses[key] = statuses.get(key, 0) + 1
    print(f"fuzz outcomes {dict(sorted(statuses.items()))}; RSS {before >> 20} -> {after >> 20} MiB")
    assert sum(case.expected is not None for case in cases) > 300
    assert server.process.poll() is None
    assert after - before < RSS_TOLERANCE, f"server RSS grew from {before >> 20} MiB to {after >> 20} MiB"
    png = pictures[1][0]
    assert grpc_infer(server.grpc, MODEL, _triton_inputs(SHAPE_Q, png, MAX_OUTPUT_LEN))[1][0][0].decode() == \
        reference[SHAPE_Q, 1]


def test_engine_metrics_on_the_metrics_port(server, pictures):
    """After requests of every kind: request counts by kind, errors, the scheduler's gauges, encoder-cache hits,
    latency histograms and generated tokens, and Triton's own metrics, all on the one metrics port."""
    png = pictures[2][0]
    repeating = {**_triton_inputs(COLOR_Q, png, 4), "repetition_penalty": np.array([[0.001]], dtype=np.float32)}
    for _ in range(2):
        assert grpc_infer(server.grpc, MODEL, repeating)[0] == "OK"  # four tokens each
    assert _post(server.openai + "/chat/completions", _openai_body(COLOR_Q, png))[0] == 200
    assert _post(server.openai + "/chat/completions", {"model": MODEL})[0] >= 400
    deadline = time.monotonic() + 10  # a request's latencies are recorded just after it is answered
    while (values := _metrics(server))["nemo_mm_time_to_first_token_seconds_count"] < 3 and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    assert values['nemo_mm_requests_total{kind="infer"}'] >= 2
    assert values['nemo_mm_requests_total{kind="openai"}'] >= 2
    assert values['nemo_mm_request_errors_total{error="bad_request",kind="openai"}'] >= 1
    assert values["nemo_mm_encoder_cache_hits_total"] >= 1
    assert values["nemo_mm_generated_tokens_total"] >= 9
    assert values["nemo_mm_time_to_first_token_seconds_count"] >= 3
    assert values["nemo_mm_time_per_output_token_seconds_count"] >= 1
    assert values["nemo_mm_queue_length"] == 0 and values["nemo_mm_running_rows"] == 0
    assert values["nemo_mm_max_rows"] == 4 and values["nemo_mm_kv_cache_used_fraction"] == 0
    assert any(name.startswith("nv_inference_request_success") for name in values)  # Triton's own


def _metrics(server: Server) -> dict[str, float]:
    with urllib.request.urlopen(server.metrics, timeout=10) as response:
        text = response.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_server_log_keeps_the_tracebacks_clients_do_not_see(server):
    """What clients get as one line, the log has in full (here: a failed request's traceback)."""
    code, message = grpc_infer(server.grpc, MODEL, {"input_text": np.array([[b"hi"]], dtype=object),
                                                    "top_p": np.array([[2.0]], dtype=np.float32)})
    assert code == "INVALID_ARGUMENT" and message.startswith("ValueError: top_p")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "Traceback" not in server.log.read_text():
        time.sleep(0.2)
    assert "Traceback (most recent call last)" in server.log.read_text()
