"""Neva end to end: tiny checkpoints in NeMo's layouts, exported, answer token for token as transformers does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from exporter import TensorRTMMExporter
from exporter.engine import EngineError, LimitError
from exporter.llm.generate import SamplingParams
from exporter.runtime import Request
from support.media import random_image
from support.neva_reference import reference_tokens
from support.tokenizer_files import tokenizer_file
from support.vlm import build_vlm

STEPS = 8
QUESTION = "describe the image"
LIMITS = {"max_batch_size": 4, "max_input_len": 256, "max_output_len": 16, "max_multimodal_len": 4 * 16,
          "max_beam_width": 2}
CASES = {
    "legacy-clip-mlp2x-inside-v1": {},
    "legacy-nonmcore-clip-linear-folder-nvgpt": dict(mcore=False, projector_type="linear", tower_at="from_pretrained",
                                                     template="nvgpt"),
    "tp2-siglip-downsample-towerpath-v1": dict(tp_size=2, tower_type="siglip", projector_type="mlp_downsample",
                                               tower_at="vision_tower_path"),
    "dist-siglip-mlp2x-inside-llama2-pad": dict(layout="torch_dist", tower_type="siglip", template="llama_2",
                                                aspect="pad"),
    "dist-clip-downsample-inside-mistral-pad": dict(layout="torch_dist", projector_type="mlp_downsample",
                                                    template="mistral", aspect="pad"),
}


@pytest.fixture(scope="module")
def sp_path(tmp_path_factory) -> Path:
    return tokenizer_file(tmp_path_factory.mktemp("sp"))


def _export(vlm, folder: Path, **overrides) -> TensorRTMMExporter:
    exporter = TensorRTMMExporter(folder, device="cpu")
    exporter.export(vlm.nemo, model_type="neva", dtype="float32", **{**LIMITS, **vlm.export_kwargs, **overrides})
    return exporter


def _token_ids(exporter: TensorRTMMExporter, question: str, image, **params) -> list[int]:
    (completion,) = exporter.generate([Request(question, image, SamplingParams(max_output_len=STEPS, **params))])
    assert not isinstance(completion, Exception), completion
    return completion.token_ids[0]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_transformers(case, sp_path, tmp_path):
    vlm = build_vlm(tmp_path / "ckpt", sp_path, **CASES[case])
    exporter = _export(vlm, tmp_path / "engine")
    image = random_image(1)
    expected = reference_tokens(vlm, QUESTION, image, STEPS)
    assert len(expected) >= 2
    assert _token_ids(exporter, QUESTION, image) == expected
    # The same answer from a path and from a uint8 array, through NeMo's forward.
    image.save(tmp_path / "image.png")
    text = exporter.engine.tokenizer.decode(expected).strip()
    assert exporter.forward(QUESTION, str(tmp_path / "image.png"), max_output_len=STEPS) == [[text]]
    assert exporter.forward(QUESTION, np.asarray(image), max_output_len=STEPS) == [[text]]


@pytest.fixture(scope="module")
def exported(sp_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("neva")
    vlm = build_vlm(folder / "ckpt", sp_path)
    return vlm, _export(vlm, folder / "engine"), folder


def test_batch_of_different_requests_equals_each_alone(exported):
    vlm, exporter, _ = exported
    questions = ["describe the image", "what is in this picture", "hello world"]
    images = [random_image(seed) for seed in (2, 3, 4)]
    together = exporter.forward(questions, images, max_output_len=STEPS)
    alone = [exporter.forward(q, image, max_output_len=STEPS)[0] for q, image in zip(questions, images)]
    assert together == alone
    expected = reference_tokens(vlm, questions[1], images[1], STEPS)
    assert together[1] == [exporter.engine.tokenizer.decode(expected).strip()]


def test_beams_and_verbatim_prompts(exported):
    vlm, exporter, _ = exported
    image = random_image(5)
    beams = exporter.forward(QUESTION, image, max_output_len=STEPS, num_beams=2)
    assert len(beams) == 1 and len(beams[0]) == 2
    # apply_chat_template=False: the text as given, features at <image>, pieces tokenized with no BOS.
    verbatim = "USER: <image>\nhello ASSISTANT:"
    (completion,) = exporter.generate([Request(verbatim, image, SamplingParams(max_output_len=STEPS),
                                               apply_chat_template=False)])
    expected = reference_tokens(vlm, "hello", image, STEPS, prompt=("USER: <image>\n{q} ASSISTANT:", False))
    assert completion.token_ids[0] == expected
    assert expected != reference_tokens(vlm, "hello", image, STEPS)  # the chat template gives another answer


def test_engine_reloads_in_a_fresh_process_without_the_checkpoint(exported, tmp_path):
    vlm, exporter, folder = exported
    image = random_image(6)
    image.save(tmp_path / "image.png")
    expected = exporter.forward(QUESTION, str(tmp_path / "image.png"), max_output_len=STEPS)
    moved = tmp_path / "elsewhere.nemo"
    vlm.nemo.rename(moved)
    try:
        script = ("import json, sys; from exporter import TensorRTMMExporter; "
                  "e = TensorRTMMExporter(sys.argv[1], device='cpu'); "
                  f"print(json.dumps(e.forward({QUESTION!r}, sys.argv[2], max_output_len={STEPS})))")
        done = subprocess.run([sys.executable, "-c", script, str(folder / "engine"), str(tmp_path / "image.png")],
                              capture_output=True, text=True, timeout=120, env={"HF_HUB_OFFLINE": "1",
                                                                               "PATH": "/usr/bin:/bin"},
                              check=False)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout.strip().splitlines()[-1]) == expected
    finally:
        moved.rename(vlm.nemo)


def test_limits_are_checked_with_messages_that_say_what_to_change(exported, tmp_path):
    vlm, exporter, _ = exported
    with pytest.raises(LimitError, match=r"max_multimodal_len=16 is below max_batch_size × features per media item"):
        _export(vlm, tmp_path / "small", max_multimodal_len=16)
    image = random_image(7)
    with pytest.raises(LimitError, match=r"over max_input_len=256"):
        exporter.forward("hello " * 300, image, max_output_len=4)
    with pytest.raises(LimitError, match=r"max_output_len=17 is over the engine's max_output_len=16"):
        exporter.forward(QUESTION, image, max_output_len=17)
    with pytest.raises(LimitError, match=r"batch of 5 requests is over max_batch_size=4"):
        exporter.forward([QUESTION] * 5, [image] * 5, max_output_len=2)
    with pytest.raises(ValueError, match="top_p"):
        exporter.forward(QUESTION, image, top_p=2.0, max_output_len=4)


def test_missing_parts_and_wrong_arguments_are_named(exported, sp_path, tmp_path):
    vlm, _, _ = exported
    no_tower = build_vlm(tmp_path / "no_tower", sp_path, tower_at="vision_tower_path")
    with pytest.raises(ValueError, match="vision_tower_path"):
        TensorRTMMExporter(tmp_path / "e1", device="cpu").export(no_tower.nemo, model_type="neva", **LIMITS)
    with pytest.raises(ValueError, match="unsupported model_type 'nevax'"):
        TensorRTMMExporter(tmp_path / "e2", device="cpu").export(vlm.nemo, model_type="nevax")
    with pytest.raises(AssertionError, match="modality"):
        TensorRTMMExporter(tmp_path / "e3", modality="smell")
    with pytest.raises(ValueError, match="modality 'vision'"):
        TensorRTMMExporter(tmp_path / "e4", modality="audio").export(vlm.nemo, model_type="neva")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "file.txt").write_text("x")
    with pytest.raises(EngineError, match="There are files in this folder"):
        TensorRTMMExporter(busy, device="cpu").export(vlm.nemo, delete_existing_files=False)
    with pytest.raises(RuntimeError, match="should be exported and loaded first"):
        TensorRTMMExporter(tmp_path / "empty", device="cpu").forward(QUESTION, random_image(8))


def test_hugging_face_tokenizer_hub_name_needs_tokenizer_path(sp_path, tmp_path):
    vlm = build_vlm(tmp_path / "hf_tok", sp_path)
    import tarfile

    import yaml

    from tools.nemo_writer import tar_directory

    unpacked = tmp_path / "unpacked"
    with tarfile.open(vlm.nemo) as archive:
        archive.extractall(unpacked, filter="data")
    config_path = unpacked / "model_config.yaml"
    config = yaml.safe_load(config_path.read_text())
    config["tokenizer"] = {"library": "huggingface", "type": "example-org/llm-tokenizer-not-downloaded"}
    config_path.write_text(yaml.safe_dump(config))
    tar_directory(unpacked, tmp_path / "hf.nemo", compress=False, dot_prefix=True)
    with pytest.raises(ValueError, match="tokenizer_path"):
        TensorRTMMExporter(tmp_path / "engine", device="cpu").export(tmp_path / "hf.nemo", model_type="neva",
                                                                     dtype="float32", **LIMITS)
