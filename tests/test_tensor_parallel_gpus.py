"""Tensor parallel on 2 GPUs (skipped elsewhere; nvidia-h200-x2): NCCL inside captured decode steps and the
symmetric-memory all-reduce give the answers of one GPU. Apart from the CPU tests' module so that it needs no
client or server packages (a GPU machine without a package index runs it as it is)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from exporter import TensorRTMMExporter
from exporter.llm.tensor_parallel import Shard, disable_multicast
from exporter.runtime.tensor_parallel import join
from support.demo import DEMO_NEMO, load_demo_builder
from support.ports import free_port

QUESTION = "What is in the picture?"
pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (nvidia-h200-x2)")


@pytest.fixture(scope="module")
def sharded_neva(tmp_path_factory):
    """A tiny Neva as NeMo's TP=2 shards, and images to ask about."""
    from support.media import random_image
    from support.tokenizer_files import tokenizer_file
    from support.vlm import build_vlm  # transformers: imported where used, as in the other GPU tests

    root = tmp_path_factory.mktemp("tp-gpus")
    return build_vlm(root / "sharded", tokenizer_file(root), tp_size=2).nemo, \
        [np.asarray(random_image(seed)) for seed in range(3)]


def test_two_gpus_as_one(sharded_neva, tmp_path):
    """On 2 GPUs (NCCL, captured decode steps with the collectives inside): a TP=2 engine answers a batch, single
    requests and a beam search as TP=1 on one GPU, float32."""
    sharded, images = sharded_neva
    options = dict(model_type="neva", dtype="float32", max_batch_size=2, max_input_len=256, max_output_len=24,
                   max_multimodal_len=128, max_beam_width=2)
    answers = {}
    for size in (1, 2):
        exporter = TensorRTMMExporter(tmp_path / f"gpu-tp{size}", device="cuda")
        exporter.export(sharded, tensor_parallel_size=size, **options)
        try:
            answers[size] = (exporter.forward([QUESTION] * 2, images[:2], max_output_len=24),
                             [exporter.forward([QUESTION], [image], max_output_len=24) for image in images],
                             exporter.forward([QUESTION], images[2:], max_output_len=24, num_beams=2))
        finally:
            exporter.close()
    assert answers[2] == answers[1]


def test_two_gpus_demo_answers_as_one_in_bfloat16(tmp_path):
    """The trained demo in bf16 (whose logits have margins that random weights lack): split over 2 GPUs, its
    answers to 2 questions about 100 images equal those of one GPU."""
    images = [image for image, _, _ in load_demo_builder().sample_examples(np.random.default_rng(20261129), 100)]
    answers = {}
    for size in (1, 2):
        exporter = TensorRTMMExporter(tmp_path / f"demo-tp{size}", device="cuda")
        exporter.export(DEMO_NEMO, model_type="neva", dtype="bfloat16", max_batch_size=8, max_input_len=512,
                        max_output_len=8, max_multimodal_len=8 * 64, tensor_parallel_size=size)
        try:
            answers[size] = [answer[0] for question in ("What shape is this?", "What color is the shape?")
                             for start in range(0, len(images), 8)
                             for answer in exporter.forward([question] * 8, images[start:start + 8],
                                                            max_output_len=4)]
        finally:
            exporter.close()
    differing = [i for i, (a, b) in enumerate(zip(answers[1], answers[2])) if a != b]
    assert not differing, f"{len(differing)} of {len(answers[1])} answers differ, first: {differing[:5]}"


def _peer_rank(rank: int, port: int, out: Path) -> None:
    tp = join(Shard(rank, 2), port, f"cuda:{rank}", torch.bfloat16)
    generator = torch.Generator("cuda").manual_seed(rank)
    sizes = [(1, 5120), (16, 5120), (128, 5120), (3, 77)]
    parts = [torch.randn(size, device="cuda", dtype=torch.bfloat16, generator=generator) for size in sizes]
    expected = [part.clone() for part in parts]
    for part in expected:
        torch.distributed.all_reduce(part)
    eager = [tp.reduce(part.clone()) for part in parts]
    staged = [part.clone() for part in parts]
    graph = torch.cuda.CUDAGraph()
    tp.reduce(staged[0].clone())  # warm-up outside the capture
    with torch.cuda.graph(graph):
        graphed = [tp.reduce(part) for part in staged]
    graph.replay()
    torch.cuda.synchronize()
    if rank == 0:
        out.write_text(json.dumps({"peer": tp.peer is not None,
                                   "eager": [bool(torch.equal(a, b)) for a, b in zip(eager, expected)],
                                   "graph": [bool(torch.equal(a, b)) for a, b in zip(graphed, expected)]}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def test_two_gpus_peer_all_reduce_equals_nccl(tmp_path):
    """The symmetric-memory all-reduce of decode-sized tensors equals NCCL's, eagerly and replayed in a graph."""
    disable_multicast()
    out = tmp_path / "peer.json"
    torch.multiprocessing.start_processes(_peer_rank, args=(free_port(), out), nprocs=2, start_method="spawn")
    result = json.loads(out.read_text())
    assert result == {"peer": True, "eager": [True] * 4, "graph": [True] * 4}
