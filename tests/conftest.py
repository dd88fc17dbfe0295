"""Shared test fixtures."""

from __future__ import annotations

import io
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece
import torch


def make_tiny_gpt_weights(config: dict, vocab: int = 64, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random canonical weights (docs/architecture.md) for a NeMo-1 style GPT `config`."""
    generator = torch.Generator().manual_seed(seed)
    hidden, ffn = config["hidden_size"], config["ffn_hidden_size"]
    heads = config["num_attention_heads"]
    groups = config.get("num_query_groups") or heads
    head_dim = config.get("kv_channels") or hidden // heads
    fc1_rows = 2 * ffn if config["activation"] in ("fast-swiglu", "swiglu", "fast-geglu", "geglu") else ffn

    def rand(*shape):
        return torch.randn(*shape, generator=generator)

    weights = {
        "embedding.word_embeddings.weight": rand(vocab, hidden),
        "decoder.final_layernorm.weight": rand(hidden),
        "output_layer.weight": rand(vocab, hidden),
        "embedding.word_embeddings.adapter_layer.mm_projector_adapter.mm_projector.0.weight": rand(hidden, 8),
        "embedding.word_embeddings.adapter_layer.mm_projector_adapter.mm_projector.0.bias": rand(hidden),
    }
    for i in range(config["num_layers"]):
        layer = f"decoder.layers.{i}."
        weights.update(
            {
                layer + "input_layernorm.weight": rand(hidden),
                layer + "self_attention.linear_qkv.weight": rand((heads + 2 * groups) * head_dim, hidden),
                layer + "self_attention.linear_qkv.bias": rand((heads + 2 * groups) * head_dim),
                layer + "self_attention.linear_proj.weight": rand(hidden, heads * head_dim),
                layer + "self_attention.linear_proj.bias": rand(hidden),
                layer + "pre_mlp_layernorm.weight": rand(hidden),
                layer + "mlp.linear_fc1.weight": rand(fc1_rows, hidden),
                layer + "mlp.linear_fc1.bias": rand(fc1_rows),
                layer + "mlp.linear_fc2.weight": rand(hidden, ffn),
                layer + "mlp.linear_fc2.bias": rand(hidden),
            }
        )
    return weights


TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def run_under_triton_interpreter(test_file: str) -> None:
    """Run ``test_file`` again in a child pytest with ``TRITON_INTERPRET=1`` (Triton reads it only when imported,
    so kernel checks on the CPU run in a fresh process); fails with the child's output if any check fails."""
    if TRITON_INTERPRETED:
        pytest.skip("this is the child run")
    root = Path(__file__).resolve().parents[1]
    environment = {**os.environ, "TRITON_INTERPRET": "1",
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file],
                           cwd=root, env=environment, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    assert " passed" in child.stdout and "failed" not in child.stdout


def captured_decode_logits(model, ids: torch.Tensor, start: int, kv_scales: torch.Tensor | None = None):
    """Logits `[B, T - start, V]` of positions `start..T-1` of token rows `ids [B, T]` as the scheduler's steps
    compute them: `ids[:, :start]` prefilled as prompt pieces into a paged KV cache (float8 with `kv_scales`), then
    one decode step per further token (captured CUDA graphs on CUDA). Returns the logits and the step (for its
    graph count)."""
    from exporter.llm.sampling import TokenChooser
    from exporter.runtime.cuda_graphs import ForwardStep, Piece

    rows, length = ids.shape
    block_size = 16
    width = -(-length // block_size) + 1
    cache = model.new_paged_kv_cache(1 + rows * width, block_size, kv_scales)
    tables = torch.arange(1, 1 + rows * width, dtype=torch.int32).view(rows, width)
    chooser = TokenChooser(rows, model.config.vocab_size, model.device)
    step = ForwardStep(model, cache, tables.to(model.device), chooser, max_chunk=max(start * rows, 32))
    ids = ids.to(model.device)
    step.launch(0, 0, [Piece(model.embed(ids[row, :start]), 0, tables[row].tolist()) for row in range(rows)])
    logits = [step.launch(rows, t + 1, tokens=ids[:, t].tolist(), positions=[t] * rows)[0].logits.clone()
              for t in range(start, length)]
    return torch.stack(logits, 1), step


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


def load_demo_builder():
    """The demo builder, tools/make_demo_checkpoint.py (its image generator and labels)."""
    from tools import make_demo_checkpoint

    return make_demo_checkpoint


def stop_server(process, timeout_s: float = 120) -> int:
    """Stop a server subprocess as Ctrl-C would (SIGINT), killing it if it does not exit in time; its exit code."""
    import signal

    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=timeout_s)
    finally:
        if process.poll() is None:
            process.kill()
    return process.returncode


def wait_until_ready(url: str, model: str, process, timeout_s: float = 240) -> None:
    """Poll Triton's model-ready endpoint until it answers 200; fail early if the server process exits."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"deploy_triton.py exited early:\n{process.stderr.read()}")
        try:
            with urllib.request.urlopen(f"http://{url}/v2/models/{model}/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("deploy_triton.py did not become ready")


def train_sentencepiece(path: Path, vocab_size: int = 300, user_defined_symbols=("<extra_id_0>", "<extra_id_1>")) -> Path:
    """Train a small BPE SentencePiece model (unk 0, bos 1, eos 2, no pad) on generated text into `path`."""
    rng = random.Random(0)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7)))
        for _ in range(400)
    ]
    words += "describe the image what is in this picture robot video hello world".split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 15))) for _ in range(3000)]
    proto = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=proto,
        vocab_size=vocab_size,
        model_type="bpe",
        user_defined_symbols=list(user_defined_symbols),
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
        num_threads=1,
    )
    path.write_bytes(proto.getvalue())
    return path
