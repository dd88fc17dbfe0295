"""On CUDA (skipped elsewhere): the fused, graph-captured GPU path against the CPU's eager one.

float32 greedy tokens through the scheduler (batched and captured prefills, captured decode steps) equal the
CPU's; bfloat16 and float16 logits of a prefill and of captured decode steps stay within 2e-2 relative error of
float32; a captured encoder call equals the eager one at every batch size.
"""

from __future__ import annotations

import pytest
import torch

from exporter.llm.generate import SamplingParams
from exporter.runtime.cuda_graphs import GraphedCall
from exporter.runtime.scheduler import Scheduler, generate
from support.decoders import PARITY_VOCAB, parity_decoder
from support.decoding import captured_decode_logits, relative_error

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@torch.inference_mode()
def test_float32_greedy_tokens_equal_the_cpu():
    cpu, gpu = parity_decoder("cpu", torch.float32), parity_decoder("cuda", torch.float32)
    prompts = [torch.randint(3, PARITY_VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9, 14)]
    params = SamplingParams(max_output_len=20)
    expected = [generate(cpu, [cpu.embed(p)], [p.tolist()], [params])[0][0] for p in prompts]
    for prompt, tokens in zip(prompts, expected):  # well-posed: no near-tie on the CPU's greedy path
        logits = cpu(cpu.embed(torch.tensor(prompt.tolist() + tokens)[None]))[0, len(prompt) - 1: -1]
        top2 = logits.topk(2).values
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-4
    scheduler = Scheduler(gpu, max_slots=4, max_seq_len=64, eos_id=None, use_cuda_graphs=True)
    handles = [scheduler.submit(gpu.embed(p.cuda()), p.tolist(), params) for p in prompts[:2]]
    scheduler.step()  # the first two are prefilled together in a captured step; the third joins decoding rows
    handles.append(scheduler.submit(gpu.embed(prompts[2].cuda()), prompts[2].tolist(), params))
    while scheduler.step():
        pass
    assert [h.result() for h in handles] == expected
    graphs = set(scheduler.forward.graphs)
    assert (0, 32, False, False) in graphs, "the first prompts were not prefilled by a captured step"
    assert any(rows and chunk for rows, chunk, *_ in graphs), "the third prompt did not ride on a captured decode step"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.inference_mode()
def test_half_precision_logits_within_2e_2_of_float32(dtype):
    """A prefill, then captured decode steps fed the same tokens, in float32 and in `dtype`."""
    ids = torch.randint(3, PARITY_VOCAB, (2, 24), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    logits = {}
    for precision in (torch.float32, dtype):
        model = parity_decoder("cuda", precision)
        decoded, step = captured_decode_logits(model, ids, 16)
        assert step.graph_count > 0
        logits[precision] = torch.cat([model(model.embed(ids[:, :16])), decoded], dim=1)
    error = relative_error(logits[dtype], logits[torch.float32])
    assert error < 2e-2, f"relative error {error:.3e}"
    cpu = parity_decoder("cpu", torch.float32)
    reference = cpu(cpu.embed(ids.cpu()))
    assert relative_error(logits[torch.float32].cpu(), reference) < 1e-4


@torch.inference_mode()
def test_captured_encoder_equals_eager_at_every_batch_size():
    encoder = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 32), torch.nn.GELU()).cuda().eval()
    graphed = GraphedCall(encoder, (3, 4, 4), torch.float32, torch.device("cuda"), max_batch=8)
    for batch in (1, 3, 8, 5, 11):
        pixels = torch.randn(batch, 3, 4, 4, device="cuda")
        torch.testing.assert_close(graphed(pixels), encoder(pixels))
    assert sorted(graphed.graphs) == [1, 4, 8]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.inference_mode()
def test_gemv_kernel_matches_cublas(dtype):
    gemv = pytest.importorskip("exporter.llm.gemv")
    if gemv.triton is None:
        pytest.skip("Triton is not installed")
    generator = torch.Generator("cuda").manual_seed(1)
    for rows, depth, with_bias in ((4096, 4096, False), (12288, 4096, True), (1000, 300, False)):
        x = torch.randn(1, 1, depth, device="cuda", dtype=dtype, generator=generator)
        weight = torch.randn(rows, depth, device="cuda", dtype=dtype, generator=generator) / depth**0.5
        bias = torch.randn(rows, device="cuda", dtype=dtype, generator=generator) if with_bias else None
        reference = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
        assert relative_error(gemv._gemv(x, weight, bias), reference) < 1e-2
        assert relative_error(gemv.linear(x, weight, bias), reference) < 1e-2


def test_exported_neva_answers_on_cuda_as_on_the_cpu(tmp_path):
    """The serving path on the GPU (graphed encoder, warmed-up scheduler) answers a batch as the CPU does."""
    from exporter import TensorRTMMExporter
    from exporter.runtime import Request
    from support.media import random_image
    from support.tokenizer_files import tokenizer_file
    from support.vlm import build_vlm

    (tmp_path / "sp").mkdir()
    vlm = build_vlm(tmp_path / "ckpt", tokenizer_file(tmp_path / "sp"))
    TensorRTMMExporter(tmp_path / "engine", device="cpu").export(
        vlm.nemo, model_type="neva", dtype="float32", max_batch_size=4, max_input_len=256, max_output_len=8,
        max_multimodal_len=64, load_model=False, **vlm.export_kwargs)
    requests = [Request(f"describe image {seed}", random_image(seed), SamplingParams(max_output_len=8))
                for seed in range(3)]
    answers = {}
    for device in ("cpu", "cuda"):
        exporter = TensorRTMMExporter(tmp_path / "engine", device=device)
        answers[device] = [completion.token_ids for completion in exporter.generate(requests)]
        exporter.pipeline.close()
    assert answers["cuda"] == answers["cpu"]
