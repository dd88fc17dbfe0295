"""Video-Neva, LITA and VITA exported from tiny checkpoints: PyAV-encoded MP4s answered alone, in mixed batches, and
through a PyTriton server on loopback with the client sending the video file's bytes."""

from __future__ import annotations

import pytest

from deploy import DeployPyTriton
from exporter import TensorRTMMExporter
from exporter.llm.generate import SamplingParams
from exporter.media_safety import MediaPolicy
from exporter.perception.video import VideoLoadError
from exporter.runtime import Request
from query import NemoQueryMultimodal
from support.media import encode_mp4
from support.ports import free_port
from support.tokenizer_files import tokenizer_file
from support.vlm import VIDEO_TYPES, build_vlm

STEPS = 5


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("videos")
    paths = []
    for seed, frames in ((1, 7), (2, 4), (3, 11)):
        path = folder / f"clip{seed}.mp4"
        path.write_bytes(encode_mp4(seed, frames))
        paths.append(path)
    return paths


@pytest.fixture(scope="module", params=list(VIDEO_TYPES))
def exported(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    vlm = build_vlm(folder / "ckpt", tokenizer_file(folder), **VIDEO_TYPES[request.param])
    exporter = TensorRTMMExporter(folder / "engine", device="cpu")
    exporter.export(vlm.nemo, model_type=request.param, dtype="float32", max_batch_size=4, max_input_len=512,
                    max_output_len=8, max_multimodal_len=4 * 128, vision_max_batch_size=16)
    return request.param, exporter


def test_mixed_batch_of_videos_equals_each_alone(exported, videos):
    _, exporter = exported
    questions = ["describe the video", "what is in this video", "hello world"]
    alone = [exporter.forward(q, str(v), max_output_len=STEPS)[0] for q, v in zip(questions, videos)]
    together = exporter.forward(questions, [str(v) for v in videos], max_output_len=STEPS)
    assert together == alone


def test_the_media_policy_caps_the_frames_the_engine_decodes(exported, videos):
    _, exporter = exported
    capped = TensorRTMMExporter(exporter.model_dir, device="cpu", media_policy=MediaPolicy(max_video_frames=5))
    short, long = capped.generate([Request("describe", str(videos[1]), SamplingParams(max_output_len=STEPS)),
                                   Request("describe", str(videos[0]), SamplingParams(max_output_len=STEPS))])
    assert short.texts == exporter.forward("describe", str(videos[1]), max_output_len=STEPS)[0]  # 4 frames
    assert isinstance(long, VideoLoadError) and "over the limit of 5 " in str(long)
    assert "--media_max_video_frames" in str(long)
    capped.pipeline.close()


def test_server_answers_video_bytes(exported, videos):
    model_type, exporter = exported
    http_port, grpc_port = free_port(), free_port()
    deployer = DeployPyTriton(exporter, "video", max_batch_size=2, http_port=http_port, grpc_port=grpc_port,
                              address="127.0.0.1")
    deployer.deploy()
    try:
        deployer.run()
        expected = exporter.forward("describe the video", str(videos[0]), max_output_len=STEPS)
        with NemoQueryMultimodal(f"127.0.0.1:{http_port}", "video", model_type) as client:
            answer = client.query("describe the video", str(videos[0]), max_output_len=STEPS, init_timeout=120)
        assert answer.tolist() == expected
        # NeMo's wire format: decoded frames [T, H, W, 3] as input_media.
        with NemoQueryMultimodal(f"127.0.0.1:{http_port}", "video", model_type, raw_pixels=True) as client:
            answer = client.query("describe the video", str(videos[0]), max_output_len=STEPS, init_timeout=120)
        assert answer.tolist() == expected
    finally:
        deployer.stop()
