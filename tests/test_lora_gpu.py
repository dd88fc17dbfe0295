"""On CUDA (skipped elsewhere): LoRA rows in captured decode steps (a late request joining with another adapter)
give what the CPU gives eagerly in float32, token for token; in bf16 the Triton kernels (`lora_kernels`, in place)
agree with the gathered batched products at LLaVA-7B's projection shapes, eagerly and replayed in a captured
graph for other slots."""

from __future__ import annotations

import pytest
import torch

from exporter.llm import lora_layers
from exporter.llm.generate import SamplingParams
from exporter.llm.lora_layers import LORA_MODULES, LoraBank, LoraSlots, lora_shape
from exporter.runtime.cuda_graphs import capture
from exporter.runtime.scheduler import Scheduler
from support.decoders import PARITY_VOCAB, parity_decoder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

UIDS = ["a", "b", None, "a", "b"]


def _with_adapters(device: str):
    model = parity_decoder(device, torch.float32)
    bank = LoraBank(model, tuple(LORA_MODULES), 8, 2)
    generator = torch.Generator().manual_seed(4)
    for uid, rank in (("a", 8), ("b", 3)):
        weights = {}
        for layer in range(model.config.num_layers):
            for module in LORA_MODULES:
                out_features, in_features = lora_shape(model.config, module)
                weights[layer, module] = (torch.randn(rank, in_features, generator=generator) * 0.3,
                                          torch.randn(out_features, rank, generator=generator) * 0.3)
        bank.add(uid, rank, 1.5, weights)
    return model


def _run(model, prompts, graphs: bool, late: int = 3) -> list[list[int]]:
    scheduler = Scheduler(model, max_slots=8, max_seq_len=64, eos_id=None, use_cuda_graphs=graphs)
    if graphs:
        scheduler.warm_up()
    params = SamplingParams(max_output_len=12)
    device = model.device
    handles = [scheduler.submit(model.embed(p.to(device)), p.tolist(), params, lora_uid=uid)
               for p, uid in zip(prompts[:late], UIDS)]
    for _ in range(3):
        scheduler.step()
    handles += [scheduler.submit(model.embed(p.to(device)), p.tolist(), params, lora_uid=uid)
                for p, uid in zip(prompts[late:], UIDS[late:])]
    while scheduler.step():
        pass
    return [handle.result() for handle in handles]


@torch.inference_mode()
def test_lora_rows_in_captured_steps_equal_the_cpu():
    prompts = [torch.randint(3, PARITY_VOCAB, (n,), generator=torch.Generator().manual_seed(n))
               for n in (5, 9, 14, 7, 4)]
    gpu = _with_adapters("cuda")
    graphed = _run(gpu, prompts, graphs=True)
    assert graphed == _run(gpu, prompts, graphs=False)
    assert graphed == _run(_with_adapters("cpu"), prompts, graphs=False)
    assert len({tuple(tokens) for tokens in graphed[:3]}) == 3  # a, b and none answer differently


def _slots_bf16(in_features: int, out_features: int, ranks=(16, 8, 16, 4)) -> LoraSlots:
    slots = LoraSlots(len(ranks), max(ranks), in_features, out_features, torch.bfloat16, torch.device("cuda"))
    generator = torch.Generator("cuda").manual_seed(in_features + out_features)
    for slot, rank in enumerate(ranks, start=1):
        slots.write(slot, torch.randn(rank, in_features, generator=generator, device="cuda") / in_features**0.5,
                    torch.randn(out_features, rank, generator=generator, device="cuda"), 2.0)
    return slots


@pytest.mark.parametrize("rows", (32, 544))
@pytest.mark.parametrize("shape", ((4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096)))
@torch.inference_mode()
def test_kernels_agree_with_the_batched_products_in_bf16(shape, rows):
    """LLaVA-7B's four projections; 32 decode rows, or 544 (decode rows and a prefill chunk's tokens)."""
    in_features, out_features = shape
    slots = _slots_bf16(in_features, out_features)
    adapters = torch.arange(rows, device="cuda") % 5
    x = torch.randn(rows, 1, in_features, device="cuda").bfloat16()
    y = torch.randn(rows, 1, out_features, device="cuda").bfloat16()
    batched = slots.batched(y, x, adapters)
    base = y.clone()
    assert slots(y, x, adapters) is y  # the kernels, in place
    # Outputs reach ~16, where one bf16 step is 0.0625: the split sums may round the rank-space values one step apart.
    torch.testing.assert_close(y.float(), batched.float(), rtol=2e-2, atol=0.15)
    assert torch.equal(y[0], base[0]) and torch.equal(y[5], base[5])
    lora_layers.CUDA_KERNEL = "bmm"
    try:
        assert torch.equal(slots(base, x, adapters), batched)
    finally:
        lora_layers.CUDA_KERNEL = "triton"


@torch.inference_mode()
def test_kernels_in_a_captured_graph_follow_each_replays_slots():
    """One capture, replayed for other inputs and another mix of slots (and none), against the batched products."""
    slots = _slots_bf16(4096, 12288)
    x = torch.zeros(32, 1, 4096, device="cuda", dtype=torch.bfloat16)
    y = torch.zeros(32, 1, 12288, device="cuda", dtype=torch.bfloat16)
    adapters = torch.zeros(32, dtype=torch.long, device="cuda")
    static = y.clone()
    graph, out = capture(lambda: slots.kernels(static, x, adapters), None)
    assert out is static
    for seed, mix in ((1, torch.arange(32) % 5), (2, torch.tensor([3, 0] * 16)), (3, torch.zeros(32))):
        generator = torch.Generator("cuda").manual_seed(seed)
        x.copy_(torch.randn(x.shape, generator=generator, device="cuda"))
        y.copy_(torch.randn(y.shape, generator=generator, device="cuda"))
        adapters.copy_(mix)
        static.copy_(y)
        graph.replay()
        torch.testing.assert_close(out.float(), slots.batched(y, x, adapters).float(), rtol=2e-2, atol=5e-2)
        assert all(torch.equal(out[row], y[row]) for row in range(32) if not int(mix[row]))
