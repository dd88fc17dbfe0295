"""Neva end to end, the cases test_neva_parity.py leaves out: towers stored in non-mcore and TP-sharded layouts, a
tower found in the local Hugging Face cache under its hub name with its own image processor, image start/end
tokens, beams and text-only requests against transformers, the input-length boundary, and an engine directory
that answers in a fresh process with the checkpoint, tower folder and tokenizer file gone.

Expected answers come from neva_reference (transformers + plain torch + SentencePiece, nothing of ``exporter``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest
import sentencepiece
import torch
from transformers import CLIPImageProcessor, SiglipImageProcessor

from exporter import TensorRTMMExporter
from exporter.engine import LimitError
from exporter.llm.generate import SamplingParams
from exporter.runtime import Request
from support.media import random_image
from support.neva_hub import cache_full_clip
from support.neva_reference import answer_ids, image_features, prompt_embeddings
from support.tokenizer_files import tokenizer_file
from support.vlm import IMAGE, PROMPTS, TinyVlm, build_vlm

STEPS = 8
QUESTION = "describe the image"
LIMITS = {"max_batch_size": 4, "max_input_len": 256, "max_output_len": 16, "max_multimodal_len": 4 * 16,
          "max_beam_width": 2}
IM_START, IM_END = "<extra_id_4>", "<extra_id_5>"
HUB_REPO = "example-org/tiny-clip-336"
STORED_TOWER_CASES = {
    "legacy-nonmcore-siglip-linear-llama2": dict(mcore=False, tower_type="siglip", projector_type="linear",
                                                 template="llama_2"),
    "legacy-tp2-clip-downsample-mistral": dict(tp_size=2, projector_type="mlp_downsample", template="mistral"),
    "dist-tp2-siglip-mlp2x-nvgpt-pad": dict(layout="torch_dist", tp_size=2, tower_type="siglip", template="nvgpt",
                                            aspect="pad"),
}


@pytest.fixture(scope="module")
def sp_path(tmp_path_factory) -> Path:
    return tokenizer_file(tmp_path_factory.mktemp("sp"))


def _sp(vlm: TinyVlm) -> sentencepiece.SentencePieceProcessor:
    return sentencepiece.SentencePieceProcessor(model_file=str(vlm.sp_path))


def _export(vlm: TinyVlm, folder: Path, **overrides) -> TensorRTMMExporter:
    exporter = TensorRTMMExporter(folder, device="cpu")
    exporter.export(vlm.nemo, model_type="neva", dtype="float32", **{**LIMITS, **vlm.export_kwargs, **overrides})
    return exporter


def _processor(tower_type: str):
    """transformers' processor configured to the fixture towers' size."""
    if tower_type == "clip":
        return CLIPImageProcessor(size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE})
    return SiglipImageProcessor(size={"height": IMAGE, "width": IMAGE})


def _features(vlm: TinyVlm, image, processor=None) -> torch.Tensor:
    return image_features(image, tower=vlm.tower, processor=processor or _processor(vlm.tower_type),
                          projector_type=vlm.projector_type, projector=vlm.projector, pad=vlm.aspect == "pad",
                          drop_class_token=vlm.tower_type == "clip")


def _template_parts(vlm: TinyVlm, question: str, media: list) -> tuple[list, bool]:
    """The template's literal prompt split at ``<image>``, ``media`` (a list of parts) in its place."""
    text, add_bos = PROMPTS[vlm.template]
    before, after = text.format(q=question).split("<image>")
    return [before, *media, after], add_bos


def _reference(vlm: TinyVlm, parts: list, add_bos: bool, num_beams: int = 1) -> list[list[int]]:
    embeddings = prompt_embeddings(vlm.llm, vlm.sp_path, parts, add_bos)
    return answer_ids(vlm.llm, embeddings, STEPS, eos_id=_sp(vlm).eos_id(), num_beams=num_beams)


def _ids(exporter: TensorRTMMExporter, question: str, media, num_beams: int = 1, **request) -> list[list[int]]:
    params = SamplingParams(max_output_len=STEPS, num_beams=num_beams)
    (completion,) = exporter.generate([Request(question, media, params, **request)])
    assert not isinstance(completion, Exception), completion
    return completion.token_ids


