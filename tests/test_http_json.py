"""wire.http_json: Triton's HTTP bodies (JSON and the binary tensor extension) to and from the wire tensors, checked
against the wire's own row splitting (what the engine decodes), against tritonclient's own encoder and decoder, and
against refusals that name the input."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from wire import WireError, param_tensors, split_request
from wire.http_json import (
    datatype_of,
    generate_request_from_json,
    infer_request_from_body,
    infer_request_from_json,
    outputs_to_binary,
    outputs_to_json,
)

DATATYPES = {"input_text": "BYTES", "input_media": "UINT8", "input_media_bytes": "BYTES", "max_output_len": "INT64",
             "top_p": "FP32", "temperature": "FP32", "lora_uids": "BYTES"}
PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe"  # not UTF-8: must travel as a data: URL


def test_a_json_request_reaches_the_server_as_the_same_rows():
    """A JSON body as curl sends it (media as base64 data: URLs), split into rows as the engine reads them."""
    png_urls = ["data:image/png;base64," + base64.b64encode(p).decode() for p in (PNG, PNG + b"2")]
    body = {"inputs": [
        {"name": "input_text", "shape": [2, 1], "datatype": "BYTES", "data": ["What is this? é", "and this"]},
        {"name": "input_media_bytes", "shape": [2, 1], "datatype": "BYTES", "data": png_urls},
        {"name": "max_output_len", "shape": [2, 1], "datatype": "INT64", "data": [7, 7]},
        {"name": "top_p", "shape": [2, 1], "datatype": "FP32", "data": [[0.5], [0.5]]},
        {"name": "temperature", "shape": [2, 1], "datatype": "FP32", "data": [0.25, 0.25]}]}
    decoded, binary = infer_request_from_body(json.dumps(body).encode(), None, DATATYPES)
    rows = split_request(decoded)
    assert [row.text for row in rows] == ["What is this? é", "and this"]
    assert [row.media_bytes for row in rows] == [(PNG,), (PNG + b"2",)]
    assert rows[0].sampling == {"max_output_len": 7, "top_p": 0.5, "temperature": 0.25}
    assert decoded["max_output_len"].dtype == np.int64 and decoded["top_p"].dtype == np.float32
    assert binary is False  # a JSON body gets a JSON answer


def test_raw_pixels_keep_their_shape_and_values():
    pixels = np.arange(2 * 3 * 4 * 3, dtype=np.uint8).reshape(1, 2, 3, 4, 3)
    body, _ = _tritonclient_body({"input_text": np.array([[b"x"]], dtype=object), "input_media": pixels}, ())
    decoded, _ = infer_request_from_body(body, None, DATATYPES)
    np.testing.assert_array_equal(decoded["input_media"], pixels)
    assert decoded["input_media"].dtype == np.uint8


def test_nested_data_lists_are_read_row_major():
    body = {"inputs": [{"name": "input_media", "shape": [1, 1, 1, 2, 3], "datatype": "UINT8",
                        "data": [[[[[1, 2, 3], [4, 5, 6]]]]]}]}
    assert infer_request_from_json(body, DATATYPES)["input_media"].reshape(-1).tolist() == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(("body", "expected"), [
    ([], '"inputs" list'),
    ({"inputs": [{"shape": [1], "datatype": "BYTES", "data": ["x"]}]}, 'a "name"'),
    ({"inputs": [{"name": "input_txt", "shape": [1, 1], "datatype": "BYTES", "data": ["x"]}]}, "unknown input"),
    ({"inputs": [{"name": "input_text", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]}, "takes BYTES"),
    ({"inputs": [{"name": "input_text", "shape": [2, 1], "datatype": "BYTES", "data": ["x"]}]}, "1 data values"),
    ({"inputs": [{"name": "input_text", "shape": [1, -1], "datatype": "BYTES", "data": ["x"]}]}, "non-negative"),
    ({"inputs": [{"name": "input_text", "shape": [1, 1], "datatype": "BYTES", "data": [3]}]}, "as strings"),
    ({"inputs": [{"name": "input_media", "shape": [1, 1, 1, 1, 3], "datatype": "UINT8", "data": [0, 256, 1]}]},
     "outside 0..255"),
    ({"inputs": [{"name": "max_output_len", "shape": [1, 1], "datatype": "INT64", "data": [2.5]}]}, "integers"),
    ({"inputs": [{"name": "top_p", "shape": [1, 1], "datatype": "FP32", "data": ["0.5"]}]}, "numbers"),
    ({"inputs": [{"name": "top_p", "shape": [1, 1], "datatype": "FP32", "data": [0.5]}] * 2}, "given twice"),
])
def test_malformed_infer_bodies_are_refused_naming_the_problem(body, expected):
    with pytest.raises(WireError, match=expected):
        infer_request_from_json(body, DATATYPES)


def test_a_generate_body_is_one_row():
    request = generate_request_from_json({"input_text": "Describe it.", "input_media_bytes": ["data:a;base64,AA=="],
                                          "max_output_len": 5, "top_p": 0.5})
    assert {name: value.shape for name, value in request.items()} == {
        "input_text": (1, 1), "input_media_bytes": (1, 1), "max_output_len": (1, 1), "top_p": (1, 1)}
    (row,) = split_request(request)
    assert row.text == "Describe it." and row.media_bytes == (b"\x00",)
    assert row.sampling == {"max_output_len": 5, "top_p": 0.5}


@pytest.mark.parametrize(("body", "expected"), [
    ("text", "JSON object"),
    ({"input_text": ["a", "b"]}, "takes a string"),
    ({"input_text": "x", "input_media": [[1, 2, 3]]}, "cannot be sent in a generate body"),
    ({"input_text": "x", "max_output_len": "5"}, "integers"),
    ({"input_text": "x", "max_output_len": True}, "integers"),
    ({"input_text": "x", "seed": 3}, "unknown input 'seed'"),
])
def test_malformed_generate_bodies_are_refused(body, expected):
    with pytest.raises(WireError, match=expected):
        generate_request_from_json(body)


def test_json_answers_hold_each_row_s_beams():
    outputs = {"outputs": np.array([[a.encode() for a in row] for row in [["un", "deux"], ["trois é", "quatre"]]],
                                   dtype=np.bytes_)}
    answer = json.loads(json.dumps(outputs_to_json("demo", outputs)))
    assert answer["model_name"] == "demo"
    assert answer["outputs"] == [{"name": "outputs", "shape": [2, 2], "datatype": "BYTES",
                                  "data": ["un", "deux", "trois é", "quatre"]}]


def test_datatypes():
    assert [datatype_of(d) for d in (object, np.bytes_, np.uint8, np.int64, np.int32, np.float32)] == [
        "BYTES", "BYTES", "UINT8", "INT64", "INT32", "FP32"]
    with pytest.raises(ValueError, match="no Triton datatype"):
        datatype_of(np.complex64)


# --- Triton's binary tensor extension, against tritonclient's own encoder and decoder ------------------------------

def _tritonclient_body(request: dict[str, np.ndarray], binary: tuple[str, ...]) -> tuple[bytes, int | None]:
    """The body `tritonclient.http` sends for `request`, the inputs in `binary` as raw bytes, the others as JSON."""
    from tritonclient.http import InferInput
    from tritonclient.http._utils import _get_inference_request
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, value in request.items():
        tensor = InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
        tensor.set_data_from_numpy(value, binary_data=name in binary)
        inputs.append(tensor)
    return _get_inference_request(inputs, "", None, 0, False, False, 0, None, None)


def test_tritonclient_binary_requests_decode_to_the_same_tensors():
    params = param_tensors({"max_output_len": 7, "top_p": 0.5})
    pixels = np.arange(2 * 3 * 4 * 3, dtype=np.uint8).reshape(1, 2, 3, 4, 3)
    request = {"input_text": np.array([["What is this? é".encode()]], dtype=object),
               "input_media_bytes": np.array([[PNG, b""]], dtype=object), "input_media": pixels,
               **{name: value[np.newaxis] for name, value in params.items()}}
    for binary in (tuple(request), ("input_media_bytes", "input_media"), ("input_media_bytes",)):  # PNG: not JSON
        body, header_length = _tritonclient_body(request, binary)
        decoded, answer_binary = infer_request_from_body(
            body, None if header_length is None else str(header_length), DATATYPES)
        assert answer_binary  # tritonclient asks for binary outputs when it names none
        assert set(decoded) == set(request)
        for name, value in request.items():
            assert decoded[name].shape == value.shape and decoded[name].dtype == value.dtype, name
            assert decoded[name].tolist() == value.tolist(), (name, binary)


def test_binary_answers_read_back_with_tritonclient():
    from tritonclient.http import InferResult

    answers = np.array([["circle", "a circle"], ["é", ""]], dtype=object)
    encoded = np.array([[a.encode() for a in row] for row in answers], dtype=object)
    body, header_length = outputs_to_binary("demo", {"outputs": encoded})
    result = InferResult.from_response_body(body, header_length=header_length)
    assert result.as_numpy("outputs").tolist() == encoded.tolist()
    assert result.get_response()["model_name"] == "demo"


def test_a_json_body_asks_for_a_json_answer_unless_it_names_binary_outputs():
    body = json.dumps({"inputs": [{"name": "input_text", "shape": [1, 1], "datatype": "BYTES", "data": ["x"]}]})
    assert infer_request_from_body(body.encode(), None, DATATYPES)[1] is False
    asking = {**json.loads(body), "outputs": [{"name": "outputs", "parameters": {"binary_data": True}}]}
    assert infer_request_from_body(json.dumps(asking).encode(), None, DATATYPES)[1] is True


@pytest.mark.parametrize(("cut", "header", "expected"), [
    (0, "abc", "Inference-Header-Content-Length is 'abc'"),
    (0, "100000", "Inference-Header-Content-Length is '100000'"),
    (3, None, "binary_data_size 18 but the body holds 15 more bytes"),
    (-3, None, "bytes after its binary inputs"),
])
def test_malformed_binary_bodies_are_refused_naming_the_problem(cut, header, expected):
    body, header_length = _tritonclient_body({"input_text": np.array([[b"hello"], [b"world"]], dtype=object)},
                                             ("input_text",))
    if cut > 0:
        body = body[:-cut]
    elif cut < 0:
        body = body + b"xyz"
    with pytest.raises(WireError, match=expected):
        infer_request_from_body(body, header or str(header_length), DATATYPES)


def test_binary_tensors_must_match_their_shape():
    header = {"inputs": [{"name": "input_text", "shape": [1, 2], "datatype": "BYTES",
                          "parameters": {"binary_data_size": 9}}]}
    raw = json.dumps(header).encode()
    with pytest.raises(WireError, match=r"shape \[1, 2\] \(2 values\) but 1 BYTES items"):
        infer_request_from_body(raw + (5).to_bytes(4, "little") + b"hello", str(len(raw)), DATATYPES)
    with pytest.raises(WireError, match="cut off"):
        infer_request_from_body(raw + (9).to_bytes(4, "little") + b"hello", str(len(raw)), DATATYPES)
    pixels = {"inputs": [{"name": "input_media", "shape": [1, 4], "datatype": "UINT8",
                          "parameters": {"binary_data_size": 3}}]}
    raw = json.dumps(pixels).encode()
    with pytest.raises(WireError, match=r"\(4 bytes of UINT8\) but 3 binary bytes"):
        infer_request_from_body(raw + b"abc", str(len(raw)), DATATYPES)
