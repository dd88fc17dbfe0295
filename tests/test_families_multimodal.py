"""Neva and SALM on every LLM family: a tiny multimodal checkpoint per family, exported and asked, answers token for
token as the transformers reference built from the same weights (transformers' own class of that family, given
the spliced embeddings)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import salm_fixtures
import vlm_fixtures
from exporter import TensorRTMMExporter
from exporter.llm.generate import SamplingParams
from exporter.runtime import Request
from llm_families import FAMILIES

torch.set_num_threads(1)
STEPS = 8
NAMES = ["mixtral", "mixtral-pre-softmax", "gemma", "falcon-7b", "falcon-40b", "falcon-rw", "starcoder",
         "starcoder2", "gpt-next"]
LIMITS = {"max_batch_size": 2, "max_input_len": 256, "max_output_len": 16, "max_multimodal_len": 256}


@pytest.fixture(scope="module")
def sp_path(tmp_path_factory) -> Path:
    return vlm_fixtures.tokenizer_file(tmp_path_factory.mktemp("sp"))


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return salm_fixtures.write_clips(tmp_path_factory.mktemp("clips"))


def _answer(exporter: TensorRTMMExporter, text: str, media) -> list[int]:
    (completion,) = exporter.generate([Request(text, media, SamplingParams(max_output_len=STEPS))])
    assert not isinstance(completion, Exception), completion
    return completion.token_ids[0]


@pytest.mark.parametrize("name", NAMES)
def test_neva_on_each_family_answers_as_transformers(name, sp_path, tmp_path):
    vlm = vlm_fixtures.build_vlm(tmp_path / "ckpt", sp_path, llm_family=FAMILIES[name](seed=7))
    exporter = TensorRTMMExporter(tmp_path / "engine", device="cpu")
    exporter.export(vlm.nemo, model_type="neva", dtype="float32", **LIMITS)
    image = vlm_fixtures.random_image(3)
    expected = vlm_fixtures.reference_tokens(vlm, "describe the image", image, STEPS)
    assert len(expected) >= 2
    assert _answer(exporter, "describe the image", image) == expected


@pytest.mark.parametrize("name", NAMES)
def test_salm_on_each_family_answers_as_transformers(name, clips, tmp_path):
    salm = salm_fixtures.build_salm(tmp_path / "ckpt", llm_family=FAMILIES[name](seed=8))
    exporter = TensorRTMMExporter(tmp_path / "engine", modality="audio", device="cpu")
    exporter.export(salm.nemo, model_type="salm", dtype="float32", **LIMITS)
    prompt = salm_fixtures.TRAINED_PROMPT.format(q=salm_fixtures.DEFAULT_QUESTION)
    expected = salm_fixtures.reference_tokens(salm, clips.wav_signal, prompt, STEPS)
    assert len(expected) >= 2
    assert _answer(exporter, "", str(clips.wav)) == expected
