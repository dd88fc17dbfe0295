"""The wire format (`wire`): NeMo's tensors, the one parameter mapping, request rows and their caps, and the
import boundaries between the packages; the one-line client errors (`deploy.triton_errors`)."""

from __future__ import annotations

import base64
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from deploy.triton_errors import BAD_REQUEST, INTERNAL, UNAVAILABLE, client_failure, one_line, parse_failure
from exporter.llm.generate import SamplingParams
from wire import (
    LORA_UIDS,
    PARAMS,
    PROMPT_BYTES_PER_TOKEN,
    WireError,
    WireLimits,
    encode_outputs,
    multimodal_triton_inputs,
    multimodal_triton_outputs,
    param_tensors,
    split_request,
)

REPO = Path(__file__).resolve().parent.parent
TEXT = np.array([[b"What is this?"]], dtype=object)


def _spec(tensors) -> dict:
    return {t.name: (tuple(t.shape), np.dtype(t.dtype).str if t.dtype not in (bytes, object) else t.dtype, t.optional)
            for t in tensors}


def test_tensor_specs_are_nemos():
    vision = _spec(multimodal_triton_inputs("vision"))
    assert list(vision) == ["input_text", "input_media", "input_media_bytes", "batch_size", "max_output_len", "top_k",
                            "num_beams", "top_p", "temperature", "repetition_penalty", "lora_uids"]
    assert vision["input_text"] == ((1,), bytes, False)
    assert vision["input_media"] == ((-1, -1, -1, 3), "|u1", True)
    assert vision["input_media_bytes"] == ((-1,), object, True)
    assert vision["max_output_len"] == ((1,), "<i8", True) and vision["top_p"] == ((1,), "<f4", True)
    assert vision["lora_uids"] == ((-1,), bytes, True)
    audio = _spec(multimodal_triton_inputs("audio"))
    assert audio["input_signal"] == ((-1,), "<f4", True) and audio["input_signal_length"] == ((1,), "<i4", True)
    assert "input_media" not in audio
    assert _spec(multimodal_triton_outputs()) == {"outputs": ((-1,), bytes, False)}
    with pytest.raises(ValueError, match="unknown modality 'text'"):
        multimodal_triton_inputs("text")


def test_client_parameters_map_to_sampling_fields_once():
    """A client's keyword arguments become tensors, the server's row holds the SamplingParams fields they set."""
    values = {"batch_size": 1, "max_output_len": 12, "top_k": 5, "num_beams": 2, "top_p": 0.5, "temperature": 0.75,
              "repetition_penalty": 1.25, LORA_UIDS: ["a"]}
    row_tensors = param_tensors(values)
    assert set(row_tensors) == {p.name for p in PARAMS} | {LORA_UIDS}
    request = {"input_text": TEXT, **{name: value[np.newaxis] for name, value in row_tensors.items()}}
    (row,) = split_request(request)
    assert row.sampling == {"max_output_len": 12, "top_k": 5, "num_beams": 2, "top_p": 0.5, "temperature": 0.75,
                            "repetition_penalty": 1.25}
    assert row.lora_uid == "a"
    assert SamplingParams(**row.sampling).top_k == 5  # every field the wire sets is a SamplingParams field
    assert param_tensors({"top_k": None}) == {}
    with pytest.raises(ValueError, match="unknown generation parameters \\['topk'\\]"):
        param_tensors({"topk": 3})


def test_rows_are_decoded_with_their_media():
    png = b"\x89PNG\r\n\x1a\n payload"
    request = {"input_text": np.array([[b"a"], [b"b"]], dtype=object),
               "input_media_bytes": np.array([[png], [b"data:image/png;base64," + base64.b64encode(png)]],
                                             dtype=object),
               "max_output_len": np.array([[3], [4]])}
    rows = split_request(request)
    assert [(r.text, r.media_bytes, r.sampling) for r in rows] == [
        ("a", (png,), {"max_output_len": 3}), ("b", (png,), {"max_output_len": 4})]
    signal = {"input_text": TEXT, "input_signal": np.ones((1, 10), np.float32),
              "input_signal_length": np.array([[6]], np.int32)}
    assert split_request(signal)[0].signal.shape == (6,)


@pytest.mark.parametrize(("change", "message"), [
    ({"input_media": np.zeros((1, 1, 0, 0, 3), np.uint8)}, "input input_media is empty \\(shape \\[1, 1, 0, 0, 3\\]\\)"),
    ({"input_media": np.zeros((1, 1, 4, 4, 3), np.float32)}, "input_media must be uint8"),
    ({"input_media": np.zeros((1, 4, 4, 3), np.uint8)}, "input_media must be uint8 \\[rows, images or frames"),
    ({"input_signal": np.zeros((1, 5), np.float64)}, "input_signal must be float32"),
    ({"input_media_bytes": np.array([[b""]], dtype=object)}, "input_media_bytes of row 0 is empty"),
    ({"input_media_bytes": np.array([[b"data:image/png,xyz"]], dtype=object)}, "without ;base64"),
    ({"input_media_bytes": np.array([[b"data:image/png;base64,!!"]], dtype=object)}, "invalid base64"),
    ({"input_text": np.array([[b"\xff"]], dtype=object)}, "input_text of row 0 is not valid UTF-8"),
    ({"max_output_len": np.array([[3], [4]])}, "input max_output_len has shape \\[2, 1\\], but input_text has 1 rows"),
    ({"max_output_len": np.array([[3, 4]])}, "input max_output_len must hold one value per row"),
    ({"input_signal": np.ones((1, 4), np.float32), "input_signal_length": np.array([[9]], np.int32)},
     "input_signal_length of row 0 is 9"),
])
def test_malformed_requests_name_the_input(change, message):
    with pytest.raises(WireError, match=message):
        split_request({"input_text": TEXT, **change})


