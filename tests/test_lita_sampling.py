"""LITA and VITA sample, pad and lay out video frames as NeMo trained them, for every video arch, from MP4 files and
uint8 arrays, in batches mixing videos shorter than, as long as and longer than ``data.num_frames``; NeMo's export
runtime sampling stays available as an opt-in. The reference (``lita_reference``) follows NeMo's training code."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from exporter import TensorRTMMExporter
from exporter.llm.generate import SamplingParams
from exporter.runtime.pipeline import Request
from support.lita_reference import (
    VID_END,
    VID_START,
    decoded_frames,
    export_runtime_frames,
    greedy_ids,
    prompt_embeddings,
    training_frames,
    video_span,
)
from support.media import encode_video, first_available, random_frames
from support.servers import deploy_script
from support.tokenizer_files import tokenizer_file
from support.vlm import CHAT, VISION_SYSTEM, build_vlm

torch.set_num_threads(1)
NUM_FRAMES, SAMPLE_FRAMES, STEPS = 6, 3, 6
LENGTHS = (4, 6, 11)  # shorter than, equal to and longer than num_frames
QUESTIONS = ("what happens in the video", "describe it", "hello world")
MEDIA = -1  # PromptLayout.token_ids marker of a feature row
PROMPTS = {  # the prompts training rendered, written out: (text, BOS in front)
    "v1": (CHAT + " USER: <video>\n{q} ASSISTANT:", True),
    "llama_3": ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n" + VISION_SYSTEM + "<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\n<video>\n{q}<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n", False),
}
ARCHS = {  # name: (model_type, visual_token_format, lita_video_arch, build_vlm arguments)
    "all_resolution": ("lita", "im_vid_start_end", "temporal_all_resolution", {"template": "v1"}),
    "spatial_pool": ("lita", "v1", "temporal_spatial_pool", {"template": "v1"}),
    "spatial": ("lita", "v1", "temporal_spatial", {"template": "v1"}),
    "vita": ("vita", "im_vid_start_end", "temporal_all_resolution",
             {"template": "llama_3", "tower_type": "siglip", "projector_type": "mlp_downsample", "aspect": "pad"}),
}


class Exported:
    """A tiny LITA/VITA checkpoint, exported with one frame sampling, and what its reference needs."""

    def __init__(self, folder, arch: str, sampling: str | None):
        model_type, self.token_format, self.arch, options = ARCHS[arch]
        mm_cfg = {"use_lita": True, "lita": {"visual_token_format": self.token_format, "lita_video_arch": self.arch,
                                             "sample_frames": SAMPLE_FRAMES}}
        if model_type == "vita":
            mm_cfg["llm"] = {"model_type": "vita"}
        self.vlm = build_vlm(folder / "ckpt", tokenizer_file(folder), **options, config_overrides={
            "mm_cfg": mm_cfg, "data": {"media_type": "video", "num_frames": NUM_FRAMES}})
        self.text, self.add_bos = PROMPTS[options["template"]]
        self.sampling = sampling
        self.engine_dir = folder / "engine"
        exporter = TensorRTMMExporter(self.engine_dir, device="cpu")
        exporter.export(self.vlm.nemo, model_type=model_type, dtype="float32", max_batch_size=4, max_input_len=512,
                        max_output_len=8, max_multimodal_len=4 * 128, video_frame_sampling=sampling)
        self.manifest = json.loads((self.engine_dir / "manifest.json").read_text())
        self.pipeline = exporter.pipeline

    def sampled(self, source) -> list[np.ndarray]:
        frames = decoded_frames(source)
        if self.sampling == "nemo-export":
            return export_runtime_frames(frames, NUM_FRAMES, SAMPLE_FRAMES, self.token_format)
        return training_frames(frames, NUM_FRAMES)

    def reference(self, question: str, source) -> torch.Tensor:
        span = video_span(self.vlm, self.sampled(source), token_format=self.token_format, arch=self.arch,
                          sample_frames=SAMPLE_FRAMES)
        return prompt_embeddings(self.vlm, self.text.format(q=question), self.add_bos, span)

    def engine_prompt(self, question: str, source):
        """The engine's prompt layout and embeddings for one request, through its public perception API."""
        engine = self.pipeline.engine
        blocks = engine.perception.encode(engine.perception.load_media(source))
        layout = engine.perception.layout(question, blocks, engine.tokenizer, engine.template, True)
        with torch.no_grad():
            embeds = torch.cat([engine.decoder.embed(torch.tensor(piece)) if isinstance(piece, list) else piece
                                for piece in layout.pieces])
        return layout, embeds


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module", params=list(ARCHS))
def trained(request, tmp_path_factory):
    return Exported(tmp_path_factory.mktemp(request.param), request.param, None)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Per length: random frames, and the same written as an MP4 file (the engine and reference decode it)."""
    folder = tmp_path_factory.mktemp("lita_videos")
    codec = first_available("libx264", "mpeg4")
    arrays, files = [], []
    for seed, length in enumerate(LENGTHS):
        frames = random_frames(length, seed=seed + 7)
        path = folder / f"clip{length}.mp4"
        path.write_bytes(encode_video(frames, "mp4", codec))
        arrays.append(frames)
        files.append(str(path))
    return {"array": arrays, "mp4": files}


def temporal_tokens(exported: Exported, layout) -> int:
    """The temporal span's length in the engine's prompt."""
    ids = layout.token_ids(MEDIA)
    if exported.token_format == "im_vid_start_end":
        tokenizer = exported.pipeline.engine.tokenizer
        start, end = ids.index(tokenizer.token_to_id(VID_START)), ids.index(tokenizer.token_to_id(VID_END))
        assert ids[start + 1:end] == [MEDIA] * (end - start - 1)
        return end - start - 1
    return ids.count(MEDIA) - exported.pipeline.engine.perception.encoder.tokens_per_image


@pytest.mark.parametrize("kind", ["mp4", "array"])
def test_mixed_batch_answers_as_training_did(trained, sources, kind):
    videos = sources[kind]
    requests = [Request(q, media=v, params=SamplingParams(max_output_len=STEPS)) for q, v in zip(QUESTIONS, videos)]
    completions = trained.pipeline.run(requests)
    for question, video, completion in zip(QUESTIONS, videos, completions):
        reference = trained.reference(question, video)
        layout, embeds = trained.engine_prompt(question, video)
        assert temporal_tokens(trained, layout) == NUM_FRAMES
        assert embeds.shape == reference.shape and rel_err(embeds, reference) < 1e-5
        assert completion.token_ids == [greedy_ids(trained.vlm, reference, STEPS)]


def test_features_per_item_is_the_trained_span(trained):
    perception = trained.pipeline.engine.perception
    tokens = perception.encoder.tokens_per_image
    spatial = SAMPLE_FRAMES * tokens if trained.token_format == "im_vid_start_end" else tokens
    assert perception.features_per_item == trained.manifest["features_per_item"] == NUM_FRAMES + spatial
    config = json.loads((trained.engine_dir / "visual_engine" / "config.json").read_text())
    assert config["lita"]["frame_sampling"] == "training"


def test_repeated_frames_are_decoded_and_encoded_once(trained, sources):
    perception = trained.pipeline.engine.perception
    (pixels,) = perception.load_media(sources["mp4"][0])  # 4 frames padded to 6 with the last
    assert pixels.pixels.shape[0] == 4 and pixels.order == (0, 1, 2, 3, 3, 3)
    (padded,) = perception.encode([pixels])
    (image,) = perception.encode(perception.load_media(sources["array"][0][1]))  # an image: one frame, 6 times
    assert padded.shape == image.shape


# --- the opt-in: NeMo's export runtime sampling ------------------------------------------------------------------


@pytest.fixture(scope="module", params=["all_resolution", "spatial_pool"])
def nemo_export(request, tmp_path_factory):
    return Exported(tmp_path_factory.mktemp(f"{request.param}_nemo_export"), request.param, "nemo-export")


def test_nemo_export_sampling_is_an_option(nemo_export, sources):
    videos = sources["mp4"]
    requests = [Request(q, media=v, params=SamplingParams(max_output_len=STEPS)) for q, v in zip(QUESTIONS, videos)]
    completions = nemo_export.pipeline.run(requests)
    temporal = []
    for question, video, completion in zip(QUESTIONS, videos, completions):
        reference = nemo_export.reference(question, video)
        layout, embeds = nemo_export.engine_prompt(question, video)
        temporal.append(temporal_tokens(nemo_export, layout))
        assert embeds.shape == reference.shape and rel_err(embeds, reference) < 1e-5
        assert completion.token_ids == [greedy_ids(nemo_export.vlm, reference, STEPS)]
    # im_vid_start_end: every frame up to num_frames, else round(11 / ceil(11 / 6)) = 6; v1: sample_frames
    assert temporal == ([4, 6, 6] if nemo_export.token_format == "im_vid_start_end" else [SAMPLE_FRAMES] * 3)
    config = json.loads((nemo_export.engine_dir / "visual_engine" / "config.json").read_text())
    assert config["lita"]["frame_sampling"] == "nemo-export"
    most = max(temporal) + (SAMPLE_FRAMES * 16 if nemo_export.token_format == "im_vid_start_end" else 16)
    assert nemo_export.manifest["features_per_item"] == most


def test_an_unknown_frame_sampling_is_named(tmp_path):
    with pytest.raises(ValueError, match="unknown video_frame_sampling 'nemo'; use one of training, nemo-export"):
        Exported(tmp_path, "spatial", "nemo")


def test_deploy_script_passes_the_sampling_on():
    script = deploy_script()
    settings = script.parse_settings(["-tmn", "m", "-mt", "vita", "-vc", "x.nemo", "--video_frame_sampling",
                                      "nemo-export"])
    assert script._export_arguments(settings)["video_frame_sampling"] == "nemo-export"
    assert "video_frame_sampling" not in script._export_arguments(script.parse_settings(["-tmn", "m"]))
    with pytest.raises(SystemExit):
        script.parse_settings(["-tmn", "m", "--video_frame_sampling", "nemo"])
