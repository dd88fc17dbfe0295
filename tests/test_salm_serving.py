"""SALM behind a real PyTriton server: `deploy_triton.py --modality audio --model_type salm` exports the tiny `.nemo`
and serves it; `query.py -im clip.wav` and `NemoQueryMultimodal` (file bytes, or NeMo's `input_signal`) get the
answers the exporter gives in-process; bad audio fails its own request only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pytriton.client import ModelClient
from pytriton.client.exceptions import PyTritonClientInferenceServerError

from exporter import TensorRTMMExporter
from query import NemoQueryMultimodal
from support.ports import free_port
from support.salm import build_salm, write_clips
from support.servers import stop_server, wait_until_ready

REPO = Path(__file__).resolve().parent.parent
MODEL = "salm"
STEPS = 6
LIMITS = ["-mil", "256", "-mol", "16", "-mbs", "2", "-mml", "256", "-dt", "float32"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(url, clips, in-process exporter of the same checkpoint) with deploy_triton.py running."""
    folder = tmp_path_factory.mktemp("salm_serving")
    salm = build_salm(folder / "ckpt")
    clips = write_clips(folder / "clips")
    local = TensorRTMMExporter(folder / "local_engine", modality="audio", device="cpu")
    local.export(salm.nemo, model_type="salm", dtype="float32", max_input_len=256, max_output_len=16,
                 max_batch_size=2, max_multimodal_len=256)
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    http_port, grpc_port = free_port(), free_port()
    command = [sys.executable, str(REPO / "scripts/deploy_triton.py"), "--modality", "audio", "--model_type", "salm",
               "--visual_checkpoint", str(salm.nemo), "--triton_model_name", MODEL,
               "--triton_model_repository", str(folder / "repo"), "--triton_port", str(http_port),
               "--grpc_port", str(grpc_port), "--triton_http_address", "127.0.0.1", "--device", "cpu", *LIMITS]
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_ready(f"127.0.0.1:{http_port}", MODEL, server)
        yield f"127.0.0.1:{http_port}", clips, local, env
    finally:
        stop_server(server, 120)


def test_query_script_sends_a_wav_file(served):
    url, clips, local, env = served
    query = [sys.executable, str(REPO / "scripts/query.py"), "-u", url, "-mn", MODEL, "-mt", "salm", "-int", "",
             "-im", str(clips.wav), "-mol", str(STEPS)]
    done = subprocess.run(query, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == local.forward("", str(clips.wav), max_output_len=STEPS)[0][0]


def test_client_sends_files_and_nemo_input_signal(served):
    url, clips, local, _ = served
    texts = ["", "what is said here?"]
    expected = [local.forward(t, str(c), max_output_len=STEPS)[0] for t, c in zip(texts, (clips.flac, clips.stereo))]
    with NemoQueryMultimodal(url, MODEL, "salm") as client:  # the files' bytes: decoded, resampled on the server
        answers = client.query(texts, [str(clips.flac), str(clips.stereo)], max_output_len=STEPS)
    assert answers.tolist() == expected
    with NemoQueryMultimodal(url, MODEL, "salm", raw_pixels=True) as client:  # NeMo's input_signal (16 kHz)
        answers = client.query(["", ""], [str(clips.wav), str(clips.flac)], max_output_len=STEPS)
    assert answers.tolist() == [local.forward("", str(c), max_output_len=STEPS)[0] for c in (clips.wav, clips.flac)]


def test_unreadable_audio_fails_its_request_only(served):
    url, clips, local, _ = served
    with ModelClient(url, MODEL, init_timeout_s=60, inference_timeout_s=120) as client:
        with pytest.raises(PyTritonClientInferenceServerError, match="not a decodable audio file"):
            client.infer_batch(input_text=np.array([[b""]]),
                               input_media_bytes=np.array([[b"RIFF but not really audio"]], dtype=object),
                               max_output_len=np.array([[STEPS]]))
    with NemoQueryMultimodal(url, MODEL, "salm") as client:
        assert client.query("", str(clips.wav), max_output_len=STEPS).tolist() == local.forward(
            "", str(clips.wav), max_output_len=STEPS)
