"""Neva and SALM on every LLM family: a tiny multimodal checkpoint per family, exported and asked, answers token for
token as the transformers reference built from the same weights (transformers' own class of that family, given
the spliced embeddings)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exporter import TensorRTMMExporter
from exporter.llm.generate import SamplingParams
from exporter.runtime import Request
from support.llm_families import FAMILIES
from support.media import random_image
from support.neva_reference import reference_tokens
from support.salm import DEFAULT_QUESTION, TRAINED_PROMPT, build_salm, write_clips
from support.salm import reference_tokens as salm_reference_tokens
from support.tokenizer_files import tokenizer_file
from support.vlm import build_vlm

torch.set_num_threads(1)
STEPS = 8
NAMES = ["mixtral", "mixtral-pre-softmax", "gemma", "falcon-7b", "falcon-40b", "falcon-rw", "starcoder",
         "starcoder2", "gpt-next"]
LIMITS = {"max_batch_size": 2, "max_input_len": 256, "max_output_len": 16, "max_multimodal_len": 256}


@pytest.fixture(scope="module")
def sp_path(tmp_path_factory) -> Path:
    return tokenizer_file(tmp_path_factory.mktemp("sp"))


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return write_clips(tmp_path_factory.mktemp("clips"))


def _answer(exporter: TensorRTMMExporter, text: str, media) -> list[int]:
    (completion,) = exporter.generate([Request(text, media, SamplingParams(max_output_len=STEPS))])
    assert not isinstance(completion, Exception), completion
    return completion.token_ids[0]


@pytest.mark.parametrize("name", NAMES)
def test_neva_on_each_family_answers_as_transformers(name, sp_path, tmp_path):
    vlm = build_vlm(tmp_path / "ckpt", sp_path, llm_family=FAMILIES[name](seed=7))
    exporter = TensorRTMMExporter(tmp_path / "engine", device="cpu")
    exporter.export(vlm.nemo, model_type="neva", dtype="float32", **LIMITS)
    image = random_image(3)
    expected = reference_tokens(vlm, "describe the image", image, STEPS)
    assert len(expected) >= 2
    assert _answer(exporter, "describe the image", image) == expected


@pytest.mark.parametrize("name", NAMES)
def test_salm_on_each_family_answers_as_transformers(name, clips, tmp_path):
    salm = build_salm(tmp_path / "ckpt", llm_family=FAMILIES[name](seed=8))
    exporter = TensorRTMMExporter(tmp_path / "engine", modality="audio", device="cpu")
    exporter.export(salm.nemo, model_type="salm", dtype="float32", **LIMITS)
    prompt = TRAINED_PROMPT.format(q=DEFAULT_QUESTION)
    expected = salm_reference_tokens(salm, clips.wav_signal, prompt, STEPS)
    assert len(expected) >= 2
    assert _answer(exporter, "", str(clips.wav)) == expected
