"""Shared fixtures; the shared helpers are the `support` package (tests/support/)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

pytest.register_assert_rewrite("support")  # the helpers' asserts explain themselves as the tests' own do

from exporter import TensorRTMMExporter  # noqa: E402
from support.decoders import make_tiny_gpt_weights  # noqa: E402
from support.demo import DEMO_NEMO, demo_deployed  # noqa: E402
from support.tokenizer_files import tokenizer_file  # noqa: E402

if TYPE_CHECKING:
    from support.vlm import TinyVlm


@pytest.fixture
def tiny_gpt_config() -> dict:
    """A tiny NeMo-1 model config: 4 layers, GQA (8 heads, 4 groups), SwiGLU, RMSNorm, biases."""
    return {
        "num_layers": 4,
        "hidden_size": 32,
        "ffn_hidden_size": 48,
        "num_attention_heads": 8,
        "num_query_groups": 4,
        "kv_channels": 4,
        "activation": "fast-swiglu",
        "normalization": "rmsnorm",
        "bias": True,
        "position_embedding_type": "rope",
        "rotary_percentage": 1.0,
        "rotary_base": 10000,
        "share_embeddings_and_output_weights": False,
        "layernorm_epsilon": 1e-5,
        "max_position_embeddings": 128,
        "tokenizer": {"library": "sentencepiece", "model": "tokenizer.model"},
    }


@pytest.fixture(scope="session")
def tiny_gpt_weights():
    """The builder of random canonical weights for a config: `tiny_gpt_weights(config, vocab=64, seed=0)`."""
    return make_tiny_gpt_weights


@pytest.fixture(scope="module")
def demo_exporter(tmp_path_factory) -> TensorRTMMExporter:
    """The demo exported in this process (float32, CPU, 8 prompts a batch)."""
    batch = 8
    exporter = TensorRTMMExporter(tmp_path_factory.mktemp("demo_engine"), device="cpu")
    exporter.export(DEMO_NEMO, model_type="neva", dtype="float32", max_batch_size=batch, max_input_len=512,
                    max_output_len=8, max_multimodal_len=batch * 64)
    return exporter


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    """The demo served in this process (`demo_deployed`: 8 prompts a batch, 16 tokens, 2 beams)."""
    with demo_deployed(tmp_path_factory.mktemp("engine"), max_batch_size=8, max_output_len=16,
                       max_beam_width=2) as running:
        yield running


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> TinyVlm:
    """A tiny Neva checkpoint in NeMo's legacy layout (`support.vlm.build_vlm`), built once per test module."""
    from support.vlm import build_vlm  # transformers: imported by the modules that use it, not at every collection

    folder = tmp_path_factory.mktemp("vlm")
    return build_vlm(folder / "legacy", tokenizer_file(folder))