def _text(vlm: TinyVlm, ids: list[int]) -> str:
    """SentencePiece's text of ``ids``; ids of the padded vocab rows (no piece) are left out."""
    sp = _sp(vlm)
    return sp.decode([i for i in ids if i < sp.get_piece_size()]).strip()


@pytest.mark.parametrize("case", list(STORED_TOWER_CASES))
def test_tower_stored_in_non_mcore_and_sharded_layouts(case, sp_path, tmp_path):
    vlm = build_vlm(tmp_path / "ckpt", sp_path, **STORED_TOWER_CASES[case])  # tower weights in the checkpoint
    exporter = _export(vlm, tmp_path / "engine")
    image = random_image(21)
    (expected,) = _reference(vlm, *_template_parts(vlm, QUESTION, [_features(vlm, image)]))
    assert len(expected) >= 2
    assert _ids(exporter, QUESTION, image) == [expected]
    assert exporter.forward(QUESTION, image, max_output_len=STEPS) == [[_text(vlm, expected)]]


def test_tower_from_the_hugging_face_cache_with_its_own_processor(sp_path, tmp_path, monkeypatch):
    """``from_pretrained`` names a hub repo (a full CLIPModel) that only the local hub cache holds; its
    preprocessor_config.json (shortest edge 40, crop 32, own mean/std) decides the pixels and the pad colour."""
    vlm = build_vlm(tmp_path / "ckpt", sp_path, tower_at="vision_tower_path", aspect="pad",
                    config_overrides={"mm_cfg": {"vision_encoder": {"from_pretrained": HUB_REPO}}})
    shutil.rmtree(tmp_path / "ckpt" / "tower")  # only the hub cache has the tower
    processor = CLIPImageProcessor(size={"shortest_edge": 40}, crop_size={"height": IMAGE, "width": IMAGE},
                                   image_mean=[0.3, 0.4, 0.5], image_std=[0.2, 0.25, 0.3])
    snapshot = cache_full_clip(tmp_path / "hub", HUB_REPO, vlm.tower, processor)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    exporter = TensorRTMMExporter(tmp_path / "engine", device="cpu")
    exporter.export(vlm.nemo, model_type="neva", dtype="float32", **LIMITS)  # no vision_tower_path
    image = random_image(22)
    cached_processor = CLIPImageProcessor.from_pretrained(snapshot)
    (expected,) = _reference(vlm, *_template_parts(vlm, QUESTION, [_features(vlm, image, cached_processor)]))
    assert _ids(exporter, QUESTION, image) == [expected]
    (default,) = _reference(vlm, *_template_parts(vlm, QUESTION, [_features(vlm, image)]))
    assert default != expected  # the cached processor matters, so the check above can fail


def test_image_start_and_end_tokens_frame_the_features(sp_path, tmp_path):
    """``use_im_start_end: True``: training kept the <extra_id_4>/<extra_id_5> embeddings around the features."""
    vlm = build_vlm(tmp_path / "ckpt", sp_path, config_overrides={"mm_cfg": {"use_im_start_end": True}})
    exporter = _export(vlm, tmp_path / "engine")
    image = random_image(23)
    sp, features = _sp(vlm), _features(vlm, image)
    parts, add_bos = _template_parts(vlm, QUESTION, [sp.piece_to_id(IM_START), features, sp.piece_to_id(IM_END)])
    (expected,) = _reference(vlm, parts, add_bos)
    (completion,) = exporter.generate([Request(QUESTION, image, SamplingParams(max_output_len=STEPS))])
    assert completion.token_ids == [expected]
    # The two framing tokens are in the prompt (a random model's answer may not show them).
    assert completion.prompt_tokens == prompt_embeddings(vlm.llm, vlm.sp_path, parts, add_bos).shape[0]
    assert sp.piece_to_id(IM_START) != sp.unk_id() and sp.piece_to_id(IM_END) != sp.unk_id()