def test_missing_prompt():
    with pytest.raises(WireError, match="request has no input_text"):
        split_request({"max_output_len": np.array([[3]])})


LIMITS = WireLimits.for_engine(max_input_len=100, max_batch_size=2, max_media_items=2, max_media_item_bytes=1000,
                               max_image_pixels=64, max_frames=3, max_audio_duration_s=0.001)


@pytest.mark.parametrize(("change", "message"), [
    ({"input_text": np.array([[b"x" * (100 * PROMPT_BYTES_PER_TOKEN + 1)]], dtype=object)},
     "input_text is 3201 bytes, over the 3200 bytes a prompt of max_input_len tokens can take"),
    ({"input_text": np.array([[b"a"], [b"b"], [b"c"]], dtype=object)}, "3 prompts, over max_batch_size=2"),
    ({"input_media_bytes": np.array([[b"a", b"b", b"c"]], dtype=object)}, "3 media items per prompt, over the cap of 2"),
    ({"input_media_bytes": np.array([[b"a" * 2000]], dtype=object)}, "item is 2000 bytes, over the cap of 1000"),
    ({"input_media_bytes": np.array([[b"data:x;base64," + base64.b64encode(b"a" * 1001)]], dtype=object)},
     "input_media_bytes of row 0 is 1001 bytes, over the cap of 1000"),
    ({"input_media": np.zeros((1, 4, 2, 2, 3), np.uint8)}, "4 images or frames per prompt, over the cap of 3"),
    ({"input_media": np.zeros((1, 1, 9, 8, 3), np.uint8)}, "8x9 pixels, over the cap of 64 pixels"),
    ({"input_signal": np.zeros((1, 49), np.float32)}, "49 samples, over the cap of 48"),
])
def test_limits_are_checked_from_sizes(change, message):
    request = {"input_text": TEXT, **change}
    if request["input_text"].shape[0] > 1:
        request = {"input_text": request["input_text"]}
    with pytest.raises(WireError, match=message):
        split_request(request, LIMITS)


def test_a_50_mb_prompt_is_refused_from_its_size_alone():
    """Refused before anything is decoded: as fast for 50 MB as for 5 KB."""
    limits = WireLimits.for_engine(max_input_len=4096, max_batch_size=8, max_media_items=8,
                                   max_media_item_bytes=1 << 20, max_image_pixels=1 << 20, max_frames=8,
                                   max_audio_duration_s=60)
    huge = {"input_text": np.array([[b"\xff" * 50_000_000]], dtype=object)}  # not even UTF-8: never decoded
    started = time.perf_counter()
    with pytest.raises(WireError, match="input_text is 50000000 bytes"):
        split_request(huge, limits)
    assert time.perf_counter() - started < 0.05
    assert limits.input_byte_caps() == {"input_text": 8 * 4096 * PROMPT_BYTES_PER_TOKEN,
                                        "input_media_bytes": 8 * 8 * (4 * -(-(1 << 20) // 3) + 256),
                                        "input_media": 8 * 8 * (1 << 20) * 3,
                                        "input_signal": 8 * 60 * 48_000 * 4}


def test_outputs_are_one_entry_per_beam():
    assert encode_outputs([["a", "b"], ["c", "d"]])["outputs"].tolist() == [[b"a", b"b"], [b"c", b"d"]]
    with pytest.raises(ValueError, match="same number of beams"):
        encode_outputs([["a"], ["b", "c"]])


def test_packages_import_one_way():
    """wire needs neither torch nor PyTriton; exporter imports neither deploy nor query; query not deploy."""
    code = ("import sys, wire; heavy = sorted({m.split('.')[0] for m in sys.modules} & "
            "{'torch', 'pytriton', 'deploy', 'exporter', 'query', 'PIL'}); print(heavy)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert done.stdout.strip() == "[]"
    for package, forbidden in (("exporter", ("deploy", "query")), ("query", ("deploy",)), ("wire", ("deploy",
                                                                                                    "exporter",
                                                                                                    "query"))):
        for path in (REPO / package).rglob("*.py"):
            for line in path.read_text().splitlines():
                words = line.strip().split()
                if words[:1] in (["import"], ["from"]) and len(words) > 1:
                    assert words[1].split(".")[0] not in forbidden, f"{path.relative_to(REPO)}: {line.strip()}"


@pytest.mark.parametrize(("error", "stopping", "status", "message"), [
    (ValueError("top_p must be in [0, 1], got 2"), False, BAD_REQUEST, "ValueError: top_p must be in [0, 1], got 2"),
    (NotImplementedError("lora_uids are not supported yet"), False, BAD_REQUEST,
     "NotImplementedError: lora_uids are not supported yet"),
    (RuntimeError("CUDA error in /opt/app/x.py:3\nsecond line"), False, INTERNAL,
     "internal server error: RuntimeError: CUDA error in <path>:3 second line"),
    (ValueError("bad"), True, UNAVAILABLE, "the server is stopping (ValueError: bad); retry on a running server"),
])
def test_client_failures_are_one_line_with_a_status(error, stopping, status, message):
    failure = client_failure(error, stopping)
    assert (failure.status, failure.message) == (status, message)
    traceback_text = f'Traceback (most recent call last):\n  File "/srv/a.py", line 1\n{type(failure).__name__}: {failure}\n'
    assert parse_failure(traceback_text) == (status, message)


def test_unmarked_failures_and_paths():
    assert parse_failure("Traceback ... KeyError: 'x'") == (INTERNAL, "internal server error; the server log has "
                                                                      "the details")
    assert one_line("see /work/wt/x.py and data:image/png and http://host/a/b") == \
        "see <path> and data:image/png and http://host/a/b"
    assert len(one_line("x" * 5000)) == 400