@pytest.fixture(scope="module")
def exported(sp_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("neva_e2e")
    vlm = build_vlm(folder / "ckpt", sp_path, seed=3)
    return vlm, _export(vlm, folder / "engine")


def test_beams_match_transformers_beam_search(exported):
    vlm, exporter = exported
    for seed, question in ((24, QUESTION), (25, "what is in this picture")):
        image = random_image(seed)
        expected = _reference(vlm, *_template_parts(vlm, question, [_features(vlm, image)]), num_beams=2)
        assert expected[0] != expected[1]
        assert _ids(exporter, question, image, num_beams=2) == expected
        texts = exporter.forward(question, image, max_output_len=STEPS, num_beams=2)
        assert texts == [[_text(vlm, beam) for beam in expected]]


def test_text_only_request_shares_a_batch_with_image_requests(exported):
    """A request without media gets the template with no <image>; the others in its batch are unaffected."""
    vlm, exporter = exported
    images = [random_image(26), None, random_image(27)]
    questions = [QUESTION, "hello world", "what is in this picture"]
    expected = []
    for question, image in zip(questions, images):
        if image is None:
            text, add_bos = PROMPTS[vlm.template]
            parts = [text.replace("<image>\n", "").format(q=question)]
        else:
            parts, add_bos = _template_parts(vlm, question, [_features(vlm, image)])
        expected.append(_text(vlm, _reference(vlm, parts, add_bos)[0]))
    assert exporter.forward(questions, images, max_output_len=STEPS) == [[text] for text in expected]


def test_image_features_count_toward_max_input_len(exported, tmp_path):
    vlm, exporter = exported
    image = random_image(28)
    parts, add_bos = _template_parts(vlm, QUESTION, [_features(vlm, image)])
    prompt_len = prompt_embeddings(vlm.llm, vlm.sp_path, parts, add_bos).shape[0]
    (completion,) = exporter.generate([Request(QUESTION, image, SamplingParams(max_output_len=STEPS))])
    assert completion.prompt_tokens == prompt_len
    at_limit = _export(vlm, tmp_path / "at_limit", max_input_len=prompt_len)
    assert _ids(at_limit, QUESTION, image) == completion.token_ids
    below = _export(vlm, tmp_path / "below", max_input_len=prompt_len - 1)
    with pytest.raises(LimitError, match=rf"prompt is {prompt_len} tokens including 16 media features, over "
                                         rf"max_input_len={prompt_len - 1}"):
        below.forward(QUESTION, image, max_output_len=STEPS)


def test_engine_directory_answers_alone_in_a_fresh_process(sp_path, tmp_path):
    """Tower folder (from_pretrained), tokenizer file and .nemo all moved away; no hub cache, offline."""
    source = tmp_path / "source"
    source.mkdir()
    own_sp = Path(shutil.copy(sp_path, source))
    vlm = build_vlm(source / "ckpt", own_sp, tower_at="from_pretrained", template="llama_2")
    _export(vlm, tmp_path / "engine")
    image = random_image(29)
    image.save(tmp_path / "image.png")
    (expected,) = _reference(vlm, *_template_parts(vlm, QUESTION, [_features(vlm, image)]))
    reference_text = _text(vlm, expected)
    source.rename(tmp_path / "gone")
    (tmp_path / "empty_hf_home").mkdir()
    script = (
        "import json, sys\n"
        "from exporter import TensorRTMMExporter\n"
        "from exporter.llm.generate import SamplingParams\n"
        "from exporter.runtime import Request\n"
        "e = TensorRTMMExporter(sys.argv[1], device='cpu')\n"
        f"(c,) = e.generate([Request({QUESTION!r}, sys.argv[2], SamplingParams(max_output_len={STEPS}))])\n"
        f"print(json.dumps({{'ids': c.token_ids, 'text': e.forward({QUESTION!r}, sys.argv[2], "
        f"max_output_len={STEPS})}}))\n"
    )
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty_hf_home"), "OMP_NUM_THREADS": "1",
           "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "engine"), str(tmp_path / "image.png")],
                          capture_output=True, text=True, timeout=120, env=env, check=False)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer == {"ids": [expected], "text": [[reference_text]]}
